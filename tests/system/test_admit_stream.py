"""The AdmitStream against the real admission service (a process of its own on the real
PostgreSQL): a call on the stream is refused exactly as Admit refuses it, only the gateway may
open one, and a call stopped by its deadline or by a cancel writes nothing."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sqlalchemy import text

from services.admission.stream import PROTOCOL_VERSION
from tests.system.conftest import RunningStack
from tether.db.engine import create_engine
from tether.errors import CODE_METADATA_KEY
from tether.runtime.rpc import internal_channel
from tether.testing.eventually import eventually
from tether.v1 import admission_pb2, admission_pb2_grpc, common_pb2, gateway_pb2, gateway_pb2_grpc

pytestmark = pytest.mark.asyncio(loop_scope="session")

# The stack's admission drains for this long on SIGTERM (TETHER_ADMISSION_GRACE_S's default).
ADMISSION_GRACE_S = 5.0


def _chat(event_id: str, **fields: Any) -> admission_pb2.AdmitRequest:
    chat = {"event_id": event_id, "conversation_id": f"c-{event_id}", "text": "hi", **fields}
    return admission_pb2.AdmitRequest(
        caller=admission_pb2.Caller(tenant_id="tenant-a", principal_id="alice"),
        chat=admission_pb2.ChatInput(**chat),
    )


def _uid() -> str:
    return f"e-{uuid.uuid4().hex}"


class Stream:
    """A raw AdmitStream, opened with the hello and welcomed."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self._ids = iter(range(1, 1 << 30))

    async def send(self, *requests: admission_pb2.AdmitRequest, timeout_ms: int = 0) -> list[int]:
        calls = [
            admission_pb2.AdmitCall(id=next(self._ids), request=r, timeout_ms=timeout_ms)
            for r in requests
        ]
        await self.call.write(admission_pb2.AdmitStreamRequest(calls=calls))
        return [c.id for c in calls]

    async def answers(self, count: int) -> dict[int, admission_pb2.AdmitAnswer]:
        got: dict[int, admission_pb2.AdmitAnswer] = {}
        while len(got) < count:
            response = await self.call.read()
            assert response is not grpc.aio.EOF, "the stream ended with calls unanswered"
            got.update((a.id, a) for a in response.answers)
        assert len(got) == count, f"more answers than calls: {sorted(got)}"
        return got


@pytest_asyncio.fixture(loop_scope="session")
async def gateway_side(stack: RunningStack) -> AsyncIterator[Any]:
    """The admission service as the gateway reaches it: its credential on every call."""
    address = stack.services.addresses()["admission"]
    async with internal_channel(address, stack.credentials["gateway"]) as channel:
        yield admission_pb2_grpc.AdmissionServiceStub(channel)


@pytest_asyncio.fixture(loop_scope="session")
async def stream(gateway_side: Any) -> AsyncIterator[Stream]:
    call = gateway_side.AdmitStream()
    hello = admission_pb2.AdmitHello(protocol_version=PROTOCOL_VERSION)
    await call.write(admission_pb2.AdmitStreamRequest(hello=hello))
    assert (await call.read()).welcome.protocol_version == PROTOCOL_VERSION
    yield Stream(call)
    call.cancel()


async def test_a_call_on_the_stream_is_refused_exactly_as_admit_refuses_it(
    gateway_side: Any, stream: Stream
) -> None:
    refused = {
        "no event id": _chat(""),
        "another tenant in the payload": _chat(_uid(), tenant_id="tenant-b"),
        "text over its limit": _chat(_uid(), text="x" * 32_001),
        "no input": admission_pb2.AdmitRequest(
            caller=admission_pb2.Caller(tenant_id="tenant-a", principal_id="alice")
        ),
    }
    unary = {}
    for why, request in refused.items():
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await gateway_side.Admit(request)
        code = dict(error.value.trailing_metadata() or ()).get(CODE_METADATA_KEY, "")
        unary[why] = (error.value.code().value[0], error.value.details(), code)
    admitted = _uid()
    ids = await stream.send(*refused.values(), _chat(admitted))
    answers = await stream.answers(len(ids))
    streamed = {
        why: (answers[i].code, answers[i].message, answers[i].error_code)
        for why, i in zip(refused, ids[:-1], strict=True)
    }
    assert streamed == unary
    assert all(code != grpc.StatusCode.INTERNAL.value[0] for code, _, _ in streamed.values())
    ok = answers[ids[-1]]
    assert ok.code == 0 and ok.response.disposition == common_pb2.DISPOSITION_CREATED
    # The stream carries on: the same event again is the same run.
    (again,) = await stream.send(_chat(admitted))
    answer = (await stream.answers(1))[again]
    assert answer.response.disposition == common_pb2.DISPOSITION_ATTACHED
    assert answer.response.run.run_id == ok.response.run.run_id


