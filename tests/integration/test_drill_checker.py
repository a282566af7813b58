"""The soak's invariant checker can fail: on a real PostgreSQL, a clean world counts 0
everywhere, and each doctored world (a stuck run, a double effect, a lost part, ...) is counted
by exactly the invariant that names it."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import insert, select
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.drill import checker
from tests.drill.load import Call, Transcript
from tether.db.schema import (
    deliveries,
    grants,
    interactions,
    messages,
    run_events,
    run_keys,
    run_parts,
    runs,
    sessions,
    tenants,
)
from tether.testing.ledger import LedgerRecord

pytestmark = pytest.mark.asyncio(loop_scope="session")

TENANT = "t-check"


@dataclass
class World:
    """A doctored database, the ledger and what the clients saw."""

    engine: AsyncEngine
    ledger: list[LedgerRecord] = field(default_factory=list)
    seen: checker.Seen = field(default_factory=checker.Seen)
    transcripts: dict[str, Transcript] = field(default_factory=dict)

    async def run(
        self,
        status: str = "completed",
        *,
        message_id: str | None = None,
        parent: str | None = None,
        event_id: str | None = None,
        tenant: str = TENANT,
        **values: Any,
    ) -> str:
        run_id = f"run_{uuid.uuid4().hex}"
        async with self.engine.begin() as conn:
            if message_id is None:
                session_id = f"ses_{uuid.uuid4().hex}"
                message_id = f"msg_{uuid.uuid4().hex}"
                await conn.execute(
                    insert(sessions).values(
                        session_id=session_id,
                        tenant_id=tenant,
                        channel="chat",
                        conversation_id=f"c-{uuid.uuid4().hex[:6]}",
                        actor_scope="principal:p",
                    )
                )
                await conn.execute(
                    insert(messages).values(
                        message_id=message_id,
                        tenant_id=tenant,
                        session_id=session_id,
                        source="chat",
                        event_id=event_id or f"ev-{uuid.uuid4().hex}",
                        actor_type="principal",
                        actor_id="p",
                        text="hi",
                    )
                )
            else:
                session_id = (await self.row(runs, message_id=message_id))["session_id"]
            await conn.execute(
                insert(runs).values(
                    run_id=run_id,
                    tenant_id=tenant,
                    session_id=session_id,
                    message_id=message_id,
                    conversation_id="c",
                    channel="chat",
                    input_text="hi",
                    visibility="private",
                    status=status,
                    max_attempts=3,
                    parent_run_id=parent,
                    root_run_id=parent or run_id,
                    **values,
                )
            )
        return run_id

    async def row(self, table: Any, **where: Any) -> dict[str, Any]:
        async with self.engine.connect() as conn:
            stmt = table.select()
            for key, value in where.items():
                stmt = stmt.where(getattr(table.c, key) == value)
            return dict((await conn.execute(stmt)).first()._mapping)

    async def add(self, table: Any, **values: Any) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(insert(table).values(**values))

    async def answered_run(self, text: str = "the answer") -> str:
        """A completed run with one final text part and three events, watched to its end by
        a client that saw all of it."""
        run_id = await self.run("completed")
        await self.add(
            run_parts,
            run_id=run_id,
            part_index=0,
            role="assistant",
            kind="text",
            payload={"text": text},
            final=True,
        )
        for seq, kind in enumerate(("run.queued", "part.added", "run.completed"), start=1):
            await self.add(run_events, run_id=run_id, seq=seq, type=kind, payload={})
        self.transcripts[run_id] = Transcript(
            run_id,
            TENANT,
            seqs={1, 2, 3},
            parts={0: {"kind": "text", "final": True, "text": text}},
            terminal="run.completed",
        )
        return run_id

    async def approval(self, run_id: str, **values: Any) -> str:
        interaction_id = f"int_{uuid.uuid4().hex}"
        row = await self.row(runs, run_id=run_id)
        await self.add(
            interactions,
            interaction_id=interaction_id,
            tenant_id=TENANT,
            run_id=run_id,
            session_id=row["session_id"],
            kind="approval",
            tool_call_id="toolu_1",
            tool_name="publish_post",
            **{"status": "claimed", "decision": "allow-once", "input": {"text": "x"}, **values},
        )
        return interaction_id

    def post(self, run_id: str, text: str = "x", key: str | None = "k") -> None:
        self.ledger.append(
            LedgerRecord(
                id=f"led_{uuid.uuid4().hex[:8]}",
                key=None if key is None else f"{key}-{uuid.uuid4().hex}",
                body={"tool": "publish_post", "text": text, "tenant_id": TENANT, "run_id": run_id},
                received_at=datetime.now(UTC).isoformat(),
            )
        )

    async def report(self) -> dict[str, Any]:
        self.seen.transcripts = self.transcripts
        return checker.evaluate(await checker.read_state_for(self.engine), self.ledger, self.seen)


@pytest.fixture
async def world(engine: AsyncEngine) -> World:
    async with engine.begin() as conn:
        await conn.execute(insert(tenants).values(tenant_id=TENANT, name=TENANT))
    return World(engine)


def failing(report: dict[str, Any]) -> dict[str, int]:
    return {name: n for name, n in report["invariants"].items() if n}


async def test_a_clean_world_counts_zero_everywhere(world: World) -> None:
    run_id = await world.answered_run()
    await world.approval(run_id)
    world.post(run_id)
    parked = await world.run("waiting-for-approval")
    pending = await world.approval(parked, status="pending", decision=None)
    async with world.engine.begin() as conn:
        await conn.execute(
            runs.update().where(runs.c.run_id == parked).values(waiting_interaction_id=pending)
        )
    await world.run("running", lease_owner="w", lease_expires_at=datetime.now(UTC) + timedelta(60))
    cancelled = await world.run("cancelled")
    world.seen.accepted_cancels = [cancelled]
    world.seen.calls = [Call(5.0, "SendMessage", "UNAVAILABLE")]
    world.seen.outages = [(4.0, 6.0)]
    report = await world.report()
    assert failing(report) == {}
    assert report["failed_invariants"] == []
    assert report["runs"]["waiting_on_person"] == 1
    assert report["runs"]["admitted"] == 4


@pytest.mark.parametrize(
    "status,values",
    [
        ("queued", {}),
        ("running", {"lease_owner": "w", "lease_expires_at": datetime(2020, 1, 1, tzinfo=UTC)}),
        ("retry-pending", {"next_attempt_at": datetime(2020, 1, 1, tzinfo=UTC)}),
        ("waiting-for-question", {}),
    ],
    ids=["queued", "lease-expired", "retry-overdue", "waiting-on-nothing"],
)
async def test_a_run_nothing_will_move_is_stuck(
    world: World, status: str, values: dict[str, Any]
) -> None:
    await world.run(status, **values)
    assert failing(await world.report()) == {"stuck_runs": 1}


async def test_a_run_parked_on_an_interaction_already_resolved_is_stuck(world: World) -> None:
    parked = await world.run("waiting-for-approval")
    decided = await world.approval(parked, status="decided")
    async with world.engine.begin() as conn:
        await conn.execute(
            runs.update().where(runs.c.run_id == parked).values(waiting_interaction_id=decided)
        )
    report = await world.report()
    assert failing(report) == {"stuck_runs": 1}
    assert report["runs"]["waiting_on_person"] == 0


async def test_one_intent_twice_in_the_ledger_is_a_duplicate_effect(world: World) -> None:
    run_id = await world.answered_run()
    await world.approval(run_id)
    world.post(run_id, key="first")
    world.post(run_id, key="second")  # another key for the same post: it went out twice
    assert failing(await world.report()) == {"duplicate_side_effects": 1}


async def test_a_ledger_record_without_a_key_is_a_duplicate_effect_waiting_to_happen(
    world: World,
) -> None:
    run_id = await world.answered_run()
    await world.approval(run_id)
    world.post(run_id, key=None)
    assert failing(await world.report()) == {"duplicate_side_effects": 1}


@pytest.mark.parametrize(
    "doctor",
    ["final-part-never-streamed", "final-part-streamed-otherwise", "snapshot-longer-than-stored"],
)
async def test_a_persisted_part_the_client_lost_is_counted(world: World, doctor: str) -> None:
    run_id = await world.answered_run("the answer")
    transcript = world.transcripts[run_id]
    if doctor == "final-part-never-streamed":
        transcript.parts.clear()
    elif doctor == "final-part-streamed-otherwise":
        transcript.parts[0]["text"] = "another answer"
    else:
        transcript.snapshot_parts[0] = {"kind": "text", "final": False, "text": "the answer is"}
    assert failing(await world.report()) == {"lost_persisted_parts": 1}


async def test_a_part_shown_but_not_stored_is_lost(world: World) -> None:
    run_id = await world.answered_run()
    world.transcripts[run_id].parts[1] = {"kind": "text", "final": True, "text": "gone"}
    assert failing(await world.report()) == {"lost_persisted_parts": 1}


async def test_a_stored_event_the_client_never_got_is_lost(world: World) -> None:
    run_id = await world.answered_run()
    world.transcripts[run_id].seqs.discard(2)
    assert failing(await world.report()) == {"lost_persisted_events": 1}


async def test_two_live_runs_for_one_inbound_event_are_counted_and_a_lineage_is_not(
    world: World,
) -> None:
    first = await world.run("failed", error={"code": "x"})
    message_id = (await world.row(runs, run_id=first))["message_id"]
    await world.run("completed", message_id=message_id, parent=first)  # a redelivery: fine
    assert failing(await world.report()) == {}
    await world.run("completed", message_id=message_id)  # a second run with no lineage
    assert failing(await world.report()) == {"runs_per_inbound_event_above_one": 1}


async def test_a_duplicate_delivery_answered_with_an_unrelated_run_is_counted(
    world: World,
) -> None:
    first = await world.run("failed", error={"code": "x"})
    message_id = (await world.row(runs, run_id=first))["message_id"]
    retried = await world.run("completed", message_id=message_id, parent=first)
    world.seen.deliveries = {"ev-1": {first, retried}}  # one lineage: fine
    assert failing(await world.report()) == {}
    world.seen.deliveries = {"ev-1": {retried, "run_unrelated"}}
    assert failing(await world.report()) == {"runs_per_inbound_event_above_one": 1}


async def test_one_event_admitted_as_two_messages_is_counted(world: World) -> None:
    await world.run("completed", event_id="ev-same")
    await world.run("completed", event_id="ev-same")
    assert failing(await world.report()) == {"runs_per_inbound_event_above_one": 1}


@pytest.mark.parametrize(
    "approval",
    [None, {"decision": "deny"}, {"input": {"text": "something else"}}, {"status": "decided"}],
    ids=["no-approval", "denied", "other-input", "never-claimed"],
)
async def test_a_gated_effect_without_a_claimed_allowing_approval_is_counted(
    world: World, approval: dict[str, Any] | None
) -> None:
    run_id = await world.answered_run()
    if approval is not None:
        await world.approval(run_id, **approval)
    world.post(run_id)
    assert failing(await world.report()) == {"executions_without_claim_or_grant": 1}


async def test_a_standing_grant_authorises_an_effect_and_one_of_another_tenant_does_not(
    world: World,
) -> None:
    run_id = await world.answered_run()
    world.post(run_id)
    await world.add(tenants, tenant_id="other", name="other")
    for tenant in ("other", TENANT):
        await world.add(
            grants,
            grant_id=f"grt_{uuid.uuid4().hex}",
            tenant_id=tenant,
            scope="tenant",
            tool_name="publish_post",
            granted_by="admin",
        )
        expected = {} if tenant == TENANT else {"executions_without_claim_or_grant": 1}
        assert failing(await world.report()) == expected


async def test_an_accepted_cancel_that_did_not_end_cancelled_is_counted(world: World) -> None:
    run_id = await world.answered_run()
    world.seen.accepted_cancels = [run_id]
    assert failing(await world.report()) == {"accepted_cancels_not_cancelled": 1}


async def test_internal_and_unknown_answers_are_counted_inside_and_outside_outages(
    world: World,
) -> None:
    world.seen.outages = [(10.0, 20.0)]
    world.seen.calls = [
        Call(12.0, "SendMessage", "INTERNAL"),
        Call(15.0, "StreamRun", "UNKNOWN"),
        Call(15.0, "StreamRun", "UNAVAILABLE"),
        Call(30.0, "CancelRun", "INTERNAL"),
    ]
    assert failing(await world.report()) == {
        "internal_or_unknown_during_outage": 2,
        "internal_or_unknown_outside_outage": 1,
    }


async def test_what_the_clients_saw_fail_is_counted(world: World) -> None:
    world.seen.conflicts_accepted = ["ev-1"]
    world.seen.decisions_accepted_twice = ["run_1"]
    assert failing(await world.report()) == {
        "conflicting_deliveries_accepted": 1,
        "decisions_accepted_twice": 1,
    }


async def _delivered(world: World, run_id: str, state: str) -> None:
    await world.add(
        deliveries,
        tenant_id=TENANT,
        delivery_id=f"dl_{uuid.uuid4().hex}",
        run_id=run_id,
        channel_id="ch_1",
        kind="slack",
        state=state,
        text="the answer",
    )


async def test_a_channel_event_answered_once_with_an_outcome_counts_zero(world: World) -> None:
    run_id = await world.answered_run()
    await _delivered(world, run_id, "sent")
    world.seen.channel_runs = {"Ev1": {run_id}}
    world.seen.channel_replies = {"Ev1": 1}
    assert failing(await world.report()) == {}


async def test_channel_events_answered_twice_or_left_without_an_outcome_are_counted(
    world: World,
) -> None:
    twice_id = await world.answered_run()
    pending_id = await world.answered_run()
    unrecorded_id = await world.answered_run()
    await _delivered(world, twice_id, "sent")
    await _delivered(world, pending_id, "pending")
    world.seen.channel_runs = {
        "Ev1": {twice_id},
        "Ev2": {pending_id},
        "Ev3": {unrecorded_id},
        "Ev4": {pending_id, unrecorded_id},
    }
    world.seen.channel_replies = {"Ev1": 2, "Ev2": 1}
    assert failing(await world.report()) == {
        "channel_events_answered_twice": 1,
        "channel_deliveries_without_outcome": 4,
        "channel_runs_per_event_above_one": 1,
    }


FLOOD = "t-flood"


async def _flood(world: World, start: datetime, runs_count: int) -> None:
    """The flooding tenant's runs: all admitted at `start`, leased one a second from 50 s on."""
    await world.add(tenants, tenant_id=FLOOD, name=FLOOD)
    for i in range(runs_count):
        await world.run(
            tenant=FLOOD,
            created_at=start,
            started_at=start + timedelta(seconds=50 + i),
            finished_at=start + timedelta(seconds=51 + i),
        )
    world.seen.flood_tenant = FLOOD


