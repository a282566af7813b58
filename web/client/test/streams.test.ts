import { describe, expect, it } from "vitest";
import { TetherClient, TetherError, type RunStreamItem, type LiveRunsItem } from "../src/index.js";
import { FakeFetch, frame, json, runEvent, sse } from "./fake.js";

const RUN = "run_1";
const PATH = `/v2/runs/${RUN}/events`;

function client(fake: FakeFetch): TetherClient {
  return new TetherClient({ fetch: fake.fetch, auth: { type: "bearer", token: "tk" }, reconnect: { initialMs: 1, maxMs: 2 } });
}

function snapshot(status = "RUN_STATUS_RUNNING", lastSeq = 0): string {
  return frame("snapshot", { snapshot: { run: { runId: RUN, status, lastSeq: String(lastSeq) }, parts: [] } });
}

async function collect<T>(gen: AsyncGenerator<T>, limit = 100): Promise<T[]> {
  const out: T[] = [];
  for await (const item of gen) {
    out.push(item);
    if (out.length >= limit) break;
  }
  return out;
}

function seqs(items: RunStreamItem[]): number[] {
  return items.flatMap((i) => (i.kind === "event" && i.event.seq ? [Number(i.event.seq)] : []));
}

describe("run stream", () => {
  it("resumes after a network break with Last-Event-ID and yields each durable event once", async () => {
    const fake = new FakeFetch().on(
      "GET",
      PATH,
      // First connection: snapshot, seq 1-3 and a delta, then the connection breaks mid-frame.
      sse([snapshot(), runEvent(RUN, 1, "run.started"), runEvent(RUN, 2, "part.added"),
        frame("text.delta", { event: { runId: RUN, type: "text.delta", textDelta: { text: "hi" } } }),
        runEvent(RUN, 3, "part.updated"), "id: 4\nevent: part.upd"], { break: true }),
      // The server replays from the cursor; 3 again (a duplicate the client must drop), then 4, 5.
      sse([snapshot("RUN_STATUS_RUNNING", 3), runEvent(RUN, 3, "part.updated"), runEvent(RUN, 4, "part.updated"),
        runEvent(RUN, 5, "run.completed")]),
    );
    const items = await collect(client(fake).streamRun(RUN));
    expect(seqs(items)).toEqual([1, 2, 3, 4, 5]);
    expect(items.map((i) => i.kind)).toEqual([
      "snapshot", "event", "event", "event", "event", "reconnecting", "snapshot", "event", "event",
    ]);
    const [first, second] = fake.calls("GET", PATH);
    expect(first!.headers["Last-Event-ID"]).toBeUndefined();
    expect(second!.headers["Last-Event-ID"]).toBe("3");
    expect(items[6]).toMatchObject({ kind: "snapshot", resumed: true });
    expect(fake.requests).toHaveLength(2); // ended after run.completed: no third connection
  });

  it("reconnects from its own cursor after an `event: error` frame", async () => {
    const errorFrame = frame("error", { error: { status: "RESOURCE_EXHAUSTED", code: "slow_consumer", message: "fell behind" }, resume: "2" });
    const fake = new FakeFetch().on("GET", PATH,
      sse([snapshot(), runEvent(RUN, 1, "run.started"), runEvent(RUN, 2, "part.added"), errorFrame]),
      sse([snapshot(), runEvent(RUN, 3, "run.failed")]),
    );
    const items = await collect(client(fake).streamRun(RUN, { after: 0 }));
    expect(seqs(items)).toEqual([1, 2, 3]);
    const reconnect = items.find((i) => i.kind === "reconnecting");
    expect((reconnect as { error: TetherError }).error.code).toBe("slow_consumer");
    expect(fake.calls("GET", PATH)[1]!.headers["Last-Event-ID"]).toBe("2");
  });

  it("starts from a kept cursor and reconnects when the server ends the stream before the run", async () => {
    const fake = new FakeFetch().on("GET", PATH,
      sse([snapshot(), runEvent(RUN, 8, "run.queued")]),
      sse([snapshot(), runEvent(RUN, 9, "run.cancelled")]),
    );
    const items = await collect(client(fake).streamRun(RUN, { after: "7", deltas: false }));
    expect(seqs(items)).toEqual([8, 9]);
    const calls = fake.calls("GET", PATH);
    expect(calls.map((c) => c.headers["Last-Event-ID"])).toEqual(["7", "8"]);
    expect(calls[0]!.url).toBe(`${PATH}?deltas=false`);
  });

  it("ends without reconnecting when a resumed run had already finished", async () => {
    const fake = new FakeFetch().on("GET", PATH, sse([snapshot("RUN_STATUS_COMPLETED", 5)]));
    const items = await collect(client(fake).streamRun(RUN, { after: 5 }));
    expect(items.map((i) => i.kind)).toEqual(["snapshot"]);
    expect(fake.requests).toHaveLength(1);
  });

  it("throws a non-retryable error (not found) instead of reconnecting", async () => {
    const fake = new FakeFetch().on("GET", PATH, () =>
      json(404, { error: { status: "NOT_FOUND", code: "not_found", message: "run 'run_1' not found" } }));
    const err = await collect(client(fake).streamRun(RUN)).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(TetherError);
    expect((err as TetherError).httpStatus).toBe(404);
    expect(fake.requests).toHaveLength(1);
  });

  it("resolves thin interaction events through the pending-* reads", async () => {
    const question = { interactionId: "int_1", runId: RUN, questions: [{ key: "color", prompt: "Which?", options: ["red", "blue"] }] };
    const fake = new FakeFetch()
      .on("GET", PATH, sse([snapshot(), runEvent(RUN, 1, "question.requested", { questionRequested: { interactionId: "int_1" } }),
        runEvent(RUN, 2, "approval.requested", { approvalRequested: { interactionId: "int_2" } }),
        runEvent(RUN, 3, "run.cancelled")]))
      .on("GET", `/v2/runs/${RUN}/pending-question`, () => json(200, { question }))
      .on("GET", `/v2/runs/${RUN}/pending-approval`, () => json(200, {}));
    const items = await collect(client(fake).streamRun(RUN));
    const events = items.filter((i) => i.kind === "event");
    expect(events[0]).toMatchObject({ pending: { type: "question", question } });
    expect(events[1]).toMatchObject({ pending: { type: "approval", approval: null } }); // decided already
    expect(events[2]).not.toHaveProperty("pending");
  });

  it("stops when its signal aborts", async () => {
    const fake = new FakeFetch().on("GET", PATH, sse([snapshot()], { hold: true }));
    const abort = new AbortController();
    const items: RunStreamItem[] = [];
    for await (const item of client(fake).streamRun(RUN, { signal: abort.signal })) {
      items.push(item);
      abort.abort();
    }
    expect(items.map((i) => i.kind)).toEqual(["snapshot"]);
  });
});

