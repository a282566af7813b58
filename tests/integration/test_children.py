"""Run trees' statements against the real PostgreSQL: one child per delegate call however many
attempts issue it at once, the refusals that create nothing, a parent woken once when its
children have all ended (and not before), budgets reserved out of what a parent has left, and
the children of a parent that ended cancelled."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace
from datetime import timedelta

import pytest
from sqlalchemy import func, insert, select, text, update
from sqlalchemy.ext.asyncio import AsyncEngine

from services.admission.domain import FreshnessPolicy
from services.admission.service import Admitter
from services.orchestrator import budgets
from services.orchestrator.agents import Agents
from services.orchestrator.children import SCAN_EVERY_S, Children
from services.orchestrator.execution import Execution
from services.orchestrator.publisher import Publisher
from tests.integration.test_admission import _tenant, chat
from tests.integration.test_transitions import _claim
from tether.db.engine import create_engine
from tether.db.schema import (
    attempts,
    routings,
    run_event_log,
    run_events,
    run_parts,
    runs,
    usage_turns,
)
from tether.domain import (
    AgentConfig,
    Batch,
    Delegation,
    EndedChild,
    Limits,
    Part,
    Role,
    Run,
    RunError,
    Text,
    ToolCall,
    child_completed,
    part_added,
    run_queued,
)
from tether.errors import FailedPrecondition, InvalidArgument, StaleLease

pytestmark = pytest.mark.asyncio(loop_scope="session")

ACTOR = {"key_id": "key-1", "principal_id": "alice"}
# The parent's document allows `stranger` too, an agent the tenant does not have.
ALLOWED = Delegation(("researcher", "stranger"))


async def _parent(engine: AsyncEngine, event_id: str, delegation: Delegation = ALLOWED) -> str:
    """A leased run (epoch 1) of tenant t1, whose agents include `researcher`, pinned to a
    routing whose agent may delegate as `delegation` says."""
    await _tenant(engine, "t1")
    await Agents(engine).apply("t1", json.dumps({"name": "researcher"}), ACTOR)
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
    run_id = (await admitter.admit(chat(event_id, conversation=event_id))).run.run_id
    await _claim(engine, run_id, "w-1", 30)
    config = AgentConfig(model="m", agent="lead", delegation=delegation)
    async with engine.begin() as conn:
        await conn.execute(
            insert(routings).values(routing_id=f"rt-{event_id}", config=config.to_json())
        )
        await conn.execute(
            update(runs).where(runs.c.run_id == run_id).values(routing_id=f"rt-{event_id}")
        )
    return str(run_id)


def _children(engine: AsyncEngine) -> Children:
    return Children(engine, Publisher(None))


async def _start(children: Children, parent: str, call: str, **more: object) -> object:
    args: dict[str, object] = {
        "tool_call_id": call,
        "agent": "researcher",
        "message": f"task of {call}",
        "max_depth": 3,
        "max_children": 8,
        **more,
    }
    return await children.start(parent, 1, **args)  # type: ignore[arg-type]


async def _count(engine: AsyncEngine, parent: str) -> int:
    async with engine.connect() as conn:
        found = await conn.scalar(
            select(func.count()).select_from(runs).where(runs.c.tree_parent_run_id == parent)
        )
    return int(found or 0)


async def _types(engine: AsyncEngine, run_id: str) -> list[str]:
    async with engine.connect() as conn:
        rows = await conn.execute(
            select(run_event_log.c.type).where(run_event_log.c.run_id == run_id).order_by("seq")
        )
        return [r.type for r in rows]


async def _end(engine: AsyncEngine, run_id: str, status: str) -> None:
    async with engine.begin() as conn:
        await conn.execute(
            update(runs).where(runs.c.run_id == run_id).values(status=status, session_head=False)
        )


async def test_attempts_issuing_one_call_at_once_start_one_child(
    engine: AsyncEngine, db_url: str
) -> None:
    parent = await _parent(engine, "e-one-child")
    engines = [create_engine(db_url, pool_size=2) for _ in range(4)]
    try:
        # Whether the worker says the call is new is only a hint: under the lock the call's
        # child is looked for all the same.
        started = await asyncio.gather(
            *(
                _start(_children(e), parent, "toolu_1", new_call=i % 2 == 0)
                for i, e in enumerate(engines)
            )
        )
    finally:
        for e in engines:
            await e.dispose()
    assert len({s.run.run_id for s in started}) == 1  # type: ignore[attr-defined]
    assert sorted(s.created for s in started) == [False, False, False, True]  # type: ignore[attr-defined]
    assert await _count(engine, parent) == 1
    assert (await _types(engine, parent)).count("child.started") == 1
    child = started[0].run  # type: ignore[attr-defined]
    assert (child.status, child.tree_depth, child.tree_root_run_id) == ("queued", 1, parent)
    assert child.channel == "delegate/researcher" and child.session_head
    # Its run.queued, read from its row (0048): why it was queued, by its lineage.
    async with engine.connect() as conn:
        first = (
            await conn.execute(
                select(run_event_log.c.seq, run_event_log.c.payload).where(
                    run_event_log.c.run_id == child.run_id
                )
            )
        ).all()
    assert [tuple(row) for row in first] == [(1, dict(run_queued(1, "delegated").payload))]


async def test_a_refused_delegation_creates_nothing(engine: AsyncEngine) -> None:
    parent = await _parent(engine, "e-refused")
    children = _children(engine)
    with pytest.raises(InvalidArgument, match="no agent 'stranger'"):
        await _start(children, parent, "toolu_1", agent="stranger")
    with pytest.raises(InvalidArgument, match="at most 0 deep"):
        await _start(children, parent, "toolu_2", max_depth=0)
    started = await _start(children, parent, "toolu_3", max_children=1)
    with pytest.raises(InvalidArgument, match="started its 1 children"):
        await _start(children, parent, "toolu_4", max_children=1)
    again = await _start(children, parent, "toolu_3", max_children=1)
    assert (again.run.run_id, again.created) == (started.run.run_id, False)  # type: ignore[attr-defined]
    # Another lease's attempt gets no child, a new call's nor the one started before.
    for call in ("toolu_5", "toolu_3"):
        with pytest.raises(StaleLease):
            await children.start(
                parent,
                7,
                tool_call_id=call,
                agent="researcher",
                message="m",
                max_depth=3,
                max_children=8,
            )
    assert await _count(engine, parent) == 1
    async with engine.begin() as conn:
        await conn.execute(
            update(runs).where(runs.c.run_id == parent).values(cancel_requested_at=func.now())
        )
    for call in ("toolu_6", "toolu_3"):
        with pytest.raises(FailedPrecondition, match="being cancelled"):
            await _start(children, parent, call)
    assert await _count(engine, parent) == 1


async def test_the_parents_document_bounds_a_delegation_whatever_the_worker_asks(
    engine: AsyncEngine,
) -> None:
    """The agents, the depth and the fan-out a parent may delegate with are its pinned
    routing's, not the worker's request's: a worker may ask for less, never for more."""
    parent = await _parent(engine, "e-bounded", Delegation(("researcher",), max_children=1))
    await Agents(engine).apply("t1", json.dumps({"name": "outsider"}), ACTOR)
    children = _children(engine)
    with pytest.raises(InvalidArgument, match="may not delegate to 'outsider'"):
        await _start(children, parent, "toolu_1", agent="outsider")
    await _start(children, parent, "toolu_2", max_children=8)
    with pytest.raises(InvalidArgument, match="started its 1 children"):
        await _start(children, parent, "toolu_3", max_children=8)
    assert await _count(engine, parent) == 1
    unpinned = await _parent(engine, "e-unpinned", Delegation())
    with pytest.raises(InvalidArgument, match="may not delegate to 'researcher'"):
        await _start(children, unpinned, "toolu_1")
    assert await _count(engine, unpinned) == 0


