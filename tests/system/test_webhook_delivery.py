"""Run-event webhooks end to end, with real services, a worker, the scripted model server and a
local subscriber: a subscriber failing three times then succeeding gets each subscribed event
once as a success, every try with the same webhook-id and a valid Standard Webhooks signature,
a run's events in order; another tenant's subscription and delivery are NOT_FOUND; an endpoint
failing past the disable window is disabled with an audit record, and redelivery still works."""

from __future__ import annotations

import base64
import json
import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from sqlalchemy import select
from standardwebhooks import Webhook

from tests.system.execution_support import ExecStack, Tenant, exec_stack, wait_for_status
from tether import apikeys
from tether.client import TetherClient
from tether.db.engine import create_engine
from tether.db.schema import audit_log
from tether.testing.eventually import eventually
from tether.testing.model_server import TextTurn, ToolUseTurn
from tether.testing.webhook_receiver import WebhookReceiver
from tether.v1 import gateway_pb2, gateway_pb2_grpc

# a whole stack of processes per module: tens of seconds, so in `make slow` (the 15-minute budget)
pytestmark = pytest.mark.slow


DISABLE_AFTER_S = 3.0
SCOPES = [*apikeys.CLIENT_SCOPES, apikeys.WEBHOOKS_READ, apikeys.WEBHOOKS_WRITE]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(
    pg_server_url: str, template_db: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ExecStack]:
    env = {
        "TETHER_ALLOW_PRIVATE_TARGETS": "loopback",
        "TETHER_WEBHOOK_DISABLE_AFTER": f"{DISABLE_AFTER_S:g}s",
        "TETHER_ORCHESTRATOR_WEBHOOK_POLL_S": "0.1",
        "TETHER_ORCHESTRATOR_WEBHOOK_WAITING_POLL_S": "0.2",
        "TETHER_ORCHESTRATOR_WEBHOOK_BACKOFF_BASE_S": "0.1",
        "TETHER_ORCHESTRATOR_WEBHOOK_BACKOFF_MAX_S": "0.3",
    }
    async with exec_stack(
        pg_server_url,
        template_db,
        redis_url,
        Path(tmp_path_factory.mktemp("webhooks")),
        workers=1,
        extra_env=env,
    ) as running:
        yield running


@pytest_asyncio.fixture(loop_scope="session")
async def receiver() -> AsyncIterator[WebhookReceiver]:
    running = WebhookReceiver()
    await running.start()
    try:
        yield running
    finally:
        await running.stop()


def new_secret() -> str:
    return "whsec_" + base64.b64encode(os.urandom(24)).decode()


def gateway(stack: ExecStack, channel: grpc.aio.Channel) -> gateway_pb2_grpc.GatewayServiceStub:
    return gateway_pb2_grpc.GatewayServiceStub(channel)


async def subscribe(
    stack: ExecStack, tenant: Tenant, url: str, events: list[str], secret: str
) -> str:
    async with grpc.aio.insecure_channel(stack.addr("gateway")) as channel:
        added = await gateway(stack, channel).AddWebhook(
            gateway_pb2.AddWebhookRequest(url=url, events=events, secret=secret),
            metadata=tenant.metadata,
        )
    return str(added.subscription_id)


async def deliveries(stack: ExecStack, tenant: Tenant, subscription_id: str) -> list[Any]:
    async with grpc.aio.insecure_channel(stack.addr("gateway")) as channel:
        listed = await gateway(stack, channel).ListWebhookDeliveries(
            gateway_pb2.ListWebhookDeliveriesRequest(subscription_id=subscription_id),
            metadata=tenant.metadata,
        )
    return list(listed.deliveries)


def verified(secret: str, received: Any) -> dict[str, Any]:
    """The body of a request whose signature verifies with `secret` (raises otherwise)."""
    payload: dict[str, Any] = Webhook(secret).verify(received.body, received.headers)
    return payload


