"""The AdmitStream between the gateway and admission, both sides over real gRPC on loopback:
admission's `AdmitStreams` served through the services' own server (caller check, error
mapping), and the gateway's `Admissions` calling it. Admission's own work is stood in for by
`Desk`, an admit whose calls the test holds and lets go, since what is under test is how calls
travel, end and are answered; the real admission behind the stream is tests/system's."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from services.admission.stream import PROTOCOL_VERSION, AdmitStreams, StreamTiming
from services.gateway.grpc.admissions import Admissions
from tether.errors import InvalidArgument, TetherError, Unavailable
from tether.runtime.rpc import RunningServer, internal_channel, start_server
from tether.testing.eventually import eventually
from tether.v1 import admission_pb2, admission_pb2_grpc, common_pb2

pytestmark = pytest.mark.asyncio(loop_scope="session")

_SERVICE = admission_pb2.DESCRIPTOR.services_by_name["AdmissionService"].full_name


class Desk:
    """Admits by event id: `fail-*` is refused as the caller's mistake, `boom-*` fails as a
    bug would, `hold-*` waits until `let_go`; each admission's run id is its event id."""

    def __init__(self) -> None:
        self.started: dict[str, asyncio.Event] = {}
        self.cancelled: dict[str, asyncio.Event] = {}
        self._gate = asyncio.Event()

    def let_go(self) -> None:
        self._gate.set()

    def seen(self, event_id: str) -> asyncio.Event:
        return self.started.setdefault(event_id, asyncio.Event())

    def was_cancelled(self, event_id: str) -> asyncio.Event:
        return self.cancelled.setdefault(event_id, asyncio.Event())

    async def admit(
        self, request: admission_pb2.AdmitRequest, traceparent: str
    ) -> admission_pb2.AdmitResponse:
        event_id = request.chat.event_id
        self.seen(event_id).set()
        if event_id.startswith("fail-"):
            raise InvalidArgument(f"{event_id} is refused", code="refused_here")
        if event_id.startswith("boom-"):
            raise RuntimeError("a bug's detail that no caller may see")
        if event_id.startswith("hold-"):
            try:
                await self._gate.wait()
            except asyncio.CancelledError:
                self.was_cancelled(event_id).set()
                raise
        return admission_pb2.AdmitResponse(
            disposition=common_pb2.DISPOSITION_CREATED, run=common_pb2.Run(run_id=event_id)
        )


class Servicer(admission_pb2_grpc.AdmissionServiceServicer):
    """Admit and AdmitStream over a `Desk`, noting each stream's peer and messages."""

    def __init__(self, desk: Desk, timing: StreamTiming, *, streams: bool = True) -> None:
        self.desk = desk
        self.streams = AdmitStreams(desk.admit, timing)
        self.peers: list[str] = []
        self.messages: list[admission_pb2.AdmitStreamRequest] = []
        self.unary_calls = 0
        if not streams:
            self.AdmitStream = super().AdmitStream  # type: ignore[method-assign]

    async def Admit(
        self, request: admission_pb2.AdmitRequest, context: grpc.aio.ServicerContext
    ) -> admission_pb2.AdmitResponse:
        self.unary_calls += 1
        return await self.desk.admit(request, "")

    async def AdmitStream(
        self, request_iterator: AsyncIterator[admission_pb2.AdmitStreamRequest], context: Any
    ) -> AsyncIterator[admission_pb2.AdmitStreamResponse]:
        self.peers.append(context.peer())

        async def noted() -> AsyncIterator[admission_pb2.AdmitStreamRequest]:
            async for message in request_iterator:
                self.messages.append(message)
                yield message

        async for response in self.streams.serve(noted()):
            yield response


async def _serve(servicer: Servicer, port: int = 0) -> RunningServer:
    return await start_server(
        host="127.0.0.1",
        port=port,
        register=[lambda s: admission_pb2_grpc.add_AdmissionServiceServicer_to_server(servicer, s)],
        service_names=[_SERVICE],
        verifiers=None,
        reflection_on=False,
    )


