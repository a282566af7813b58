"""A local Slack Web API: `chat.postMessage`, `conversations.replies`, `auth.test` on the wire.

Point the real SDK at it (`AsyncWebClient(token=server.bot_token, base_url=server.api_url)`)
and script what it answers per test. In process::

    async with SlackServer() as slack:
        slack.script("chat.postMessage", RateLimited(retry_after=2), times=1)
        slack.hold_post_answers()  # posts are stored, their answers wait for release_post_answers()
        event = slack.user_message("C1", "U1", "hello")  # stored, and the event_callback to send
        ...
        assert [m.text for m in slack.thread("C1", event["event"]["ts"])] == ["hello", "answer"]

As Slack answers: HTTP 200 with `{"ok": false, "error": ...}` for every refusal except a rate
limit (429 with `Retry-After`); `not_authed` without a token, `invalid_auth` for a wrong one.
Tokens come as `Authorization: Bearer xoxb-...` or a `token` form field; bodies are form or JSON.

Out of process: `python -m tether.testing.slack_server --port 0 [--bot-token T]
[--webhook-url URL] [--signing-secret S]` prints `slack listening http://HOST:PORT`; drive it with
the control API (`tether.testing.slack_control`): `POST /_script`, `POST /_hold`, `POST /_webhook`
(`{"url", "signing_secret"}`: where a person's messages are delivered), `POST /_user_message`
(`{"channel", "user", "text", "thread_ts"?}`: stored, delivered to the webhook signed as Slack
signs, answered with the webhook's status), `GET /_requests`, `GET /_messages?channel=C`,
`POST /_reset`.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from tether.testing.local_server import LocalServer, run_cli
from tether.testing.slack_control import SlackControl
from tether.testing.slack_events import DEFAULT_TEAM_ID, message_event
from tether.testing.slack_push import Pushed, WebhookTarget, push
from tether.testing.slack_wire import (
    BOT_ID,
    BOT_USER_ID,
    DEFAULT_BOT_TOKEN,
    DEMO_SIGNING_SECRET,
    MAX_REPLIES_PAGE,
    MAX_TEXT_CHARS,
    ApiError,
    Fault,
    HttpFailure,
    RateLimited,
    RecordedCall,
    SlackMessage,
    fault_from_json,
    parse_metadata,
    read_call,
)

__all__ = [
    "ApiError",
    "Fault",
    "HttpFailure",
    "RateLimited",
    "RecordedCall",
    "SlackMessage",
    "SlackServer",
    "fault_from_json",
    "main",
]


class _Stopped(Exception):
    """The server began stopping while an answer was held."""


@dataclass
class _Scripted:
    fault: Fault
    remaining: int | None  # None: until cleared


@dataclass
class _Channel:
    messages: list[SlackMessage] = field(default_factory=list)


class SlackServer(LocalServer):
    """The server. `start()` binds (port 0 picks a free one); `stop()` ends held answers.

    State lives on the event loop that called `start()`.
    """

    name = "slack"

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        bot_token: str = DEFAULT_BOT_TOKEN,
        team_id: str = DEFAULT_TEAM_ID,
        webhook_url: str | None = None,
        signing_secret: str = DEMO_SIGNING_SECRET,
    ) -> None:
        super().__init__(host, port)
        self.bot_token = bot_token
        self.team_id = team_id
        self.webhook = None if webhook_url is None else WebhookTarget(webhook_url, signing_secret)
        self._channels: dict[str, _Channel] = {}
        self._scripts: dict[str, list[_Scripted]] = {}
        self._calls: list[RecordedCall] = []
        self._seconds = int(time.time())
        self._sequence = itertools.count(1)
        self._answer_posts = asyncio.Event()
        self._answer_posts.set()
        self._closing = asyncio.Event()
        self._changed = asyncio.Event()

    @property
    def api_url(self) -> str:
        """The SDK's `base_url`: `http://HOST:PORT/api/`."""
        return self.base_url + "/api/"

    def runner_options(self) -> dict[str, Any]:
        """Handler cancellation: a caller that disconnects while its answer is held (killed)
        cancels the handler, which records `disconnected`."""
        return {"handler_cancellation": True, "access_log": None, "shutdown_timeout": 1.0}

    async def start(self) -> None:
        """Bind and begin serving."""
        self._closing.clear()
        await super().start()

    async def stop(self) -> None:
        """Stop: held answers end without being sent."""
        self._closing.set()
        await super().stop()

    # Scripting -------------------------------------------------------------------------------

    def script(self, method: str, fault: Fault, times: int | None = 1) -> None:
        """The next `times` calls of `method` get `fault` (None: every call until `clear_script`).

        Faults queue in order: `script(m, RateLimited(2), times=2)` then `script(m, ApiError(...))`
        answers two 429s, then the error, then normally again.
        """
        if times is not None and times < 1:
            raise ValueError("times must be at least 1, or None for every call")
        self._scripts.setdefault(method, []).append(_Scripted(fault, times))

    def clear_script(self, method: str | None = None) -> None:
        """Forget scripted faults for `method` (None: every method)."""
        if method is None:
            self._scripts.clear()
        else:
            self._scripts.pop(method, None)

    def hold_post_answers(self) -> None:
        """From now on a `chat.postMessage` is stored, then its answer waits for release."""
        self._answer_posts.clear()

    def release_post_answers(self) -> None:
        """Send every held answer, and answer later posts at once."""
        self._answer_posts.set()

    def user_message(
        self, channel: str, user: str, text: str, *, thread_ts: str | None = None, **event: Any
    ) -> dict[str, Any]:
        """Store a person's message in the channel; returns the `event_callback` Slack would send
        for it (`event` passes `event_id`, `subtype`, ... on to `message_event`)."""
        message = self._store(SlackMessage(channel, self._next_ts(), text, user, thread_ts))
        return message_event(
            channel=channel,
            user=user,
            text=text,
            ts=message.ts,
            thread_ts=thread_ts,
            team_id=self.team_id,
            **event,
        )

    def set_webhook(self, url: str | None, signing_secret: str = DEMO_SIGNING_SECRET) -> None:
        """Deliver a person's messages to `url` (the app's Request URL), signed with
        `signing_secret`; None: deliver nowhere."""
        self.webhook = None if url is None else WebhookTarget(url, signing_secret)

    async def send_user_message(
        self, channel: str, user: str, text: str, *, thread_ts: str | None = None, **event: Any
    ) -> tuple[dict[str, Any], Pushed | None]:
        """`user_message`, then its `event_callback` POSTed to the webhook, signed as Slack signs
        it: the body and how the app answered (None: no webhook set)."""
        body = self.user_message(channel, user, text, thread_ts=thread_ts, **event)
        target = self.webhook
        return body, None if target is None else await push(target, body)

    def reset(self) -> None:
        """Forget messages, scripts and the call log, and answer posts at once again."""
        self._channels.clear()
        self._scripts.clear()
        self._calls.clear()
        self._answer_posts.set()

    # Reading back ----------------------------------------------------------------------------

    def messages(self, channel: str) -> list[SlackMessage]:
        """Every message in the channel, threads included, in the order they were stored."""
        return list(self._channels.get(channel, _Channel()).messages)

    def thread(self, channel: str, thread_ts: str) -> list[SlackMessage]:
        """The thread's parent (when stored) then its replies, as `conversations.replies` lists
        them; `thread_ts` may name the parent or any reply, as Slack allows."""
        stored = self._channels.get(channel, _Channel()).messages
        named = next((m for m in stored if m.ts == thread_ts), None)
        parent = thread_ts if named is None or named.thread_ts is None else named.thread_ts
        return [m for m in stored if parent in (m.ts, m.thread_ts)]

    def posts(self, channel: str | None = None) -> list[SlackMessage]:
        """What the bot posted (in `channel`, or anywhere), oldest first."""
        chosen = [self._channels[channel]] if channel in self._channels else []
        every = self._channels.values() if channel is None else chosen
        return sorted(
            (m for c in every for m in c.messages if m.bot_id is not None), key=lambda m: m.ts
        )

    @property
    def calls(self) -> list[RecordedCall]:
        """A copy of the call log, oldest first."""
        return list(self._calls)

    async def wait_until(self, predicate: Callable[[Sequence[RecordedCall]], bool]) -> None:
        """Wait until `predicate(log)` holds; re-checked on every call and every answer.

        Has no timeout of its own: wrap it in `asyncio.timeout(...)`.
        """
        while not predicate(self._calls):
            await self._changed.wait()

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    # The app ---------------------------------------------------------------------------------

    def build_app(self) -> web.Application:
        """The aiohttp application."""
        app = web.Application()
        app.router.add_route("*", "/api/{method}", self._api)
        SlackControl(self).add_routes(app)
        return app

    async def _api(self, request: web.Request) -> web.StreamResponse:
        method = request.match_info["method"]
        params, token = await read_call(request)
        call = RecordedCall(method, request.method, token, params, time.time())
        self._calls.append(call)
        self._notify()
        try:
            return await self._answer(method, call)
        except _Stopped:
            # The caller never hears back, as when Slack stored a post and the connection broke.
            call.outcome = "server_stopped"
            if request.transport is not None:
                request.transport.abort()
            return web.Response(status=499)
        except asyncio.CancelledError:
            if call.outcome in ("pending", "held"):
                call.outcome = "server_stopped" if self._closing.is_set() else "disconnected"
            raise
        finally:
            self._notify()

    async def _answer(self, method: str, call: RecordedCall) -> web.StreamResponse:
        handler = self._methods().get(method)
        if handler is None:
            return self._reply(call, {"ok": False, "error": "unknown_method"})
        if call.token is None:
            return self._reply(call, {"ok": False, "error": "not_authed"})
        if call.token != self.bot_token:
            return self._reply(call, {"ok": False, "error": "invalid_auth"})
        fault = self._take_fault(method)
        if isinstance(fault, RateLimited):
            return self._reply(
                call,
                {"ok": False, "error": "ratelimited"},
                status=429,
                headers={"Retry-After": str(fault.retry_after)},
            )
        if isinstance(fault, HttpFailure):
            call.status, call.outcome = fault.status, "answered"
            return web.Response(status=fault.status, text="upstream unavailable")
        if isinstance(fault, ApiError):
            return self._reply(call, {"ok": False, "error": fault.error})
        return await handler(call)

    def _methods(self) -> dict[str, Callable[[RecordedCall], Awaitable[web.StreamResponse]]]:
        return {
            "chat.postMessage": self._post_message,
            "conversations.replies": self._replies,
            "auth.test": self._auth_test,
        }

    def _take_fault(self, method: str) -> Fault | None:
        queue = self._scripts.get(method)
        if not queue:
            return None
        head = queue[0]
        if head.remaining is not None:
            head.remaining -= 1
            if head.remaining == 0:
                queue.pop(0)
        return head.fault

    def _reply(
        self,
        call: RecordedCall,
        body: dict[str, Any],
        *,
        status: int = 200,
        headers: dict[str, str] | None = None,
    ) -> web.Response:
        call.status, call.answer, call.outcome = status, body, "answered"
        return web.json_response(body, status=status, headers=headers)

    async def _post_message(self, call: RecordedCall) -> web.StreamResponse:
        params = call.params
        channel = params.get("channel")
        text = params.get("text")
        if not channel:
            return self._reply(call, {"ok": False, "error": "channel_not_found"})
        if not text and not params.get("blocks") and not params.get("attachments"):
            return self._reply(call, {"ok": False, "error": "no_text"})
        if text is not None and len(str(text)) > MAX_TEXT_CHARS:
            return self._reply(call, {"ok": False, "error": "msg_too_long"})
        metadata, problem = parse_metadata(params.get("metadata"))
        if problem is not None:
            return self._reply(call, {"ok": False, "error": problem})
        thread_ts = params.get("thread_ts") or None
        message = self._store(
            SlackMessage(
                str(channel),
                self._next_ts(),
                str(text or ""),
                BOT_USER_ID,
                None if thread_ts is None else str(thread_ts),
                BOT_ID,
                metadata,
            )
        )
        if not self._answer_posts.is_set():
            call.outcome = "held"
            self._notify()
            await self._held()
        return self._reply(
            call,
            {
                "ok": True,
                "channel": message.channel,
                "ts": message.ts,
                "message": message.to_json(include_metadata=True),
            },
        )

    async def _held(self) -> None:
        """Wait for release; raises `_Stopped` when the server stops first."""
        release = asyncio.ensure_future(self._answer_posts.wait())
        closing = asyncio.ensure_future(self._closing.wait())
        try:
            await asyncio.wait({release, closing}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            release.cancel()
            closing.cancel()
        if not self._answer_posts.is_set():
            raise _Stopped

    async def _replies(self, call: RecordedCall) -> web.StreamResponse:
        params = call.params
        channel, ts = params.get("channel"), params.get("ts")
        if not channel or str(channel) not in self._channels:
            return self._reply(call, {"ok": False, "error": "channel_not_found"})
        if not ts:
            return self._reply(call, {"ok": False, "error": "invalid_arguments"})
        thread = self.thread(str(channel), str(ts))
        if not thread:
            return self._reply(call, {"ok": False, "error": "thread_not_found"})
        try:
            limit = min(int(params.get("limit") or MAX_REPLIES_PAGE), MAX_REPLIES_PAGE)
            start = int(params.get("cursor") or 0)
        except ValueError:
            return self._reply(call, {"ok": False, "error": "invalid_cursor"})
        include = str(params.get("include_all_metadata", "")).lower() in ("true", "1")
        page = thread[start : start + limit]
        following = start + limit if start + limit < len(thread) else None
        return self._reply(
            call,
            {
                "ok": True,
                "messages": [m.to_json(include_metadata=include) for m in page],
                "has_more": following is not None,
                "response_metadata": {"next_cursor": "" if following is None else str(following)},
            },
        )

    async def _auth_test(self, call: RecordedCall) -> web.StreamResponse:
        return self._reply(
            call,
            {
                "ok": True,
                "url": "https://tether-test.slack.com/",
                "team": "Tether Test",
                "user": "tether",
                "team_id": self.team_id,
                "user_id": BOT_USER_ID,
                "bot_id": BOT_ID,
                "is_enterprise_install": False,
            },
        )

    def _store(self, message: SlackMessage) -> SlackMessage:
        self._channels.setdefault(message.channel, _Channel()).messages.append(message)
        return message

    def _next_ts(self) -> str:
        """Slack's `SECONDS.SEQUENCE`: unique and increasing, compared as text by callers."""
        return f"{self._seconds}.{next(self._sequence):06d}"


# Command line ---------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m tether.testing.slack_server [--host H] [--port P] [--bot-token T]
    [--webhook-url URL] [--signing-secret S]`."""

    def options(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--bot-token", default=DEFAULT_BOT_TOKEN)
        parser.add_argument("--webhook-url", help="where a person's messages are delivered")
        parser.add_argument(
            "--signing-secret", default=DEMO_SIGNING_SECRET, help="what deliveries are signed with"
        )

    run_cli(
        __doc__,
        lambda args: SlackServer(
            args.host,
            args.port,
            bot_token=args.bot_token,
            webhook_url=args.webhook_url,
            signing_secret=args.signing_secret,
        ),
        argv,
        extra=options,
    )


if __name__ == "__main__":
    main()
