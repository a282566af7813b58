"""The worker's side of a delegation, against a replica spoken by the test over real gRPC (the
worker is real: pool, attempt, stream, the SDK against the local model server): the turn that
makes the run's last delegate call goes with the call, which parks the run (no checkpoint and
no park of its own), the slot the parked call gave back is not granted again, and a lease that
says how each child ended has its calls answered from it (no StartChild)."""

from __future__ import annotations

import pytest

from tests.integration.work_replica import Replica, lease, worker
from tether.convert import part_to_proto, status_to_proto
from tether.domain import Part, Role, ToolCall
from tether.testing.model_server import ModelServer, TextTurn, ToolUseTurn
from tether.v1 import orchestrator_pb2

pytestmark = pytest.mark.asyncio(loop_scope="session")

CALL = {"agent": "researcher", "message": "find the opening hours"}


def _delegating(run_id: str, prompt: str, epoch: int = 1) -> orchestrator_pb2.WorkResponse:
    pushed = lease(run_id, prompt, epoch)
    pushed.lease.config.agent = "lead"
    pushed.lease.config.delegation.agents.append("researcher")
    pushed.lease.config.delegation.max_depth = 3
    pushed.lease.config.delegation.max_children = 8
    return pushed


async def test_a_delegating_turn_parks_with_its_child_and_the_resume_answers_from_its_lease(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("ANTHROPIC_CUSTOM_HEADERS", raising=False)
    replica = Replica(takes_batches=True, outcome_returns_credit=True)
    async with ModelServer() as model, worker(replica, model, concurrency=1, worker_id="w-d"):
        model.script("ask around", [ToolUseTurn("delegate", CALL, tool_id="toolu_d1")])
        model.script("ask around", [TextTurn("open nine to five")])
        assert (await replica.next("credits")).credits.credits == 1
        replica.outbox.put_nowait(_delegating("run_p", "ask around"))

        # One write for the call: the turn that made it rides along, and it parks the run.
        sent = await replica.next()
        assert sent.WhichOneof("kind") == "start_child", f"a write before the call: {sent}"
        start = sent.start_child
        assert (start.tool_call_id, start.agent, start.new_call) == ("toolu_d1", "researcher", True)
        assert list(start.park_tool_call_ids) == ["toolu_d1"]
        carried = [p.part.WhichOneof("kind") for p in start.checkpoint.parts]
        assert "tool_call" in carried, f"the call's own part is not carried: {carried}"
        replica.outbox.put_nowait(
            orchestrator_pb2.WorkResponse(
                ack=orchestrator_pb2.WorkAck(
                    id=sent.id,
                    start_child=orchestrator_pb2.StartChildResponse(
                        child_run_id="run_c",
                        status=status_to_proto("queued"),
                        created=True,
                        parked=True,
                    ),
                )
            )
        )

        # Resumed: its lease carries the call and how the child ended.
        resumed = _delegating("run_p", "ask around", epoch=2)
        call = Part(0, Role.ASSISTANT, ToolCall("toolu_d1", "delegate", CALL), final=True)
        resumed.lease.history.append(part_to_proto(call))
        resumed.lease.context.ended_children.append(
            orchestrator_pb2.EndedChild(
                tool_call_id="toolu_d1",
                child_run_id="run_c",
                status=status_to_proto("completed"),
                result_text="nine to five, Mondays to Fridays",
            )
        )
        replica.outbox.put_nowait(resumed)
        # The parked call gave the slot back (the replica counted it): no credit comes before
        # the resumed attempt's completion, and no StartChild for the call it answers.
        ended = await replica.next()
        assert ended.WhichOneof("kind") == "complete", f"not the completion first: {ended}"
        assert ended.complete.result_text == "open nine to five"
        replica.ack(ended)
        answered = model.requests[-1].body["messages"]
        results = [b for m in answered for b in m["content"] if b.get("type") == "tool_result"]
        assert [(b["tool_use_id"], b["content"]) for b in results] == [
            ("toolu_d1", "nine to five, Mondays to Fridays")
        ]