async def test_only_the_gateway_may_open_an_admit_stream(stack: RunningStack) -> None:
    address = stack.services.addresses()["admission"]
    seen = {}
    for who, credential in (("nobody", None), ("worker", stack.credentials["worker"])):
        async with internal_channel(address, credential) as channel:
            call = admission_pb2_grpc.AdmissionServiceStub(channel).AdmitStream()
            # Refused as the call opens, before any message: no hello is written, since a write
            # racing the server's early end is reported by grpc's client as INTERNAL
            # (grpc/grpc#36066) or as the refusal, by chance.
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call.read()
            seen[who] = refused.value.code()
    assert seen == {
        "nobody": grpc.StatusCode.UNAUTHENTICATED,
        "worker": grpc.StatusCode.PERMISSION_DENIED,
    }


class RunsLocked:
    """Every insert of a run waits: the runs table locked by an open transaction."""

    def __init__(self, db_url: str) -> None:
        self._engine = create_engine(db_url, pool_size=2)

    async def __aenter__(self) -> RunsLocked:
        self._conn = await self._engine.connect()
        await self._conn.begin()
        await self._conn.execute(text("LOCK TABLE runs IN EXCLUSIVE MODE"))
        return self

    async def waiting(self) -> int:
        """Statements of other sessions waiting on a lock."""
        async with self._engine.connect() as conn:
            return int(
                await conn.scalar(
                    text(
                        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                        " AND datname = current_database() AND pid <> pg_backend_pid()"
                    )
                )
                or 0
            )

    async def __aexit__(self, *exc: object) -> None:
        await self._conn.rollback()
        await self._conn.close()
        await self._engine.dispose()


async def test_a_call_stopped_by_its_deadline_or_a_cancel_writes_nothing(
    stack: RunningStack, gateway_side: Any, stream: Stream
) -> None:
    late, dropped = _uid(), _uid()
    async with RunsLocked(stack.db_url) as locked:
        (late_id,) = await stream.send(_chat(late), timeout_ms=300)
        answer = (await stream.answers(1))[late_id]
        assert answer.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
        (dropped_id,) = await stream.send(_chat(dropped))
        await eventually(
            lambda: _one_waits(locked), timeout=10, what="the admission to wait on the lock"
        )
        await stream.call.write(admission_pb2.AdmitStreamRequest(cancels=[dropped_id]))
        await eventually(lambda: _none_waits(locked), timeout=10, what="the cancel to stop it")
    # Only the call sent after is answered: the cancelled one never is.
    (after_id,) = await stream.send(_chat(_uid()))
    assert list(await stream.answers(1)) == [after_id]
    for event_id in (late, dropped):
        again = await gateway_side.Admit(_chat(event_id))
        assert again.disposition == common_pb2.DISPOSITION_CREATED, "nothing was written before"


async def _one_waits(locked: RunsLocked) -> bool | None:
    return True if await locked.waiting() == 1 else None


async def _none_waits(locked: RunsLocked) -> bool | None:
    return True if await locked.waiting() == 0 else None


