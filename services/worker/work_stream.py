"""The worker's one Work stream to an orchestrator replica (see the Work RPC in orchestrator.proto).

Out: the hello (this process's id and the leases it holds), credits (free slots), keepalives
and the writes of every attempt. In: pushed leases, one acknowledgement per write, cancels and
lost leases, handed to the pool as domain types (a pushed lease becomes an `Assignment` here;
protobuf stops at this module and `orchestrator_client`).

What is queued when the stream can write goes as one message to a replica that reads batches,
and a lone message goes at once. An outcome (complete, park, retry, release, or a delegate call
answered parked: `ends_lease`) acknowledged OK frees its slot on a replica that says so
(WorkWelcome.outcome_returns_credit): the pool grants no credit for it, so a run costs the
stream three messages, not four.

When the stream breaks (a replica stopped or asked the connection to go away, the network) it
reconnects, to whichever replica answers, announces the leases it holds and sends again every
write that was not acknowledged: the epoch is the authority and every write is idempotent under
it (checkpoints are numbered), so an attempt carries on as if nothing happened.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from google.protobuf.message import Message

from services.worker.history_cache import HistoryCache, HistoryOutOfStep
from tether.convert.catalog import announcements_to_proto
from tether.convert.render import render_job_from_proto, rendered_to_proto
from tether.convert.work import assignment_from_proto, ends_lease, write_request
from tether.domain import Assignment, Rendered, RenderJob, ToolAnnouncement
from tether.errors import TetherError, Unavailable, from_status_number
from tether.v1 import orchestrator_pb2, orchestrator_pb2_grpc

log = logging.getLogger(__name__)

# The Work protocol this worker speaks.
PROTOCOL_VERSION = 1
# Reconnect backoff: doubling from the first to the last.
RECONNECT_FIRST_S = 0.05
RECONNECT_MAX_S = 2.0


@dataclass(frozen=True, slots=True)
class Held:
    """A lease the worker holds, and how long its attempt has gone without progress."""

    run_id: str
    epoch: int
    idle_s: float


class Handler(Protocol):
    """What the stream hands the pool."""

    def leased(self, assignment: Assignment) -> None:
        """A lease was pushed: run it (a credit was spent on it)."""

    def cancelled(self, run_id: str, epoch: int) -> None:
        """A caller asked to cancel a run this worker holds."""

    def lost(self, run_id: str, epoch: int) -> None:
        """A lease is no longer this worker's: stop its attempt."""

    def held(self) -> Sequence[Held]:
        """Every lease the worker holds now."""

    def render(self, job: RenderJob) -> None:
        """Build the request `job` asks for and answer it (`WorkStream.rendered`)."""


