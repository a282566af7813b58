"""Channel webhooks against the ordinary API: `webhook_admit_vs_send_c16` is signed Slack
webhook admissions per second over `POST /v2/messages` admissions per second, both over HTTP to
the same gateway of the same stack, 16 concurrent callers, every event unique. The two loads
alternate in rounds, so a neighbour's load on a shared machine falls on both alike."""

from __future__ import annotations

import secrets
import uuid

import aiohttp

from bench.common import bench_stack, closed_loop, emit
from tether import apikeys
from tether.credentials import SECRETS_KEY_ENV, new_secrets_key
from tether.db.engine import create_engine
from tether.testing import slack_events

CALLERS = 16
OPS_PER_CALLER = 100
ROUNDS = 3


async def _admin_key(db_url: str) -> str:
    engine = create_engine(db_url, pool_size=1)
    try:
        async with engine.begin() as conn:
            key, _ = await apikeys.create_key(
                conn, "bench", "bench-admin", [apikeys.CHANNELS_WRITE]
            )
    finally:
        await engine.dispose()
    return key


async def run() -> None:
    """Run the channels group."""
    names = ("orchestrator", "admission", "interactions", "gateway")
    async with bench_stack(names, {SECRETS_KEY_ENV: new_secrets_key()}) as stack:
        base = f"http://{stack.services.http_addresses()['gateway']}"
        signing = secrets.token_hex(16)
        connector = aiohttp.TCPConnector(limit=CALLERS * 2)
        async with aiohttp.ClientSession(connector=connector) as http:
            added = await http.post(
                f"{base}/v2/channels",
                json={
                    "kind": "slack",
                    "name": "bench",
                    "secrets": {"signingSecret": signing, "botToken": secrets.token_hex(8)},
                },
                headers={"Authorization": f"Bearer {await _admin_key(stack.db_url)}"},
            )
            assert added.status == 201, await added.text()
            url = (await added.json())["webhookUrl"]
            auth = {"Authorization": f"Bearer {stack.api_key}"}
            tag = uuid.uuid4().hex[:8]
            counter = iter(range(10**9))

            async def send(c: int, i: int) -> None:
                body = {
                    "event_id": f"m-{tag}-{next(counter)}",
                    "conversation_id": f"conv-{tag}-{c}",
                    "text": "bench message",
                }
                async with http.post(f"{base}/v2/messages", json=body, headers=auth) as answer:
                    assert answer.status == 200, await answer.text()

            async def webhook(c: int, i: int) -> None:
                n = next(counter)
                event = slack_events.message_event(
                    channel=f"C{c}",
                    user="U1",
                    text="bench message",
                    ts=f"{1700000000 + n}.000100",
                    thread_ts="1700000000.000001",
                    event_id=f"Ev{tag}{n}",
                )
                answer = await slack_events.deliver(url, event, signing, session=http)
                assert answer.status == 200, answer.text

            for op in (send, webhook):  # warm-up: connections, the kept verification
                await closed_loop(op, callers=CALLERS, ops_per_caller=10)
            totals = {"send": [0, 0.0], "webhook": [0, 0.0]}
            for _ in range(ROUNDS):
                for name, op in (("send", send), ("webhook", webhook)):
                    result = await closed_loop(op, callers=CALLERS, ops_per_caller=OPS_PER_CALLER)
                    totals[name][0] += result.ops
                    totals[name][1] += result.seconds
    send_per_s = totals["send"][0] / totals["send"][1]
    webhook_per_s = totals["webhook"][0] / totals["webhook"][1]
    config = {"callers": CALLERS, "rounds": ROUNDS, "ops_each": totals["send"][0]}
    emit("webhook_admit_vs_send_c16", webhook_per_s / send_per_s, "ratio", **config)
    emit("webhook_admit_per_s_c16", webhook_per_s, "ops/s", **config)
    emit("send_admit_per_s_c16", send_per_s, "ops/s", **config)
