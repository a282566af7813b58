"""Dependency outages done for real: PostgreSQL stopped (immediate shutdown) under streaming
runs, Redis stopped, internal services killed. Every call answers UNAVAILABLE saying what is
down and that it may be retried (never INTERNAL or UNKNOWN), the Python client and the CLI
retry an idempotent send with the same event id, and each logical send makes exactly one run.

PostgreSQL here is a server of this module's own with fsync and synchronous commit on (the
suite's shared one has them off): the runs must survive its crash, not just its pause.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import asyncpg
import grpc
import pytest
import pytest_asyncio
from sqlalchemy import func, select

from tests.system.conftest import DurableServer
from tests.system.execution_support import (
    ExecStack,
    Tenant,
    exec_stack,
    parts_of,
    wait_for_status,
)
from tether.client import TetherClient
from tether.db.engine import create_engine
from tether.db.schema import messages, runs
from tether.stack.embedded import EmbeddedRedis
from tether.testing.eventually import eventually
from tether.testing.model_server import TextTurn
from tether.v1 import gateway_pb2, gateway_pb2_grpc

# processes killed and restarted, services outlived: seconds each, so in `make slow` (the budget)
pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.slow]

# Long enough that calls made while it lasts must have met it (and the clients' retries run
# across it); short enough to keep the suite fast.
OUTAGE_S = 3.0


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def own_redis(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[EmbeddedRedis]:
    server = EmbeddedRedis(Path(tmp_path_factory.mktemp("outage-redis")))
    await server.start()
    yield server
    server.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def outage(
    durable_pg: DurableServer,
    own_redis: EmbeddedRedis,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[ExecStack]:
    """One stack for the module (starting five services is the slow part); each test puts
    back what it broke."""
    async with exec_stack(
        durable_pg.url,
        durable_pg.template_db,
        own_redis.url,
        Path(tmp_path_factory.mktemp("outage")),
        workers=1,
        extra_env={"TETHER_GATEWAY_POLL_INTERVAL_S": "0.1"},
    ) as stack:
        yield stack


def event_id() -> str:
    return f"e-{uuid.uuid4().hex}"


async def refusal(call: object) -> grpc.aio.AioRpcError:
    """The error a call ends with (it must end with one)."""
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await call  # type: ignore[misc]
    return refused.value


def assert_unavailable(exc: grpc.aio.AioRpcError, names: str) -> None:
    assert (exc.code(), names in (exc.details() or "")) == (grpc.StatusCode.UNAVAILABLE, True), (
        f"{exc.code().name}: {exc.details()}"
    )
    assert "retr" in (exc.details() or ""), "the message says the call may be retried"


async def runs_for_event(db_url: str, tenant_id: str, event: str) -> int:
    engine = create_engine(db_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            count = await conn.scalar(
                select(func.count())
                .select_from(runs.join(messages, runs.c.message_id == messages.c.message_id))
                .where(messages.c.tenant_id == tenant_id, messages.c.event_id == event)
            )
    finally:
        await engine.dispose()
    return int(count or 0)


def cli_send(stack: ExecStack, tenant: Tenant, text: str, event: str) -> asyncio.Future[bytes]:
    """`tether send --event-id EVENT` as a separate process; its stdout once it exits 0."""

    async def run() -> bytes:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tether.cli",
            "send",
            text,
            "--event-id",
            event,
            "--json",
            env={
                **os.environ,
                "TETHER_GATEWAY": stack.addr("gateway"),
                "TETHER_API_KEY": tenant.api_key,
            },
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await process.communicate()
        assert process.returncode == 0, err.decode()
        return out

    return asyncio.ensure_future(run())


async def test_postgres_killed_under_streaming_runs_answers_unavailable_and_loses_nothing(
    outage: ExecStack, durable_pg: DurableServer
) -> None:
    admin = await asyncpg.connect(durable_pg.url)
    try:
        settings = [
            await admin.fetchval(f"SHOW {name}") for name in ("fsync", "synchronous_commit")
        ]
    finally:
        await admin.close()
    assert settings == ["on", "on"], "the drill runs on durable storage"

    tenant = await outage.tenant()
    done_before = f"finished before the crash {uuid.uuid4().hex}"
    outage.model.script(done_before, [TextTurn("Durable answer.")])
    acknowledged = await tenant.send(done_before)
    await wait_for_status(outage.db_url, acknowledged, "completed")

    streaming = []
    for i in range(8):
        text = f"stream through the outage {i} {uuid.uuid4().hex}"
        words = [f"w{i}.{n} " for n in range(150)]
        outage.model.script(text, [TextTurn("".join(words), chunks=words, delay_ms=20)])
        streaming.append(await tenant.send(text))

    http = outage.services.http_addresses()["gateway"]
    async with (
        grpc.aio.insecure_channel(outage.addr("gateway")) as channel,
        TetherClient(outage.addr("gateway"), tenant.api_key) as client,
        aiohttp.ClientSession(headers={"Authorization": f"Bearer {tenant.api_key}"}) as web,
    ):
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        await durable_pg.postgres.kill()
        try:
            sent = await refusal(
                stub.SendMessage(
                    gateway_pb2.SendMessageRequest(
                        text="hello", conversation_id="c-down", event_id=event_id()
                    ),
                    metadata=tenant.metadata,
                )
            )
            assert_unavailable(sent, "PostgreSQL")
            read = await refusal(
                stub.GetRun(
                    gateway_pb2.GetRunRequest(run_id=acknowledged), metadata=tenant.metadata
                )
            )
            assert_unavailable(read, "PostgreSQL")
            async with web.get(f"http://{http}/v1/runs/{acknowledged}") as response:
                body = await response.json()
                assert (response.status, body["error"]["status"]) == (503, "UNAVAILABLE"), body
                assert "PostgreSQL" in body["error"]["message"]

            # A send retried by the client and one by the CLI, each with one event id.
            client_event, cli_event = event_id(), event_id()
            retried = asyncio.ensure_future(
                client.send(
                    "sent during the outage", conversation_id="c-client", event_id=client_event
                )
            )
            by_cli = cli_send(outage, tenant, "sent by the CLI during the outage", cli_event)
            await asyncio.sleep(OUTAGE_S)  # the outage itself, not a wait for anything
            assert not retried.done() and not by_cli.done(), "still retrying while it is down"
        finally:
            await durable_pg.postgres.restart()

        response = await asyncio.wait_for(retried, 30)
        cli_run = json.loads((await asyncio.wait_for(by_cli, 30)).splitlines()[0])["run_id"]
        again = await client.send(
            "sent during the outage", conversation_id="c-client", event_id=client_event
        )
        assert again.run.run_id == response.run.run_id

    assert await runs_for_event(outage.db_url, tenant.tenant_id, client_event) == 1
    assert await runs_for_event(outage.db_url, tenant.tenant_id, cli_event) == 1
    for run_id in [*streaming, response.run.run_id, cli_run]:
        await wait_for_status(outage.db_url, run_id, "completed", timeout=60)
    before = await wait_for_status(outage.db_url, acknowledged, "completed")
    assert before.result_text == "Durable answer.", "what was committed before the crash stayed"


async def test_redis_down_costs_no_call(outage: ExecStack, own_redis: EmbeddedRedis) -> None:
    """No call needs Redis (it carries hints): with it stopped, sends, reads and streams answer
    as usual and the run completes; none answers INTERNAL."""
    tenant = await outage.tenant()
    text = f"while redis is down {uuid.uuid4().hex}"
    outage.model.script(text, [TextTurn("No Redis needed.")])
    own_redis.stop()
    try:
        async with TetherClient(outage.addr("gateway"), tenant.api_key) as client:
            sent = await client.send(text, conversation_id="c-redis", event_id=event_id())
            run_id = sent.run.run_id
            events = [item async for item in client.watch(run_id)]
            assert events, "the stream answered from PostgreSQL"
            found = await client.get_run(run_id)
            assert found.run.result_text == "No Redis needed."
    finally:
        await own_redis.start()


async def test_a_killed_internal_service_is_named_and_a_retried_send_makes_one_run(
    outage: ExecStack,
) -> None:
    tenant = await outage.tenant()
    text = f"sent while admission is down {uuid.uuid4().hex}"
    outage.model.script(text, [TextTurn("Admitted once.")])
    ports = {name: outage.services.procs[name].port for name in ("admission", "orchestrator")}
    async with (
        grpc.aio.insecure_channel(outage.addr("gateway")) as channel,
        TetherClient(outage.addr("gateway"), tenant.api_key) as client,
    ):
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        # A key the gateway has verified once is cached: the calls below reach the hops.
        await stub.ListRuns(gateway_pb2.ListRunsRequest(), metadata=tenant.metadata)
        for name in ports:
            outage.services.kill(name)
        event = event_id()
        try:
            sent = await refusal(
                stub.SendMessage(
                    gateway_pb2.SendMessageRequest(
                        text=text, conversation_id="c-a", event_id=event
                    ),
                    metadata=tenant.metadata,
                )
            )
            assert_unavailable(sent, "admission")
            read = await refusal(
                stub.GetRun(gateway_pb2.GetRunRequest(run_id="run_x"), metadata=tenant.metadata)
            )
            assert_unavailable(read, "orchestrator")
            retried = asyncio.ensure_future(
                client.send(text, conversation_id="c-a", event_id=event)
            )
            await asyncio.sleep(OUTAGE_S)  # the outage itself, not a wait for anything
            assert not retried.done(), "still retrying while admission is down"
        finally:
            await asyncio.gather(
                *(
                    outage.services.start(
                        name, extra_env={f"TETHER_{name.upper()}_PORT": str(port)}
                    )
                    for name, port in ports.items()
                )
            )
        response = await asyncio.wait_for(retried, 30)
    assert await runs_for_event(outage.db_url, tenant.tenant_id, event) == 1
    run = await wait_for_status(outage.db_url, response.run.run_id, "completed", timeout=30)
    assert run.result_text == "Admitted once."


async def test_a_dropped_database_connection_does_not_fail_a_streaming_run(
    outage: ExecStack,
) -> None:
    """Every service's PostgreSQL connections are cut (as a proxy failover or an idle-timeout
    would) while a run streams: the orchestrator's next statement meets the dead connection and
    answers UNAVAILABLE, but the database is up, so a worker that took that for a crash and
    finalised the run would fail it for good. It must complete."""
    tenant = await outage.tenant()
    text = f"stream past a cut connection {uuid.uuid4().hex}"
    words = [f"d{n} " for n in range(150)]
    outage.model.script(
        text, [TextTurn("".join(words), chunks=words, delay_ms=20), TextTurn("Recovered.")]
    )
    run_id = await tenant.send(text)

    async def streaming() -> bool:
        parts = await parts_of(outage.db_url, run_id)
        return bool(parts and parts[0].payload.get("text"))

    await eventually(streaming, timeout=30, what="a checkpoint of streamed text")
    admin = await asyncpg.connect(outage.db_url)
    try:
        cut = await admin.fetchval(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
    finally:
        await admin.close()
    assert cut > 0
    run = await wait_for_status(outage.db_url, run_id, "completed", "failed", timeout=60)
    assert (run.status, run.error) == ("completed", None)
