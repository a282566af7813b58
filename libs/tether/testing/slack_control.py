"""The Slack stand-in's control API, for a stand-in run as a subprocess (`python -m
tether.testing.slack_server`): script faults, hold answers, say where a person's message is
delivered, post one as a person, read back, reset.

- `POST /_script` `{"method", "fault", "times"}` (fault as in `slack_wire.fault_from_json`);
- `POST /_hold` `{"held": bool}`;
- `POST /_webhook` `{"url", "signing_secret"}` (url null: deliver nowhere): the app's Request
  URL and the signing secret Slack signs its deliveries with (`GET /_webhook` shows the URL,
  never the secret);
- `POST /_user_message` `{"channel", "user", "text", "thread_ts"?}`: stores the message and
  answers its `event_callback`; with a webhook set, that body is first POSTed there, signed, and
  the answer's HTTP status is the webhook's (502 when it was not reached);
- `GET /_requests`, `GET /_messages?channel=C`, `POST /_reset`, `GET /_health`.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from aiohttp import web

from tether.testing.slack_wire import fault_from_json

if TYPE_CHECKING:
    from tether.testing.slack_server import SlackServer


def _refused(message: str) -> web.Response:
    return web.json_response({"error": message}, status=400)


class SlackControl:
    """The control routes of one stand-in."""

    def __init__(self, server: SlackServer) -> None:
        self._server = server

    def add_routes(self, app: web.Application) -> None:
        """Add the control routes to the stand-in's app."""
        app.router.add_post("/_script", self._script)
        app.router.add_post("/_hold", self._hold)
        app.router.add_post("/_webhook", self._webhook)
        app.router.add_get("/_webhook", self._webhook_shown)
        app.router.add_post("/_user_message", self._user_message)
        app.router.add_get("/_requests", self._requests)
        app.router.add_get("/_messages", self._messages)
        app.router.add_post("/_reset", self._reset)
        app.router.add_get("/_health", self._health)

    async def _script(self, request: web.Request) -> web.StreamResponse:
        try:
            payload = await request.json()
            fault = fault_from_json(payload["fault"])
            times = payload.get("times", 1)
            count = None if times is None else int(times)
            self._server.script(str(payload["method"]), fault, count)
        except (ValueError, KeyError, TypeError) as exc:
            return _refused(str(exc))
        return web.json_response({"ok": True})

    async def _hold(self, request: web.Request) -> web.StreamResponse:
        try:
            payload = await request.json()
            held = payload["held"]
        except (ValueError, KeyError, TypeError) as exc:
            return _refused(f"expected {{'held': bool}}: {exc}")
        if held:
            self._server.hold_post_answers()
        else:
            self._server.release_post_answers()
        return web.json_response({"ok": True})

    async def _webhook(self, request: web.Request) -> web.StreamResponse:
        try:
            payload: Any = await request.json()
            url, secret = payload["url"], payload.get("signing_secret")
        except (ValueError, KeyError, TypeError) as exc:
            return _refused(f"expected {{'url': str, 'signing_secret': str}}: {exc}")
        if url is None:
            self._server.set_webhook(None)
            return web.json_response({"ok": True})
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            return _refused("url must be an http(s) URL, or null")
        if not isinstance(secret, str) or not secret:
            return _refused("signing_secret is required with a url")
        self._server.set_webhook(url, secret)
        return web.json_response({"ok": True})

    async def _webhook_shown(self, request: web.Request) -> web.StreamResponse:
        target = self._server.webhook
        return web.json_response({"url": None if target is None else target.url})

    async def _user_message(self, request: web.Request) -> web.StreamResponse:
        try:
            payload = await request.json()
            channel, user, text = (str(payload[k]) for k in ("channel", "user", "text"))
            thread_ts = payload.get("thread_ts")
        except (ValueError, KeyError, TypeError) as exc:
            return _refused(str(exc))
        event, pushed = await self._server.send_user_message(
            channel, user, text, thread_ts=thread_ts
        )
        if pushed is None:
            return web.json_response(event)
        if pushed.status == 0:
            refused = f"the webhook was not reached: {pushed.text}"
            return web.json_response({"error": refused, "event_callback": event}, status=502)
        return web.json_response(event, status=pushed.status)

    async def _requests(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"requests": [c.to_json() for c in self._server.calls]})

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        shown = self._server.messages(request.query.get("channel", ""))
        return web.json_response({"messages": [asdict(m) for m in shown]})

    async def _reset(self, request: web.Request) -> web.StreamResponse:
        self._server.reset()
        return web.json_response({"ok": True})

    async def _health(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"ok": True})
