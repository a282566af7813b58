"""`tether run RUN_ID --tree`: a run's tree (the runs its delegate calls started, and theirs),
each node with its status and spend, from its root down."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tether.client import TetherClient, run_to_dict
from tether.v1 import common_pb2

# ListRuns' largest page.
PAGE = 200


async def tree_runs(client: TetherClient, run_id: str) -> tuple[str, list[common_pb2.Run]]:
    """The root of `run_id`'s tree and every run of it the key may see."""
    found = (await client.get_run(run_id)).run
    root = found.tree_root_run_id or found.run_id
    runs: list[common_pb2.Run] = []
    token = ""
    while True:
        page = await client.list_runs(tree_root_run_id=root, page_size=PAGE, page_token=token)
        runs.extend(page.runs)
        token = page.next_page_token
        if not token:
            return root, runs


def _spend(usage: common_pb2.Usage) -> str:
    return (
        f"in={usage.input_tokens} out={usage.output_tokens} "
        f"cost=${usage.cost_micros / 1_000_000:.6f}"
    )


def _total(run_id: str, below: dict[str, list[common_pb2.Run]], by_id: dict[str, Any]) -> Any:
    """The spend of a run and every run below it."""
    total = common_pb2.Usage()
    stack = [by_id[run_id]]
    while stack:
        run = stack.pop()
        for name in ("input_tokens", "output_tokens", "cost_micros"):
            setattr(total, name, getattr(total, name) + getattr(run.usage, name))
        stack.extend(below.get(run.run_id, ()))
    return total


def tree_nodes(root: str, runs: Sequence[common_pb2.Run]) -> list[dict[str, Any]]:
    """The tree's runs depth first from its root, children oldest first: each as `run_to_dict`
    gives it, with its `depth` and its subtree's spend (`tree_usage`)."""
    by_id = {r.run_id: r for r in runs}
    below: dict[str, list[common_pb2.Run]] = {}
    for run in runs:
        if run.tree_parent_run_id:
            below.setdefault(run.tree_parent_run_id, []).append(run)
    for children in below.values():
        children.sort(key=lambda r: (r.created_at.ToDatetime(), r.run_id))
    nodes: list[dict[str, Any]] = []
    # A run whose parent the key may not see is shown under the root's level, not lost.
    tops = [by_id[root]] if root in by_id else []
    tops += [r for r in runs if r.tree_parent_run_id and r.tree_parent_run_id not in by_id]
    stack = [(top, 0) for top in reversed(tops)]
    while stack:
        run, depth = stack.pop()
        node = run_to_dict(run)
        node["depth"] = depth
        total = _total(run.run_id, below, by_id)
        node["tree_usage"] = {
            "input_tokens": total.input_tokens,
            "output_tokens": total.output_tokens,
            "cost_micros": total.cost_micros,
        }
        nodes.append(node)
        stack.extend((child, depth + 1) for child in reversed(below.get(run.run_id, [])))
    return nodes


def tree_text(root: str, runs: Sequence[common_pb2.Run]) -> str:
    """One line per run, indented by depth: id, agent, status, own spend, the subtree's."""
    by_id = {r.run_id: r for r in runs}
    lines = []
    for node in tree_nodes(root, runs):
        run = by_id[node["run_id"]]
        agent = f" {run.routing.agent}" if run.routing.agent else ""
        call = f" ({run.tree_call_id})" if run.tree_call_id else ""
        line = (
            f"{'  ' * node['depth']}{run.run_id}{agent}{call} {node['status']} {_spend(run.usage)}"
        )
        tree = node["tree_usage"]
        if tree["output_tokens"] != run.usage.output_tokens or tree["cost_micros"] != (
            run.usage.cost_micros
        ):
            line += (
                f" tree: out={tree['output_tokens']} cost=${tree['cost_micros'] / 1_000_000:.6f}"
            )
        lines.append(line)
    return "\n".join(lines)
