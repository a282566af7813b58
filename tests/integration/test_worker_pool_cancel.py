"""A cancel pushed to a worker whose attempt has already sent its completion does not replace
that completion with a second, empty ending: the completion lands, and the orchestrator (which
took the cancel first) ends the run cancelled with the completion's parts kept. Before, the pool
cancelled the attempt's task under its unanswered completion and reported a cancelled ending
without them, and whichever of the two the orchestrator wrote first won: the answer was lost.

The worker is real (pool, attempt, stream, the SDK against the local model server); the replica
is this test, speaking the Work protocol over real gRPC, so the order of what the worker hears
is the test's to choose."""

from __future__ import annotations

import asyncio

import pytest

from tests.integration.work_replica import Replica, lease, worker
from tether.testing.model_server import ModelServer, TextTurn
from tether.v1 import common_pb2, orchestrator_pb2

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPT = "answer, then be cancelled"
RUN_ID, EPOCH = "run_pushed_cancel", 1


async def test_a_cancel_pushed_after_the_completion_was_sent_leaves_the_completion_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("ANTHROPIC_CUSTOM_HEADERS", raising=False)
    replica = Replica()
    async with (
        ModelServer() as model,
        worker(replica, model, concurrency=1, worker_id="w-pushed-cancel"),
    ):
        model.script(PROMPT, [TextTurn("Here it is.")])
        assert (await replica.next("credits")).credits.credits == 1
        replica.outbox.put_nowait(lease(RUN_ID, PROMPT, EPOCH))
        sent = await replica.next("complete")
        assert sent.complete.status == common_pb2.RUN_STATUS_COMPLETED
        assert sent.complete.result_text == "Here it is."

        # The caller's cancel reaches the worker before the completion's answer does.
        cancel = orchestrator_pb2.WorkCancel(run_id=RUN_ID, epoch=EPOCH)
        replica.outbox.put_nowait(orchestrator_pb2.WorkResponse(cancel=cancel))
        replica.ack(sent)

        # The slot comes back once the attempt is over: anything it sent meanwhile came first.
        after = await asyncio.wait_for(replica.requests.get(), 20)
        assert after.WhichOneof("kind") == "credits", f"a second ending was sent: {after}"
