"""The WhatsApp Cloud API's wire shapes for the local stand-in (`whatsapp_server`): the faults a
test scripts, Graph's error body, the stored messages, the call and callback logs."""

from __future__ import annotations

import math
import secrets
from dataclasses import asdict, dataclass, field
from typing import Any, Generic, TypeVar

_T = TypeVar("_T")

DEFAULT_ACCESS_TOKEN = "EAAtether-test-token"
DEFAULT_APP_SECRET = "tether-test-app-secret"
DEFAULT_PHONE_NUMBER_ID = "106540352242922"
DEFAULT_DISPLAY_PHONE_NUMBER = "15550783881"
DEFAULT_BUSINESS_ACCOUNT_ID = "102290129340398"
MAX_TEXT_CHARS = 4096
"""A text message's body is at most 4,096 characters; longer is refused with code 100."""

CALLBACK_TIMEOUT_S = 10.0
"""Meta gives a webhook a few seconds; a test receiver slower than this is reported as an error."""
INVALID_TOKEN = 190
"""Graph's `OAuthException` code for a missing, malformed or expired access token."""
INVALID_PARAMETER = 100
RATE_LIMIT_HIT = 130429
"""Cloud API throughput reached for the phone number."""
PAIR_RATE_LIMIT_HIT = 131056
"""Too many messages from the business number to one recipient in a short time."""


@dataclass(frozen=True)
class RateLimited:
    """Answer 429 with Graph's error `code` and, when given, `Retry-After: retry_after`."""

    retry_after: int | None = None
    code: int = RATE_LIMIT_HIT


@dataclass(frozen=True)
class HttpFailure:
    """Answer a bare HTTP status (e.g. 503): the provider cannot be asked."""

    status: int = 503


@dataclass(frozen=True)
class GraphError:
    """Answer `status` with Graph's error body (e.g. 400, code 131026 undeliverable)."""

    status: int
    code: int
    message: str = "(#131000) Something went wrong"
    error_subcode: int | None = None


Fault = RateLimited | HttpFailure | GraphError


def fault_from_json(raw: Any) -> Fault:
    """`{"kind": "rate_limited", "retry_after": 2, "code": 131056}`, `{"kind": "http",
    "status": 503}` or `{"kind": "error", "status": 400, "code": 131026, "message": ...}`."""
    kind = raw["kind"]
    if kind == "rate_limited":
        after = raw.get("retry_after")
        return RateLimited(None if after is None else int(after), int(raw.get("code", 130429)))
    if kind == "http":
        return HttpFailure(int(raw.get("status", 503)))
    if kind == "error":
        subcode = raw.get("error_subcode")
        return GraphError(
            int(raw["status"]),
            int(raw["code"]),
            str(raw.get("message", GraphError.message)),
            None if subcode is None else int(subcode),
        )
    raise ValueError(f"unknown fault kind {kind!r}")


@dataclass(frozen=True)
class StatusPlan:
    """How the status callbacks of one accepted message are sent: after `delay_s`, or not at all
    (`drop`: the provider never reports, so a sender cannot learn whether it delivered)."""

    delay_s: float = 0.0
    drop: bool = False


def status_plan_from_json(raw: Any) -> StatusPlan:
    """`{"delay_s": 1.5}` or `{"drop": true}`."""
    if not isinstance(raw, dict):
        raise TypeError("expected an object with delay_s and/or drop")
    delay = float(raw.get("delay_s", 0.0))
    if not math.isfinite(delay) or delay < 0:
        raise ValueError("delay_s must be a finite number of seconds, at least 0")
    drop = raw.get("drop", False)
    if not isinstance(drop, bool):
        raise TypeError("drop must be true or false")
    return StatusPlan(delay, drop)


def graph_error(
    code: int, message: str, *, kind: str = "OAuthException", error_subcode: int | None = None
) -> dict[str, Any]:
    """Graph's error body; `fbtrace_id` differs per answer as Meta's does."""
    error: dict[str, Any] = {"message": message, "type": kind, "code": code}
    if error_subcode is not None:
        error["error_subcode"] = error_subcode
    error["fbtrace_id"] = "A" + secrets.token_urlsafe(16)
    return {"error": error}


@dataclass
class WhatsAppMessage:
    """A message the business sent and the stand-in accepted."""

    id: str
    phone_number_id: str
    to: str
    text: str
    timestamp: int
    biz_opaque_callback_data: str | None = None
    context_message_id: str | None = None


@dataclass
class RecordedCall:
    """One API call as it arrived and how it was answered."""

    http_method: str
    path: str
    token: str | None
    body: Any
    timestamp: float
    status: int = 0
    answer: dict[str, Any] | None = None
    outcome: str = "pending"
    """`answered`, `held` (stored, answer not yet sent), `disconnected`, `server_stopped`."""

    def to_json(self) -> dict[str, Any]:
        """The record as `GET /_requests` lists it."""
        return asdict(self)


@dataclass
class StatusCallback:
    """One status callback the stand-in posted (or tried to) to the webhook URL."""

    message_id: str
    status: str
    url: str
    body: dict[str, Any]
    answered: int | None = None
    """The webhook's HTTP status; None when it could not be reached."""
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The record as `GET /_callbacks` lists it."""
        return asdict(self)


@dataclass
class _Scripted(Generic[_T]):
    what: _T
    remaining: int | None  # None: until cleared


@dataclass
class ScriptQueue(Generic[_T]):
    """Scripted answers in order, each for a number of calls or until cleared."""

    _queue: list[_Scripted[_T]] = field(default_factory=list)

    def add(self, what: _T, times: int | None) -> None:
        """`what` for the next `times` calls (None: every call until cleared)."""
        if times is not None and times < 1:
            raise ValueError("times must be at least 1, or None for every call")
        self._queue.append(_Scripted(what, times))

    def take(self) -> _T | None:
        """What the next call gets, or None when nothing is scripted."""
        if not self._queue:
            return None
        head = self._queue[0]
        if head.remaining is not None:
            head.remaining -= 1
            if head.remaining == 0:
                self._queue.pop(0)
        return head.what

    def clear(self) -> None:
        """Forget everything scripted."""
        self._queue.clear()


def invalid_text_message(body: Any) -> str | None:
    """Why a send is not a text message the Cloud API accepts, or None."""
    if not isinstance(body, dict):
        return "(#100) The parameter messaging_product is required."
    if body.get("messaging_product") != "whatsapp":
        return "(#100) The parameter messaging_product is required."
    if not isinstance(body.get("to"), str) or not body["to"]:
        return "(#100) The parameter to is required."
    if body.get("recipient_type", "individual") != "individual":
        return "(#100) Param recipient_type must be one of {INDIVIDUAL, GROUP}."
    if body.get("type", "text") != "text":
        return f"(#100) The stand-in sends only text messages, not {body.get('type')!r}."
    text = body.get("text")
    if not isinstance(text, dict) or not isinstance(text.get("body"), str) or not text["body"]:
        return "(#100) The parameter text['body'] is required."
    if len(text["body"]) > MAX_TEXT_CHARS:
        return f"(#100) Param text['body'] must be at most {MAX_TEXT_CHARS} characters long."
    context = body.get("context")
    if context is not None and not (
        isinstance(context, dict) and isinstance(context.get("message_id"), str)
    ):
        return "(#100) Param context['message_id'] must be a valid message id."
    opaque = body.get("biz_opaque_callback_data")
    if opaque is not None and (not isinstance(opaque, str) or len(opaque) > 512):
        return "(#100) Param biz_opaque_callback_data must be a string of at most 512 characters."
    return None
