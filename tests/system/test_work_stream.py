"""The Work stream spoken by hand against a real orchestrator process: the hello, credits and
pushed leases, acknowledgements that keep a refused write from ending the stream, keepalives
that renew, cancel and drop leases in one statement, and a reconnect that carries a lease on."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from sqlalchemy import select

from tests.system.execution_support import ExecStack, Tenant, exec_stack, run_row, wait_for_status
from tether.db.engine import create_engine
from tether.db.schema import runs, tool_catalog
from tether.runtime.rpc import internal_channel
from tether.testing.eventually import eventually
from tether.v1 import common_pb2, orchestrator_pb2, orchestrator_pb2_grpc

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROGRESS_DEADLINE_S = 1.0
KEEPALIVE_S = 0.5  # a stream not heard from for twice this is quiet


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(
    pg_server_url: str, template_db: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ExecStack]:
    run_dir = Path(tmp_path_factory.mktemp("work-stream"))
    settings = {
        "TETHER_ORCHESTRATOR_PROGRESS_DEADLINE_S": str(PROGRESS_DEADLINE_S),
        "TETHER_ORCHESTRATOR_KEEPALIVE_INTERVAL_S": str(KEEPALIVE_S),
    }
    async with exec_stack(
        pg_server_url, template_db, redis_url, run_dir, workers=0, extra_env=settings
    ) as running:
        yield running


class Stream:
    """A Work stream spoken by hand: send messages, read what comes back."""

    def __init__(self, stack: ExecStack, credential: str | None = None) -> None:
        worker = stack.credentials["worker"] if credential is None else credential
        self._channel = internal_channel(stack.addr("orchestrator"), worker or None)
        self._outbox: asyncio.Queue[orchestrator_pb2.WorkRequest | None] = asyncio.Queue()
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(self._channel)
        self.call = stub.Work(self._requests())
        self._ids = iter(range(1, 1_000_000))
        self.held: dict[str, int] = {}  # leases pushed and not handed back: run id -> epoch

    async def _requests(self) -> AsyncIterator[orchestrator_pb2.WorkRequest]:
        while (message := await self._outbox.get()) is not None:
            yield message

    def send(self, **kind: Any) -> int:
        """Send one message (`kind`: its WorkRequest field); returns the id it carries."""
        for name, written in kind.items():
            if name in ("complete", "park", "schedule_retry", "release"):
                self.held.pop(written.run_id, None)
        request_id = next(self._ids)
        self._outbox.put_nowait(orchestrator_pb2.WorkRequest(id=request_id, **kind))
        return request_id

    async def hello(
        self, version: int = 1, held: tuple[tuple[str, int], ...] = (), **says: bool
    ) -> Any:
        """Say hello (with what else the worker `says` it does); the welcome."""
        leases = [orchestrator_pb2.HeldLease(run_id=r, epoch=e) for r, e in held]
        self.send(
            hello=orchestrator_pb2.WorkHello(
                protocol_version=version, worker_id=WORKER, held=leases, **says
            )
        )
        return (await self.next("welcome")).welcome

    async def next(self, kind: str) -> orchestrator_pb2.WorkResponse:
        """The next message of `kind` (others are skipped)."""
        return await self.next_of(kind)

    async def next_of(self, *kinds: str) -> orchestrator_pb2.WorkResponse:
        """The next message of any of `kinds` (others are skipped; a probe not waited for is
        answered at once with a keepalive, as a worker does: on a loaded machine a write can
        outlast the two keepalive intervals after which the replica asks)."""
        async with asyncio.timeout(20):
            while True:
                response = await self.call.read()
                assert response is not grpc.aio.EOF, "the stream ended"
                kind = response.WhichOneof("kind")
                batch = response.batch.responses if kind == "batch" else [response]
                for one in batch:
                    if one.WhichOneof("kind") == "lease":
                        self.held[one.lease.lease.run_id] = one.lease.lease.epoch
                if kind in kinds:
                    return response
                if kind == "probe":
                    held = [
                        orchestrator_pb2.HeldLease(run_id=run_id, epoch=epoch)
                        for run_id, epoch in self.held.items()
                    ]
                    self.send(keepalive=orchestrator_pb2.WorkKeepalive(held=held))

    async def close(self) -> None:
        self._outbox.put_nowait(None)
        self.call.cancel()
        await self._channel.close()


WORKER = f"hand-{uuid.uuid4().hex[:6]}"


async def queued_run(stack: ExecStack) -> tuple[Tenant, str]:
    tenant = await stack.tenant()
    return tenant, await tenant.send(f"work stream {uuid.uuid4().hex}")


def checkpoint(run_id: str, epoch: int, batch: int) -> orchestrator_pb2.CheckpointRequest:
    part = common_pb2.Part(index=0, role="assistant", text=common_pb2.TextPart(text="so far"))
    return orchestrator_pb2.CheckpointRequest(
        run_id=run_id, epoch=epoch, batch=batch, parts=[orchestrator_pb2.PartWrite(part=part)]
    )


async def test_a_peer_speaking_another_protocol_version_is_refused_naming_both(
    stack: ExecStack,
) -> None:
    stream = Stream(stack)
    try:
        stream.send(hello=orchestrator_pb2.WorkHello(protocol_version=7, worker_id=WORKER))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stream.next("welcome")
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "Work protocol 7" in str(refused.value.details())
        assert "speaks 1" in str(refused.value.details())
    finally:
        await stream.close()


async def test_a_stream_is_authenticated_once_and_must_open_with_a_hello(
    stack: ExecStack,
) -> None:
    anonymous = Stream(stack, credential="")
    try:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await anonymous.next("welcome")
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await anonymous.close()
    gateway = Stream(stack, credential=stack.credentials["gateway"])
    try:
        with pytest.raises(grpc.aio.AioRpcError) as denied:
            await gateway.next("welcome")
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        await gateway.close()
    rude = Stream(stack)
    try:
        rude.send(credits=orchestrator_pb2.WorkCredits(credits=1))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await rude.next("welcome")
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        await rude.close()


async def test_a_credit_brings_a_pushed_lease_and_a_stale_write_is_refused_alone(
    stack: ExecStack,
) -> None:
    stream = Stream(stack)
    try:
        welcome = await stream.hello()
        assert welcome.protocol_version == 1 and welcome.keepalive_interval_ms > 0
        _, run_id = await queued_run(stack)
        stream.send(credits=orchestrator_pb2.WorkCredits(credits=1))
        lease = (await stream.next("lease")).lease
        assert lease.claimed and lease.lease.run_id == run_id and lease.run.input_text
        assert lease.config.model, "the attempt's inputs come with it"
        epoch = lease.lease.epoch
        stale = stream.send(checkpoint=checkpoint(run_id, epoch + 1, 1))
        ack = (await stream.next("ack")).ack
        assert (ack.id, ack.code, ack.error_code) == (
            stale,
            9,
            "stale_lease",
        )  # FAILED_PRECONDITION
        landed = stream.send(checkpoint=checkpoint(run_id, epoch, 1))
        ack = (await stream.next("ack")).ack
        assert (ack.id, ack.code, ack.WhichOneof("result")) == (landed, 0, "checkpoint")
        done = stream.send(
            complete=orchestrator_pb2.CompleteRunRequest(
                run_id=run_id, epoch=epoch, status=common_pb2.RUN_STATUS_COMPLETED, result_text="ok"
            )
        )
        ack = (await stream.next("ack")).ack
        assert (ack.id, ack.code) == (done, 0)
        assert (await run_row(stack.db_url, run_id)).status == "completed"
    finally:
        await stream.close()


async def test_a_quiet_worker_is_probed_and_given_a_lease_only_once_it_answers(
    stack: ExecStack,
) -> None:
    """A worker holding no lease sends no keepalives, so before a lease goes to one not heard
    from lately the replica asks whether it is there: a frozen one never answers, and is given
    nothing."""
    stream = Stream(stack)
    try:
        welcome = await stream.hello()
        assert welcome.probes_quiet_workers and welcome.keepalive_interval_ms == KEEPALIVE_S * 1000
        stream.send(credits=orchestrator_pb2.WorkCredits(credits=1))  # nothing queued: it waits
        # Time itself is what makes a stream quiet: two keepalive intervals without a word.
        await asyncio.sleep(2.5 * KEEPALIVE_S)
        _, run_id = await queued_run(stack)
        await stream.next("probe")
        assert (await run_row(stack.db_url, run_id)).status == "queued", "pushed to nobody yet"
        stream.send(keepalive=orchestrator_pb2.WorkKeepalive())  # here, holding nothing
        lease = (await stream.next("lease")).lease
        assert lease.lease.run_id == run_id
        done = orchestrator_pb2.CompleteRunRequest(
            run_id=run_id, epoch=lease.lease.epoch, status=common_pb2.RUN_STATUS_COMPLETED
        )
        stream.send(complete=done)
        assert (await stream.next("ack")).ack.code == 0
    finally:
        await stream.close()


async def leased(stream: Stream, wanted: set[str]) -> dict[str, int]:
    """The leases of `wanted` (run id -> epoch), a credit at a time. A run an earlier test left
    behind (its lease lapsed and it was queued again) may come first: it is ended, so it never
    comes back."""
    leases: dict[str, int] = {}
    while set(leases) != wanted:
        stream.send(credits=orchestrator_pb2.WorkCredits(credits=1))
        lease = (await stream.next("lease")).lease.lease
        if lease.run_id in wanted:
            leases[lease.run_id] = lease.epoch
            continue
        left = orchestrator_pb2.CompleteRunRequest(
            run_id=lease.run_id, epoch=lease.epoch, status=common_pb2.RUN_STATUS_COMPLETED
        )
        stream.send(complete=left)
        await stream.next("ack")
    return leases


async def expiry(stack: ExecStack, run_id: str) -> Any:
    return (await run_row(stack.db_url, run_id)).lease_expires_at


async def test_a_keepalive_renews_every_lease_and_names_the_lost_and_the_cancelled(
    stack: ExecStack,
) -> None:
    stream = Stream(stack)
    try:
        await stream.hello()
        _, kept = await queued_run(stack)
        owner, cancelled = await queued_run(stack)
        leases = await leased(stream, {kept, cancelled})
        before = {run_id: await expiry(stack, run_id) for run_id in leases}
        await owner.cancel(cancelled)  # a running run: flagged for its worker, and hinted
        pushed = (await stream.next("cancel")).cancel
        assert (pushed.run_id, pushed.epoch) == (cancelled, leases[cancelled])
        held = [orchestrator_pb2.HeldLease(run_id=r, epoch=e) for r, e in leases.items()]
        held.append(orchestrator_pb2.HeldLease(run_id="run_gone", epoch=3))
        stream.send(keepalive=orchestrator_pb2.WorkKeepalive(held=held))
        lost = (await stream.next("lost")).lost
        assert [lease.run_id for lease in lost.leases] == ["run_gone"]
        again = (await stream.next("cancel")).cancel  # durable: the keepalive carries it too
        assert again.run_id == cancelled
        for run_id in leases:
            assert await expiry(stack, run_id) > before[run_id], "renewed"
    finally:
        await stream.close()


async def test_a_lease_past_the_progress_deadline_is_not_renewed_and_is_reaped(
    stack: ExecStack,
) -> None:
    stream = Stream(stack)
    try:
        await stream.hello()
        _, run_id = await queued_run(stack)
        epoch = (await leased(stream, {run_id}))[run_id]
        hung = orchestrator_pb2.HeldLease(
            run_id=run_id, epoch=epoch, idle_ms=int(PROGRESS_DEADLINE_S * 1000) + 1
        )
        before = await expiry(stack, run_id)
        stream.send(keepalive=orchestrator_pb2.WorkKeepalive(held=[hung]))
        row = await wait_for_status(stack.db_url, run_id, "queued")
        assert row.attempt == 2, "reaped: the next attempt is a new one"
        assert await expiry(stack, run_id) is None and before is not None
    finally:
        await stream.close()


async def test_a_worker_that_reconnects_announces_its_lease_and_carries_on(
    stack: ExecStack,
) -> None:
    first = Stream(stack)
    await first.hello()
    _, run_id = await queued_run(stack)
    epoch = (await leased(first, {run_id}))[run_id]
    await first.close()  # cut, no goodbye
    second = Stream(stack)
    try:
        await second.hello(held=((run_id, epoch),))
        landed = second.send(checkpoint=checkpoint(run_id, epoch, 1))
        ack = (await second.next("ack")).ack
        assert (ack.id, ack.code) == (landed, 0), "the epoch, not the stream, is the authority"
        done = second.send(
            complete=orchestrator_pb2.CompleteRunRequest(
                run_id=run_id, epoch=epoch, status=common_pb2.RUN_STATUS_COMPLETED, result_text="ok"
            )
        )
        assert (await second.next("ack")).ack.id == done
        row = await run_row(stack.db_url, run_id)
        assert (row.status, row.attempt, row.lease_epoch) == ("completed", 1, epoch)
    finally:
        await second.close()


async def test_a_stream_cut_without_goodbye_leaves_its_leases_to_lapse_and_be_reaped(
    stack: ExecStack,
) -> None:
    stream = Stream(stack)
    await stream.hello()
    _, run_id = await queued_run(stack)
    await leased(stream, {run_id})
    await stream.close()
    row = await wait_for_status(stack.db_url, run_id, "queued")
    assert row.attempt == 2
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            owner = (
                await conn.execute(select(runs.c.lease_owner).where(runs.c.run_id == run_id))
            ).scalar()
    finally:
        await engine.dispose()
    assert owner is None


async def test_a_worker_that_takes_batches_gets_one_claims_leases_in_one_message(
    stack: ExecStack,
) -> None:
    stream = Stream(stack)
    try:
        assert (await stream.hello(takes_batches=True)).takes_batches
        ours = {(await queued_run(stack))[1] for _ in range(3)}
        stream.send(credits=orchestrator_pb2.WorkCredits(credits=3))
        batch = (await stream.next("batch")).batch
        leases = [r.lease.lease for r in batch.responses]
        assert [r.WhichOneof("kind") for r in batch.responses] == ["lease"] * 3
        assert ours <= {lease.run_id for lease in leases} or len(leases) == 3
        # A batch of writes is handled as its messages one by one, in order: two acks.
        first, second = leases[0], leases[1]
        writes = [
            orchestrator_pb2.WorkRequest(
                id=101, checkpoint=checkpoint(first.run_id, first.epoch, 1)
            ),
            orchestrator_pb2.WorkRequest(
                id=102,
                complete=orchestrator_pb2.CompleteRunRequest(
                    run_id=second.run_id,
                    epoch=second.epoch,
                    status=common_pb2.RUN_STATUS_COMPLETED,
                ),
            ),
        ]
        stream.send(batch=orchestrator_pb2.WorkRequests(requests=writes))
        acks: dict[int, int] = {}
        while len(acks) < 2:
            response = await stream.next_of("ack", "batch")
            for one in response.batch.responses if response.HasField("batch") else [response]:
                acks[one.ack.id] = one.ack.code
        assert acks == {101: 0, 102: 0}
    finally:
        await stream.close()


async def test_an_outcome_acknowledged_ok_gives_its_slot_back_without_a_credit(
    stack: ExecStack,
) -> None:
    stream = Stream(stack)
    try:
        assert (await stream.hello(outcome_returns_credit=True)).outcome_returns_credit
        _, first = await queued_run(stack)
        epoch = (await leased(stream, {first}))[first]
        _, second = await queued_run(stack)
        done = orchestrator_pb2.CompleteRunRequest(
            run_id=first, epoch=epoch, status=common_pb2.RUN_STATUS_COMPLETED
        )
        stream.send(complete=done)
        assert (await stream.next("ack")).ack.code == 0
        # No credit sent: the completion gave the slot back, and the next run is pushed to it.
        while (lease := (await stream.next("lease")).lease.lease).run_id != second:
            left = orchestrator_pb2.CompleteRunRequest(
                run_id=lease.run_id, epoch=lease.epoch, status=common_pb2.RUN_STATUS_COMPLETED
            )
            stream.send(complete=left)  # an earlier test's leftover: ended, its slot back
        # A refused outcome leaves the lease held; its release then gives the slot back.
        _, third = await queued_run(stack)
        stale = orchestrator_pb2.CompleteRunRequest(
            run_id=second, epoch=lease.epoch + 1, status=common_pb2.RUN_STATUS_COMPLETED
        )
        stream.send(complete=stale)
        assert (await stream.next("ack")).ack.error_code == "stale_lease"
        stream.send(release=orchestrator_pb2.ReleaseRunRequest(run_id=second, epoch=lease.epoch))
        assert (await stream.next("ack")).ack.code == 0
        assert (await stream.next("lease")).lease.lease.run_id in {second, third}
    finally:
        await stream.close()


async def test_a_batch_inside_a_batch_is_refused(stack: ExecStack) -> None:
    stream = Stream(stack)
    try:
        await stream.hello()
        inner = orchestrator_pb2.WorkRequests(
            requests=[orchestrator_pb2.WorkRequest(credits=orchestrator_pb2.WorkCredits())]
        )
        nested = orchestrator_pb2.WorkRequest(batch=inner)
        stream.send(batch=orchestrator_pb2.WorkRequests(requests=[nested]))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stream.next("lease")
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "holds no batch" in str(refused.value.details())
    finally:
        await stream.close()


async def catalog_rows(stack: ExecStack) -> list[Any]:
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            return list(await conn.execute(select(tool_catalog).order_by(tool_catalog.c.name)))
    finally:
        await engine.dispose()


async def test_a_hello_fills_the_tool_catalog_and_a_malformed_announcement_is_refused(
    stack: ExecStack,
) -> None:
    digest = "ab" * 32
    bad = Stream(stack)
    try:
        tools = [
            orchestrator_pb2.ToolAnnouncement(name=n, input_schema_sha256=digest, risk="read")
            for n in ("fine", "bad\n")
        ]
        hello = orchestrator_pb2.WorkHello(protocol_version=1, worker_id=WORKER, tools=tools)
        bad.send(hello=hello)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await bad.next("welcome")
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "hello.tools[1].name" in str(refused.value.details())
    finally:
        await bad.close()
    assert await catalog_rows(stack) == [], "a refused hello writes nothing"

    stream = Stream(stack)
    try:
        announced = orchestrator_pb2.ToolAnnouncement(
            name="fax", input_schema_sha256=digest, risk="send_reply", writes_externally=True
        )
        hello = orchestrator_pb2.WorkHello(protocol_version=1, worker_id=WORKER, tools=[announced])
        stream.send(hello=hello)
        await stream.next("welcome")
        (row,) = await eventually(lambda: catalog_rows(stack), what="the announced tool")
        assert (row.name, row.schema_sha256, row.risk, row.writes_externally) == (
            "fax",
            digest,
            "send_reply",
            True,
        )
        assert row.announced_by == WORKER
    finally:
        await stream.close()
