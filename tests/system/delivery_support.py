"""Support for the delivery tests: a stack with one worker, the Slack and WhatsApp stand-ins,
channel connections added through interactions as the gateway adds them, and channel messages
admitted through admission's Admit as the gateway's webhooks admit them (the connection's
principal, with the gateway's own service credential)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web
from sqlalchemy import select
from standardwebhooks import Webhook, WebhookVerificationError

from tests.system.execution_support import ExecStack, Tenant, exec_stack
from tether.db.engine import create_engine
from tether.db.schema import deliveries
from tether.runtime.rpc import internal_channel
from tether.testing.local_server import LocalServer
from tether.testing.slack_server import SlackServer
from tether.testing.whatsapp_server import WhatsAppServer
from tether.v1 import admission_pb2, admission_pb2_grpc, common_pb2, interactions_pb2_grpc
from tether.v1 import interactions_pb2 as ipb

RECONCILE_S = 1.5


@dataclass
class Rig:
    """The stack and the providers' stand-ins."""

    stack: ExecStack
    slack: SlackServer
    whatsapp: WhatsAppServer

    @property
    def db_url(self) -> str:
        return self.stack.db_url

    async def add_channel(self, tenant: Tenant, kind: str, **fields: Any) -> str:
        """A connection of `kind` for the tenant, added as the gateway adds one."""
        if kind == "slack":
            secrets = ipb.ChannelSecrets(
                signing_secret="sig-secret", bot_token=self.slack.bot_token
            )
            settings = ipb.ChannelSettings()
            base = fields.pop("api_base_url", self.slack.api_url)
        else:
            secrets = ipb.ChannelSecrets(
                app_secret=self.whatsapp.app_secret,
                verify_token="verify-me",
                access_token=self.whatsapp.access_token,
            )
            settings = ipb.ChannelSettings(phone_number_id=self.whatsapp.phone_number_id)
            base = fields.pop("api_base_url", self.whatsapp.base_url)
        async with internal_channel(
            self.stack.addr("interactions"), self.stack.credentials["gateway"]
        ) as channel:
            response = await interactions_pb2_grpc.InteractionsServiceStub(channel).AddChannel(
                ipb.InteractionsServiceAddChannelRequest(
                    tenant_id=tenant.tenant_id,
                    principal_id="tester",
                    kind=kind,
                    name=f"{kind}-{uuid.uuid4().hex[:8]}",
                    api_base_url=base,
                    secrets=secrets,
                    settings=settings,
                )
            )
        return str(response.channel.channel_id)

    async def add_webhook_channel(self, tenant: Tenant, secret: str, reply_url: str) -> str:
        """A generic webhook connection whose answers go to `reply_url`."""
        async with internal_channel(
            self.stack.addr("interactions"), self.stack.credentials["gateway"]
        ) as channel:
            response = await interactions_pb2_grpc.InteractionsServiceStub(channel).AddChannel(
                ipb.InteractionsServiceAddChannelRequest(
                    tenant_id=tenant.tenant_id,
                    principal_id="tester",
                    kind="webhook",
                    name=f"webhook-{uuid.uuid4().hex[:8]}",
                    reply_url=reply_url,
                    secrets=ipb.ChannelSecrets(secret=secret),
                    settings=ipb.ChannelSettings(
                        text_field="/text",
                        thread_field="/thread",
                        sender_field="/sender",
                        event_id_field="/id",
                    ),
                )
            )
        return str(response.channel.channel_id)

    async def remove_channel(self, tenant: Tenant, channel_id: str) -> None:
        async with internal_channel(
            self.stack.addr("interactions"), self.stack.credentials["gateway"]
        ) as channel:
            await interactions_pb2_grpc.InteractionsServiceStub(channel).RemoveChannel(
                ipb.InteractionsServiceRemoveChannelRequest(
                    tenant_id=tenant.tenant_id, channel_id=channel_id
                )
            )

    async def admit(
        self,
        tenant: Tenant,
        channel_id: str,
        kind: str,
        text: str,
        *,
        address: str,
        thread: str,
        reply_to: str,
    ) -> str:
        """A channel message admitted as the gateway's webhook admits it; the run's id."""
        event_id = f"Ev{uuid.uuid4().hex[:12]}"
        async with internal_channel(
            self.stack.addr("admission"), self.stack.credentials["gateway"]
        ) as channel:
            response = await admission_pb2_grpc.AdmissionServiceStub(channel).Admit(
                admission_pb2.AdmitRequest(
                    caller=admission_pb2.Caller(
                        tenant_id=tenant.tenant_id, principal_id=f"channel:{channel_id}"
                    ),
                    channel_message=admission_pb2.ChannelMessageInput(
                        channel_id=channel_id,
                        event_id=event_id,
                        thread_id=thread or address,
                        sender_id="U0PERSON",
                        text=text,
                        reply=common_pb2.ReplyTarget(
                            channel_id=channel_id,
                            kind=kind,
                            address=address,
                            thread=thread,
                            reply_to=reply_to,
                        ),
                    ),
                )
            )
        return str(response.run.run_id)

    async def slack_run(self, tenant: Tenant, channel_id: str, text: str) -> tuple[str, str, str]:
        """A person's message stored in a Slack channel, then admitted: (run, channel, thread)."""
        slack_channel = f"C{uuid.uuid4().hex[:10].upper()}"
        event = self.slack.user_message(slack_channel, "U0PERSON", text)
        ts = event["event"]["ts"]
        run_id = await self.admit(
            tenant, channel_id, "slack", text, address=slack_channel, thread=ts, reply_to=ts
        )
        return run_id, slack_channel, ts