async def test_wakers_racing_resume_a_parent_once_and_only_when_every_child_ended(
    engine: AsyncEngine, db_url: str
) -> None:
    parent = await _parent(engine, "e-wake")
    children = _children(engine)
    first = (await _start(children, parent, "toolu_a")).run.run_id  # type: ignore[attr-defined]
    second = (await _start(children, parent, "toolu_b")).run.run_id  # type: ignore[attr-defined]
    assert await children.park(parent, 1, ["toolu_a", "toolu_b"])
    assert children.nudge.is_set()
    await _end(engine, first, "completed")
    assert await children.resume_done() == 0, "one child is still active"
    await _end(engine, second, "failed")
    engines = [create_engine(db_url, pool_size=2) for _ in range(4)]
    try:
        woken = await asyncio.gather(*(_children(e).resume_done() for e in engines))
    finally:
        for e in engines:
            await e.dispose()
    assert sorted(woken) == [0, 0, 0, 1]
    types = await _types(engine, parent)
    assert types[-4:] == ["children.waiting", "child.completed", "child.completed", "run.queued"]
    async with engine.connect() as conn:
        row = (await conn.execute(select(runs).where(runs.c.run_id == parent))).one()
        logged = await conn.execute(
            select(run_event_log.c.seq, run_event_log.c.payload)
            .where(run_event_log.c.run_id == parent)
            .order_by(run_event_log.c.seq.desc())
            .limit(3)
        )
        tail = sorted(logged, key=lambda r: r.seq)
    assert (row.status, row.lease_owner) == ("queued", None)
    # The statement writes the events the domain's own constructors make, seqs in a row.
    assert [r.payload for r in tail] == [
        child_completed("toolu_a", first, "completed").payload,
        child_completed("toolu_b", second, "failed").payload,
        run_queued(0, "children").payload,
    ]
    assert [r.seq for r in tail] == list(range(row.last_seq - 2, row.last_seq + 1))


