"""Context figures: how long an attempt takes to assemble what the model sees (its live facts,
the retrieval over the tenant's 1,000 knowledge documents, the history rendered in the
documented order), deep into a conversation against early in it. The goal: the assembly's cost
follows the new turns (compaction keeps the history within the agent's budget), not the whole
conversation.

One stack (orchestrator, admission, gateway) and one worker against a local model server (a
separate process; its demo agent answers, and writes the summaries). The tenant uploads 1,000
documents through the gateway, then holds one conversation of 300 short turns (a note that
names a policy, every seventh a tool turn) with a context budget of 4,000 tokens. The figure is
the worker's context stage of each turn (`attempts.stages.context_ms`), the median of nine
turns around the 10th and of the last nine. The documents are analysed (as autovacuum does
within a minute of a bulk upload) before the conversation: the search's plan depends on it.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import uuid

from sqlalchemy import select, text, update
from sqlalchemy.ext.asyncio import AsyncEngine

from bench.common import bench_stack, emit
from bench.model import model_server
from bench.runs import worker_env
from tether import apikeys
from tether.client import TetherClient
from tether.db.engine import create_engine
from tether.db.schema import attempts, runs, tenants

SERVICES = ("orchestrator", "admission", "gateway")
DOCUMENTS = 1_000
TURNS = 300
BUDGET_TOKENS = 4_000
WINDOW = 9  # turns around each measured one: a median that load on the machine moves less
UPLOADERS = 8
TIMEOUT_S = 300.0
# Words the documents and the messages share, so each message retrieves a few documents.
WORDS = [f"topic{i}" for i in range(200)]


def document(rng: random.Random, i: int) -> tuple[str, str]:
    """A document of a few hundred characters about a few topics."""
    topics = rng.sample(WORDS, 3)
    body = " ".join(
        f"The {topic} policy covers case {rng.randrange(10_000)} and its exceptions."
        for topic in topics * 3
    )
    return f"Policy {i} ({', '.join(topics)})", body


def message(rng: random.Random, turn: int) -> str:
    """A turn: a note naming a policy, every seventh a question for a tool."""
    if turn % 7 == 3:
        return f"what time is it now, turn {turn}?"
    return f"note {turn}: remember the {rng.choice(WORDS)} policy for box {turn}"


async def run() -> None:
    """Run the context group."""
    rng = random.Random(13)
    async with model_server() as model, bench_stack(SERVICES) as stack:
        engine = create_engine(stack.db_url, pool_size=1)
        try:
            async with engine.begin() as conn:
                key, _ = await apikeys.create_key(conn, "bench", "curator", apikeys.ALL_SCOPES)
                await conn.execute(
                    update(tenants)
                    .where(tenants.c.tenant_id == "bench")
                    .values(
                        agent={
                            "tool_allowlist": ["get_time"],
                            "context": {"budget_tokens": BUDGET_TOKENS},
                        }
                    )
                )
            await stack.services.start("worker", extra_env=worker_env(model))
            gateway = stack.services.addresses()["gateway"]
            async with TetherClient(gateway, key) as client:
                documents = [document(rng, i) for i in range(DOCUMENTS)]
                queue = list(documents)

                async def upload() -> None:
                    while queue:
                        title, content = queue.pop()
                        await client.add_document(title, content)

                await asyncio.gather(*(upload() for _ in range(UPLOADERS)))
                # The figure is the steady state's: statistics as autovacuum gathers them.
                async with engine.begin() as conn:
                    await conn.execute(text("ANALYZE documents"))
                conversation = f"context-{uuid.uuid4().hex[:8]}"
                run_ids = []
                for turn in range(TURNS):
                    sent = await client.send(
                        message(rng, turn),
                        conversation_id=conversation,
                        event_id=f"ctx-{uuid.uuid4().hex}",
                    )
                    run_ids.append(sent.run.run_id)
                await _finished(engine, run_ids[-1])
            async with engine.connect() as conn:
                rows = (
                    await conn.execute(
                        select(runs.c.run_id, runs.c.status, attempts.c.stages)
                        .join(attempts, attempts.c.run_id == runs.c.run_id)
                        .where(runs.c.run_id.in_(run_ids), attempts.c.attempt == 1)
                        .order_by(runs.c.created_at, attempts.c.lease_epoch)
                    )
                ).all()
        finally:
            await engine.dispose()
    first = {}
    for row in rows:
        first.setdefault(row.run_id, float((row.stages or {}).get("context_ms", 0.0)))
    context_ms = [first[r] for r in run_ids if r in first]
    early = statistics.median(context_ms[10 - 1 - WINDOW // 2 : 10 + WINDOW // 2])
    late = statistics.median(context_ms[TURNS - WINDOW :])
    config = {
        "documents": DOCUMENTS,
        "turns": TURNS,
        "budget_tokens": BUDGET_TOKENS,
        "window": WINDOW,
        "completed": sum(1 for row in rows if row.status == "completed"),
    }
    emit("context_build_ratio_t300_t10", late / early, "ratio", goal="< 2", **config)
    emit("context_build_ms_t300", late, "ms", goal="< 10", **config)
    emit("context_build_ms_t10", early, "ms", **config)


async def _finished(engine: AsyncEngine, run_id: str) -> None:
    """Wait until the conversation's last run is over."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + TIMEOUT_S
    while loop.time() < deadline:
        async with engine.connect() as conn:
            status = (
                await conn.execute(select(runs.c.status).where(runs.c.run_id == run_id))
            ).scalar_one()
        if status in ("completed", "failed", "cancelled"):
            return
        await asyncio.sleep(0.2)
    raise TimeoutError(f"the conversation's last run did not finish in {TIMEOUT_S:g} s")
