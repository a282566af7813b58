// @vitest-environment jsdom
import { act, cleanup, fireEvent, render, renderHook, screen, waitFor } from "@testing-library/react";
import type { ReactNode } from "react";
import { afterEach, describe, expect, it } from "vitest";
import { TetherClient } from "@tether/client";
import {
  ApprovalCard,
  CONNECT_STORAGE_PREFIX,
  ConnectionCard,
  QuestionCard,
  TetherProvider,
  usePendingConnection,
  usePendingQuestion,
  useRun,
  useRuns,
  useSession,
} from "../src/index.js";
import { FakeFetch, frame, json, runEvent, sse } from "../../client/test/fake.js";

afterEach(cleanup);

function wrapper(fake: FakeFetch) {
  const client = new TetherClient({ fetch: fake.fetch, reconnect: { initialMs: 1, maxMs: 2 } });
  return ({ children }: { children: ReactNode }) => <TetherProvider client={client}>{children}</TetherProvider>;
}

const RUN = "run_1";
const part = (index: number, text: string, final = false) => ({ part: { index, role: "assistant", final, text: { text } } });

describe("useRun", () => {
  it("folds the stream into parts, resolves the question and keeps each event once across a break", async () => {
    const question = { interactionId: "int_1", runId: RUN, questions: [{ key: "k", prompt: "Which?" }] };
    const fake = new FakeFetch()
      .on("GET", `/v2/runs/${RUN}/events`,
        sse([frame("snapshot", { snapshot: { run: { runId: RUN, status: "RUN_STATUS_RUNNING" } } }),
          runEvent(RUN, 1, "part.added", { partAdded: part(0, "Hel") }),
          frame("text.delta", { event: { runId: RUN, type: "text.delta", textDelta: { partIndex: 0, text: "lo", offset: "3" } } })], { break: true }),
        sse([frame("snapshot", { snapshot: { run: { runId: RUN, status: "RUN_STATUS_RUNNING", lastSeq: "1" }, parts: [part(0, "Hello").part] } }),
          runEvent(RUN, 2, "part.updated", { partUpdated: part(0, "Hello!", true) }),
          runEvent(RUN, 3, "question.requested", { questionRequested: { interactionId: "int_1" } })], { hold: true }))
      .on("GET", `/v2/runs/${RUN}/pending-question`, () => json(200, { question }));
    const cursors: number[] = [];
    const { result } = renderHook(() => useRun(RUN, { onCursor: (c) => cursors.push(c) }), { wrapper: wrapper(fake) });
    await waitFor(() => expect(result.current.state.lastSeq).toBe(3));
    const s = result.current.state;
    expect(s.parts).toEqual([part(0, "Hello!", true).part]);
    expect(s.run?.status).toBe("RUN_STATUS_WAITING_FOR_QUESTION");
    expect(s.pending).toEqual({ type: "question", question });
    expect(s.events.map((e) => e.seq)).toEqual([1, 2, 3]);
    expect(cursors).toEqual([1, 2, 3]);
    expect(fake.calls("GET", `/v2/runs/${RUN}/events`)[1]!.headers["Last-Event-ID"]).toBe("1");
  });

  it("reads the pending approval when it resumes past the thin event", async () => {
    const approval = { interactionId: "int_2", runId: RUN, toolName: "deploy" };
    const fake = new FakeFetch()
      .on("GET", `/v2/runs/${RUN}/events`, sse([frame("snapshot", { snapshot: { run: { runId: RUN, status: "RUN_STATUS_WAITING_FOR_APPROVAL", lastSeq: "9" } } })], { hold: true }))
      .on("GET", `/v2/runs/${RUN}/pending-approval`, () => json(200, { approval }));
    const { result } = renderHook(() => useRun(RUN, { after: 9 }), { wrapper: wrapper(fake) });
    await waitFor(() => expect(result.current.state.pending).toEqual({ type: "approval", approval }));
    expect(fake.requests[0]!.headers["Last-Event-ID"]).toBe("9");
  });

  it("reports a run it may not see as not found", async () => {
    const fake = new FakeFetch().on("GET", `/v2/runs/${RUN}/events`, () =>
      json(404, { error: { status: "NOT_FOUND", code: "not_found", message: "run 'run_1' not found" } }));
    const { result } = renderHook(() => useRun(RUN), { wrapper: wrapper(fake) });
    await waitFor(() => expect(result.current.error?.status).toBe("NOT_FOUND"));
    expect(result.current.state.connection).toBe("ended");
  });
});