async def test_the_turns_last_delegate_call_parks_its_parent_with_its_child(
    engine: AsyncEngine,
) -> None:
    """`park` on the turn's last call parks the parent in the child's own transaction, on the
    calls whose children it still waits for: as ParkRun would (lease cleared,
    children.waiting), with no park of the worker's own; a refused call parks nothing."""
    children = _children(engine)
    refused = await _parent(engine, "e-park-refused")
    with pytest.raises(InvalidArgument, match="no agent 'stranger'"):
        await _start(children, refused, "toolu_1", agent="stranger", park=["toolu_1"])
    async with engine.connect() as conn:
        status = await conn.scalar(select(runs.c.status).where(runs.c.run_id == refused))
    assert status == "running" and "children.waiting" not in await _types(engine, refused)

    parent = await _parent(engine, "e-park")
    first = await _start(children, parent, "toolu_a")
    assert not first.parked  # type: ignore[attr-defined]
    children.nudge.clear()
    last = await _start(children, parent, "toolu_b", park=["toolu_a", "toolu_b"])
    assert (last.created, last.parked) == (True, True)  # type: ignore[attr-defined]
    assert children.nudge.is_set()
    async with engine.connect() as conn:
        row = (await conn.execute(select(runs).where(runs.c.run_id == parent))).one()
        waiting = await conn.scalar(
            select(run_event_log.c.payload).where(
                run_event_log.c.run_id == parent, run_event_log.c.type == "children.waiting"
            )
        )
    assert (row.status, row.lease_owner, row.lease_expires_at) == (
        "waiting-for-children",
        None,
        None,
    )
    assert waiting["toolCallIds"] == ["toolu_a", "toolu_b"]
    types = await _types(engine, parent)
    assert types[-3:] == ["child.started", "child.started", "children.waiting"]
    # The lease is over: the call issued again under it (a worker that missed the answer) is
    # refused, and nothing is made or parked twice.
    with pytest.raises(StaleLease):
        await _start(children, parent, "toolu_b", park=["toolu_b"])
    assert await _count(engine, parent) == 2


