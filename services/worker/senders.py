"""How an answer reaches each kind of channel, and how a delivery already made is found again.

A sender does one provider call and classifies its outcome; the retry policy, the record and the
decision to look before posting again are the delivery's (`services.worker.delivery`). Every
call goes through a `tether.targets` session, so the private-address rule holds at connect time.

- Slack: `chat.postMessage` through the real `slack_sdk` client built with NO retry handlers (its
  default ones re-post on a rate limit or a dropped connection: openclaw#22780), the delivery id
  in the message's `metadata`; found again with `conversations.replies(include_all_metadata)`.
- WhatsApp: the Cloud API's messages endpoint with `biz_opaque_callback_data` = the delivery id;
  found again through the status callback that carries it back (recorded by the gateway, read
  through the orchestrator), waited for up to the reconcile window.
- Generic webhook: a POST to the connection's reply URL signed per Standard Webhooks with
  `webhook-id` = the delivery id. The receiver deduplicates on it, so a generic delivery re-sent
  after a crash is safe: there is nothing to look up, and it is sent again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

import aiohttp
from slack_sdk.errors import SlackApiError
from slack_sdk.web.async_client import AsyncWebClient
from standardwebhooks import Webhook

from tether.domain import ReplyTarget, RunError
from tether.errors import StaleLease
from tether.retry import ProviderCode, ProviderFailure, parse_retry_after, should_retry_status
from tether.targets import TargetPolicy, refused_target, target_session

METADATA_EVENT = "tether_delivery"
"""Slack message metadata's `event_type` on every answer Tether posts."""
WHATSAPP_VERSION = "v21.0"
"""The Graph API version used when a connection's api_base_url names none."""
_VERSION = re.compile(r"v\d+\.\d+")
# The SDK logs each request at DEBUG; nothing it says may reach the service's log.
_SDK_LOG = logging.getLogger("tether.worker.slack_sdk")
_SDK_LOG.setLevel(logging.WARNING)
# A provider call that hears nothing back within this is treated as maybe-sent.
CALL_TIMEOUT_S = 30.0

# When the post being made must be on its way by (`posting_before`): the delivery checks it
# before it calls the sender, and the session checks it again once the connection is made,
# right before the request is written. Between the two lie the sender's own work, the name's
# resolution and the connect: a worker frozen (or starved) there past its lease would otherwise
# wake and post beside the attempt that took its run over, looked, found nothing and posted (the
# drill found one: a SIGSTOP landed in that window).
_POST_BY: ContextVar[datetime | None] = ContextVar("tether_post_by", default=None)


@contextlib.contextmanager
def posting_before(deadline: datetime) -> Iterator[None]:
    """Within this block, a request of a `delivery_session` is written only before `deadline`
    (an aware datetime); past it, the request raises StaleLease unwritten."""
    token = _POST_BY.set(deadline)
    try:
        yield
    finally:
        _POST_BY.reset(token)


async def _check_post_by(*_: Any) -> None:
    deadline = _POST_BY.get()
    if deadline is not None and datetime.now(UTC) >= deadline:
        raise StaleLease(
            f"the post was due on its way by {deadline.isoformat()}: too late to write it under "
            "the lease that counted it"
        )


def _post_fence() -> aiohttp.TraceConfig:
    fence = aiohttp.TraceConfig()
    # Called once the connection is had (made, or taken from the pool), with nothing between
    # it and the request's writing but the client's own bookkeeping.
    fence.on_connection_create_end.append(_check_post_by)
    fence.on_connection_reuseconn.append(_check_post_by)
    return fence


def delivery_session(
    policy: TargetPolicy, more: tuple[aiohttp.TraceConfig, ...] = ()
) -> aiohttp.ClientSession:
    """The session a delivery's provider calls go through: a `tether.targets` session (the
    private-address rule at connect time) whose requests honour `posting_before`; `more`: other
    trace configurations, called before the fence."""
    return target_session(policy, trace_configs=[*more, _post_fence()])


@dataclass(frozen=True)
class Sending:
    """What interactions handed the worker for one delivery: never stored, logged or traced."""

    kind: str
    api_base_url: str
    reply_url: str
    settings: Mapping[str, str]
    credential: bytes
    signing_secret: bytes

    def __repr__(self) -> str:
        return f"Sending(kind={self.kind!r}, api_base_url={self.api_base_url!r}, secrets hidden)"


class Refused(Exception):
    """The provider refused the answer for good (a 4xx other than 429, Slack's `ok: false`): its
    own message kept in `error`."""

    def __init__(self, error: RunError) -> None:
        super().__init__(error.message)
        self.error = error


class Transient(Exception):
    """A failure worth retrying. `maybe_sent`: the provider may have stored the answer (no answer
    came back), so the next try looks for it first."""

    def __init__(self, failure: ProviderFailure, *, maybe_sent: bool) -> None:
        super().__init__(failure.message)
        self.failure = failure
        self.maybe_sent = maybe_sent


