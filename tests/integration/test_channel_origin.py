"""A channel connection's message against the real PostgreSQL: admitted as the connection's
principal with where its answer goes, and the claim hands that to the attempt."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from services.admission.adapters import normalise
from services.admission.domain import FreshnessPolicy, InboundEvent
from services.admission.service import Admitter
from services.orchestrator.agents import Agents
from services.orchestrator.execution import Execution
from tests.integration.test_admission import _tenant, chat
from tether.db.schema import messages, runs
from tether.domain import ReplyTarget
from tether.v1 import admission_pb2, common_pb2

pytestmark = pytest.mark.asyncio(loop_scope="session")


def channel_message(
    channel_id: str,
    event_id: str,
    thread: str,
    *,
    tenant: str = "t1",
    text: str = "hi",
    agent: str = "",
) -> InboundEvent:
    return normalise(
        admission_pb2.AdmitRequest(
            caller=admission_pb2.Caller(tenant_id=tenant, principal_id=f"channel:{channel_id}"),
            channel_message=admission_pb2.ChannelMessageInput(
                channel_id=channel_id,
                event_id=event_id,
                thread_id=thread,
                sender_id="U1",
                text=text,
                reply=common_pb2.ReplyTarget(
                    channel_id=channel_id,
                    kind="slack",
                    address="C1",
                    thread=thread,
                    reply_to=event_id,
                ),
                agent=agent,
            ),
        )
    )


async def test_the_claim_hands_the_attempt_where_a_channel_runs_answer_goes(
    engine: AsyncEngine,
) -> None:
    await _tenant(engine, "t1")
    execution = Execution.build(engine, None, lease_ttl_s=30, claim_poll_s=60)
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
    admitted = await admitter.admit(channel_message("ch_origin1", "Ev1", "1700.1"))
    run_id = admitted.run.run_id
    claimed = None
    while claimed is None or claimed.run.run_id != run_id:
        claimed = await execution.claims.claim("w-origin", wait_s=0)
        assert claimed is not None, "the admitted run is claimable"
    assert claimed.origin.reply == ReplyTarget("ch_origin1", "slack", "C1", "1700.1", "Ev1")
    assert (claimed.origin.source, claimed.origin.channel) == ("messaging", "slack")
    async with engine.connect() as conn:
        stored = (
            await conn.execute(
                select(messages.c.channel_origin).where(messages.c.event_id == "Ev1")
            )
        ).scalar_one()
    assert stored["v"] == 1 and stored["reply"]["address"] == "C1"


async def test_two_connections_naming_one_thread_never_share_a_conversation(
    engine: AsyncEngine,
) -> None:
    await _tenant(engine, "t1")
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
    first = await admitter.admit(channel_message("ch_sharedA", "EvA", "1700.9"))
    second = await admitter.admit(channel_message("ch_sharedB", "EvA", "1700.9"))
    # The same provider event id on two connections is two events, each its own run...
    assert first.run.run_id != second.run.run_id
    assert second.disposition.name == first.disposition.name == "CREATED"
    # ...in two sessions: the thread id is a correlation value within its connection.
    assert first.run.session_id != second.run.session_id
    again = await admitter.admit(channel_message("ch_sharedA", "EvA", "1700.9"))
    assert again.run.run_id == first.run.run_id


async def test_plain_messages_store_no_channel_origin(engine: AsyncEngine) -> None:
    await _tenant(engine, "t1")
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
    await admitter.admit(chat("e-no-origin", conversation="c-no-origin"))
    async with engine.connect() as conn:
        stored = (
            await conn.execute(
                select(messages.c.channel_origin.is_(None)).where(
                    messages.c.event_id == "e-no-origin"
                )
            )
        ).scalar_one()
    assert stored is True  # SQL NULL, not JSON null


async def test_a_connection_naming_an_agent_pins_its_runs_to_it_over_the_routes(
    engine: AsyncEngine,
) -> None:
    await _tenant(engine, "t-pin")
    agents = Agents(engine)
    actor = {"key_id": "key-1", "principal_id": "alice"}
    doc = {"name": "general", "instructions": "You are general."}
    await agents.apply("t-pin", json.dumps(doc), actor)
    routed = {
        "name": "slacker",
        "instructions": "You answer Slack.",
        "routes": [{"channel": "slack"}],
    }
    await agents.apply("t-pin", json.dumps(routed), actor)
    await agents.apply(
        "t-pin", json.dumps({"name": "support", "instructions": "You support."}), actor
    )
    execution = Execution.build(engine, None, lease_ttl_s=30, claim_poll_s=60)
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
    pinned = await admitter.admit(
        channel_message("ch_pin1", "Pin1", "1.1", tenant="t-pin", agent="support")
    )
    by_route = await admitter.admit(channel_message("ch_pin2", "Pin2", "1.1", tenant="t-pin"))
    missing = await admitter.admit(
        channel_message("ch_pin3", "Pin3", "1.1", tenant="t-pin", agent="gone")
    )
    claimed = {c.run.run_id: c for c in await execution.claims.claim_many("w-pin", 3)}
    assert claimed[pinned.run.run_id].config.agent == "support"
    assert claimed[by_route.run.run_id].config.agent == "slacker"
    # A connection routing to an agent the tenant lacks fails its run, saying why.
    assert missing.run.run_id not in claimed
    async with engine.connect() as conn:
        row = (
            await conn.execute(
                select(runs.c.status, runs.c.error).where(runs.c.run_id == missing.run.run_id)
            )
        ).one()
    assert row.status == "failed" and row.error["code"] == "routing_failed"
    assert "'gone'" in row.error["message"]