async def test_a_last_call_whose_child_ended_parks_only_on_the_others(engine: AsyncEngine) -> None:
    """A resumed attempt's last call finds its child ended: the parent parks on the turn's
    other calls still waiting, and not at all when there are none."""
    children = _children(engine)
    parent = await _parent(engine, "e-park-ended")
    done = (await _start(children, parent, "toolu_a")).run.run_id  # type: ignore[attr-defined]
    await _end(engine, done, "completed")
    again = await _start(children, parent, "toolu_a", park=["toolu_a"])
    assert (again.created, again.parked, again.run.status) == (False, False, "completed")  # type: ignore[attr-defined]
    await _start(children, parent, "toolu_b")
    parked = await _start(children, parent, "toolu_a", park=["toolu_b", "toolu_a"])
    assert (parked.created, parked.parked) == (False, True)  # type: ignore[attr-defined]
    async with engine.connect() as conn:
        waiting = await conn.scalar(
            select(run_event_log.c.payload).where(
                run_event_log.c.run_id == parent, run_event_log.c.type == "children.waiting"
            )
        )
    assert waiting["toolCallIds"] == ["toolu_b"]


def _turn(number: int, index: int, content: ToolCall | Text) -> Batch:
    """A checkpoint of one final part, announced."""
    part = Part(index, Role.ASSISTANT, content, final=True)
    return Batch(number, [part], [part_added(part)])


async def _parts(engine: AsyncEngine, run_id: str) -> list[int]:
    async with engine.connect() as conn:
        rows = await conn.execute(
            select(run_parts.c.part_index)
            .where(run_parts.c.run_id == run_id)
            .order_by("part_index")
        )
        return [r.part_index for r in rows]


async def test_a_delegate_call_carries_its_turn_into_the_childs_own_transaction(
    engine: AsyncEngine,
) -> None:
    """The progress a delegate call carries (the turn that made the call) is written under
    the parent's lock ahead of the child, in one transaction: its part, then child.started and
    the park. A call refused, or one a cancel came before, writes it all the same (the attempt
    goes on), and no child."""
    children = Execution.build(engine, None, lease_ttl_s=30, claim_poll_s=60).children
    parent = await _parent(engine, "e-carried")
    call = ToolCall("toolu_1", "delegate", {"agent": "researcher", "message": "m"})
    started = await _start(
        children, parent, "toolu_1", park=["toolu_1"], new_call=True, checkpoint=_turn(1, 0, call)
    )
    assert (started.created, started.parked) == (True, True)  # type: ignore[attr-defined]
    assert await _parts(engine, parent) == [0]
    assert (await _types(engine, parent))[-3:] == [
        "part.added",
        "child.started",
        "children.waiting",
    ]
    async with engine.connect() as conn:
        xmins = await conn.execute(  # the log's own rows: which transaction wrote each
            select(text("xmin::text"))
            .select_from(run_events)
            .where(run_events.c.run_id == parent)
            .order_by(run_events.c.seq.desc())
            .limit(3)
        )
        assert len({r[0] for r in xmins}) == 1, "one transaction wrote all three"

    refused = await _parent(engine, "e-carried-refused")
    with pytest.raises(InvalidArgument, match="no agent 'stranger'"):
        await _start(
            children,
            refused,
            "toolu_1",
            agent="stranger",
            new_call=True,
            checkpoint=_turn(1, 0, Text("let me ask")),
        )
    assert await _parts(engine, refused) == [0] and await _count(engine, refused) == 0
    async with engine.begin() as conn:
        await conn.execute(
            update(runs).where(runs.c.run_id == refused).values(cancel_requested_at=func.now())
        )
    with pytest.raises(FailedPrecondition, match="being cancelled"):
        await _start(children, refused, "toolu_2", new_call=True, checkpoint=_turn(2, 1, Text("x")))
    assert await _parts(engine, refused) == [0, 1] and await _count(engine, refused) == 0
    # Under a stale lease nothing is written.
    with pytest.raises(StaleLease):
        await children.start(
            refused,
            7,
            tool_call_id="toolu_3",
            agent="researcher",
            message="m",
            max_depth=3,
            max_children=8,
            checkpoint=_turn(3, 2, Text("y")),
        )
    assert await _parts(engine, refused) == [0, 1]


