"""The Work stream: each worker process's one long-lived stream to this replica.

A session serves one stream. In: the hello (protocol version, worker id, the leases the worker
still holds), credits (free slots), keepalives and writes under leases. Out: pushed leases,
one acknowledgement per write (with what the unary call would have answered), cancellations
and lost leases. The dispatcher pushes leases to the sessions with credits as runs become
claimable, one claim statement per session and look for all of its credits. A keepalive renews
every lease the worker holds in one statement, which also names the runs a caller asked to
cancel, so a cancel survives a Redis flush and a change of replica.

The lease epoch, not the stream, is the authority: a stream that breaks leaves its leases to
lapse (the reaper and the fence work as ever), and a worker that comes back, to this replica or
another, announces the leases it holds and carries on with them.

Batched, not delayed: what is queued for a worker when the stream can write goes as one message
(the acknowledgements of one group commit, the leases of one claim), and a lone message goes at
once, alone. A message on a stream costs both processes more CPU than anything in it, so a
worker that says it reads batches gets them, and an outcome acknowledged OK frees its slot
without a WorkCredits message of its own (WorkHello.outcome_returns_credit).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from google.protobuf.message import Message
from sqlalchemy.ext.asyncio import AsyncEngine

from services.orchestrator.claims import Claimed, Claims, Known
from services.orchestrator.lease_histories import StreamHistories, known
from services.orchestrator.repositories import leases as lease_repo
from services.orchestrator.work_session import Session
from tether.convert.render import render_job_to_proto, rendered_from_proto
from tether.convert.work import WRITE_FIELDS, ends_lease
from tether.domain import Rendered, RenderJob, ToolAnnouncement
from tether.errors import FailedPrecondition, InvalidArgument, TetherError, Unavailable
from tether.runtime.rpc import refuse_undecodable
from tether.v1 import orchestrator_pb2

log = logging.getLogger(__name__)

# The Work protocol this orchestrator speaks; a worker speaking another is refused at its hello.
PROTOCOL_VERSION = 1

# A write: the unary handler's request in, its response out (TetherError for a refusal).
Write = Callable[[Message], Awaitable[Message]]
# Records the tools a worker's hello announced (its worker id, the tools) in the catalog.
Announce = Callable[[str, Sequence[ToolAnnouncement]], Awaitable[None]]
# How long a stream that is ending waits for the acknowledgements of writes still running.
DRAIN_S = 5.0


@dataclass(frozen=True)
class WorkSettings:
    """How a replica keeps Work streams: the lease each keepalive grants, how often the worker
    sends one, and how long an attempt may go without progress before its lease lapses."""

    lease_ttl_s: float
    keepalive_interval_s: float
    progress_deadline_s: float
    render_timeout_s: float = 5.0


def _known(histories: StreamHistories, session_id: str) -> Known:
    """What a stream's worker holds of a session's history, as a claim reads it."""
    return known(histories.peek(session_id))


async def _record_tools(announce: Announce, session: Session) -> None:
    """Record the tools the session's hello announced, beside the stream: a worker is leased
    to whether or not the catalog could be written."""
    try:
        await announce(session.worker_id, session.tools)
    except Unavailable as exc:
        # PostgreSQL is down or restarting: the worker announces again at its next hello, and
        # its tools are very likely in the catalog from an earlier one.
        log.warning("recording the tools of %s deferred: %s", session.worker_id, exc)


class Work:
    """This replica's Work streams, and the dispatcher that pushes leases to them."""

    def __init__(
        self,
        engine: AsyncEngine,
        claims: Claims,
        lease: Callable[[Claimed, StreamHistories | None, int], orchestrator_pb2.ClaimRunResponse],
        release: Callable[[str, int], Awaitable[bool]],
        writes: Mapping[type[Message], Write],
        *,
        replica_id: str,
        lease_ttl_s: float,
        keepalive_interval_s: float,
        progress_deadline_s: float,
        announce: Announce | None = None,
        let_go: Callable[[str], object] | None = None,
        leases_held_for: Callable[[], float] | None = None,
    ) -> None:
        self._engine = engine
        # Told each run whose lease leaves a worker here (model rate-limit reservations).
        self._let_go = let_go
        # Seconds to lease nothing yet (a model rate limit refused a call: ModelLimits).
        self._leases_held_for = leases_held_for
        self._announce = announce
        self._claims = claims
        self._lease = lease
        self._release = release
        self._writes = dict(writes)
        self._replica_id = replica_id
        self._ttl = lease_ttl_s
        self._keepalive_s = keepalive_interval_s
        self._deadline_s = progress_deadline_s
        self._sessions: list[Session] = []
        # Called when a worker's stream begins or ends (the model limits' share follows).
        self.sessions_changed: Callable[[], object] | None = None
        # Set when a session may take leases it could not before: credits granted, a probe
        # answered.
        self._may_lease = asyncio.Event()
        self._render_ids = itertools.count(1)
        # render id -> its caller, waiting for the worker's answer
        self._renders: dict[int, asyncio.Future[Rendered]] = {}

    @property
    def connected(self) -> int:
        """Workers whose Work stream this replica serves now."""
        return len(self._sessions)

    # -- one stream ---------------------------------------------------------------------------

    async def serve(
        self, requests: AsyncIterator[orchestrator_pb2.WorkRequest]
    ) -> AsyncIterator[orchestrator_pb2.WorkResponse]:
        """Serve one Work stream until the worker ends it or it breaks."""
        session = await self._greet(requests)
        yield orchestrator_pb2.WorkResponse(
            welcome=orchestrator_pb2.WorkWelcome(
                protocol_version=PROTOCOL_VERSION,
                replica_id=self._replica_id,
                keepalive_interval_ms=int(self._keepalive_s * 1000),
                progress_deadline_ms=int(self._deadline_s * 1000),
                probes_quiet_workers=True,
                takes_batches=True,
                outcome_returns_credit=True,
                model_limits=self._let_go is not None,
            )
        )
        self._sessions.append(session)
        if self.sessions_changed is not None:
            self.sessions_changed()
        if self._announce is not None and session.tools:
            self._spawn(session, _record_tools(self._announce, session))
        reader = asyncio.ensure_future(self._read(session, requests))
        reader.add_done_callback(lambda _: session.end())
        try:
            async for response in session.outgoing():
                yield response
            reader.result()  # a refused request ends the stream with its status
            # The worker said goodbye or closed its side: the writes it sent are answered.
            if session.writes:
                await asyncio.wait(set(session.writes), timeout=DRAIN_S)
            session.end()
            async for response in session.outgoing():
                yield response
        finally:
            session.closed = True
            self._sessions.remove(session)
            if self.sessions_changed is not None:
                self.sessions_changed()
            if self._let_go is not None:
                for run_id in session.held:
                    self._let_go(run_id)
            reader.cancel()
            for task in session.writes:
                task.cancel()

    async def _greet(self, requests: AsyncIterator[orchestrator_pb2.WorkRequest]) -> Session:
        """The session a hello opens; refused when the first message is none, or speaks
        another protocol version."""
        try:
            first = refuse_undecodable(await anext(requests))
        except StopAsyncIteration:
            raise InvalidArgument("a Work stream starts with a hello") from None
        if first.WhichOneof("kind") != "hello":
            raise InvalidArgument("a Work stream starts with a hello")
        hello = first.hello
        if hello.protocol_version != PROTOCOL_VERSION:
            raise FailedPrecondition(
                f"the worker speaks Work protocol {hello.protocol_version} and this orchestrator "
                f"speaks {PROTOCOL_VERSION}; run a worker and an orchestrator of compatible "
                "releases",
                code="protocol_version_mismatch",
                details={"worker": hello.protocol_version, "orchestrator": PROTOCOL_VERSION},
            )
        if not hello.worker_id:
            raise InvalidArgument("the hello must name the worker (worker_id)")
        return Session(hello)

    async def _read(
        self, session: Session, requests: AsyncIterator[orchestrator_pb2.WorkRequest]
    ) -> None:
        async for raw in requests:
            session.heard_at = time.monotonic()
            if session.probed_at is not None:
                session.probed_at = None  # it is there: the dispatcher may lease to it again
                self._may_lease.set()
            request = refuse_undecodable(raw)
            if request.WhichOneof("kind") == "batch":
                for one in request.batch.requests:
                    if one.WhichOneof("kind") == "batch":
                        raise InvalidArgument("a Work batch holds no batch")
                    self._take(session, one)
            else:
                self._take(session, request)

    def _take(self, session: Session, request: orchestrator_pb2.WorkRequest) -> None:
        """Act on one message of the worker's: a write goes to its handler by its type."""
        kind = request.WhichOneof("kind")
        if kind is not None:
            message = getattr(request, kind)
            write = self._writes.get(type(message))
            if write is not None:
                self._spawn(session, self._write(session, request.id, write, message))
                return
        if kind == "credits":
            if request.credits.credits < 0:
                raise InvalidArgument("credits must not be negative")
            if not session.leaving:
                session.credits += request.credits.credits
            self._may_lease.set()
        elif kind == "keepalive":
            self._spawn(session, self._keepalive(session, request.keepalive))
        elif kind == "rendered":
            waiting = self._renders.get(request.rendered.render_id)
            if waiting is not None and not waiting.done():
                waiting.set_result(rendered_from_proto(request.rendered))
        elif kind == "goodbye":
            # The worker is stopping: no more leases; its last writes still come, until it
            # closes its side.
            session.credits = 0
            session.leaving = True
        else:
            raise InvalidArgument(f"a Work stream takes no {kind or 'empty'} message here")

    @staticmethod
    def _spawn(session: Session, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        session.writes.add(task)
        task.add_done_callback(session.writes.discard)

    async def _write(self, session: Session, request_id: int, write: Write, request: Any) -> None:
        """Run one write (`request`, handled by `write`) as its unary call would, and
        acknowledge it."""
        ack = orchestrator_pb2.WorkAck(id=request_id)
        kind = type(request)
        try:
            answer = await write(request)
        except TetherError as exc:
            ack.code, ack.message, ack.error_code = exc.status.value[0], exc.message, exc.code
        except Exception:
            log.exception("Work write %s of %s failed", kind.__name__, session.worker_id)
            ack.code, ack.message = 13, "internal error; see the orchestrator's log"  # INTERNAL
        else:
            getattr(ack, WRITE_FIELDS[kind]).CopyFrom(answer)
            if ends_lease(request, answer):
                session.held.pop(request.run_id, None)  # the run left this worker's hands
                if self._let_go is not None:
                    self._let_go(request.run_id)
                if session.outcome_returns_credit and not session.leaving:
                    session.credits += 1  # and its slot is free (WorkHello)
                    self._may_lease.set()
        session.send(orchestrator_pb2.WorkResponse(ack=ack))

    async def _keepalive(self, session: Session, keepalive: orchestrator_pb2.WorkKeepalive) -> None:
        """Renew the leases the worker holds (all but those past the progress deadline: their
        attempts hang, and their leases lapse); push what it must stop and what was cancelled."""
        deadline_ms = self._deadline_s * 1000
        held = {lease.run_id: lease.epoch for lease in keepalive.held}
        session.held = dict(held)
        alive = {(h.run_id, h.epoch) for h in keepalive.held if h.idle_ms <= deadline_ms}
        if not held:
            return
        try:
            async with self._engine.begin() as conn:
                renewed = await lease_repo.renew(conn, sorted(alive), self._ttl)
        except Unavailable as exc:
            # PostgreSQL is down or restarting: the worker keeps alive again shortly, and a
            # lease that lapses meanwhile is fenced off as any lapsed lease is.
            log.warning(
                "renewing %d lease(s) of %s deferred: %s", len(alive), session.worker_id, exc
            )
            return
        current = {(row.run_id, row.lease_epoch) for row in renewed}
        lost = [
            orchestrator_pb2.HeldLease(run_id=run_id, epoch=epoch)
            for run_id, epoch in held.items()
            if (run_id, epoch) in alive and (run_id, epoch) not in current
        ]
        if lost:
            for lease in lost:
                session.held.pop(lease.run_id, None)
                if self._let_go is not None:
                    self._let_go(lease.run_id)
            session.send(orchestrator_pb2.WorkResponse(lost=orchestrator_pb2.WorkLost(leases=lost)))
        for row in renewed:
            if row.cancel_requested:
                cancel = orchestrator_pb2.WorkCancel(run_id=row.run_id, epoch=row.lease_epoch)
                session.send(orchestrator_pb2.WorkResponse(cancel=cancel))

    # -- renders --------------------------------------------------------------------------------

    async def render(self, job: RenderJob, timeout_s: float) -> Rendered:
        """Have a worker on a stream here build `job` (its render id is assigned here) and
        return its answer; Unavailable when no worker is connected or none answers within
        `timeout_s`. It takes no credit: a render calls no model and holds no slot."""
        sessions = [s for s in self._sessions if not (s.closed or s.leaving)]
        if not sessions:
            raise Unavailable(
                "no worker is connected to render the agent; start a worker and try again",
                code="no_worker",
            )
        # The worker heard from last is the likeliest to be there.
        session = max(sessions, key=lambda s: s.heard_at)
        job = replace(job, render_id=next(self._render_ids))
        answer: asyncio.Future[Rendered] = asyncio.get_running_loop().create_future()
        self._renders[job.render_id] = answer
        try:
            session.send(orchestrator_pb2.WorkResponse(render=render_job_to_proto(job)))
            async with asyncio.timeout(timeout_s):
                return await answer
        except TimeoutError:
            raise Unavailable(
                f"worker {session.worker_id} did not answer the render within {timeout_s:g} s; "
                "try again",
                code="render_timed_out",
            ) from None
        finally:
            self._renders.pop(job.render_id, None)

    # -- cancels --------------------------------------------------------------------------------

    async def cancel_hinted(self, run_id: str) -> None:
        """A caller asked to cancel `run_id` (a hint): if a stream here holds it, ask PostgreSQL
        (the cancel request is durable) and push the cancel."""
        for session in list(self._sessions):
            epoch = session.held.get(run_id)
            if epoch is None:
                continue
            try:
                async with self._engine.begin() as conn:
                    renewed = await lease_repo.renew(conn, [(run_id, epoch)], self._ttl)
            except Exception as exc:  # the next keepalive carries the cancel anyway
                log.warning("cancel check of %s deferred to the next keepalive: %s", run_id, exc)
                return
            if renewed and renewed[0].cancel_requested:
                cancel = orchestrator_pb2.WorkCancel(run_id=run_id, epoch=epoch)
                session.send(orchestrator_pb2.WorkResponse(cancel=cancel))

    # -- the dispatcher -------------------------------------------------------------------------

    async def dispatch(self, retry_s: float) -> None:
        """Push leases to the sessions with credits as runs become claimable: look whenever a
        run may have become claimable (a wake-up from here or through Redis, or the replica's
        claim poll when one was lost) or a worker granted credits. While no credits wait, no
        look is made: an idle fleet costs nothing. A look that leaves credits unspent found
        the queue drained: until something wakes, more credits alone (a run ended, its slot
        came back) cannot find anything, so they wait for the next wake-up instead of
        looking (a claim statement each, for nothing)."""
        wakeups = self._claims.wakeups
        turn = itertools.count()
        drained_as_of = -1  # wakeups.generation when the last look that drained the queue began
        while True:
            if not any(s.credits for s in self._sessions):
                self._may_lease.clear()
                await self._may_lease.wait()
                continue
            held_s = self._leases_held_for() if self._leases_held_for is not None else 0.0
            if held_s > 0:
                await asyncio.sleep(held_s)  # a wake-up meanwhile is seen by the look after
                continue
            self._may_lease.clear()
            ticket = wakeups.ticket()  # before looking: a wake-up during the look counts
            generation = wakeups.generation
            if generation != drained_as_of:
                try:
                    leased, drained = await self._look(next(turn))
                except Exception:
                    wakeups.leave(ticket, claimed=None)
                    log.exception("pushing leases failed; looking again in %.1f s", retry_s)
                    await asyncio.sleep(retry_s)
                    continue
                if drained:
                    drained_as_of = generation
                elif leased:
                    # Every credit found a run: there may be more, so look again at once (a
                    # wake-up this ticket was handed is not passed on).
                    wakeups.leave(ticket, claimed=None, looking_again=True)
                    continue
            granted: asyncio.Future[Any] = asyncio.ensure_future(self._may_lease.wait())
            await asyncio.wait({ticket, granted}, return_when=asyncio.FIRST_COMPLETED)
            granted.cancel()
            wakeups.leave(ticket, claimed=None, looking_again=True)

    async def _look(self, turn: int) -> tuple[int, bool]:
        """One round: every session with credits, from a rotating start, leases what it can,
        until a claim comes back short (the queue is drained: the sessions after it would find
        nothing). How many runs were leased, and whether the queue was found drained. A worker
        not heard from for two keepalive intervals is given nothing until it speaks again: it
        is probed (once a keepalive interval), and its answer brings another round. A worker
        that holds no lease sends no keepalives, so this is how an idle one is told from a
        frozen one (or one whose connection is half dead)."""
        now = time.monotonic()
        quiet_since = now - 2 * self._keepalive_s
        sessions = []
        for session in self._sessions:
            if session.credits <= 0:
                continue
            if session.heard_at >= quiet_since:
                sessions.append(session)
            elif session.probed_at is None or session.probed_at < now - self._keepalive_s:
                session.probed_at = now
                session.send(orchestrator_pb2.WorkResponse(probe=orchestrator_pb2.WorkProbe()))
        if not sessions:
            return 0, False
        start = turn % len(sessions)
        leased = 0
        for session in sessions[start:] + sessions[:start]:
            wanted = session.credits
            histories = session.histories
            held = None if histories is None else functools.partial(_known, histories)
            claimed = await self._claims.claim_many(session.worker_id, wanted, held)
            if session.closed:
                # The stream ended during the claim: nobody will run these, give them back.
                for one in claimed:
                    await self._release(one.run.run_id, one.run.lease_epoch)
                continue
            for one in claimed:
                session.credits -= 1
                session.held[one.run.run_id] = one.run.lease_epoch
                lease = self._lease(one, histories, self._claims.history_runs)
                session.send(orchestrator_pb2.WorkResponse(lease=lease))
            leased += len(claimed)
            if len(claimed) < wanted:
                return leased, True
        return leased, False
