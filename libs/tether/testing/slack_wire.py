"""The Slack Web API's wire shapes for the local stand-in (`slack_server`): the faults a test
scripts, the stored messages, the call log, and how a call's arguments and token are read."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from aiohttp import web

DEFAULT_BOT_TOKEN = "xoxb-tether-test-token"
# The demo Slack channel of `make run` (`tether channels add slack --demo`): the stand-in's
# well-known signing secret and bot token, so the demo needs no files. Never a real app's.
DEMO_SIGNING_SECRET = "tether-demo-signing-secret-not-for-production"
DEMO_BOT_TOKEN = DEFAULT_BOT_TOKEN
BOT_USER_ID = "U0TETHERBOT"
BOT_ID = "B0TETHERBOT"
MAX_TEXT_CHARS = 40_000
"""Slack truncates past 40,000 characters and refuses longer with `msg_too_long`."""
MAX_REPLIES_PAGE = 1000
"""`conversations.replies` answers at most 1,000 messages per page."""


@dataclass(frozen=True)
class RateLimited:
    """Answer 429 `{"ok": false, "error": "ratelimited"}` with `Retry-After: retry_after`."""

    retry_after: int


@dataclass(frozen=True)
class HttpFailure:
    """Answer a bare HTTP status (e.g. 503): the provider cannot be asked."""

    status: int = 503


@dataclass(frozen=True)
class ApiError:
    """Answer HTTP 200 `{"ok": false, "error": error}` (e.g. `fatal_error`, `internal_error`)."""

    error: str


Fault = RateLimited | HttpFailure | ApiError


def fault_from_json(raw: Any) -> Fault:
    """`{"kind": "rate_limited", "retry_after": 2}`, `{"kind": "http", "status": 503}` or
    `{"kind": "error", "error": "fatal_error"}`."""
    kind = raw["kind"]
    if kind == "rate_limited":
        return RateLimited(int(raw["retry_after"]))
    if kind == "http":
        return HttpFailure(int(raw.get("status", 503)))
    if kind == "error":
        return ApiError(str(raw["error"]))
    raise ValueError(f"unknown fault kind {kind!r}")


@dataclass
class SlackMessage:
    """A message in a channel; `thread_ts` is None for a top-level one."""

    channel: str
    ts: str
    text: str
    user: str
    thread_ts: str | None = None
    bot_id: str | None = None
    metadata: dict[str, Any] | None = None

    def to_json(self, *, include_metadata: bool) -> dict[str, Any]:
        """The message as `conversations.replies` lists it."""
        shown: dict[str, Any] = {"type": "message", "user": self.user, "text": self.text}
        shown["ts"] = self.ts
        if self.thread_ts is not None:
            shown["thread_ts"] = self.thread_ts
        if self.bot_id is not None:
            shown["bot_id"] = self.bot_id
            shown["app_id"] = "A0TETHER01"
        if include_metadata and self.metadata is not None:
            shown["metadata"] = self.metadata
        return shown


@dataclass
class RecordedCall:
    """One Web API call as it arrived and how it was answered."""

    method: str
    http_method: str
    token: str | None
    params: dict[str, Any]
    timestamp: float
    status: int = 0
    answer: dict[str, Any] | None = None
    outcome: str = "pending"
    """`answered`, `held` (stored, answer not yet sent), `disconnected`, `server_stopped`."""

    def to_json(self) -> dict[str, Any]:
        """The record as `GET /_requests` lists it."""
        return asdict(self)


async def read_call(request: web.Request) -> tuple[dict[str, Any], str | None]:
    """Arguments from the query string and a form or JSON body, and the token."""
    params: dict[str, Any] = dict(request.query)
    if request.content_type == "application/json":
        try:
            body = await request.json()
        except ValueError:
            body = None
        if isinstance(body, dict):
            params.update(body)
    elif request.can_read_body:
        params.update({k: v for k, v in (await request.post()).items() if isinstance(v, str)})
    token: str | None = None
    authorization = request.headers.get("Authorization", "")
    if authorization.startswith("Bearer "):
        token = authorization.removeprefix("Bearer ").strip() or None
    elif isinstance(params.get("token"), str):
        token = params["token"] or None
    params.pop("token", None)
    return params, token


def parse_metadata(raw: Any) -> tuple[dict[str, Any] | None, str | None]:
    """`metadata` as an object (JSON bodies) or JSON text (form bodies); or the refusal."""
    if raw is None or raw == "":
        return None, None
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            return None, "invalid_metadata_format"
    if not isinstance(raw, dict):
        return None, "invalid_metadata_format"
    if not isinstance(raw.get("event_type"), str) or not isinstance(raw.get("event_payload"), dict):
        return None, "invalid_metadata_schema"
    return {"event_type": raw["event_type"], "event_payload": raw["event_payload"]}, None
