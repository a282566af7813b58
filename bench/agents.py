"""`make bench BENCH=agents`: what a tenant's many agents cost the claim.

One stack, two tenants: one with a single agent, one with 1,000 agents declaring 2,000 routes.
The bench is the worker (a real Work stream, as services/worker speaks it) and times each run
from the SendMessage that admits it to its pushed lease arriving on the stream; runs of the two
tenants alternate, so both see the same machine. The figure is the ratio of the medians
(goal <= 1.2: routing among a tenant's agents is a lookup, not a scan per claim).

The 999 agents beside the one applied through the API are written as rows (parsed and digested
by tether.agent_spec as an apply does): applying each through the API checks its routes against
every other published agent, which for 1,000 would take minutes of setup. The last agent is
applied through the API, so the set is one the orchestrator accepted and its revision moved.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import time
import uuid
from collections.abc import Sequence

from sqlalchemy import insert

from bench.common import BenchStack, bench_stack, emit
from services.worker.work_stream import Held, WorkStream
from tether import agent_spec, apikeys
from tether.client import TetherClient
from tether.db.engine import create_engine
from tether.db.schema import agent_sets, agent_versions, agents
from tether.domain import Assignment
from tether.runtime.rpc import internal_channel

AGENTS = 1_000
RUNS = 60  # each tenant; at least 50 per the issue, plus a margin for the warm-up
WARM_UP = 3  # the first claims of a tenant load its agents (once per revision): not measured
SCOPES = (*apikeys.CLIENT_SCOPES, apikeys.AGENTS_READ, apikeys.AGENTS_WRITE)


def document(index: int) -> dict[str, object]:
    """Agent `index`: two routes of its own channel (with and without a source)."""
    channel = f"c{index}"
    return {
        "name": f"agent-{index}",
        "instructions": f"You are agent {index}.",
        # No tools: the bench is the worker and announces none, and an apply naming a tool no
        # worker announced is refused; routing's cost does not depend on them.
        "routes": [{"channel": channel}, {"source": "chat", "channel": channel}],
    }


class Arrivals:
    """The bench's side of the Work stream: when each run's lease arrived."""

    def __init__(self) -> None:
        self.arrived: dict[str, asyncio.Future[float]] = {}

    def waiting_for(self, run_id: str) -> asyncio.Future[float]:
        return self.arrived.setdefault(run_id, asyncio.get_running_loop().create_future())

    def leased(self, assignment: Assignment) -> None:
        future = self.waiting_for(assignment.lease.run_id)
        if not future.done():
            future.set_result(time.perf_counter())

    def cancelled(self, run_id: str, epoch: int) -> None:
        pass  # no run is cancelled here

    def lost(self, run_id: str, epoch: int) -> None:
        pass  # the bench holds its leases only long enough to time them

    def held(self) -> Sequence[Held]:
        return []


async def _tenant(stack: BenchStack, tenant_id: str, seeded: int) -> str:
    """A tenant with a key able to apply agents, and `seeded` agents written as rows."""
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.begin() as conn:
            await apikeys.ensure_tenant(conn, tenant_id)
            key, _ = await apikeys.create_key(conn, tenant_id, "bench", SCOPES)
            if seeded:
                specs = [agent_spec.parse(json.dumps(document(i))) for i in range(seeded)]
                await conn.execute(
                    insert(agents),
                    [
                        {"tenant_id": tenant_id, "name": s.name, "published_version": 1}
                        for s in specs
                    ],
                )
                await conn.execute(
                    insert(agent_versions),
                    [
                        {
                            "tenant_id": tenant_id,
                            "name": s.name,
                            "version": 1,
                            "written": s.written,
                            "normalised": s.normalised,
                            "digest": s.digest,
                            "created_by": {"kind": "bench"},
                        }
                        for s in specs
                    ],
                )
                await conn.execute(
                    insert(agent_sets).values(
                        tenant_id=tenant_id, revision=1, default_agent=specs[0].name
                    )
                )
    finally:
        await engine.dispose()
    return key


async def _time_run(
    client: TetherClient, arrivals: Arrivals, channel: str, tag: str
) -> tuple[float, str]:
    """Milliseconds from sending a message to its run's lease reaching the bench's stream."""
    start = time.perf_counter()
    sent = await client.send(
        "what time is it?",
        conversation_id=f"{tag}-{uuid.uuid4().hex}",
        event_id=uuid.uuid4().hex,
        channel=channel,
    )
    run_id = sent.run.run_id
    arrived = await asyncio.wait_for(arrivals.waiting_for(run_id), 30)
    return (arrived - start) * 1000, run_id


async def run() -> None:
    """Run the agents group."""
    async with bench_stack() as stack:
        one_key = await _tenant(stack, f"one-{uuid.uuid4().hex[:6]}", 0)
        many_key = await _tenant(stack, f"many-{uuid.uuid4().hex[:6]}", AGENTS - 1)
        channel = internal_channel(
            stack.services.addresses()["orchestrator"], stack.credentials["worker"]
        )
        stream, arrivals = WorkStream(channel, f"bench-{uuid.uuid4().hex[:6]}"), Arrivals()
        serving = asyncio.ensure_future(stream.run(arrivals))
        try:
            await asyncio.wait_for(stream.connected.wait(), 30)
            stream.grant(2 * (RUNS + WARM_UP) + 10)
            async with (
                TetherClient(stack.services.addresses()["gateway"], one_key) as one,
                TetherClient(stack.services.addresses()["gateway"], many_key) as many,
            ):
                await one.apply_agent(json.dumps(document(0)))
                await many.apply_agent(json.dumps(document(AGENTS - 1)))
                listed = await many.list_agents()
                assert len(listed.agents) == AGENTS, len(listed.agents)
                # The runs of the many tenant come on a channel an agent in the middle routes.
                middle = f"c{AGENTS // 2}"
                samples: dict[str, list[float]] = {"one": [], "many": []}
                for i in range(RUNS + WARM_UP):
                    one_ms, _ = await _time_run(one, arrivals, "c0", "one")
                    many_ms, run_id = await _time_run(many, arrivals, middle, "many")
                    if i >= WARM_UP:
                        samples["one"].append(one_ms)
                        samples["many"].append(many_ms)
                routed = await many.get_run(run_id)
                assert routed.run.routing.agent == f"agent-{AGENTS // 2}", routed.run.routing
        finally:
            await stream.close()
            serving.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await serving
            await channel.close()
    one_p50, many_p50 = statistics.median(samples["one"]), statistics.median(samples["many"])
    config = {"runs_each": RUNS, "agents": AGENTS, "routes": 2 * AGENTS}
    emit("claim_ms_p50_agents1", one_p50, "ms", **config)
    emit(f"claim_ms_p50_agents{AGENTS}", many_p50, "ms", **config)
    emit(
        f"claim_cost_ratio_agents{AGENTS}_agents1", many_p50 / one_p50, "ratio", goal=1.2, **config
    )