async def test_a_quiet_tenants_run_the_flood_was_leased_past_is_counted(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(checker, "FLOOD_BACKLOG", 3)
    monkeypatch.setattr(checker, "QUIET_WAIT_BOUND", 2)
    t0 = datetime.now(UTC) - timedelta(seconds=200)

    def at(seconds: float) -> datetime:
        return t0 + timedelta(seconds=seconds)

    await _flood(world, t0, 10)  # leased at 50, 51, ..., 59 s
    for quiet in ("q1", "q2", "q3", "q4", "q5", "q6"):
        await world.add(tenants, tenant_id=quiet, name=quiet)
    # Quiet tenants' runs queued while the flood had 10 queued: one flood lease before one,
    # four before the other.
    await world.run(tenant="q1", created_at=at(10), started_at=at(50.5), finished_at=at(60))
    late = await world.run(tenant="q2", created_at=at(10), started_at=at(53.5), finished_at=at(60))
    # Leased in the same claim as a flood run (52 s): that one is not ahead of it.
    await world.run(tenant="q3", created_at=at(20), started_at=at(52), finished_at=at(60))
    # Queued once the flood was all leased: nothing to wait behind, not measured.
    await world.run(tenant="q4", created_at=at(60), started_at=at(80), finished_at=at(81))
    # Queued behind its session's earlier run (here its retry): its wait starts when that run
    # ended (54.2 s: one flood lease after, five queued), not at its admission (six leases).
    first = await world.run(tenant="q5", created_at=at(5), started_at=at(5.2), finished_at=at(54.2))
    await world.run(
        tenant="q5",
        message_id=(await world.row(runs, run_id=first))["message_id"],
        parent=first,
        created_at=at(6),
        started_at=at(55.5),
        finished_at=at(56),
    )
    # Queued behind its own tenant's earlier run, still waiting: not a quiet tenant's run, so
    # not measured (eight flood leases in its wait).
    await world.run(tenant="q6", created_at=at(10), started_at=at(50.5), finished_at=at(60))
    await world.run(tenant="q6", created_at=at(11), started_at=at(58.6), finished_at=at(60))
    report = await world.report()
    assert failing(report) == {"quiet_runs_waiting_past_bound": 1}
    assert report["examples"]["quiet_runs_waiting_past_bound"][0].startswith(late)
    assert report["flood"]["quiet_runs_measured"] == 6


async def test_a_flood_no_quiet_run_waited_behind_is_counted(world: World) -> None:
    await _flood(world, datetime.now(UTC) - timedelta(seconds=200), 3)
    await world.run()  # admitted now, the flood long leased: nothing to measure
    assert failing(await world.report()) == {"flood_without_quiet_runs_measured": 1}


async def test_a_tree_whose_root_ended_with_a_child_active_is_counted(world: World) -> None:
    root = await world.run("cancelled")
    await world.run("completed", tree_parent_run_id=root, tree_root_run_id=root, tree_depth=1)
    assert failing(await world.report()) == {}
    child = await world.run("waiting-for-children", tree_parent_run_id=root, tree_root_run_id=root)
    await world.run(
        "running",
        tree_parent_run_id=child,
        tree_root_run_id=root,
        tree_depth=2,
        lease_owner="w",
        lease_expires_at=datetime.now(UTC) + timedelta(hours=1),
    )
    assert failing(await world.report()) == {"children_active_after_root_ended": 2}


async def test_a_parent_waiting_for_children_that_all_ended_is_stuck(world: World) -> None:
    parent = await world.run("waiting-for-children")
    await world.run("completed", tree_parent_run_id=parent, tree_root_run_id=parent)
    assert failing(await world.report()) == {"stuck_runs": 1}


async def test_a_timer_fired_twice_or_left_unfired_past_its_due_time_is_counted(
    world: World,
) -> None:
    waiting = await world.run("waiting-for-timer", next_wake_at=datetime.now(UTC) + timedelta(1))
    assert failing(await world.report()) == {}, "a timer not yet due is neither stuck nor lost"
    await world.run("waiting-for-timer", next_wake_at=datetime.now(UTC) - timedelta(minutes=5))
    twice = await world.run("completed")
    for seq, kind in enumerate(("timer.set", "timer.fired", "timer.fired"), start=1):
        await world.add(run_events, run_id=twice, seq=seq, type=kind, payload={})
    for seq, kind in enumerate(("timer.set", "timer.fired"), start=1):
        await world.add(run_events, run_id=waiting, seq=seq, type=kind, payload={})
    assert failing(await world.report()) == {"timers_fired_twice": 1, "timers_lost": 1}


async def test_a_run_without_its_keys_and_keys_without_their_run_are_counted(world: World) -> None:
    kept = await world.run()
    unkeyed = await world.run()
    async with world.engine.begin() as conn:
        await conn.execute(run_keys.delete().where(run_keys.c.run_id == unkeyed))
        # Keys of a run that is not there, naming a session and a message that are (its keys
        # refer to them).
        named = (await conn.execute(select(runs.c.session_id, runs.c.message_id))).first()
        assert named is not None
        await conn.execute(
            insert(run_keys).values(
                tenant_id=TENANT,
                created_at=datetime.now(UTC),
                run_id="run_gone",
                session_id=named.session_id,
                message_id=named.message_id,
            )
        )
    report = await world.report()
    assert failing(report) == {"run_keys_out_of_step": 2}
    assert sorted(report["examples"]["run_keys_out_of_step"]) == sorted([unkeyed, "run_gone"])
    assert kept not in report["examples"]["run_keys_out_of_step"]