def _chat(event_id: str) -> admission_pb2.AdmitRequest:
    return admission_pb2.AdmitRequest(
        caller=admission_pb2.Caller(tenant_id="t", principal_id="p"),
        chat=admission_pb2.ChatInput(event_id=event_id, conversation_id="c", text="hi"),
    )


class Gateway:
    """The gateway's side: `Admissions` over channels of their own to `address`."""

    def __init__(self, address: str, timeout_s: float = 30.0) -> None:
        self.unary = internal_channel(address, None, service="admission")
        self.admissions = Admissions(
            lambda: internal_channel(address, None, service="admission", own_connection=True),
            admission_pb2_grpc.AdmissionServiceStub(self.unary),
            timeout_s=timeout_s,
        )

    async def admit(self, event_id: str, timeout_s: float | None = None) -> str:
        response = await self.admissions.admit(_chat(event_id), timeout_s)
        return response.run.run_id

    async def close(self) -> None:
        await self.admissions.close()
        await self.unary.close()


_LONG = StreamTiming(max_age_s=600.0, drain_grace_s=30.0)


async def _stack(
    timing: StreamTiming = _LONG, *, streams: bool = True
) -> tuple[Servicer, RunningServer, Gateway]:
    servicer = Servicer(Desk(), timing, streams=streams)
    served = await _serve(servicer)
    return servicer, served, Gateway(f"127.0.0.1:{served.port}")


async def test_calls_queued_together_go_as_one_message_and_each_gets_its_own_answer() -> None:
    servicer, served, gateway = await _stack()
    try:
        ids = [f"e-{n}" for n in range(5)]
        assert await asyncio.gather(*(gateway.admit(i) for i in ids)) == ids
        hello, *calls = servicer.messages
        assert hello.hello.protocol_version == PROTOCOL_VERSION and not hello.calls
        assert [[c.request.chat.event_id for c in m.calls] for m in calls] == [ids]
        assert await gateway.admit("e-5") == "e-5"
        assert len(servicer.peers) == 1, "every call went on the one stream"
    finally:
        await gateway.close()
        await served.stop(None)


async def test_a_refused_call_is_its_own_answer_and_the_stream_carries_on() -> None:
    servicer, served, gateway = await _stack()
    try:
        with pytest.raises(InvalidArgument) as refused:
            await gateway.admit("fail-1")
        assert (refused.value.message, refused.value.code) == ("fail-1 is refused", "refused_here")
        with pytest.raises(TetherError) as broken:
            await gateway.admit("boom-1")
        assert broken.value.status == grpc.StatusCode.INTERNAL
        assert "detail" not in broken.value.message
        assert broken.value.message == "internal error; see the admission service's log"
        assert await gateway.admit("ok-1") == "ok-1"
        assert len(servicer.peers) == 1
    finally:
        await gateway.close()
        await served.stop(None)


async def test_a_caller_that_gives_up_stops_its_call_at_admission() -> None:
    servicer, served, gateway = await _stack()
    desk = servicer.desk
    try:
        waiting = asyncio.ensure_future(gateway.admit("hold-1"))
        await desk.seen("hold-1").wait()
        waiting.cancel()
        await desk.was_cancelled("hold-1").wait()
        # Past its deadline: stopped there, and answered as an outage the caller may retry.
        with pytest.raises(Unavailable) as late:
            await gateway.admit("hold-2", timeout_s=0.05)
        assert desk.was_cancelled("hold-2").is_set()
        assert late.value.message == "the admission did not end within the call's deadline"
        # Each call carries its deadline: the caller's, within the gateway's own bound (less
        # what opening the stream took).
        first, second = [c.timeout_ms for m in servicer.messages for c in m.calls]
        assert 29_000 < first <= 30_000 and 40 < second <= 50
        assert [i for m in servicer.messages for i in m.cancels] == [1]
        assert await gateway.admit("ok") == "ok"
    finally:
        await gateway.close()
        await served.stop(None)


