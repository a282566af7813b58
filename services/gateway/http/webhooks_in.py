"""Channel connections' webhook endpoints, at the URL `tether channels add` gives each
connection: `POST /v2/webhooks/slack/{channel_id}`, `GET` and `POST
/v2/webhooks/whatsapp/{channel_id}`, `POST /v2/webhooks/webhook/{channel_id}`.

No API key: the provider's signature over the raw body, checked against the connection's secret
before anything is parsed or stored, is the authentication. The tenant, the principal
(`channel:<channel_id>`) and the agent come from the verified connection, never from the body.
Admission is the only work on the request path (a provider gives up within seconds): its dedup
makes a redelivery (Slack's retries, concurrent or not) attach to the first run. The answer is
`{"run_id", "disposition"}` (providers ignore it); an unknown connection, another tenant's and a
URL of another kind are the same 404. Log lines name the connection and the outcome, never a
secret or a signature. docs/bridge-v2.md, "Channel webhooks", has the contract."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Protocol

from aiohttp import web

from services.gateway.http import webhooks_generic, webhooks_slack, webhooks_whatsapp
from services.gateway.http.errors import MAX_BODY_BYTES
from services.gateway.http.webhook_lookup import ChannelVerification, Verifications
from services.gateway.http.webhook_messages import InboundMessage
from tether.domain.channels import channel_principal
from tether.errors import TetherError, Unauthenticated
from tether.v1 import admission_pb2, common_pb2, orchestrator_pb2, orchestrator_pb2_grpc

log = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Admitter(Protocol):
    """The gateway's admission client (services.gateway.grpc.admissions.Admissions), handed in
    by main.py: the HTTP room does not import the gRPC room."""

    async def admit(
        self, request: admission_pb2.AdmitRequest, timeout_s: float | None
    ) -> admission_pb2.AdmitResponse: ...


Verify = Callable[[bytes, Mapping[str, str], Sequence[str]], None]
IGNORED = "ignored"


def _too_large(request: web.Request) -> None:
    """413 before reading a body its Content-Length says is over the limit (one sent chunked is
    cut off by aiohttp's own limit as it is read)."""
    length = request.content_length
    if length is not None and length > MAX_BODY_BYTES:
        raise web.HTTPRequestEntityTooLarge(max_size=MAX_BODY_BYTES, actual_size=length)


def _answer(run_id: str, disposition: str, **extra: object) -> web.Response:
    return web.json_response({"run_id": run_id, "disposition": disposition, **extra})


class Webhooks:
    """The webhook routes: verify, read the provider's shape, admit."""

    def __init__(
        self,
        verifications: Verifications,
        admissions: Admitter,
        orchestrator: orchestrator_pb2_grpc.OrchestratorServiceStub,
    ) -> None:
        self._verifications = verifications
        self._admissions = admissions
        self._orchestrator = orchestrator

    def add_routes(self, app: web.Application) -> None:
        """Add the webhook routes to `app`."""
        router = app.router
        router.add_post("/v2/webhooks/slack/{channel_id}", self._logged("slack", self.slack))
        router.add_get(
            "/v2/webhooks/whatsapp/{channel_id}", self._logged("whatsapp", self.whatsapp_check)
        )
        router.add_post(
            "/v2/webhooks/whatsapp/{channel_id}", self._logged("whatsapp", self.whatsapp)
        )
        router.add_post("/v2/webhooks/webhook/{channel_id}", self._logged("webhook", self.generic))

    @staticmethod
    def _logged(kind: str, handler: Handler) -> Handler:
        async def handle(request: web.Request) -> web.StreamResponse:
            channel_id = request.match_info["channel_id"][:128]
            try:
                response = await handler(request)
            except TetherError as exc:
                log.info("webhook %s %r: refused %s (%s)", kind, channel_id, exc.status.name,
                         exc.code)  # fmt: skip
                raise
            log.info("webhook %s %r: %s", kind, channel_id, response.status)
            return response

        return handle

    async def _verified(
        self, request: web.Request, kind: str, verify: Verify
    ) -> tuple[ChannelVerification, bytes]:
        """The connection and the raw body, once the body's signature verified against one of
        its valid secrets; 404, 413 or 401 before anything is parsed."""
        found = await self._verifications.of(request.match_info["channel_id"], kind)
        _too_large(request)
        raw = await request.read()
        try:
            verify(raw, request.headers, found.valid_secrets())
        except Unauthenticated:
            # Perhaps a secret rotated in since this connection was looked up: ask once more.
            fresher = await self._verifications.fresher(found)
            if fresher is None:
                raise
            verify(raw, request.headers, fresher.valid_secrets())
            found = fresher
        return found, raw

    async def _admit(self, found: ChannelVerification, message: InboundMessage) -> web.Response:
        admitted = await self._admissions.admit(
            admission_pb2.AdmitRequest(
                caller=admission_pb2.Caller(
                    tenant_id=found.tenant_id, principal_id=channel_principal(found.channel_id)
                ),
                channel_message=admission_pb2.ChannelMessageInput(
                    channel_id=found.channel_id,
                    event_id=message.event_id,
                    thread_id=message.thread_id,
                    sender_id=message.sender_id,
                    text=message.text,
                    reply=common_pb2.ReplyTarget(
                        channel_id=found.channel_id,
                        kind=found.kind,
                        address=message.address,
                        thread=message.thread,
                        reply_to=message.reply_to,
                    ),
                    agent=found.agent,
                ),
            ),
            None,
        )
        disposition = common_pb2.Disposition.Name(admitted.disposition)
        return _answer(admitted.run.run_id, disposition.removeprefix("DISPOSITION_").lower())

    async def slack(self, request: web.Request) -> web.StreamResponse:
        found, raw = await self._verified(request, "slack", webhooks_slack.verify)
        body = webhooks_slack.parse(raw)
        challenge = webhooks_slack.challenge(body)
        if challenge is not None:
            return web.json_response({"challenge": challenge})
        message = webhooks_slack.message(body)
        if message is None:
            return _answer("", IGNORED)
        return await self._admit(found, message)

    async def whatsapp_check(self, request: web.Request) -> web.StreamResponse:
        found = await self._verifications.of(request.match_info["channel_id"], "whatsapp")
        challenge = webhooks_whatsapp.subscribe(request.query, found.verify_token)
        return web.Response(text=challenge, content_type="text/plain")

    async def whatsapp(self, request: web.Request) -> web.StreamResponse:
        found, raw = await self._verified(request, "whatsapp", webhooks_whatsapp.verify)
        notification = webhooks_whatsapp.parse(raw)
        if notification.statuses:
            await self._record(found, notification.statuses)
        answers = [await self._admit(found, m) for m in notification.messages]
        if not answers:
            return _answer("", IGNORED, statuses=len(notification.statuses))
        # One message a POST is what Meta sends; more are each admitted, the last one answered.
        return answers[-1]

    async def _record(
        self, found: ChannelVerification, statuses: list[webhooks_whatsapp.StatusReport]
    ) -> None:
        request = orchestrator_pb2.RecordChannelStatusesRequest(
            tenant_id=found.tenant_id, channel_id=found.channel_id
        )
        for status in statuses:
            reported = request.statuses.add(
                provider_message_id=status.provider_message_id,
                status=status.status,
                callback_data=status.callback_data,
                errors_json=status.errors_json,
            )
            reported.reported_at.FromDatetime(status.reported_at)
        await self._orchestrator.RecordChannelStatuses(request)

    async def generic(self, request: web.Request) -> web.StreamResponse:
        found, raw = await self._verified(request, "webhook", webhooks_generic.verify)
        return await self._admit(found, webhooks_generic.message(raw, found.settings))
