import { useEffect, useMemo, useState } from "react";
import type { RunJson } from "@tether/client";
import { useTetherClient } from "@tether/react";
import { formatMicros, statusClass, statusWords, tokens } from "./format.js";
import { href, onLinkClick } from "./router.js";
import { ownSpend, treeNodes, type Spend, type TreeNode } from "./tree.js";

// ListRuns' largest page.
const PAGE = 200;

/** The run tree `runId` belongs to, from its root down; nothing for a run in no tree. Read again
 * whenever `status` changes: a parent's status moves as its children start and end. */
export function RunTree({ runId, rootRunId, status }: { runId: string; rootRunId: string | undefined; status: string | undefined }) {
  const client = useTetherClient();
  const [tree, setTree] = useState<{ root: string; runs: RunJson[] } | null>(null);
  useEffect(() => {
    const abort = new AbortController();
    const { signal } = abort;
    const read = async () => {
      // The stream's snapshot names the root; a run read by id does too, should it not.
      const root = rootRunId || (await client.getRun(runId, { signal })).run?.treeRootRunId || runId;
      const runs: RunJson[] = [];
      let pageToken = "";
      do {
        const page = await client.listRuns({ treeRootRunId: root, pageSize: PAGE, ...(pageToken ? { pageToken } : {}) }, { signal });
        runs.push(...(page.runs ?? []));
        pageToken = page.nextPageToken ?? "";
      } while (pageToken);
      if (!signal.aborted) setTree({ root, runs });
    };
    // The tree is an aside to the run: a failed read leaves the last one shown.
    read().catch(() => undefined);
    return () => abort.abort();
  }, [client, runId, rootRunId, status]);

  const nodes = useMemo(() => (tree ? treeNodes(tree.root, tree.runs) : []), [tree]);
  // A root whose delegate calls started nothing is no tree; a child is, even when the key sees
  // none of the rest of it.
  if (!tree || (nodes.length < 2 && tree.root === runId)) return null;
  return (
    <section aria-label="Run tree" className="run-tree">
      <h2>Run tree</h2>
      <ul>
        {nodes.filter((n) => n.depth === 0).map((n) => <Branch key={n.run.runId} node={n} currentRunId={runId} />)}
      </ul>
    </section>
  );
}

function spendWords(spend: Spend): string {
  return `${tokens(spend.inputTokens)} in, ${tokens(spend.outputTokens)} out, ${formatMicros(spend.costMicros)}`;
}

function Branch({ node, currentRunId }: { node: TreeNode; currentRunId: string }) {
  const { run, treeSpend, children } = node;
  const runId = run.runId ?? "";
  return (
    <li data-run-id={runId}>
      <a href={href({ page: "run", runId })} onClick={onLinkClick} aria-current={runId === currentRunId ? "page" : undefined}>
        <code>{runId}</code>
      </a>
      {" "}<span className={statusClass(run.status)}>{statusWords(run.status)}</span>
      {" "}<span className="spend">{spendWords(ownSpend(run))}</span>
      {children.length > 0 && <span className="spend"> (with the runs below: {spendWords(treeSpend)})</span>}
      {children.length > 0 && (
        <ul>
          {children.map((c) => <Branch key={c.run.runId} node={c} currentRunId={currentRunId} />)}
        </ul>
      )}
    </li>
  );
}