class LookupFailed(Exception):
    """The provider could not say whether the answer was posted."""


class Sender(Protocol):
    """One kind of channel."""

    can_look_up: bool
    """Whether `find` can tell a delivery already made (False: re-sending is safe)."""

    async def send(self, delivery_id: str, text: str) -> str:
        """Post `text`; the provider's message id. Refused, Transient."""
        ...

    async def find(self, delivery_id: str) -> str | None:
        """The provider's id of the message this delivery posted, or None. LookupFailed."""
        ...


def _unreachable(exc: BaseException, what: str) -> Exception:
    """A connection failure: a refused target is for good, anything else may have posted."""
    refused = refused_target(exc)
    if refused is not None:
        return Refused(RunError("delivery_target_refused", str(refused)))
    failure = ProviderFailure(
        ProviderCode.CONNECTION, f"{what}: {type(exc).__name__}: {exc}", True, 0
    )
    return Transient(failure, maybe_sent=True)


def _status_failure(status: int, message: str, headers: Mapping[str, str]) -> Exception:
    """An HTTP answer that is not a success: retryable (429, 5xx, ...) or refused."""
    if should_retry_status(status, headers):
        code = ProviderCode.RATE_LIMITED if status == 429 else ProviderCode.SERVER_ERROR
        retry_after = parse_retry_after(headers)
        failure = ProviderFailure(code, message, True, status, retry_after or None)
        return Transient(failure, maybe_sent=False)
    return Refused(RunError("delivery_refused", message, False, status))


def _slack_said(exc: SlackApiError) -> str:
    """Slack's error code (`channel_not_found`), or the HTTP status when the body is not Slack's."""
    data = exc.response.data
    error = data.get("error") if isinstance(data, dict) else None
    return str(error or f"HTTP {exc.response.status_code}")


def slack_base_url(api_base_url: str) -> str:
    """The SDK's base_url for a connection's api_base_url (`https://slack.com/api/`, or a
    stand-in's root or its `/api/`)."""
    base = api_base_url.rstrip("/")
    return base + "/" if base.endswith("/api") else base + "/api/"


class SlackSender:
    """chat.postMessage in the thread, the delivery id in the message's metadata."""

    can_look_up = True

    def __init__(self, sending: Sending, target: ReplyTarget, session: aiohttp.ClientSession):
        self._target = target
        self._thread = target.thread or target.reply_to
        self._client = AsyncWebClient(
            token=sending.credential.decode(),
            base_url=slack_base_url(sending.api_base_url),
            session=session,
            timeout=int(CALL_TIMEOUT_S),
            logger=_SDK_LOG,
            retry_handlers=[],  # never the SDK's: they re-post (openclaw#22780)
        )

    async def send(self, delivery_id: str, text: str) -> str:
        try:
            response = await self._client.chat_postMessage(
                channel=self._target.address,
                thread_ts=self._thread or None,
                text=text,
                metadata={
                    "event_type": METADATA_EVENT,
                    "event_payload": {"delivery_id": delivery_id},
                },
            )
        except SlackApiError as exc:
            raise self._api_failure(exc) from None
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise _unreachable(exc, "Slack did not answer chat.postMessage") from None
        return str(response.get("ts") or "")

    @staticmethod
    def _api_failure(exc: SlackApiError) -> Exception:
        status = int(exc.response.status_code)
        message = f"Slack refused chat.postMessage: {_slack_said(exc)}"
        headers = {
            k.lower(): str(v[0] if isinstance(v, list) else v)
            for k, v in exc.response.headers.items()
        }
        if status == 200:
            return Refused(RunError("delivery_refused", message, False, status))
        return _status_failure(status, message, headers)

    async def find(self, delivery_id: str) -> str | None:
        if not self._thread:
            raise LookupFailed("the answer has no thread to look in")
        cursor: str | None = None
        while True:
            try:
                page = await self._client.conversations_replies(
                    channel=self._target.address,
                    ts=self._thread,
                    include_all_metadata=True,
                    cursor=cursor,
                )
            except SlackApiError as exc:
                raise LookupFailed(f"conversations.replies failed: {_slack_said(exc)}") from None
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                raise LookupFailed(
                    f"conversations.replies failed: {type(exc).__name__}: {exc}"
                ) from None
            for message in page.get("messages") or []:
                metadata = message.get("metadata") or {}
                payload = metadata.get("event_payload") or {}
                if (
                    metadata.get("event_type") == METADATA_EVENT
                    and payload.get("delivery_id") == delivery_id
                ):
                    return str(message.get("ts") or "")
            cursor = (page.get("response_metadata") or {}).get("next_cursor") or None
            if not page.get("has_more") or not cursor:
                return None


def whatsapp_messages_url(api_base_url: str, phone_number_id: str) -> str:
    """`{api_base_url}/{version}/{phone_number_id}/messages`, the version the URL's own when it
    names one."""
    base = api_base_url.rstrip("/")
    if not _VERSION.fullmatch(base.rsplit("/", 1)[-1]):
        base = f"{base}/{WHATSAPP_VERSION}"
    return f"{base}/{phone_number_id}/messages"