describe("useRuns", () => {
  it("replaces the list on each page, updates runs by id and drops those leaving the filter", async () => {
    const fake = new FakeFetch().on("GET", "/v2/runs/live", sse([
      frame("runs", { runs: [{ runId: "b", status: "RUN_STATUS_RUNNING", createdAt: "2026-12-03T10:00:02Z" }, { runId: "a", status: "RUN_STATUS_RUNNING", createdAt: "2026-12-03T10:00:01Z" }] }),
      frame("run", { run: { runId: "c", status: "RUN_STATUS_RUNNING", createdAt: "2026-12-03T10:00:03Z" } }),
      frame("run", { run: { runId: "a", status: "RUN_STATUS_COMPLETED", createdAt: "2026-12-03T10:00:01Z" } }),
    ], { hold: true }));
    const { result } = renderHook(() => useRuns({ statuses: ["RUN_STATUS_RUNNING"] }), { wrapper: wrapper(fake) });
    await waitFor(() => expect(result.current.runs.map((r) => r.runId)).toEqual(["c", "b"]));
    expect(result.current.live).toBe(true);
  });
});

describe("useSession", () => {
  it("reads the session, signs out with the CSRF token", async () => {
    const fake = new FakeFetch()
      .on("GET", "/v2/session", () => json(200, { csrfToken: "c1", tenantId: "t" }))
      .on("DELETE", "/v2/session", () => json(204, null));
    const { result } = renderHook(() => useSession(), { wrapper: wrapper(fake) });
    await waitFor(() => expect(result.current.session?.tenantId).toBe("t"));
    await act(() => result.current.signOut());
    expect(result.current.session).toBeNull();
    expect(fake.calls("DELETE", "/v2/session")[0]!.headers["X-CSRF-Token"]).toBe("c1");
  });

  it("is signed out (no error) when the cookie is missing, and reports a bad key", async () => {
    const unauth = (m: string) => () => json(401, { error: { status: "UNAUTHENTICATED", code: "unauthenticated", message: m } });
    const fake = new FakeFetch().on("GET", "/v2/session", unauth("no session")).on("POST", "/v2/session", unauth("invalid API key"));
    const { result } = renderHook(() => useSession(), { wrapper: wrapper(fake) });
    await waitFor(() => expect(result.current.loading).toBe(false));
    expect(result.current.error).toBeNull();
    let ok = true;
    await act(async () => {
      ok = await result.current.signIn("tk_bad");
    });
    expect(ok).toBe(false);
    expect(result.current.error?.message).toBe("invalid API key");
  });
});

