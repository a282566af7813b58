import { describe, expect, it } from "vitest";
import type { RunJson } from "@tether/client";
import { treeNodes } from "../src/tree.js";

function run(runId: string, parent: string, createdAt: string, output: number, cost: number): RunJson {
  return {
    runId,
    treeRootRunId: "root",
    ...(parent ? { treeParentRunId: parent } : {}),
    createdAt,
    status: "RUN_STATUS_COMPLETED",
    // int64 fields come as strings in the JSON mapping.
    usage: { inputTokens: "10", outputTokens: String(output), costMicros: String(cost) },
  };
}

const at = (minute: number) => `2026-01-01T00:${String(minute).padStart(2, "0")}:00Z`;

// root
//   a (oldest)
//     a1
//   b
//     b1 (older than b2)
//     b2
const TREE = [
  run("b2", "b", at(6), 7, 700),
  run("root", "", at(0), 1, 100),
  run("b", "root", at(2), 3, 300),
  run("a1", "a", at(3), 4, 400),
  run("b1", "b", at(5), 6, 600),
  run("a", "root", at(1), 2, 200),
];

describe("treeNodes", () => {
  it("lists a 3-level tree depth first from its root, children oldest first", () => {
    const nodes = treeNodes("root", TREE);
    expect(nodes.map((n) => [n.run.runId, n.depth])).toEqual([
      ["root", 0],
      ["a", 1],
      ["a1", 2],
      ["b", 1],
      ["b1", 2],
      ["b2", 2],
    ]);
    const [root] = nodes;
    expect(root!.children.map((n) => n.run.runId)).toEqual(["a", "b"]);
    expect(root!.children[1]!.children.map((n) => n.run.runId)).toEqual(["b1", "b2"]);
  });

  it("sums each node's subtree: input, output and cost", () => {
    const spend = Object.fromEntries(treeNodes("root", TREE).map((n) => [n.run.runId, n.treeSpend]));
    expect(spend["root"]).toEqual({ inputTokens: 60, outputTokens: 23, costMicros: 2300 });
    expect(spend["b"]).toEqual({ inputTokens: 30, outputTokens: 16, costMicros: 1600 });
    expect(spend["a"]).toEqual({ inputTokens: 20, outputTokens: 6, costMicros: 600 });
    expect(spend["b2"]).toEqual({ inputTokens: 10, outputTokens: 7, costMicros: 700 });
  });

  it("orders children of the same instant by run id", () => {
    const twins = [run("root", "", at(0), 0, 0), run("y", "root", at(1), 0, 0), run("x", "root", at(1), 0, 0)];
    expect(treeNodes("root", twins).map((n) => n.run.runId)).toEqual(["root", "x", "y"]);
  });

  it("shows a run whose parent is not visible at the root's level, with its own subtree", () => {
    // b is not visible (another principal's private run): b1 and b2 are orphans.
    const seen = TREE.filter((r) => r.runId !== "b");
    const nodes = treeNodes("root", seen);
    expect(nodes.map((n) => [n.run.runId, n.depth])).toEqual([
      ["root", 0],
      ["a", 1],
      ["a1", 2],
      ["b1", 0],
      ["b2", 0],
    ]);
    expect(nodes[0]!.treeSpend.outputTokens).toBe(1 + 2 + 4);
  });

  it("shows the visible runs of a tree whose root is not visible", () => {
    const seen = TREE.filter((r) => r.runId !== "root");
    expect(treeNodes("root", seen).map((n) => [n.run.runId, n.depth])).toEqual([
      ["a", 0],
      ["a1", 1],
      ["b", 0],
      ["b1", 1],
      ["b2", 1],
    ]);
  });

  it("is a single node for a run alone, and empty for no runs", () => {
    expect(treeNodes("root", [run("root", "", at(0), 1, 1)])).toHaveLength(1);
    expect(treeNodes("root", [])).toEqual([]);
  });
});