StatusLookup = Callable[[str], Awaitable[str | None]]
"""The provider message id a status callback reported for a callback data, or None."""


class WhatsAppSender:
    """The Cloud API's messages endpoint, the delivery id as `biz_opaque_callback_data`."""

    can_look_up = True

    def __init__(
        self,
        sending: Sending,
        target: ReplyTarget,
        session: aiohttp.ClientSession,
        *,
        status: StatusLookup,
        reconcile_s: float,
        poll_s: float = 0.2,
    ) -> None:
        self._target = target
        self._session = session
        self._token = sending.credential.decode()
        self._url = whatsapp_messages_url(
            sending.api_base_url, sending.settings.get("phone_number_id", "")
        )
        self._status = status
        self._reconcile_s = reconcile_s
        self._poll_s = poll_s

    async def send(self, delivery_id: str, text: str) -> str:
        body: dict[str, Any] = {
            "messaging_product": "whatsapp",
            "recipient_type": "individual",
            "to": self._target.address,
            "type": "text",
            "text": {"body": text},
            "biz_opaque_callback_data": delivery_id,
        }
        if self._target.reply_to:
            body["context"] = {"message_id": self._target.reply_to}
        headers = {"Authorization": f"Bearer {self._token}"}
        try:
            async with (
                asyncio.timeout(CALL_TIMEOUT_S),
                self._session.post(self._url, json=body, headers=headers) as response,
            ):
                answer = await _json(response)
                if response.status >= 300:
                    error = answer.get("error") if isinstance(answer, dict) else None
                    message = (error or {}).get("message") if isinstance(error, dict) else None
                    raise _status_failure(
                        response.status,
                        f"WhatsApp refused the message: {message or f'HTTP {response.status}'}",
                        {k.lower(): v for k, v in response.headers.items()},
                    )
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise _unreachable(exc, "WhatsApp did not answer") from None
        messages = answer.get("messages") if isinstance(answer, dict) else None
        return str(messages[0].get("id", "")) if messages else ""

    async def find(self, delivery_id: str) -> str | None:
        """Wait up to the reconcile window for a status callback naming the delivery."""
        deadline = time.monotonic() + self._reconcile_s
        while True:
            found = await self._status(delivery_id)
            if found is not None:
                return found
            if time.monotonic() >= deadline:
                return None
            # The callback arrives on its own schedule (Meta's); polling the record is the only
            # way to see it from here.
            await asyncio.sleep(min(self._poll_s, max(deadline - time.monotonic(), 0.0)))


class WebhookSender:
    """A signed POST to the connection's reply URL; the receiver deduplicates on webhook-id."""

    can_look_up = False

    def __init__(self, sending: Sending, target: ReplyTarget, session: aiohttp.ClientSession):
        self._target = target
        self._session = session
        self._url = sending.reply_url
        self._signer = Webhook(sending.signing_secret.decode())

    async def send(self, delivery_id: str, text: str) -> str:
        if not self._url:
            raise Refused(
                RunError("delivery_no_reply_url", "the webhook connection has no reply_url")
            )
        target = self._target
        body = json.dumps(
            {
                "type": "tether.reply",
                "delivery_id": delivery_id,
                "address": target.address,
                "thread": target.thread,
                "reply_to": target.reply_to,
                "text": text,
            },
            separators=(",", ":"),
        )
        now = datetime.now(UTC)
        headers = {
            "Content-Type": "application/json",
            "webhook-id": delivery_id,
            "webhook-timestamp": str(int(now.timestamp())),
            "webhook-signature": self._signer.sign(delivery_id, now, body),
        }
        try:
            async with (
                asyncio.timeout(CALL_TIMEOUT_S),
                self._session.post(self._url, data=body.encode(), headers=headers) as response,
            ):
                if response.status >= 300:
                    raise _status_failure(
                        response.status,
                        f"the reply URL answered HTTP {response.status}",
                        {k.lower(): v for k, v in response.headers.items()},
                    )
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise _unreachable(exc, "the reply URL did not answer") from None
        return delivery_id

    async def find(self, delivery_id: str) -> str | None:
        return None  # nothing to ask: re-sending is safe


async def _json(response: aiohttp.ClientResponse) -> Any:
    try:
        return await response.json(content_type=None)
    except ValueError:
        return None


def sender_for(
    sending: Sending,
    target: ReplyTarget,
    session: aiohttp.ClientSession,
    *,
    status: StatusLookup,
    reconcile_s: float,
) -> Sender:
    """The sender of the connection's kind."""
    if sending.kind == "slack":
        return SlackSender(sending, target, session)
    if sending.kind == "whatsapp":
        return WhatsAppSender(sending, target, session, status=status, reconcile_s=reconcile_s)
    return WebhookSender(sending, target, session)