async def test_admission_stopped_mid_call_answers_it_before_it_exits(
    stack: RunningStack,
) -> None:
    """SIGTERM while a call waits on the gateway's stream: admission drains (it says so, and
    no longer reports itself ready), answers the call, and exits; the gateway moves to the
    restarted process by itself. Restarts admission, as the test after it does."""
    async with grpc.aio.insecure_channel(stack.gateway) as channel:
        send = _sender(gateway_pb2_grpc.GatewayServiceStub(channel), stack.metadata(stack.key_a))
        assert (await send(_uid())).disposition == common_pb2.DISPOSITION_CREATED  # stream open
        held = _uid()
        admission = stack.services.procs["admission"]
        async with RunsLocked(stack.db_url) as locked:
            sending = asyncio.ensure_future(send(held))
            await eventually(
                lambda: _one_waits(locked), timeout=10, what="the admission to wait on the lock"
            )
            async with grpc.aio.insecure_channel(admission.health_address) as health_channel:
                watch = health_pb2_grpc.HealthStub(health_channel).Watch(
                    health_pb2.HealthCheckRequest()
                )
                assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
                stopping = asyncio.ensure_future(stack.services.stop("admission", grace=20))
                update = await watch.read()
                assert update.status == health_pb2.HealthCheckResponse.NOT_SERVING
                watch.cancel()
            assert not sending.done(), "the call was cut when the stop began"
        # The lock is gone: the call the stopping process still holds is answered.
        answered = await sending
        assert answered.disposition == common_pb2.DISPOSITION_CREATED
        # The drained stream then ends, so the process need not sit out its grace (5 s) for it:
        # an undrained stream stays open until the grace cuts it.
        answered_at = asyncio.get_running_loop().time()
        assert await stopping == 0
        assert asyncio.get_running_loop().time() - answered_at < ADMISSION_GRACE_S / 2
        await stack.services.restart("admission")
        assert (await send(_uid())).disposition == common_pb2.DISPOSITION_CREATED


def _sender(gateway: Any, metadata: Any) -> Any:
    async def send(event_id: str) -> gateway_pb2.SendMessageResponse:
        request = gateway_pb2.SendMessageRequest(
            event_id=event_id, conversation_id=f"c-{event_id}", text="hi"
        )
        response: gateway_pb2.SendMessageResponse = await gateway.SendMessage(
            request, metadata=metadata
        )
        return response

    return send


async def test_admission_killed_mid_call_fails_it_as_an_outage_and_the_gateway_reconnects(
    stack: RunningStack,
) -> None:
    """Restarts the admission service."""
    async with grpc.aio.insecure_channel(stack.gateway) as channel:
        send = _sender(gateway_pb2_grpc.GatewayServiceStub(channel), stack.metadata(stack.key_a))
        assert (await send(_uid())).disposition == common_pb2.DISPOSITION_CREATED  # stream open
        cut = _uid()
        async with RunsLocked(stack.db_url) as locked:
            sending = asyncio.ensure_future(send(cut))
            await eventually(
                lambda: _one_waits(locked), timeout=10, what="the admission to wait on the lock"
            )
            stack.services.kill("admission")
            with pytest.raises(grpc.aio.AioRpcError) as lost:
                await sending
        assert lost.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "the admission service is unreachable" in (lost.value.details() or "")
        # While admission is away, a call is refused the same way, at once.
        with pytest.raises(grpc.aio.AioRpcError) as away:
            await send(_uid())
        assert away.value.code() == grpc.StatusCode.UNAVAILABLE
        await stack.services.restart("admission")
        # The gateway opens a new stream by itself. The cut call's event, sent again, is one
        # run: its statement may have committed after its caller was gone (it was waiting on
        # the lock), and then the same event attaches to that run.
        again = await send(cut)
        assert again.disposition in (
            common_pb2.DISPOSITION_CREATED,
            common_pb2.DISPOSITION_ATTACHED,
        )
        engine = create_engine(stack.db_url, pool_size=1)
        try:
            async with engine.connect() as conn:
                runs = await conn.scalar(
                    text("SELECT count(*) FROM runs WHERE conversation_id = :c"), {"c": f"c-{cut}"}
                )
        finally:
            await engine.dispose()
        assert runs == 1
        assert (await send(_uid())).disposition == common_pb2.DISPOSITION_CREATED
