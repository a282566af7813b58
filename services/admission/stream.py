"""Admission's side of the AdmitStream (see the RPC in admission.proto): many admissions on one
long-lived stream from a gateway, each run as Admit runs it and answered by its id.

A call runs in a task of its own, as a unary call does, so calls on one stream overlap; what
has ended by the time the stream can write goes back as one message. A refused call is an
answer carrying its status, never the end of the stream. When the replica stops, or a stream
reaches its age, the stream says drain: the calls sent on it are still answered, and it ends
once the gateway has closed its side and every call is answered (or, from a gateway that does
not close its side, once the drain's grace is over and the calls read by then are answered).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import grpc

from tether.errors import FailedPrecondition, InvalidArgument, TetherError
from tether.runtime.rpc import refuse_undecodable
from tether.v1 import admission_pb2

log = logging.getLogger(__name__)

# The AdmitStream protocol this replica speaks.
PROTOCOL_VERSION = 1
# Calls one stream may have running at once; past it the stream reads no more until one ends
# (HTTP/2 flow control then holds the gateway back).
MAX_IN_FLIGHT = 512

Admit = Callable[[admission_pb2.AdmitRequest, str], Awaitable[admission_pb2.AdmitResponse]]


@dataclass(frozen=True)
class StreamTiming:
    """How long a stream lives before it says drain (each stream a little less or more, so a
    gateway's streams do not all move at once), and how long after that a gateway may keep
    sending before the stream stops reading."""

    max_age_s: float
    drain_grace_s: float


class _Stream:
    """One gateway's stream: its calls running, and what goes out."""

    def __init__(self) -> None:
        self.running: dict[int, asyncio.Task[None]] = {}
        self.answers: list[admission_pb2.AdmitAnswer] = []
        self.drained = False
        self.read_all = False  # the gateway closed its side, or the drain's grace is over
        self.ready = asyncio.Event()  # something to send, or the stream may end
        self.slots = asyncio.Semaphore(MAX_IN_FLIGHT)

    def answer(self, answer: admission_pb2.AdmitAnswer) -> None:
        self.answers.append(answer)
        self.ready.set()

    def drain(self) -> None:
        if not self.drained:
            self.drained = True
            self.ready.set()

    @property
    def over(self) -> bool:
        return self.read_all and not self.running and not self.answers


class AdmitStreams:
    """This replica's AdmitStreams."""

    def __init__(self, admit: Admit, timing: StreamTiming) -> None:
        self._admit = admit
        self._timing = timing
        self._streams: set[_Stream] = set()
        self._stopping = False

    def drain_all(self) -> None:
        """The replica is stopping: every stream says drain, now and from the first message."""
        self._stopping = True
        for stream in self._streams:
            stream.drain()

    async def serve(
        self, requests: AsyncIterator[admission_pb2.AdmitStreamRequest]
    ) -> AsyncIterator[admission_pb2.AdmitStreamResponse]:
        """Serve one stream until it is over, or breaks."""
        await _greet(requests)
        yield admission_pb2.AdmitStreamResponse(
            welcome=admission_pb2.AdmitWelcome(protocol_version=PROTOCOL_VERSION)
        )
        stream = _Stream()
        self._streams.add(stream)
        if self._stopping:
            stream.drain()
        loop = asyncio.get_running_loop()
        age = self._timing.max_age_s * random.uniform(0.9, 1.1)
        aged = loop.call_later(age, stream.drain)
        reader = asyncio.ensure_future(self._read(stream, requests))
        reader.add_done_callback(lambda _: stream.ready.set())
        grace: asyncio.TimerHandle | None = None
        try:
            while not stream.over:
                await stream.ready.wait()
                stream.ready.clear()
                if reader.done() and not reader.cancelled() and reader.exception() is not None:
                    reader.result()  # a message it refused ends the stream with its status
                out = admission_pb2.AdmitStreamResponse(answers=stream.answers)
                stream.answers = []
                if stream.drained and grace is None:
                    out.drain = True
                    grace = loop.call_later(
                        self._timing.drain_grace_s, _stop_reading, stream, reader
                    )
                if out.answers or out.drain:
                    yield out
        finally:
            aged.cancel()
            if grace is not None:
                grace.cancel()
            self._streams.discard(stream)
            reader.cancel()
            for task in stream.running.values():
                task.cancel()

    async def _read(
        self, stream: _Stream, requests: AsyncIterator[admission_pb2.AdmitStreamRequest]
    ) -> None:
        try:
            async for raw in requests:
                request = refuse_undecodable(raw)
                if request.HasField("hello"):
                    raise InvalidArgument(
                        "an AdmitStream carries its hello in its first message only"
                    )
                for call_id in request.cancels:
                    task = stream.running.get(call_id)
                    if task is not None:
                        task.cancel()
                for call in request.calls:
                    if call.id in stream.running:
                        raise InvalidArgument(f"call {call.id} is already running on this stream")
                    await stream.slots.acquire()
                    task = asyncio.ensure_future(self._call(stream, call))
                    stream.running[call.id] = task
        finally:
            stream.read_all = True

    async def _call(self, stream: _Stream, call: admission_pb2.AdmitCall) -> None:
        """Run one call as Admit would, and answer it (not when its caller cancelled it)."""
        answer = admission_pb2.AdmitAnswer(id=call.id)
        try:
            async with asyncio.timeout(call.timeout_ms / 1000 if call.timeout_ms else None):
                answer.response.CopyFrom(await self._admit(call.request, call.traceparent))
        except TimeoutError:
            answer.code = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
            answer.message = "the admission did not end within the call's deadline"
        except TetherError as exc:
            answer.code, answer.message, answer.error_code = (
                exc.status.value[0],
                exc.message,
                exc.code,
            )
        except asyncio.CancelledError:
            raise  # the caller gave up on it, or the stream is ending: nobody to answer
        except Exception:
            log.exception("an admission on an AdmitStream failed")
            answer.code = grpc.StatusCode.INTERNAL.value[0]
            answer.message = "internal error; see the admission service's log"
        finally:
            del stream.running[call.id]
            stream.slots.release()
            stream.ready.set()
        stream.answer(answer)


def _stop_reading(stream: _Stream, reader: asyncio.Future[None]) -> None:
    """The drain's grace is over and the gateway still has not closed its side: read no more
    (what it sends from now on is not run; the calls read already are answered)."""
    stream.read_all = True
    reader.cancel()
    stream.ready.set()


async def _greet(requests: AsyncIterator[admission_pb2.AdmitStreamRequest]) -> None:
    """Refuse a stream whose first message is no hello, or speaks another protocol version."""
    try:
        first = refuse_undecodable(await anext(requests))
    except StopAsyncIteration:
        raise InvalidArgument("an AdmitStream starts with a hello") from None
    if not first.HasField("hello") or first.calls or first.cancels:
        raise InvalidArgument("an AdmitStream starts with a hello, alone in its message")
    version = first.hello.protocol_version
    if version != PROTOCOL_VERSION:
        raise FailedPrecondition(
            f"the gateway speaks AdmitStream protocol {version} and this admission replica "
            f"speaks {PROTOCOL_VERSION}; run a gateway and an admission service of compatible "
            "releases",
            code="protocol_version_mismatch",
            details={"gateway": version, "admission": PROTOCOL_VERSION},
        )