async def test_a_parent_queued_again_is_leased_with_how_each_child_ended(
    engine: AsyncEngine,
) -> None:
    """The lease of a parent its children's ends queued again says how each ended (answer, or
    error), read in the account the lease makes anyway: its worker answers the delegate calls
    it issues again from there, with no StartChild each."""
    execution = Execution.build(engine, None, lease_ttl_s=30, claim_poll_s=60)
    children = execution.children
    parent = await _parent(engine, "e-ended-lease")
    answered = (await _start(children, parent, "toolu_a", new_call=True)).run.run_id  # type: ignore[attr-defined]
    last = await _start(children, parent, "toolu_b", park=["toolu_a", "toolu_b"], new_call=True)
    gone = last.run.run_id  # type: ignore[attr-defined]
    why = RunError("max_steps_exceeded", "the run used its 4 model turns")
    async with engine.begin() as conn:
        for child, values in (
            (answered, {"status": "completed", "result_text": "the answer"}),
            (gone, {"status": "failed", "error": why.to_row()}),
        ):
            await conn.execute(
                update(runs)
                .where(runs.c.run_id == child)
                .values(**values, session_head=False, finished_at=func.now())
            )
    assert await children.resume_done(among=[parent]) == 1
    (claimed,) = await execution.claims.claim_many("w-2", 1)
    assert claimed.run.run_id == parent
    assert sorted(claimed.ended_children, key=lambda c: c.tool_call_id) == [
        EndedChild("toolu_a", answered, "completed", "the answer"),
        EndedChild("toolu_b", gone, "failed", "", why),
    ]


async def test_a_childs_end_here_resumes_its_parent_by_a_look_at_it_alone(
    engine: AsyncEngine,
) -> None:
    """A child's end (or a park) on this replica names its parent: the waker looks at that
    parent by id, and at every waiting parent (for children that ended on another replica)
    once per SCAN_EVERY_S, not for each child's end."""
    now = [100.0]
    publisher = Publisher(None)
    children = Children(engine, publisher, clock=lambda: now[0])
    here, elsewhere = await _parent(engine, "e-named"), await _parent(engine, "e-unnamed")
    ended = []
    for parent in (here, elsewhere):
        ended.append((await _start(children, parent, "toolu_1", park=["toolu_1"])).run.run_id)  # type: ignore[attr-defined]
    # Parked with the child just made, which cannot have ended yet: nothing to look at.
    assert publisher.parents_to_look == set()
    publisher.look_at_parent(here)
    await children.round()  # named, and the first look at all: every child is still active
    assert publisher.parents_to_look == set()
    for child in ended:
        await _end(engine, child, "completed")
    publisher.look_at_parent(here)  # as its child's end here does (Publisher.wake_next)
    now[0] += SCAN_EVERY_S / 2
    await children.round()

    async def statuses() -> list[str]:
        async with engine.connect() as conn:
            rows = await conn.execute(
                select(runs.c.run_id, runs.c.status).where(runs.c.run_id.in_([here, elsewhere]))
            )
            found = {r.run_id: r.status for r in rows}
        return [found[here], found[elsewhere]]

    assert await statuses() == ["queued", "waiting-for-children"]
    now[0] += SCAN_EVERY_S / 2
    await children.round()  # not nudged: the look at every waiting parent
    assert await statuses() == ["queued", "queued"]
    assert (await _types(engine, elsewhere))[-2:] == ["child.completed", "run.queued"]