async def delivery_of(db_url: str, run_id: str) -> Any:
    """The run's deliveries row, or None."""
    engine = create_engine(db_url, pool_size=1)
    try:
        async with engine.connect() as conn:
            return (
                await conn.execute(select(deliveries).where(deliveries.c.run_id == run_id))
            ).first()
    finally:
        await engine.dispose()


@asynccontextmanager
async def delivery_rig(
    pg_server_url: str, template_db: str, redis_url: str, run_dir: Path
) -> AsyncIterator[Rig]:
    """One stack with one worker that may reach the loopback stand-ins."""
    slack = SlackServer()
    whatsapp = WhatsAppServer()
    await slack.start()
    await whatsapp.start()
    try:
        async with exec_stack(
            pg_server_url,
            template_db,
            redis_url,
            run_dir,
            workers=1,
            extra_env={
                "TETHER_ALLOW_PRIVATE_TARGETS": "loopback",
                "TETHER_DELIVERY_RECONCILE_S": str(RECONCILE_S),
            },
        ) as stack:
            yield Rig(stack, slack, whatsapp)
    finally:
        await slack.stop()
        await whatsapp.stop()


class Receiver(LocalServer):
    """A generic connection's reply URL: verifies each POST per Standard Webhooks and keeps
    what arrived; answers `fail_first` 503s first."""

    name = "receiver"

    def __init__(self, secret: str) -> None:
        super().__init__()
        self._verifier = Webhook(secret)
        self.fail_first = 0
        self.received: list[tuple[str, dict[str, Any]]] = []
        self.refused: list[str] = []

    def build_app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/reply", self._reply)
        return app

    async def _reply(self, request: web.Request) -> web.StreamResponse:
        body = await request.text()
        try:
            payload = self._verifier.verify(body, dict(request.headers))
        except WebhookVerificationError as exc:
            self.refused.append(str(exc))
            return web.Response(status=401)
        if self.fail_first > 0:
            self.fail_first -= 1
            self.received.append((request.headers["webhook-id"], {"refused": True}))
            return web.Response(status=503)
        self.received.append((request.headers["webhook-id"], payload))
        return web.json_response({"ok": True})