describe("cards", () => {
  it("QuestionCard sends the chosen options and 'other', once", async () => {
    const fake = new FakeFetch().on("POST", `/v2/runs/${RUN}/answer`, () => json(200, { interactionId: "int_1", resumed: true }));
    const question = {
      interactionId: "int_1",
      questions: [
        { key: "size", prompt: "Size?", options: ["S", "M", "L"] },
        { key: "extras", prompt: "Extras?", options: ["cheese", "ham"], multiple: true, allowOther: true },
      ],
    };
    const Wrapper = wrapper(fake);
    render(<Wrapper><QuestionCard runId={RUN} question={question} /></Wrapper>);
    const send = screen.getByRole("button", { name: "Send answer" });
    expect((send as HTMLButtonElement).disabled).toBe(true);
    fireEvent.click(screen.getByLabelText("M"));
    fireEvent.click(screen.getByLabelText("cheese"));
    fireEvent.click(screen.getByLabelText("ham"));
    fireEvent.click(screen.getByLabelText("ham"));
    fireEvent.change(screen.getByLabelText("Other answer for Extras?"), { target: { value: "olives" } });
    fireEvent.click(send);
    await screen.findByText("Answered; the run resumes.");
    fireEvent.click(send);
    fireEvent.submit(send.closest("form")!);
    expect(fake.requests).toHaveLength(1);
    expect(fake.requests[0]!.body).toEqual({ answers: { size: { values: ["M"] }, extras: { values: ["cheese", "olives"] } } });
    expect((send as HTMLButtonElement).disabled).toBe(true);
  });

  it("QuestionCard: typing an 'other' answer to a single-choice question replaces the option", async () => {
    const fake = new FakeFetch().on("POST", `/v2/runs/${RUN}/answer`, () => json(200, { resumed: true }));
    const Wrapper = wrapper(fake);
    const question = { interactionId: "int_5", questions: [{ key: "choice", prompt: "Which?", options: ["A", "B"], allowOther: true }] };
    render(<Wrapper><QuestionCard runId={RUN} question={question} /></Wrapper>);
    fireEvent.click(screen.getByLabelText("A"));
    fireEvent.change(screen.getByLabelText("Other answer for Which?"), { target: { value: "C" } });
    expect((screen.getByLabelText("A") as HTMLInputElement).checked).toBe(false);
    fireEvent.click(screen.getByRole("button", { name: "Send answer" }));
    await screen.findByText("Answered; the run resumes.");
    expect(fake.requests[0]!.body).toEqual({ answers: { choice: { values: ["C"] } } });
  });

  it("ApprovalCard offers allow-always only when policy permits and decides once", async () => {
    const fake = new FakeFetch().on("POST", `/v2/runs/${RUN}/decision`, () => json(200, { interactionId: "int_2", resumed: true }));
    const Wrapper = wrapper(fake);
    const approval = { interactionId: "int_2", runId: RUN, toolName: "deploy", summary: "Deploy", riskCategory: "write", estimatedCostMicros: "1500000", input: { env: "prod" }, allowedDecisions: ["allow-once", "allow-conversation", "deny"] };
    const { rerender } = render(<Wrapper><ApprovalCard runId={RUN} approval={approval} /></Wrapper>);
    expect(screen.queryByRole("button", { name: "Always allow" })).toBeNull();
    expect(screen.getByText("$1.50")).toBeTruthy();
    expect(screen.getByLabelText("Tool input").textContent).toBe(JSON.stringify({ env: "prod" }, null, 2));
    rerender(<Wrapper><ApprovalCard runId={RUN} approval={{ ...approval, allowedDecisions: [...approval.allowedDecisions, "allow-always"] }} /></Wrapper>);
    fireEvent.click(screen.getByRole("button", { name: "Always allow" }));
    await screen.findByText(/Decided: Always allow/);
    fireEvent.click(screen.getByRole("button", { name: "Deny" }));
    expect(fake.requests.map((r) => r.body)).toEqual([{ decision: "allow-always", alwaysScope: "principal" }]);
  });
});

describe("pending reads", () => {
  it("read the open interaction, null once resolved, again on reload", async () => {
    const connection = { interactionId: "int_3", runId: RUN, provider: "democal", gap: "CONNECTION_GAP_EXPIRED", loginUrl: "https://id.example/authorize?state=st_1&client_id=c" };
    const fake = new FakeFetch()
      .on("GET", `/v2/runs/${RUN}/pending-connection`, () => json(200, { connection }), () => json(200, {}))
      .on("GET", `/v2/runs/${RUN}/pending-question`, () =>
        json(404, { error: { status: "NOT_FOUND", code: "not_found", message: "run 'run_1' not found" } }));
    const { result } = renderHook(() => ({ c: usePendingConnection(RUN), q: usePendingQuestion(RUN) }), { wrapper: wrapper(fake) });
    await waitFor(() => expect(result.current.c.connection).toEqual(connection));
    await waitFor(() => expect(result.current.q.error?.status).toBe("NOT_FOUND"));
    expect(result.current.q.question).toBeNull();
    act(() => result.current.c.reload());
    await waitFor(() => expect(result.current.c.connection).toBeNull());
  });

  it("ConnectionCard says the gap in words and remembers the run for the OAuth landing page", () => {
    const fake = new FakeFetch();
    const Wrapper = wrapper(fake);
    const connection = { interactionId: "int_3", provider: "democal", gap: "CONNECTION_GAP_INSUFFICIENT_SCOPE" as const, scopes: ["calendar.read"], loginUrl: "https://id.example/authorize?state=st_9" };
    render(<Wrapper><ConnectionCard runId={RUN} connection={connection} /></Wrapper>);
    expect(screen.getByText(/missing a permission this needs \(calendar.read\)/)).toBeTruthy();
    const link = screen.getByRole("link", { name: "Sign in to democal" });
    expect(link.getAttribute("href")).toBe(connection.loginUrl);
    link.addEventListener("click", (e) => e.preventDefault()); // jsdom does not navigate
    fireEvent.click(link);
    expect(window.sessionStorage.getItem(CONNECT_STORAGE_PREFIX + "st_9")).toBe(RUN);
    expect(fake.requests).toHaveLength(0);
  });
});
