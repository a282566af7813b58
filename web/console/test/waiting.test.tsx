// @vitest-environment jsdom
import { cleanup, render, screen } from "@testing-library/react";
import { afterEach, describe, expect, it } from "vitest";
import { TetherClient } from "@tether/client";
import { TetherProvider } from "@tether/react";
import { RunPage } from "../src/RunPage.js";
import { waitingWords } from "../src/WaitingFor.js";
import { FakeFetch, frame, json, sse } from "../../client/test/fake.js";

afterEach(cleanup);

const RUN = "run_held";

function page(status: string, waitingFor?: { reason: string; cap: number }) {
  const run = { runId: RUN, status, conversationId: "c", routing: { model: "model-read-by-id" }, ...(waitingFor ? { waitingFor } : {}) };
  const fake = new FakeFetch()
    .on("GET", `/v2/runs/${RUN}/events`, sse([frame("snapshot", { snapshot: { run: { runId: RUN, status } } })], { hold: true }))
    .on("GET", `/v2/runs/${RUN}`, () => json(200, { run, parts: [] }))
    .on("GET", `/v2/runs/${RUN}/attempts`, () => json(200, { run, attempts: [], turns: [], lineage: [] }));
  const client = new TetherClient({ fetch: fake.fetch, reconnect: { initialMs: 1, maxMs: 2 } });
  render(<TetherProvider client={client}><RunPage runId={RUN} /></TetherProvider>);
  return fake;
}

describe("the run page's waiting_for", () => {
  it("says a queued run waits behind its agent's cap, with the reason and the cap", async () => {
    page("RUN_STATUS_QUEUED", { reason: "agent_concurrency", cap: 3 });
    const held = await screen.findByTestId("waiting-for");
    expect(held.getAttribute("data-reason")).toBe("agent_concurrency");
    expect(held.textContent).toContain("Queued behind its agent's cap: 3 runs at once, all running");
    expect(held.textContent).toContain("(agent_concurrency, cap 3)");
  });

  it("says a queued run waits behind its tenant's cap", async () => {
    page("RUN_STATUS_QUEUED", { reason: "tenant_concurrency", cap: 1 });
    const held = await screen.findByTestId("waiting-for");
    expect(held.textContent).toContain("Queued behind the tenant's cap: 1 run at once, all running");
  });

  it("shows nothing for a queued run no cap holds back, nor for a running one", async () => {
    page("RUN_STATUS_QUEUED");
    await screen.findByText("model-read-by-id"); // the run read by id has been shown
    expect(screen.queryByTestId("waiting-for")).toBeNull();
    cleanup();
    page("RUN_STATUS_RUNNING", { reason: "agent_concurrency", cap: 3 });
    await screen.findByText("model-read-by-id");
    expect(screen.queryByTestId("waiting-for")).toBeNull();
  });

  it("names an unknown reason as it came", () => {
    expect(waitingWords({ reason: "someday", cap: 2 })).toBe("Queued behind someday: 2 runs at once, all running");
    expect(waitingWords(undefined)).toBe("");
  });
});