async def test_a_draining_replica_answers_its_calls_and_new_ones_go_on_a_new_connection() -> None:
    servicer, served, gateway = await _stack()
    desk = servicer.desk
    try:
        held = asyncio.ensure_future(gateway.admit("hold-1"))
        await desk.seen("hold-1").wait()
        servicer.streams.drain_all()  # as when the replica stops: every stream, new ones too
        assert await gateway.admit("after-1") == "after-1"
        assert await gateway.admit("after-2") == "after-2"
        desk.let_go()
        assert await held == "hold-1"
        # A call sent before the drain reached the gateway went on the old stream, and was
        # answered there; the rest went on new streams, each on a connection of its own.
        assert len(servicer.peers) >= 2
        assert len(set(servicer.peers)) == len(servicer.peers)
    finally:
        await gateway.close()
        await served.stop(None)


async def test_a_broken_stream_fails_its_calls_as_an_outage_and_the_next_call_reconnects() -> None:
    servicer, served, gateway = await _stack()
    port = served.port
    try:
        held = asyncio.ensure_future(gateway.admit("hold-1"))
        await servicer.desk.seen("hold-1").wait()
        await served.stop(0)  # the replica goes away with the call unanswered
        with pytest.raises(Unavailable) as lost:
            await held
        assert lost.value.code == "dependency_unavailable"
        assert "the admission service" in lost.value.message
        back = Servicer(Desk(), _LONG)
        served = await _serve(back, port)
        assert await gateway.admit("again") == "again"
        assert len(back.peers) == 1
    finally:
        await gateway.close()
        await served.stop(None)


async def test_a_replica_without_the_stream_is_called_unary() -> None:
    servicer, served, gateway = await _stack(streams=False)
    try:
        assert await gateway.admit("a") == "a"
        assert await gateway.admit("b") == "b"
        assert servicer.unary_calls == 2 and servicer.messages == []
    finally:
        await gateway.close()
        await served.stop(None)


async def _open(address: str) -> tuple[grpc.aio.Channel, Any]:
    channel = grpc.aio.insecure_channel(address)
    call = admission_pb2_grpc.AdmissionServiceStub(channel).AdmitStream()
    return channel, call


def _calls(*calls: admission_pb2.AdmitCall) -> admission_pb2.AdmitStreamRequest:
    return admission_pb2.AdmitStreamRequest(calls=list(calls))


async def test_a_stream_opens_with_a_hello_of_this_protocol_alone() -> None:
    _, served, gateway = await _stack()
    address = f"127.0.0.1:{served.port}"
    try:
        refusals = {
            "another version": admission_pb2.AdmitStreamRequest(
                hello=admission_pb2.AdmitHello(protocol_version=PROTOCOL_VERSION + 1)
            ),
            "no hello": _calls(admission_pb2.AdmitCall(id=1, request=_chat("x"))),
            "a call beside it": admission_pb2.AdmitStreamRequest(
                hello=admission_pb2.AdmitHello(protocol_version=PROTOCOL_VERSION),
                calls=[admission_pb2.AdmitCall(id=1, request=_chat("x"))],
            ),
        }
        seen = {}
        for why, first in refusals.items():
            channel, call = await _open(address)
            await call.write(first)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call.read()
            seen[why] = (refused.value.code(), refused.value.details())
            await channel.close()
        code, details = seen["another version"]
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        assert f"protocol {PROTOCOL_VERSION + 1}" in details
        assert f"speaks {PROTOCOL_VERSION}" in details
        assert seen["no hello"][0] == grpc.StatusCode.INVALID_ARGUMENT
        assert seen["a call beside it"][0] == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        await gateway.close()
        await served.stop(None)


