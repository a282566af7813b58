"""The gateway's admissions, carried on the one AdmitStream it keeps open to the admission
service (see the RPC in admission.proto) instead of a unary call each.

A call waits on the stream for its answer: Admit's response, or the TetherError Admit would
have raised. Calls queued together go as one message. The stream opens on first use; its hello
goes alone and calls wait for the welcome (calls written behind a refused hello would hide the
refusal's status).

- **Drain.** When admission says drain (it is stopping, or the stream reached its age), the next
  calls go on a new stream over a new connection, which may reach another replica, and the old
  stream is closed once its calls are answered.
- **Breaks.** A stream that breaks fails the calls it carried as UNAVAILABLE, as a unary call
  whose connection is lost fails. The caller may send the same event again: admission's dedup
  makes it one run. The next call opens a new stream.
- **Deadlines and cancels.** Each call carries its deadline: the caller's remaining time, at
  most `timeout_s`. Admission stops a call past it and answers DEADLINE_EXCEEDED; should no
  answer come (a connection gone dead without a reset), the gateway gives up a second after it,
  as UNAVAILABLE. Opening a stream is bounded by `timeout_s` too: a replica that never welcomes
  one fails the callers waiting on it, and the next caller opens another. A caller that gives
  up (its deadline passed, its connection closed) sends a cancel, and admission stops the call
  as it stops a cancelled unary call.
- **Rollouts.** An admission replica of the release before AdmitStream (UNIMPLEMENTED) is called
  with unary Admit, and the stream is tried again a minute later.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from tether import telemetry
from tether.errors import CODE_METADATA_KEY, Unavailable, from_rpc_error, from_status_number
from tether.telemetry import tracing
from tether.v1 import admission_pb2, admission_pb2_grpc

log = logging.getLogger(__name__)

# The AdmitStream protocol this gateway speaks.
PROTOCOL_VERSION = 1
# After admission answered UNIMPLEMENTED (a replica of the release before AdmitStream), calls
# go unary for this long before the stream is tried again.
UNARY_FOR_S = 60.0
# How much longer than a call's deadline the gateway waits for admission's own answer to it.
ANSWER_MARGIN_S = 1.0
# Which service a refusal or an outage is reported as.
_SERVICE = "admission"


class _Unimplemented(Exception):
    """The admission replica serves no AdmitStream."""


class _Closed(Exception):
    """The stream took no more calls by the time this one came: send it on the next."""


class Admissions:
    """Admissions over an AdmitStream, reopened as needed. `connect` makes a channel of its
    own (a new connection) for each stream; `unary` is Admit, for replicas without the
    stream."""

    def __init__(
        self,
        connect: Callable[[], Any],
        unary: admission_pb2_grpc.AdmissionServiceStub,
        *,
        timeout_s: float = 30.0,
    ) -> None:
        self._connect = connect
        self._unary = unary
        self._timeout_s = timeout_s
        self._current: _Stream | None = None
        self._opening: asyncio.Future[_Stream] | None = None
        self._unary_until = 0.0
        self._streams: set[_Stream] = set()  # open or draining, until each is over

    async def admit(
        self, request: admission_pb2.AdmitRequest, timeout_s: float | None
    ) -> admission_pb2.AdmitResponse:
        """Admit `request` (its caller having `timeout_s` left, or no deadline)."""
        timeout_s = self._timeout_s if timeout_s is None else min(timeout_s, self._timeout_s)
        deadline = time.monotonic() + timeout_s
        traceparent = tracing.traceparent() if telemetry.on else ""
        while time.monotonic() >= self._unary_until:
            try:
                # Opening is bounded on its own; a caller with a shorter deadline is cancelled
                # by it.
                stream = await self._stream()
                left = max(deadline - time.monotonic(), 0.001)
                return await stream.call(request, left, traceparent, bound_s=timeout_s)
            except _Unimplemented:
                log.warning("the admission service serves no AdmitStream; calling Admit")
                self._unary_until = time.monotonic() + UNARY_FOR_S
            except _Closed:
                continue
        response: admission_pb2.AdmitResponse = await self._unary.Admit(request, timeout=timeout_s)
        return response

    async def close(self) -> None:
        """Close every stream (the gateway is stopping; its calls have ended)."""
        self._current = None
        for stream in list(self._streams):
            await stream.close()

    async def _stream(self) -> _Stream:
        current = self._current
        if current is not None and current.takes_calls:
            return current
        if self._opening is None:
            self._opening = asyncio.ensure_future(self._open())
        # Shielded: a caller that gives up does not stop the opening the others wait for.
        return await asyncio.shield(self._opening)

    async def _open(self) -> _Stream:
        """A new stream, welcomed; bounded as a call is (a replica that never welcomes one
        must not hold every caller after it)."""
        try:
            stream = _Stream(self._connect(), self._drained, self._streams.discard)
            self._streams.add(stream)
            try:
                async with asyncio.timeout(self._timeout_s):
                    await stream.start()
            except TimeoutError:
                raise _no_answer(self._timeout_s) from None
            self._current = stream
            return stream
        finally:
            self._opening = None

    def _drained(self, stream: _Stream) -> None:
        if self._current is stream:
            self._current = None


class _Stream:
    """One AdmitStream on its own channel."""

    def __init__(
        self,
        channel: Any,
        drained: Callable[[_Stream], None],
        over: Callable[[_Stream], None],
    ) -> None:
        self._channel = channel
        self._stub = admission_pb2_grpc.AdmissionServiceStub(channel)
        self._drained = drained
        self._over = over
        self._ids = itertools.count(1)
        self._outbox: asyncio.Queue[admission_pb2.AdmitStreamRequest | None] = asyncio.Queue()
        self._waiting: dict[int, asyncio.Future[admission_pb2.AdmitResponse]] = {}
        self._call: Any = None
        self._reader: asyncio.Future[None] | None = None
        self.takes_calls = False
        self._sending = True  # this side is not closed yet

    async def start(self) -> None:
        """Send the hello and wait for the welcome; raise why not."""
        hello = admission_pb2.AdmitHello(protocol_version=PROTOCOL_VERSION)
        self._outbox.put_nowait(admission_pb2.AdmitStreamRequest(hello=hello))
        self._call = self._stub.AdmitStream(self._requests())
        try:
            first = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            await self.close()
            raise refusal(exc) from exc
        except BaseException:
            await self.close()
            raise
        if first is grpc.aio.EOF or not first.HasField("welcome"):
            await self.close()
            raise Unavailable.outage("the admission service")
        self.takes_calls = True
        self._reader = asyncio.ensure_future(self._read())

    async def call(
        self,
        request: admission_pb2.AdmitRequest,
        timeout_s: float,
        traceparent: str,
        *,
        bound_s: float,
    ) -> admission_pb2.AdmitResponse:
        """Send one call and wait for its answer: admission's, or none past `timeout_s` (what
        is left of the call's bound, `bound_s`)."""
        if not self.takes_calls:
            raise _Closed
        call_id = next(self._ids)
        answer: asyncio.Future[admission_pb2.AdmitResponse] = (
            asyncio.get_running_loop().create_future()
        )
        self._waiting[call_id] = answer
        call = admission_pb2.AdmitCall(
            id=call_id,
            request=request,
            timeout_ms=max(1, math.ceil(timeout_s * 1000)),
            traceparent=traceparent,
        )
        self._outbox.put_nowait(admission_pb2.AdmitStreamRequest(calls=[call]))
        try:
            async with asyncio.timeout(timeout_s + ANSWER_MARGIN_S):
                return await answer
        except TimeoutError:
            self._give_up(call_id)
            raise _no_answer(bound_s) from None
        except asyncio.CancelledError:
            self._give_up(call_id)
            raise

    def _give_up(self, call_id: int) -> None:
        """The caller no longer waits for `call_id`: admission stops it, if it still runs."""
        if self._waiting.pop(call_id, None) is not None and self._sending:
            self._outbox.put_nowait(admission_pb2.AdmitStreamRequest(cancels=[call_id]))
            self._close_if_done()

    async def close(self) -> None:
        """End the stream now: stop reading (the reader then ends it), or end it here when it
        never got as far as reading."""
        if self._call is not None:
            self._call.cancel()
        if self._reader is None:
            await self._ended()
            return
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader

    async def _requests(self) -> AsyncIterator[admission_pb2.AdmitStreamRequest]:
        """What the stream sends, as it is queued: everything queued by the time the stream
        can write goes as one message, until this side closes."""
        while True:
            queued = [await self._outbox.get()]
            while not self._outbox.empty():
                queued.append(self._outbox.get_nowait())
            messages: list[admission_pb2.AdmitStreamRequest] = []
            for message in queued:
                if message is None:
                    break
                messages.append(message)
            if len(messages) == 1:
                yield messages[0]
            elif messages:
                yield admission_pb2.AdmitStreamRequest(
                    calls=[call for message in messages for call in message.calls],
                    cancels=[call_id for message in messages for call_id in message.cancels],
                )
            if len(messages) < len(queued):
                return

    async def _read(self) -> None:
        try:
            while True:
                response = await self._call.read()
                if response is grpc.aio.EOF:
                    break
                for answer in response.answers:
                    self._answered(answer)
                if response.drain:
                    self.takes_calls = False
                    self._drained(self)
                self._close_if_done()
        except grpc.aio.AioRpcError as exc:
            if self._waiting:
                log.warning("AdmitStream broke (%s: %s)", exc.code().name, exc.details())
        finally:
            await self._ended()

    async def _ended(self) -> None:
        """Nothing more comes on this stream: it takes no calls, those still waiting fail as an
        outage, this side closes and so does the channel."""
        self.takes_calls = False
        self._drained(self)
        self._fail_waiting()
        self._end()
        self._over(self)
        await self._channel.close()

    def _answered(self, answer: admission_pb2.AdmitAnswer) -> None:
        waiting = self._waiting.pop(answer.id, None)
        if waiting is None or waiting.done():
            return  # its caller gave up
        if answer.code:
            waiting.set_exception(
                from_status_number(answer.code, answer.message, answer.error_code)
            )
        else:
            waiting.set_result(answer.response)

    def _close_if_done(self) -> None:
        """A draining stream whose calls are all answered closes its side (admission then ends
        the stream)."""
        if not self.takes_calls and not self._waiting:
            self._end()

    def _end(self) -> None:
        if self._sending:
            self._sending = False
            self._outbox.put_nowait(None)

    def _fail_waiting(self) -> None:
        waiting, self._waiting = self._waiting, {}
        for answer in waiting.values():
            if not answer.done():
                answer.set_exception(Unavailable.outage("the admission service"))


def _no_answer(timeout_s: float) -> Unavailable:
    return Unavailable(
        f"the admission service did not answer within {timeout_s:g} s; the call may be retried "
        "(with the same event id it makes one run)",
        code="dependency_timeout",
        details={"dependency": "the admission service"},
    )


def refusal(exc: grpc.aio.AioRpcError) -> Exception:
    """What a stream that failed to open means for the call waiting on it. Admission's own
    refusals (another protocol version, a credential it does not know) carry their stable code
    and are raised as they are; a replica without the stream means unary calls. Anything else
    is an outage: grpc's client reports a write that raced the server's early end as INTERNAL
    ("Internal error from Core", grpc/grpc#36066), hiding a stopping replica's UNAVAILABLE."""
    if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
        return _Unimplemented()
    trailers = dict(exc.trailing_metadata() or ())
    if CODE_METADATA_KEY not in trailers:
        return Unavailable.outage("the admission service")
    return from_rpc_error(exc, _SERVICE)
