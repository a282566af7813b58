"""`mcp_run_vs_local_tool_p50` (part of `make bench BENCH=tools`): what taking a tool from an MCP
server costs a run, end to end.

One stack (the services as processes, one worker, the local model server) and the local MCP
stand-in as a process of its own. Two agents of the bench tenant: `local`, offered the built-in
read tool `get_time`, and `mcp`, offered the stand-in's read tool `lookup_order` as
`desk__lookup_order`. Each run is scripted alike: one model turn calling its one tool, then one
answering in text. Runs go one at a time (light load), the two kinds alternating so both see the
same machine, and each is timed from just before SendMessage to its terminal event on Redis. The
figure is p50(mcp) / p50(local): the MCP call's round trip to the server (over a session kept
open; the listing cached, so the lease adds none) and its key (a read is not an effects record,
as a built-in read is not), over a local call. Goal: <= 1.2.

Beside it, its floor: (p50(local) + p50 of a bare call of the SDK's own client) / p50(local),
the bare calls made between the runs on a session of the bench's own, with the stack up.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import cast

import httpx2
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.types import RequestParamsMeta

from bench.common import bench_stack, emit, percentile
from bench.model import Model, model_server
from bench.runs import Completions, completions, worker_env
from tether import apikeys
from tether.client import TetherClient
from tether.db.engine import create_engine
from tether.mcp_wire import IDEMPOTENCY_KEY_META

SERVICES = ("orchestrator", "admission", "interactions", "gateway")
RUNS = 40  # each kind
WARM_UP = 5  # each kind: sessions opened, listings cached, code paths warm
SCOPES = (*apikeys.CLIENT_SCOPES, apikeys.AGENTS_READ, apikeys.AGENTS_WRITE)
CATALOG_WAIT_S = 30.0


@asynccontextmanager
async def mcp_stand_in() -> AsyncIterator[str]:
    """`python -m tether.testing.mcp_server --port 0`: its MCP URL, stopped on exit."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tether.testing.mcp_server",
        "--port",
        "0",
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        line = (await asyncio.wait_for(process.stdout.readline(), 30)).decode().strip()
        if "listening" not in line:
            raise RuntimeError(f"the MCP stand-in did not start: {line!r}")
        yield line.rsplit(" ", 1)[-1]
    finally:
        if process.returncode is None:
            process.terminate()
            await process.wait()


async def _agents_key(db_url: str) -> str:
    engine = create_engine(db_url, pool_size=1)
    try:
        async with engine.begin() as conn:
            key, _ = await apikeys.create_key(conn, "bench", "bench-agents", SCOPES)
    finally:
        await engine.dispose()
    return key


async def _apply(client: TetherClient, mcp_url: str) -> None:
    deadline = asyncio.get_running_loop().time() + CATALOG_WAIT_S
    while "get_time" not in {t.name for t in (await client.list_tools()).tools}:
        if asyncio.get_running_loop().time() > deadline:
            raise RuntimeError("no worker announced get_time")
        await asyncio.sleep(0.1)
    limits = {"max_steps": 4, "max_tool_calls": 4}
    documents = [
        {
            "name": "local",
            "instructions": "Tell the time.",
            "tools": ["get_time"],
            "limits": limits,
            "routes": [{"channel": "local"}],
        },
        {
            "name": "mcp",
            "instructions": "Look orders up.",
            # Offered its one MCP tool and nothing else, as `local` is offered its one tool (an
            # absent `tools` would add every built-in tool to each request).
            "tools": [],
            "mcp_servers": [{"name": "desk", "url": mcp_url, "tools": ["lookup_order"]}],
            "limits": limits,
            "routes": [{"channel": "mcp"}],
        },
    ]
    for document in documents:
        await client.apply_agent(json.dumps(document))


async def _one(
    client: TetherClient, done: Completions, model: Model, channel: str, tool: str, args: object
) -> float:
    text = f"bench {channel} {uuid.uuid4().hex}"
    await model.script(
        text,
        [{"kind": "tool_use", "name": tool, "input": args}, {"kind": "text", "text": "done"}],
    )
    start = time.perf_counter()
    sent = await client.send(
        text, conversation_id=text.replace(" ", "-"), event_id=text[-32:], channel=channel
    )
    finished, outcome = await done.wait(sent.run.run_id)
    if outcome != "completed":
        raise RuntimeError(f"a {channel} run ended {outcome}")
    return (finished - start) * 1000


SDK_CALLS = 3  # after each pair of runs


@asynccontextmanager
async def sdk_session(mcp_url: str) -> AsyncIterator[ClientSession]:
    """A session of the SDK's own client with the stand-in, nothing of Tether's."""
    async with (
        httpx2.AsyncClient() as http,
        streamable_http_client(mcp_url, http_client=http) as (read, write),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        yield session


async def sdk_call_ms(session: ClientSession) -> float:
    """One `tools/call` of the read tool, with its own idempotency key in `_meta` as Tether
    sends it (the server's work for a keyed call, remembering its answer under the key, is the
    server's, not Tether's), in ms."""
    started = time.perf_counter()
    meta = cast("RequestParamsMeta", {IDEMPOTENCY_KEY_META: f"floor-{uuid.uuid4()}"})
    await session.call_tool("lookup_order", {"order_id": "A-1001"}, meta=meta)
    return (time.perf_counter() - started) * 1000


async def mcp_run_vs_local_tool_p50() -> None:
    """The figure (see the module docstring)."""
    env = {"TETHER_ALLOW_PRIVATE_TARGETS": "loopback"}
    async with (
        model_server() as model,
        mcp_stand_in() as mcp_url,
        bench_stack(SERVICES, extra_env=env) as stack,
    ):
        await stack.services.start("worker", extra_env=worker_env(model))
        key = await _agents_key(stack.db_url)
        async with (
            TetherClient(stack.services.addresses()["gateway"], key) as client,
            completions(stack.redis_url) as done,
            sdk_session(mcp_url) as session,
        ):
            await _apply(client, mcp_url)
            kinds = {
                "local": ("get_time", {}),
                "mcp": ("desk__lookup_order", {"order_id": "A-1001"}),
            }
            samples: dict[str, list[float]] = {"local": [], "mcp": [], "sdk": []}
            for i in range(WARM_UP + RUNS):
                for channel, (tool, args) in kinds.items():
                    ms = await _one(client, done, model, channel, tool, args)
                    if i >= WARM_UP:
                        samples[channel].append(ms)
                for _ in range(SDK_CALLS):
                    ms = await sdk_call_ms(session)
                    if i >= WARM_UP:
                        samples["sdk"].append(ms)
    local, mcp, sdk = (statistics.median(samples[k]) for k in ("local", "mcp", "sdk"))
    # The floor: the same run's local tool run plus one bare SDK call to the same server (an
    # open session, nothing of Tether's), made between the runs, with the stack up as they
    # ran: what no MCP run can go under.
    emit(
        "mcp_run_vs_local_tool_p50_floor",
        (local + sdk) / local,
        "ratio",
        sdk_call_p50_ms=round(sdk, 2),
        local_p50_ms=round(local, 2),
        calls=len(samples["sdk"]),
    )
    emit(
        "mcp_run_vs_local_tool_p50",
        mcp / local,
        "ratio",
        goal="<= 1.2",
        runs_each=RUNS,
        local_p50_ms=round(local, 2),
        mcp_p50_ms=round(mcp, 2),
        local_p90_ms=round(percentile(samples["local"], 90), 2),
        mcp_p90_ms=round(percentile(samples["mcp"], 90), 2),
    )
