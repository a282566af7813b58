/** A run tree (a run, the runs its delegate calls started, and theirs) as the run page shows it,
 * built as `tether run RUN_ID --tree` builds it (libs/tether/cli/trees.py). */
import type { RunJson } from "@tether/client";

/** A subtree's spend: the usage fields the CLI sums. Numbers, as a tree's stays far below 2^53. */
export interface Spend {
  inputTokens: number;
  outputTokens: number;
  costMicros: number;
}

export interface TreeNode {
  run: RunJson;
  depth: number;
  /** The run's own spend and that of every run below it. */
  treeSpend: Spend;
  /** The nodes one level below, oldest first (the same objects as in the list). */
  children: TreeNode[];
}

/** The run's own spend, without the runs below it. */
export function ownSpend(run: RunJson): Spend {
  return {
    inputTokens: Number(run.usage?.inputTokens ?? 0),
    outputTokens: Number(run.usage?.outputTokens ?? 0),
    costMicros: Number(run.usage?.costMicros ?? 0),
  };
}

function oldestFirst(a: RunJson, b: RunJson): number {
  const at = Date.parse(a.createdAt ?? "") || 0;
  const bt = Date.parse(b.createdAt ?? "") || 0;
  if (at !== bt) return at - bt;
  const aid = a.runId ?? "";
  const bid = b.runId ?? "";
  return aid < bid ? -1 : aid > bid ? 1 : 0;
}

/** The tree's runs depth first from `rootRunId`, children oldest first, each with its depth and
 * its subtree's spend. The nodes at depth 0 (the root, then any orphans) start its branches. */
export function treeNodes(rootRunId: string, runs: readonly RunJson[]): TreeNode[] {
  const byId = new Map(runs.map((r) => [r.runId ?? "", r]));
  const below = new Map<string, RunJson[]>();
  for (const run of runs) {
    if (!run.treeParentRunId) continue;
    const children = below.get(run.treeParentRunId) ?? [];
    children.push(run);
    below.set(run.treeParentRunId, children);
  }
  for (const children of below.values()) children.sort(oldestFirst);

  const spends = new Map<string, Spend>();
  // Recursion is as deep as the tree, which its depth limit keeps small; a run's total is stored
  // before its children are added so that a cycle in bad data ends instead of recursing forever.
  const treeSpend = (runId: string): Spend => {
    const known = spends.get(runId);
    if (known) return known;
    const total = ownSpend(byId.get(runId)!);
    spends.set(runId, total);
    for (const child of below.get(runId) ?? []) {
      const sub = treeSpend(child.runId ?? "");
      total.inputTokens += sub.inputTokens;
      total.outputTokens += sub.outputTokens;
      total.costMicros += sub.costMicros;
    }
    return total;
  };

  // A run whose parent the key may not see is shown at the root's level (oldest first, after the
  // root's subtree), not lost.
  const root = byId.get(rootRunId);
  const orphans = runs.filter((r) => r.treeParentRunId && !byId.has(r.treeParentRunId)).sort(oldestFirst);
  const tops = [...(root ? [root] : []), ...orphans];
  const nodes: TreeNode[] = [];
  const seen = new Set<string>();
  const stack: [RunJson, TreeNode | null][] = tops.reverse().map((r) => [r, null]);
  while (stack.length > 0) {
    const [run, parent] = stack.pop()!;
    const runId = run.runId ?? "";
    if (seen.has(runId)) continue;
    seen.add(runId);
    const node: TreeNode = { run, depth: parent ? parent.depth + 1 : 0, treeSpend: treeSpend(runId), children: [] };
    nodes.push(node);
    parent?.children.push(node);
    const children = below.get(runId) ?? [];
    for (let i = children.length - 1; i >= 0; i--) stack.push([children[i]!, node]);
  }
  return nodes;
}
