"""What the channel-webhook system tests share: connections added through the gateway's HTTP API
as a user adds them, Standard Webhooks signing written here with hmac (a second implementation
beside the `standardwebhooks` package the gateway verifies with), and the rows a webhook may
write, counted."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx2
from sqlalchemy import func, select

from tests.system.conftest import RunningStack
from tether.db.engine import create_engine
from tether.db.schema import channel_statuses, event_claims, messages, runs


def secret_value(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(16)}"


def whsec() -> str:
    """A Standard Webhooks secret as a sender shows it."""
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


def standard_sign(
    secret: str, body: bytes, *, msg_id: str | None = None, timestamp: int | None = None
) -> dict[str, str]:
    """The three Standard Webhooks headers: v1 = base64 HMAC-SHA256 of `id.timestamp.body`
    under the secret's decoded bytes."""
    key = base64.b64decode(secret.removeprefix("whsec_"))
    msg_id = msg_id or f"msg_{uuid.uuid4().hex}"
    stamp = int(time.time()) if timestamp is None else timestamp
    signed = f"{msg_id}.{stamp}.".encode() + body
    mac = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(stamp),
        "webhook-signature": f"v1,{mac}",
        "Content-Type": "application/json",
    }


@dataclass
class Secrets:
    """Every secret value a module's tests used, to look for in the services' logs."""

    values: set[str] = field(default_factory=set)

    def new(self, prefix: str) -> str:
        value = secret_value(prefix)
        self.values.add(value)
        return value

    def whsec(self) -> str:
        value = whsec()
        self.values.add(value)
        return value


def http_base(stack: RunningStack) -> str:
    return f"http://{stack.services.http_addresses()['gateway']}"


async def add_channel(stack: RunningStack, body: dict[str, Any]) -> dict[str, Any]:
    """POST /v2/channels with the admin key; the answer (channelId, webhookUrl, channel)."""
    async with httpx2.AsyncClient(base_url=http_base(stack), timeout=30) as http:
        added = await http.post(
            "/v2/channels",
            json={"name": f"{body['kind']}-{uuid.uuid4().hex[:8]}", **body},
            headers={"Authorization": f"Bearer {stack.admin_key}"},
        )
    assert added.status_code == 201, added.text
    answer: dict[str, Any] = added.json()
    return answer


async def counts(stack: RunningStack) -> dict[str, int]:
    """Rows of each table a webhook may write."""
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            return {
                table.name: int(await conn.scalar(select(func.count()).select_from(table)) or 0)
                for table in (event_claims, messages, runs, channel_statuses)
            }
    finally:
        await engine.dispose()


async def origin_of(stack: RunningStack, run_id: str) -> tuple[dict[str, Any], str, str]:
    """The stored channel origin of a run's message, its tenant and its input text."""
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            row = (
                await conn.execute(
                    select(messages.c.channel_origin, runs.c.tenant_id, runs.c.input_text)
                    .select_from(runs.join(messages, messages.c.message_id == runs.c.message_id))
                    .where(runs.c.run_id == run_id)
                )
            ).one()
    finally:
        await engine.dispose()
    return row.channel_origin, row.tenant_id, row.input_text


async def statuses_of(stack: RunningStack, channel_id: str) -> list[dict[str, Any]]:
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            rows = await conn.execute(
                select(channel_statuses).where(channel_statuses.c.channel_id == channel_id)
            )
            return [dict(r._mapping) for r in rows]
    finally:
        await engine.dispose()


def body_of(data: dict[str, Any]) -> bytes:
    return json.dumps(data, separators=(",", ":")).encode()
