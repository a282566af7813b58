// @vitest-environment jsdom
import { cleanup, render, screen, within } from "@testing-library/react";
import { afterEach, describe, expect, it, vi } from "vitest";
import { TetherClient, type RunJson, type RunStatusJson } from "@tether/client";
import { TetherProvider } from "@tether/react";
import { RunTree } from "../src/RunTree.js";
import { FakeFetch, json } from "../../client/test/fake.js";

afterEach(cleanup);

function run(runId: string, parent: string, minute: number, status: RunStatusJson, output: number): RunJson {
  return {
    runId,
    treeRootRunId: "run_root",
    ...(parent ? { treeParentRunId: parent } : {}),
    createdAt: `2026-01-01T00:0${minute}:00Z`,
    status,
    usage: { inputTokens: "100", outputTokens: String(output), costMicros: "2500" },
  };
}

function show(runId: string, rootRunId: string | undefined, fake: FakeFetch) {
  const client = new TetherClient({ fetch: fake.fetch });
  render(<TetherProvider client={client}><RunTree runId={runId} rootRunId={rootRunId} status="RUN_STATUS_RUNNING" /></TetherProvider>);
}

describe("the run page's tree", () => {
  it("pages through the tree from its root and nests each run under its parent, this one marked", async () => {
    const fake = new FakeFetch().on(
      "GET",
      "/v2/runs",
      () => json(200, { runs: [run("run_child", "run_root", 1, "RUN_STATUS_RUNNING", 5)], nextPageToken: "p2" }),
      () => json(200, { runs: [run("run_root", "", 0, "RUN_STATUS_WAITING_FOR_CHILDREN", 7), run("run_grandchild", "run_child", 2, "RUN_STATUS_COMPLETED", 3)] }),
    );
    show("run_child", "run_root", fake);

    const tree = await screen.findByRole("region", { name: "Run tree" });
    expect(fake.calls("GET", "/v2/runs").map((r) => r.url.slice(r.url.indexOf("?")))).toEqual([
      "?pageSize=200&treeRootRunId=run_root",
      "?pageSize=200&pageToken=p2&treeRootRunId=run_root",
    ]);
    const root = tree.querySelector('li[data-run-id="run_root"]')!;
    const child = root.querySelector('li[data-run-id="run_child"]')!;
    expect(child.querySelector('li[data-run-id="run_grandchild"]')).not.toBeNull();
    expect(within(tree).getByRole("link", { current: "page" }).textContent).toBe("run_child");
    expect(within(tree).getByRole("link", { name: "run_root" }).getAttribute("href")).toBe("/console/runs/run_root");
    expect(root.textContent).toContain("waiting for children");
    // The root's own spend, then its subtree's: 7 + 5 + 3 output tokens, 3 x $0.0025.
    expect(root.textContent).toContain("100 in, 7 out, $0.0025 (with the runs below: 300 in, 15 out, $0.0075)");
  });

  it("shows nothing for a run in no tree", async () => {
    const fake = new FakeFetch()
      .on("GET", "/v2/runs/run_alone", () => json(200, { run: { runId: "run_alone", treeRootRunId: "run_alone" } }))
      .on("GET", "/v2/runs", () => json(200, { runs: [{ runId: "run_alone", treeRootRunId: "run_alone" }] }));
    show("run_alone", undefined, fake);
    await vi.waitFor(() => expect(fake.calls("GET", "/v2/runs")).toHaveLength(1));
    // Past the listing's answer, which renders nothing either.
    await new Promise((resolve) => setTimeout(resolve, 50));
    expect(fake.calls("GET", "/v2/runs/run_alone")).toHaveLength(1);
    expect(screen.queryByRole("region", { name: "Run tree" })).toBeNull();
  });
});