async def test_parallel_children_split_what_their_parent_has_left(engine: AsyncEngine) -> None:
    parent = await _parent(engine, "e-budget")
    async with engine.begin() as conn:
        # The parent ran as an agent with 1,000 output tokens and spent 100 of them.
        routing = await conn.scalar(select(runs.c.routing_id).where(runs.c.run_id == parent))
        # Pinned by hand to a routing with the default limits: no output-token ceiling of its
        # agent's, so the tree budget below is what bounds it.
        pinned = await conn.scalar(
            select(routings.c.config).where(routings.c.routing_id == routing)
        )
        assert AgentConfig.from_json(pinned).limits.max_output_tokens == 0
        await conn.execute(
            insert(usage_turns).values(
                run_id=parent,
                model="m",
                input_tokens=10,
                output_tokens=100,
                cache_creation_input_tokens=0,
                cache_read_input_tokens=0,
                cost_micros=5,
            )
        )
        await conn.execute(
            update(runs)
            .where(runs.c.run_id == parent)
            .values(tree_budget={"max_output_tokens": 1000, "max_steps": 8})
        )
    children = _children(engine)
    first = await _start(children, parent, "toolu_a", share=3)
    second = await _start(children, parent, "toolu_b", share=2)
    third = await _start(children, parent, "toolu_c", share=1)
    budgets = [c.run.tree_budget for c in (first, second, third)]  # type: ignore[attr-defined]
    assert [b["max_output_tokens"] for b in budgets] == [300, 300, 300]
    assert [b["max_steps"] for b in budgets] == [2, 2, 3]
    with pytest.raises(InvalidArgument, match="no budget left for a child"):
        await _start(children, parent, "toolu_d")
    assert await _count(engine, parent) == 3


async def test_the_active_children_of_a_parent_that_ended_are_cancelled(
    engine: AsyncEngine,
) -> None:
    parent = await _parent(engine, "e-orphan")
    children = _children(engine)
    child = (await _start(children, parent, "toolu_a")).run.run_id  # type: ignore[attr-defined]
    assert await children.cancel_orphans() == 0
    await _end(engine, parent, "failed")
    assert await children.cancel_orphans() == 1
    async with engine.connect() as conn:
        row = (await conn.execute(select(runs).where(runs.c.run_id == child))).one()
    assert row.status == "cancelled"
    assert f"its parent run {parent} ended failed" in row.error["message"]
    assert await children.cancel_orphans() == 0


async def test_the_wall_clock_counts_what_earlier_attempts_ran_and_children_get_what_is_left(
    engine: AsyncEngine,
) -> None:
    parent = await _parent(engine, "e-clock")
    # The attempt under way starts inside the next transaction, so it has run no longer than
    # this clock has by the time the child starts.
    before = time.monotonic()
    async with engine.begin() as conn:
        # Its first lease ran 2 s; then it was parked (no attempt) and leased again (epoch 2).
        await conn.execute(
            insert(attempts).values(
                run_id=parent,
                lease_epoch=1,
                attempt=1,
                worker_id="w-1",
                started_at=func.now() - timedelta(seconds=60),
                ended_at=func.now() - timedelta(seconds=58),
            )
        )
        await conn.execute(
            insert(attempts).values(
                run_id=parent, lease_epoch=2, attempt=1, worker_id="w-1", started_at=func.now()
            )
        )
        await conn.execute(
            update(runs)
            .where(runs.c.run_id == parent)
            .values(lease_epoch=2, tree_budget={"wall_clock_seconds": 10})
        )
    async with engine.connect() as conn:
        row = (await conn.execute(select(runs).where(runs.c.run_id == parent))).one()
        run = Run.from_row(row._mapping)
        config = AgentConfig(model="m", limits=Limits(max_steps=8, wall_clock_seconds=30))
        (lowered,) = (await budgets.leased_configs(conn, [(run, config)])).configs.values()
        plain = replace(run, lease_epoch=1, tree_budget=None)
        first = await budgets.leased_configs(conn, [(plain, config)])
        assert (first.configs, first.ended) == ({}, {}), "a first lease"
        assert (await budgets.account(conn, run, config.limits)).elapsed_s == pytest.approx(2)
    # Its own 10 s (its share, below its agent's 30), less the 2 s its first attempt ran: the
    # minute it was parked does not count.
    assert lowered.limits.wall_clock_seconds == pytest.approx(8, abs=0.01)
    child = await _children(engine).start(
        parent,
        2,
        tool_call_id="toolu_a",
        agent="researcher",
        message="m",
        max_depth=3,
        max_children=8,
    )
    under_way = time.monotonic() - before
    # What is left, less what the attempt under way has run until the child started.
    assert 8 - under_way - 0.01 <= child.run.tree_budget["wall_clock_seconds"] <= 8 + 0.01