async def test_a_failing_subscriber_gets_each_event_once_in_order_with_one_webhook_id(
    stack: ExecStack, receiver: WebhookReceiver
) -> None:
    tenant = await stack.tenant(scopes=SCOPES)
    secret = new_secret()
    events = ["question.requested", "run.completed"]
    subscription_id = await subscribe(stack, tenant, receiver.url, events, secret)
    receiver.script([500, 500, 500])
    text = f"ask me {uuid.uuid4().hex}"
    stack.model.script(
        text,
        [
            ToolUseTurn("ask_questions", {"questions": [{"key": "city", "prompt": "Which?"}]}),
            TextTurn("Lisbon it is."),
        ],
    )
    run_id = await tenant.send(text)
    await wait_for_status(stack.db_url, run_id, "waiting-for-question")

    async def question_taken() -> bool:
        return any(r.answered == 200 for r in receiver.received)

    # Sent while the run waits, after three failures.
    await eventually(question_taken, timeout=15, what="question.requested sent while waiting")
    async with TetherClient(stack.addr("gateway"), tenant.api_key) as client:
        await client.answer(run_id, {"city": ["Lisbon"]})
    await wait_for_status(stack.db_url, run_id, "completed")

    async def both_sent() -> list[Any] | None:
        found = await deliveries(stack, tenant, subscription_id)
        return found if len(found) == 2 and all(d.status == "sent" for d in found) else None

    logged = await eventually(both_sent, timeout=20, what="both deliveries sent")
    received = list(receiver.received)
    assert [r.answered for r in received] == [500, 500, 500, 200, 200]
    bodies = [verified(secret, r) for r in received]
    assert [b["type"] for b in bodies] == ["question.requested"] * 4 + ["run.completed"]
    ids = [r.headers["webhook-id"] for r in received]
    assert len(set(ids[:4])) == 1 and ids[4] != ids[0]
    # The body is the event as the run's stream carries it, in seq order.
    assert all(b["data"]["runId"] == run_id for b in bodies)
    seqs = [int(b["data"]["seq"]) for b in bodies]
    assert seqs[:4] == [seqs[0]] * 4 and seqs[4] > seqs[0]
    assert "runCompleted" in bodies[4]["data"] and "questionRequested" in bodies[0]["data"]
    # The run.completed stored by reference goes out whole, its answer and usage filled in.
    completed = bodies[4]["data"]["runCompleted"]
    assert completed["resultText"] == "Lisbon it is." and int(completed["usage"]["outputTokens"])
    by_id = {d.delivery_id: d for d in logged}
    assert by_id[ids[0]].attempts == 4 and by_id[ids[0]].event_type == "question.requested"
    assert by_id[ids[4]].attempts == 1 and by_id[ids[4]].last_http_status == 200
    assert secret not in str(logged)

    # Another tenant: the subscription and its delivery are NOT_FOUND, like absent ones.
    other = await stack.tenant(scopes=SCOPES)
    async with grpc.aio.insecure_channel(stack.addr("gateway")) as channel:
        stub = gateway(stack, channel)
        calls = [
            lambda sid, did: stub.ListWebhookDeliveries(
                gateway_pb2.ListWebhookDeliveriesRequest(subscription_id=sid),
                metadata=other.metadata,
            ),
            lambda sid, did: stub.RedeliverWebhook(
                gateway_pb2.RedeliverWebhookRequest(delivery_id=did), metadata=other.metadata
            ),
            lambda sid, did: stub.RemoveWebhook(
                gateway_pb2.RemoveWebhookRequest(subscription_id=sid), metadata=other.metadata
            ),
        ]
        for call in calls:
            seen = []
            for sid, did in ((subscription_id, ids[0]), ("whsub_absent", "msg_absent")):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call(sid, did)
                seen.append(
                    (
                        refused.value.code(),
                        refused.value.details().replace(sid, "X").replace(did, "X"),
                    )
                )
            assert seen[0] == seen[1] and seen[0][0] == grpc.StatusCode.NOT_FOUND, seen
        listed = await stub.ListWebhooks(gateway_pb2.ListWebhooksRequest(), metadata=other.metadata)
        assert list(listed.subscriptions) == []
    # Untouched by the other tenant's tries.
    assert len(await deliveries(stack, tenant, subscription_id)) == 2


async def test_an_endpoint_failing_past_the_window_is_disabled_and_redelivery_still_works(
    stack: ExecStack, receiver: WebhookReceiver
) -> None:
    tenant = await stack.tenant(scopes=SCOPES)
    secret = new_secret()
    receiver.default = 503
    subscription_id = await subscribe(stack, tenant, receiver.url, ["run.completed"], secret)
    text = f"done {uuid.uuid4().hex}"
    stack.model.script(text, [TextTurn("done")])
    run_id = await tenant.send(text)
    await wait_for_status(stack.db_url, run_id, "completed")

    async def disabled() -> Any:
        async with grpc.aio.insecure_channel(stack.addr("gateway")) as channel:
            listed = await gateway(stack, channel).ListWebhooks(
                gateway_pb2.ListWebhooksRequest(), metadata=tenant.metadata
            )
        [found] = listed.subscriptions
        return found if found.status == "disabled" else None

    found = await eventually(
        disabled, timeout=DISABLE_AFTER_S + 15, what="the subscription disabled"
    )
    failed_for = found.disabled_at.ToDatetime() - found.failing_since.ToDatetime()
    assert failed_for.total_seconds() >= DISABLE_AFTER_S
    [delivery] = await deliveries(stack, tenant, subscription_id)
    assert delivery.status == "failed" and delivery.last_http_status == 503
    assert delivery.attempts >= 2
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            actions = (
                await conn.execute(
                    select(audit_log.c.action, audit_log.c.detail)
                    .where(audit_log.c.tenant_id == tenant.tenant_id)
                    .order_by(audit_log.c.created_at)
                )
            ).all()
    finally:
        await engine.dispose()
    webhook_acts = [a for a in actions if a.action.startswith("webhook.")]
    assert [a.action for a in webhook_acts] == ["webhook.added", "webhook.disabled"]
    assert webhook_acts[1].detail["subscription_id"] == subscription_id
    assert secret not in json.dumps([a.detail for a in actions])

    # Redelivery of that delivery still works on the disabled subscription, same webhook-id.
    receiver.default = 200
    tries_before = len(receiver.received)
    async with grpc.aio.insecure_channel(stack.addr("gateway")) as channel:
        requeued = await gateway(stack, channel).RedeliverWebhook(
            gateway_pb2.RedeliverWebhookRequest(delivery_id=delivery.delivery_id),
            metadata=tenant.metadata,
        )
    assert requeued.delivery.status == "pending"

    async def sent() -> Any:
        [again] = await deliveries(stack, tenant, subscription_id)
        return again if again.status == "sent" else None

    await eventually(sent, timeout=10, what="the redelivery sent")
    last = receiver.received[-1]
    assert len(receiver.received) == tries_before + 1
    assert last.answered == 200 and last.headers["webhook-id"] == delivery.delivery_id
    assert verified(secret, last)["data"]["runId"] == run_id
    # Every service's log is free of either secret.
    for proc in stack.services.procs.values():
        assert secret not in proc.log_path.read_text(errors="replace"), proc.name