async def test_an_aged_stream_drains_answers_every_call_sent_to_it_then_ends() -> None:
    servicer, served, gateway = await _stack(StreamTiming(max_age_s=0.2, drain_grace_s=30.0))
    channel, call = await _open(f"127.0.0.1:{served.port}")
    hello = admission_pb2.AdmitHello(protocol_version=PROTOCOL_VERSION)
    try:
        await call.write(admission_pb2.AdmitStreamRequest(hello=hello))
        assert (await call.read()).welcome.protocol_version == PROTOCOL_VERSION
        await call.write(_calls(admission_pb2.AdmitCall(id=1, request=_chat("hold-1"))))
        drained = await call.read()
        assert drained.drain and not drained.answers
        # Sent before the caller saw the drain: still run and answered.
        await call.write(_calls(admission_pb2.AdmitCall(id=2, request=_chat("late"))))
        late = await call.read()
        assert [(a.id, a.response.run.run_id) for a in late.answers] == [(2, "late")]
        servicer.desk.let_go()
        held = await call.read()
        assert [(a.id, a.code, a.response.run.run_id) for a in held.answers] == [(1, 0, "hold-1")]
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF
        assert await call.code() == grpc.StatusCode.OK
    finally:
        await channel.close()
        await gateway.close()
        await served.stop(None)


async def test_a_drained_stream_whose_caller_keeps_it_open_ends_after_the_grace() -> None:
    _, served, gateway = await _stack(StreamTiming(max_age_s=0.05, drain_grace_s=0.1))
    channel, call = await _open(f"127.0.0.1:{served.port}")
    hello = admission_pb2.AdmitHello(protocol_version=PROTOCOL_VERSION)
    try:
        await call.write(admission_pb2.AdmitStreamRequest(hello=hello))
        await call.read()
        assert (await call.read()).drain
        assert await call.read() is grpc.aio.EOF  # never closed its side: ended after the grace
        assert await call.code() == grpc.StatusCode.OK
    finally:
        await channel.close()
        await gateway.close()
        await served.stop(None)


class Mute(Servicer):
    """A replica that welcomes a stream (or, with `welcomes` False, not even that), then never
    answers: its connection gone dead."""

    welcomes = True

    async def AdmitStream(
        self, request_iterator: AsyncIterator[admission_pb2.AdmitStreamRequest], context: Any
    ) -> AsyncIterator[admission_pb2.AdmitStreamResponse]:
        self.peers.append(context.peer())
        async for message in request_iterator:
            self.messages.append(message)
            if message.HasField("hello") and self.welcomes:
                yield admission_pb2.AdmitStreamResponse(
                    welcome=admission_pb2.AdmitWelcome(protocol_version=PROTOCOL_VERSION)
                )


async def test_a_call_admission_never_answers_is_given_up_past_its_deadline() -> None:
    mute = Mute(Desk(), _LONG)
    served = await _serve(mute)
    gateway = Gateway(f"127.0.0.1:{served.port}", timeout_s=0.1)
    try:
        with pytest.raises(Unavailable) as silent:
            await gateway.admit("e-1")  # no deadline of its own: the gateway's bound holds
        assert silent.value.code == "dependency_timeout"
        assert "did not answer within 0.1 s" in silent.value.message
        calls = [c for m in mute.messages for c in m.calls]
        assert len(calls) == 1 and 0 < calls[0].timeout_ms <= 100
        await eventually(
            lambda: _cancelled(mute, calls[0].id), timeout=5, what="the cancel to reach admission"
        )
    finally:
        await gateway.close()
        await served.stop(None)


async def test_a_stream_admission_never_welcomes_fails_its_callers_and_is_opened_again() -> None:
    mute = Mute(Desk(), _LONG)
    mute.welcomes = False
    served = await _serve(mute)
    gateway = Gateway(f"127.0.0.1:{served.port}", timeout_s=0.1)
    try:
        for event_id in ("e-1", "e-2"):
            with pytest.raises(Unavailable) as silent:
                await gateway.admit(event_id)
            assert silent.value.code == "dependency_timeout"
        # The opening given up held nobody after it: the next caller opened another.
        assert len(mute.peers) == 2
        assert not [c for m in mute.messages for c in m.calls], "no call goes before a welcome"
    finally:
        await gateway.close()
        await served.stop(None)


async def _cancelled(servicer: Servicer, call_id: int) -> bool | None:
    return True if any(call_id in m.cancels for m in servicer.messages) else None