describe("token expiry mid-stream", () => {
  it("gets a fresh token once and resumes from the cursor; a second refusal in a row throws", async () => {
    const expired = frame("error", { error: { status: "UNAUTHENTICATED", code: "unauthenticated", message: "token expired" } });
    const fake = new FakeFetch().on("GET", PATH,
      sse([snapshot(), runEvent(RUN, 1, "run.started"), expired]),
      sse([snapshot(), runEvent(RUN, 2, "part.added"), expired]),
      sse([snapshot(), expired]),
    );
    const asked: boolean[] = [];
    let n = 0;
    const c = new TetherClient({
      fetch: fake.fetch,
      auth: { type: "bearer", getToken: ({ refresh }) => { asked.push(refresh); return `tt_${++n}`; } },
      reconnect: { initialMs: 1, maxMs: 2 },
    });
    const items: RunStreamItem[] = [];
    const err = await (async () => {
      for await (const item of c.streamRun(RUN)) items.push(item);
    })().catch((e: unknown) => e);
    expect(seqs(items)).toEqual([1, 2]);
    expect((err as TetherError).status).toBe("UNAUTHENTICATED");
    expect(asked).toEqual([false, true, true]);
    expect(fake.requests.map((r) => [r.headers["Authorization"], r.headers["Last-Event-ID"]])).toEqual([
      ["Bearer tt_1", undefined],
      ["Bearer tt_2", "1"],
      ["Bearer tt_3", "2"],
    ]);
  });
});

describe("live run list", () => {
  it("starts every connection with a fresh page and then yields changed runs", async () => {
    const fake = new FakeFetch().on("GET", "/v2/runs/live",
      sse([frame("runs", { runs: [{ runId: "a", status: "RUN_STATUS_QUEUED" }] }), frame("run", { run: { runId: "a", status: "RUN_STATUS_RUNNING" } })], { break: true }),
      sse([frame("runs", { runs: [{ runId: "b" }, { runId: "a", status: "RUN_STATUS_COMPLETED" }] })], { hold: true }),
    );
    const items: LiveRunsItem[] = await collect(client(fake).streamRuns({ statuses: ["RUN_STATUS_RUNNING"], pageSize: 10 }), 4);
    expect(items.map((i) => i.kind)).toEqual(["runs", "run", "reconnecting", "runs"]);
    expect(items[3]).toMatchObject({ kind: "runs", page: { runs: [{ runId: "b" }, { runId: "a" }] } });
    expect(fake.requests[0]!.url).toBe("/v2/runs/live?status=RUN_STATUS_RUNNING&pageSize=10");
    expect(fake.requests.every((r) => r.headers["Last-Event-ID"] === undefined)).toBe(true);
  });
});

describe("conversation stream", () => {
  it("resumes from the last cursor and drops a repeated durable event", async () => {
    const ev = (seq: number, cursor: string) =>
      `id: ${cursor}\nevent: part.added\ndata: ${JSON.stringify({ event: { runId: "r1", seq: String(seq), type: "part.added" }, cursor })}\n\n`;
    const fake = new FakeFetch().on("GET", "/v2/conversations/c1/events",
      sse([ev(1, "c-1"), ev(2, "c-2")], { break: true }),
      sse([ev(2, "c-2"), ev(3, "c-3")], { hold: true }),
    );
    const items = await collect(client(fake).streamConversation("c1"), 4);
    expect(items.flatMap((i) => (i.kind === "event" ? [i.cursor] : []))).toEqual(["c-1", "c-2", "c-3"]);
    expect(fake.requests[1]!.headers["Last-Event-ID"]).toBe("c-2");
  });
});
