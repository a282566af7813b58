"""One worker's Work stream as this replica keeps it (`Session`): what the worker may still be
given (its credits), what it holds (its leases, and its sessions' histories as the lease
mirror counts them) and what goes out to it, queued and sent in batches (see
`services.orchestrator.work`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from services.orchestrator.lease_histories import stream_histories
from tether.convert.catalog import announcements_from_proto
from tether.v1 import orchestrator_pb2

# Queued after the last message of a stream that ends.
_ENDED = orchestrator_pb2.WorkResponse()


class Session:
    """One worker's stream: what it may still be given, what it holds, what goes out."""

    def __init__(self, hello: orchestrator_pb2.WorkHello) -> None:
        self.worker_id = hello.worker_id
        self.tools = announcements_from_proto(hello.tools)
        self.takes_batches = hello.takes_batches
        self.outcome_returns_credit = hello.outcome_returns_credit
        self.closed = False
        self.leaving = False  # said goodbye: takes no more leases
        self.credits = 0
        # run id -> lease epoch, as last pushed or announced
        self.held: dict[str, int] = {lease.run_id: lease.epoch for lease in hello.held}
        # What the worker holds of its sessions' histories (None: it keeps none).
        self.histories = stream_histories(hello)
        self.heard_at = time.monotonic()  # the last message from the worker
        self.probed_at: float | None = None  # asked whether it is there, and not answered yet
        self.outbox: asyncio.Queue[orchestrator_pb2.WorkResponse] = asyncio.Queue()
        self.writes: set[asyncio.Task[None]] = set()

    def send(self, response: orchestrator_pb2.WorkResponse) -> None:
        """Queue a message for the worker (never waits: the stream drains the queue)."""
        self.outbox.put_nowait(response)

    def end(self) -> None:
        """Nothing more comes in: the stream sends what is queued and ends."""
        self.outbox.put_nowait(_ENDED)

    async def outgoing(self) -> AsyncIterator[orchestrator_pb2.WorkResponse]:
        """What to write, as it is queued, until `end`: everything queued by the time the
        stream can write goes together (one batch, for a worker that takes them)."""
        while True:
            queued = [await self.outbox.get()]
            while not self.outbox.empty():
                queued.append(self.outbox.get_nowait())
            ends = [i for i, message in enumerate(queued) if message is _ENDED]
            ended = bool(ends)
            if ended:
                queued = queued[: ends[0]]
            if len(queued) > 1 and self.takes_batches:
                responses = orchestrator_pb2.WorkResponses(responses=queued)
                yield orchestrator_pb2.WorkResponse(batch=responses)
            else:
                for response in queued:
                    yield response
            if ended:
                return
