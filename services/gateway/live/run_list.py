"""The live run list: the first page of a caller's runs, then each run that changes.

It adds nothing to a run's path: no statement, index or message of its own. The hub hears every
run's durable events while some list is open (`RunsWatch`, on the channels runs already publish
on, each message naming the run's tenant and owner); a list woken by one of a run its caller may
see re-reads its first page through the orchestrator's SearchRuns (which reads as its caller may
see) and sends the runs that differ from what it sent. A run it sent
that left the page (its status left the filter, newer runs pushed it down) is read by id when
it changes, so the client hears that too. With Redis down, or quiet for `reread_s`, it re-reads
anyway: a change is never missed for longer than that. A reconnect starts with a fresh page, so
nothing changed while away is lost.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.gateway.live.hub import EventHub
from services.gateway.live.streams import StreamInterrupted
from tether.errors import NotFound
from tether.v1 import common_pb2, gateway_pb2, orchestrator_pb2, orchestrator_pb2_grpc
from tether.visibility import Viewer

if TYPE_CHECKING:
    from services.gateway.auth import KeyWatch

# Runs remembered beyond the current page (sent before, read by id when they change).
MAX_REMEMBERED = 200


@dataclass(frozen=True)
class LiveListTiming:
    """How a live list paces its re-reads (from the gateway's settings)."""

    reread_s: float = 5.0  # with nothing heard (or Redis down: `poll_s`)
    poll_s: float = 1.0
    min_interval_s: float = 0.25  # at most this often while runs change
    keepalive_s: float = 5.0  # a quiet list sends an empty message this often


class LiveRuns:
    """Serves live run lists over the orchestrator and the hub."""

    def __init__(
        self,
        orchestrator: orchestrator_pb2_grpc.OrchestratorServiceStub,
        hub: EventHub,
        timing: LiveListTiming,
    ) -> None:
        self._orchestrator = orchestrator
        self._hub = hub
        self._timing = timing

    async def _page(
        self, viewer: Viewer, request: gateway_pb2.StreamRunsRequest
    ) -> gateway_pb2.ListRunsResponse:
        page = await self._orchestrator.SearchRuns(
            orchestrator_pb2.SearchRunsRequest(
                **viewer.fields(),
                statuses=request.statuses,
                conversation_id=request.conversation_id,
                page_size=request.page_size,
            )
        )
        return gateway_pb2.ListRunsResponse(runs=page.runs, next_page_token=page.next_page_token)

    async def _lookup(self, viewer: Viewer, run_id: str) -> common_pb2.Run | None:
        try:
            found = await self._orchestrator.LookupRun(
                orchestrator_pb2.LookupRunRequest(**viewer.fields(), run_id=run_id)
            )
        except NotFound:
            return None  # removed (retention, its tenant deleted)
        run: common_pb2.Run = found.run
        return run

    async def items(
        self,
        viewer: Viewer,
        request: gateway_pb2.StreamRunsRequest,
        *,
        key_watch: KeyWatch | None = None,
    ) -> AsyncGenerator[gateway_pb2.StreamRunsResponse, None]:
        """The page, then every run that changed, until the gateway stops or the caller's
        credential no longer holds."""
        watch = self._hub.watch_runs(viewer)
        try:
            await self._hub.hear_every_run()
            page = await self._page(viewer, request)
            sent = {run.run_id: run for run in page.runs}
            yield gateway_pb2.StreamRunsResponse(page=page)
            loop = asyncio.get_running_loop()
            last = spoke = loop.time()
            while True:
                period = self._timing.reread_s if self._hub.watching_live() else self._timing.poll_s
                wait = min(last + period, spoke + self._timing.keepalive_s) - loop.time()
                if key_watch is not None:
                    wait = key_watch.bound(wait)  # wakes to re-verify the credential too
                woken = await watch.next(wait)
                if watch.closed:
                    raise StreamInterrupted("the gateway is stopping; reconnect for a fresh page")
                if key_watch is not None:
                    await key_watch.verify_if_due()
                if woken is None and loop.time() < last + period:
                    if loop.time() >= spoke + self._timing.keepalive_s:
                        # Quiet: an empty message keeps a proxy from cutting an idle stream.
                        spoke = loop.time()
                        yield gateway_pb2.StreamRunsResponse()
                    continue  # woken to re-verify or to keep alive, not to re-read
                # Without a complete list of what changed, every run sent may have.
                changed = set(sent) if woken is None or woken[1] else woken[0]
                pause = last + self._timing.min_interval_s - loop.time()
                if pause > 0:
                    await asyncio.sleep(pause)  # a rate limit on re-reads, not a wait for state
                last = loop.time()
                for run in await self._changes(viewer, request, sent, changed):
                    spoke = loop.time()
                    yield gateway_pb2.StreamRunsResponse(run=run)
        finally:
            self._hub.unwatch_runs(watch)

    async def _changes(
        self,
        viewer: Viewer,
        request: gateway_pb2.StreamRunsRequest,
        sent: dict[str, common_pb2.Run],
        changed: set[str],
    ) -> list[common_pb2.Run]:
        """The runs that differ from what was sent, oldest first (so a client putting each on
        top ends newest first); `sent` is updated."""
        page = await self._page(viewer, request)
        differ = [run for run in page.runs if sent.get(run.run_id) != run]
        on_page = {run.run_id for run in page.runs}
        for run_id in sorted(changed & (sent.keys() - on_page)):
            run = await self._lookup(viewer, run_id)
            if run is None:
                sent.pop(run_id, None)
            elif sent.get(run_id) != run:
                differ.append(run)
        for run in differ:
            sent[run.run_id] = run
        off_page = [run_id for run_id in sent if run_id not in on_page]
        for run_id in off_page[: max(0, len(off_page) - MAX_REMEMBERED)]:
            del sent[run_id]
        differ.reverse()
        return differ