class WorkStream:
    """One Work stream, kept open (and reopened) until `close`."""

    def __init__(
        self,
        channel: grpc.aio.Channel,
        worker_id: str,
        tools: Sequence[ToolAnnouncement] = (),
        histories: HistoryCache | None = None,
    ) -> None:
        """`tools`: what every hello announces for the orchestrator's tool catalog;
        `histories`: where sessions' histories are kept between leases (None: nothing is, and
        every lease carries its whole history)."""
        self._stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
        self._worker_id = worker_id
        self._tools = announcements_to_proto(tools)
        self._ids = itertools.count(1)
        # Writes not yet acknowledged: sent again on every new stream until they are.
        self._unanswered: dict[int, tuple[orchestrator_pb2.WorkRequest, asyncio.Future[Any]]] = {}
        self._outbox: asyncio.Queue[orchestrator_pb2.WorkRequest] | None = None
        self._free = 0  # slots granted and not yet leased
        # What the replica of the current stream said it does (its welcome).
        self._batches = False
        self._returns_credit = False
        # Leases whose outcome an acknowledgement freed the slot of (run id, epoch).
        self._returned: set[tuple[str, int]] = set()
        self._keepalive_s = 2.0
        # Whether the replica probes a quiet worker (then one holding no lease sends nothing).
        self._probed = False
        self.progress_deadline_s = 120.0
        self.model_limits = False  # the replica keeps model rate limits (its welcome says)
        self._closing = False
        self._leaving = False
        self._keepalive_due = asyncio.Event()
        self.connected = asyncio.Event()
        self._histories = histories
        # Set when a lease counted on history not held as it named it: the stream is opened
        # again (both ends then start from nothing held) once what arrived with it is handled.
        self._out_of_step = False
        self._releases: set[asyncio.Task[None]] = set()

    # -- what attempts and the pool call --------------------------------------------------------

    async def write(self, request: Message) -> Any:
        """Send one write (its WorkRequest field is its type's) and return its acknowledged
        answer; raise the TetherError the orchestrator refused it with. Survives reconnects."""
        request_id = next(self._ids)
        message = write_request(request_id, request)
        answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._unanswered[request_id] = (message, answer)
        if self._outbox is not None:
            self._outbox.put_nowait(message)
        try:
            return await answer
        finally:
            self._unanswered.pop(request_id, None)

    def slot_freed(self, run_id: str, epoch: int) -> None:
        """The attempt of (run_id, epoch) is over: its slot goes back to the replica, unless
        its acknowledged outcome gave it back already."""
        if (run_id, epoch) in self._returned:
            self._returned.discard((run_id, epoch))
        else:
            self.grant(1)

    def grant(self, credits: int) -> None:
        """`credits` more slots are free."""
        if self._leaving:
            return
        self._free += credits
        if self._outbox is not None and credits:
            self._outbox.put_nowait(
                orchestrator_pb2.WorkRequest(credits=orchestrator_pb2.WorkCredits(credits=credits))
            )

    def rendered(self, rendered: Rendered) -> None:
        """Answer a render job; an answer the stream broke under is lost (the orchestrator's
        caller is told no worker answered in time)."""
        if self._outbox is not None:
            self._outbox.put_nowait(
                orchestrator_pb2.WorkRequest(rendered=rendered_to_proto(rendered))
            )

    def keepalive_now(self) -> None:
        """Renew the leases at once (a cancel hint came: the answer carries the cancel)."""
        self._keepalive_due.set()

    # -- the connection -------------------------------------------------------------------------

    async def run(self, handler: Handler) -> None:
        """Keep a stream open, handing what arrives to `handler`, until `close`. A refusal that
        reconnecting cannot mend (another protocol version, a credential refused) is raised."""
        delay = RECONNECT_FIRST_S
        while not self._closing:
            try:
                await self._serve(handler)
                delay = RECONNECT_FIRST_S
            except asyncio.CancelledError:
                raise
            except (grpc.aio.AioRpcError, TetherError) as exc:
                if self._closing:
                    return
                if isinstance(exc, grpc.aio.AioRpcError) and exc.code() in _FOR_GOOD:
                    raise
                log.warning("Work stream ended (%s); reconnecting", _why(exc))
            finally:
                self.connected.clear()
            if not self._closing:
                await asyncio.sleep(delay)
                delay = min(delay * 2, RECONNECT_MAX_S)

    async def _serve(self, handler: Handler) -> None:
        # The hello goes alone: anything written while a refusal is on its way back would hide
        # the refusal's status (grpc reports such a call as INTERNAL).
        outbox: asyncio.Queue[orchestrator_pb2.WorkRequest] = asyncio.Queue()
        hello = orchestrator_pb2.WorkHello(
            protocol_version=PROTOCOL_VERSION,
            worker_id=self._worker_id,
            held=[_held(h) for h in handler.held()],
            takes_batches=True,
            outcome_returns_credit=True,
            tools=self._tools,
            history_cache_bytes=0 if self._histories is None else self._histories.budget_bytes,
        )
        if self._histories is not None:
            self._histories.clear()  # this stream's orchestrator counts on nothing held
        self._out_of_step = False
        outbox.put_nowait(orchestrator_pb2.WorkRequest(hello=hello))
        self._batches = self._returns_credit = False  # until this stream's welcome says
        call = self._stub.Work(self._drain(outbox))
        keepalive: asyncio.Future[None] | None = None
        try:
            async for response in call:
                if response.WhichOneof("kind") == "welcome":
                    self._welcomed(response.welcome, outbox)
                    keepalive = asyncio.ensure_future(self._keepalive(handler, outbox))
                else:
                    self._receive(handler, response)
                if self._out_of_step:
                    raise Unavailable("a lease counted on history this worker does not hold")
            if not self._closing:
                raise Unavailable("the orchestrator ended the Work stream")
        finally:
            self._outbox = None
            if keepalive is not None:
                keepalive.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await keepalive
            outbox.put_nowait(_END)
            call.cancel()

    def _welcomed(
        self,
        welcome: orchestrator_pb2.WorkWelcome,
        outbox: asyncio.Queue[orchestrator_pb2.WorkRequest],
    ) -> None:
        """The stream is accepted: grant the free slots, send again every write the last stream
        did not answer, and take writes from here on."""
        self._keepalive_s = welcome.keepalive_interval_ms / 1000 or self._keepalive_s
        self._probed = welcome.probes_quiet_workers
        self._batches = welcome.takes_batches
        self._returns_credit = welcome.outcome_returns_credit
        self.progress_deadline_s = welcome.progress_deadline_ms / 1000 or self.progress_deadline_s
        self.model_limits = welcome.model_limits
        if self._leaving:
            outbox.put_nowait(orchestrator_pb2.WorkRequest(goodbye=orchestrator_pb2.WorkGoodbye()))
        elif self._free:
            credits = orchestrator_pb2.WorkCredits(credits=self._free)
            outbox.put_nowait(orchestrator_pb2.WorkRequest(credits=credits))
        for message, _ in list(self._unanswered.values()):
            outbox.put_nowait(message)
        self._outbox = outbox
        self.connected.set()

    def _receive(self, handler: Handler, response: orchestrator_pb2.WorkResponse) -> None:
        kind = response.WhichOneof("kind")
        if kind == "batch":
            for one in response.batch.responses:
                if one.WhichOneof("kind") != "batch":  # a batch holds no batch
                    self._receive(handler, one)
        elif kind == "ack":
            self._acknowledged(response.ack)
        elif kind == "lease":
            self._free = max(self._free - 1, 0)
            self._leased(handler, response.lease)
        elif kind == "cancel":
            handler.cancelled(response.cancel.run_id, response.cancel.epoch)
        elif kind == "lost":
            for lease in response.lost.leases:
                handler.lost(lease.run_id, lease.epoch)
        elif kind == "probe":
            self._keepalive_due.set()  # the answer: a keepalive, now
        elif kind == "render":
            handler.render(render_job_from_proto(response.render))

    def _leased(self, handler: Handler, lease: orchestrator_pb2.ClaimRunResponse) -> None:
        if self._histories is None:
            handler.leased(assignment_from_proto(lease))
            return
        try:
            assignment = self._histories.assignment(lease)
        except HistoryOutOfStep as exc:
            # Never run on a history not as the lease names it: give the lease back (no attempt
            # spent; it is leased again, whole, to a stream that holds nothing).
            log.error("lease of %s refused: %s", lease.lease.run_id, exc)
            self._out_of_step = True
            release = asyncio.ensure_future(self._release(lease.lease.run_id, lease.lease.epoch))
            self._releases.add(release)
            release.add_done_callback(self._releases.discard)
            return
        handler.leased(assignment)

    async def _release(self, run_id: str, epoch: int) -> None:
        try:
            await self.write(orchestrator_pb2.ReleaseRunRequest(run_id=run_id, epoch=epoch))
        except TetherError as exc:
            log.warning("releasing %s failed (its lease lapses): %s", run_id, exc)
        self.slot_freed(run_id, epoch)

    def _acknowledged(self, ack: orchestrator_pb2.WorkAck) -> None:
        entry = self._unanswered.get(ack.id)
        if entry is None or entry[1].done():
            return  # answered on an earlier stream already, or its writer gave up
        _, answer = entry
        if ack.code:
            answer.set_exception(from_status_number(ack.code, ack.message, ack.error_code))
            return
        message = entry[0]
        written = getattr(message, str(message.WhichOneof("kind")))
        result = getattr(ack, str(ack.WhichOneof("result")))
        if ends_lease(written, result) and self._returns_credit and not self._leaving:
            self._returned.add((written.run_id, written.epoch))
            self._free += 1  # the replica counted the slot free again
        answer.set_result(result)

    async def _keepalive(
        self, handler: Handler, outbox: asyncio.Queue[orchestrator_pb2.WorkRequest]
    ) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._keepalive_due.wait(), self._keepalive_s)
            asked = self._keepalive_due.is_set()
            self._keepalive_due.clear()
            held = [_held(h) for h in handler.held()]
            if not (held or asked) and self._probed:
                continue  # nothing to renew: the replica probes before it leases to us
            outbox.put_nowait(
                orchestrator_pb2.WorkRequest(keepalive=orchestrator_pb2.WorkKeepalive(held=held))
            )

    async def _drain(self, outbox: asyncio.Queue[orchestrator_pb2.WorkRequest]) -> Any:
        """The requests of one stream, as they are queued, until the end sentinel: everything
        queued by the time the stream can write goes together (one batch, once the replica
        said it takes them)."""
        while True:
            queued = [await outbox.get()]
            while not outbox.empty():
                queued.append(outbox.get_nowait())
            ends = [i for i, message in enumerate(queued) if message is _END]
            ended = bool(ends)
            if ended:
                queued = queued[: ends[0]]
            if len(queued) > 1 and self._batches:
                yield orchestrator_pb2.WorkRequest(
                    batch=orchestrator_pb2.WorkRequests(requests=queued)
                )
            else:
                for message in queued:
                    yield message
            if ended:
                return

    def goodbye(self) -> None:
        """Take no more leases (the worker is stopping); writes still go until `close`."""
        self._free = 0
        self._leaving = True
        if self._outbox is not None:
            self._outbox.put_nowait(
                orchestrator_pb2.WorkRequest(goodbye=orchestrator_pb2.WorkGoodbye())
            )

    async def close(self) -> None:
        """End the stream (after `goodbye`, once the attempts are over) and stop."""
        self._closing = True
        if self._outbox is not None:
            self._outbox.put_nowait(_END)


# The sentinel that ends a stream's request iterator.
_END = orchestrator_pb2.WorkRequest()
# Refusals of a stream that reconnecting cannot mend. (UNIMPLEMENTED is not one: an orchestrator
# of the release before Work is upgraded during a rollout; roll out orchestrators first.)
_FOR_GOOD = frozenset(
    {
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
    }
)


def _held(held: Held) -> orchestrator_pb2.HeldLease:
    return orchestrator_pb2.HeldLease(
        run_id=held.run_id, epoch=held.epoch, idle_ms=int(held.idle_s * 1000)
    )


def _why(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc)
