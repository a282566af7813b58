"""A local WhatsApp Cloud API: `POST /{version}/{phone_number_id}/messages` on the wire, and the
signed status callbacks (`sent`, `delivered`) Meta posts to the app's webhook afterwards.

Point the runtime at it (`api_base_url=server.base_url`, the access token, the phone number id)
and script what it answers per test. In process::

    async with WhatsAppServer(webhook_url=receiver_url) as whatsapp:
        whatsapp.script(RateLimited(retry_after=2), times=1)
        whatsapp.script_statuses(StatusPlan(drop=True))  # accepted, never reported
        whatsapp.hold_answers()  # messages are stored, their answers wait for release_answers()
        ...
        assert [m.text for m in whatsapp.messages("15551234567")] == ["answer"]

As Graph answers: `{"messaging_product", "contacts", "messages": [{"id": "wamid..."}]}` on
success; refusals in Graph's error shape (`{"error": {"message", "type", "code",
"error_subcode"?, "fbtrace_id"}}`): 401 code 190 for a missing or wrong token, 400 code 100 for
an invalid parameter, 429 with code 130429 or 131056 (and `Retry-After` when scripted so).

Out of process: `python -m tether.testing.whatsapp_server --port 0 [--access-token T]
[--app-secret S] [--webhook-url URL]` prints `whatsapp listening http://HOST:PORT`; script it
with `POST /_script` (`{"fault", "times"}`, fault as in `fault_from_json`), `POST /_statuses`
(`{"plan": {"delay_s", "drop"}, "times"}`), `POST /_hold` (`{"held": bool}`), `POST /_webhook`
(`{"url"}`), read `GET /_requests`, `GET /_messages?to=N` and `GET /_callbacks`, clear
everything with `POST /_reset`.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import aiohttp
from aiohttp import web

from tether.testing.local_server import LocalServer, run_cli
from tether.testing.whatsapp_events import encode, new_message_id, sign, status_update
from tether.testing.whatsapp_wire import (
    CALLBACK_TIMEOUT_S,
    DEFAULT_ACCESS_TOKEN,
    DEFAULT_APP_SECRET,
    DEFAULT_BUSINESS_ACCOUNT_ID,
    DEFAULT_DISPLAY_PHONE_NUMBER,
    DEFAULT_PHONE_NUMBER_ID,
    INVALID_PARAMETER,
    INVALID_TOKEN,
    Fault,
    GraphError,
    HttpFailure,
    RateLimited,
    RecordedCall,
    ScriptQueue,
    StatusCallback,
    StatusPlan,
    WhatsAppMessage,
    fault_from_json,
    graph_error,
    invalid_text_message,
    status_plan_from_json,
)

__all__ = [
    "Fault",
    "GraphError",
    "HttpFailure",
    "RateLimited",
    "RecordedCall",
    "StatusCallback",
    "StatusPlan",
    "WhatsAppMessage",
    "WhatsAppServer",
    "fault_from_json",
    "main",
]

_VERSION = re.compile(r"v\d+\.\d+")


class _Stopped(Exception):
    """The server began stopping while an answer was held."""


class WhatsAppServer(LocalServer):
    """The server. `start()` binds (port 0 picks a free one); `stop()` ends held answers and
    cancels status callbacks not yet posted.

    State lives on the event loop that called `start()`.
    """

    name = "whatsapp"

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        access_token: str = DEFAULT_ACCESS_TOKEN,
        app_secret: str = DEFAULT_APP_SECRET,
        phone_number_id: str = DEFAULT_PHONE_NUMBER_ID,
        display_phone_number: str = DEFAULT_DISPLAY_PHONE_NUMBER,
        business_account_id: str = DEFAULT_BUSINESS_ACCOUNT_ID,
        webhook_url: str | None = None,
    ) -> None:
        super().__init__(host, port)
        self.access_token = access_token
        self.app_secret = app_secret
        self.phone_number_id = phone_number_id
        self.display_phone_number = display_phone_number
        self.business_account_id = business_account_id
        self.webhook_url = webhook_url
        self._messages: list[WhatsAppMessage] = []
        self._faults: ScriptQueue[Fault] = ScriptQueue()
        self._plans: ScriptQueue[StatusPlan] = ScriptQueue()
        self._calls: list[RecordedCall] = []
        self._callbacks: list[StatusCallback] = []
        self._senders: set[asyncio.Task[None]] = set()
        self._session: aiohttp.ClientSession | None = None
        self._answer_now = asyncio.Event()
        self._answer_now.set()
        self._closing = asyncio.Event()
        self._changed = asyncio.Event()

    @property
    def messages_url(self) -> str:
        """Where the business posts messages: `http://HOST:PORT/v21.0/{phone_number_id}/messages`."""
        return f"{self.base_url}/v21.0/{self.phone_number_id}/messages"

    def runner_options(self) -> dict[str, Any]:
        """Handler cancellation: a caller that disconnects while its answer is held (killed)
        cancels the handler, which records `disconnected`."""
        return {"handler_cancellation": True, "access_log": None, "shutdown_timeout": 1.0}

    async def start(self) -> None:
        """Bind and begin serving."""
        self._closing.clear()
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=CALLBACK_TIMEOUT_S)
        )
        await super().start()

    async def stop(self) -> None:
        """Stop: held answers end without being sent, pending callbacks are never posted."""
        self._closing.set()
        for sender in list(self._senders):
            sender.cancel()
        if self._senders:
            await asyncio.wait(self._senders)
        await super().stop()
        if self._session is not None:
            await self._session.close()
            self._session = None

    # Scripting -------------------------------------------------------------------------------

    def script(self, fault: Fault, times: int | None = 1) -> None:
        """The next `times` sends get `fault` (None: every send until `clear_script`); faults
        queue in order, as the Slack stand-in's do."""
        self._faults.add(fault, times)

    def clear_script(self) -> None:
        """Forget scripted faults."""
        self._faults.clear()

    def script_statuses(self, plan: StatusPlan, times: int | None = 1) -> None:
        """The next `times` accepted messages report their statuses as `plan` says (None: every
        one until `clear_statuses`); unscripted, `sent` then `delivered` go out at once."""
        self._plans.add(plan, times)

    def clear_statuses(self) -> None:
        """Forget scripted status plans."""
        self._plans.clear()

    def hold_answers(self) -> None:
        """From now on a message is stored (and its statuses planned), then its answer waits."""
        self._answer_now.clear()

    def release_answers(self) -> None:
        """Send every held answer, and answer later sends at once."""
        self._answer_now.set()

    def reset(self) -> None:
        """Forget messages, scripts and logs, and answer at once again."""
        self._messages.clear()
        self._faults.clear()
        self._plans.clear()
        self._calls.clear()
        self._callbacks.clear()
        self._answer_now.set()

    # Reading back ----------------------------------------------------------------------------

    def messages(self, to: str | None = None) -> list[WhatsAppMessage]:
        """Messages accepted (to `to`, or anyone), oldest first."""
        return [m for m in self._messages if to is None or m.to == to]

    @property
    def calls(self) -> list[RecordedCall]:
        """A copy of the call log, oldest first."""
        return list(self._calls)

    @property
    def callbacks(self) -> list[StatusCallback]:
        """A copy of the status callbacks posted (or attempted), oldest first."""
        return list(self._callbacks)

    async def wait_until(self, predicate: Callable[[WhatsAppServer], bool]) -> None:
        """Wait until `predicate(server)` holds; re-checked on every call, answer and callback.

        Has no timeout of its own: wrap it in `asyncio.timeout(...)`.
        """
        while not predicate(self):
            await self._changed.wait()

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    # The app ---------------------------------------------------------------------------------

    def build_app(self) -> web.Application:
        """The aiohttp application."""
        app = web.Application()
        app.router.add_post("/{version}/{phone_number_id}/messages", self._api)
        app.router.add_post("/_script", self._control_script)
        app.router.add_post("/_statuses", self._control_statuses)
        app.router.add_post("/_hold", self._control_hold)
        app.router.add_post("/_webhook", self._control_webhook)
        app.router.add_get("/_requests", self._control_requests)
        app.router.add_get("/_messages", self._control_messages)
        app.router.add_get("/_callbacks", self._control_callbacks)
        app.router.add_post("/_reset", self._control_reset)
        app.router.add_get("/_health", self._control_health)
        return app

    async def _api(self, request: web.Request) -> web.StreamResponse:
        try:
            body: Any = await request.json()
        except ValueError:
            body = None
        authorization = request.headers.get("Authorization", "")
        token = authorization.removeprefix("Bearer ").strip() or None
        if not authorization.startswith("Bearer "):
            token = None
        call = RecordedCall(request.method, request.path, token, body, time.time())
        self._calls.append(call)
        self._notify()
        try:
            return await self._answer(request, call)
        except _Stopped:
            # The caller never hears back, as when Meta accepted a message and the connection broke.
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

    async def _answer(self, request: web.Request, call: RecordedCall) -> web.StreamResponse:
        if call.token is None:
            return self._refuse(call, 401, INVALID_TOKEN, "An active access token must be used")
        if call.token != self.access_token:
            return self._refuse(
                call, 401, INVALID_TOKEN, "Invalid OAuth access token - Cannot parse access token"
            )
        version = request.match_info["version"]
        if not _VERSION.fullmatch(version):
            return self._refuse(call, 400, 2500, f"Unknown path components: /{version}")
        if request.match_info["phone_number_id"] != self.phone_number_id:
            return self._refuse(
                call,
                400,
                INVALID_PARAMETER,
                "Unsupported post request. Object with ID "
                f"'{request.match_info['phone_number_id']}' does not exist",
                kind="GraphMethodException",
                error_subcode=33,
            )
        fault = self._faults.take()
        if isinstance(fault, RateLimited):
            headers = None if fault.retry_after is None else {"Retry-After": str(fault.retry_after)}
            return self._refuse(
                call, 429, fault.code, f"(#{fault.code}) Rate limit hit", headers=headers
            )
        if isinstance(fault, HttpFailure):
            call.status, call.outcome = fault.status, "answered"
            return web.Response(status=fault.status, text="upstream unavailable")
        if isinstance(fault, GraphError):
            return self._refuse(
                call, fault.status, fault.code, fault.message, error_subcode=fault.error_subcode
            )
        problem = invalid_text_message(call.body)
        if problem is not None:
            return self._refuse(call, 400, INVALID_PARAMETER, problem)
        return await self._accept(call)

    def _refuse(
        self,
        call: RecordedCall,
        status: int,
        code: int,
        message: str,
        *,
        kind: str = "OAuthException",
        error_subcode: int | None = None,
        headers: dict[str, str] | None = None,
    ) -> web.Response:
        body = graph_error(code, message, kind=kind, error_subcode=error_subcode)
        return self._reply(call, body, status=status, headers=headers)

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

    async def _accept(self, call: RecordedCall) -> web.StreamResponse:
        body: dict[str, Any] = call.body
        context = body.get("context")
        opaque = body.get("biz_opaque_callback_data")
        message = WhatsAppMessage(
            new_message_id(),
            self.phone_number_id,
            str(body["to"]),
            str(body["text"]["body"]),
            int(time.time()),
            None if opaque is None else str(opaque),
            context.get("message_id") if isinstance(context, dict) else None,
        )
        self._messages.append(message)
        self._plan_statuses(message, self._plans.take() or StatusPlan())
        if not self._answer_now.is_set():
            call.outcome = "held"
            self._notify()
            await self._held()
        return self._reply(
            call,
            {
                "messaging_product": "whatsapp",
                "contacts": [{"input": message.to, "wa_id": message.to}],
                "messages": [{"id": message.id}],
            },
        )

    async def _held(self) -> None:
        """Wait for release; raises `_Stopped` when the server stops first."""
        release = asyncio.ensure_future(self._answer_now.wait())
        closing = asyncio.ensure_future(self._closing.wait())
        try:
            await asyncio.wait({release, closing}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            release.cancel()
            closing.cancel()
        if not self._answer_now.is_set():
            raise _Stopped

    # Status callbacks ------------------------------------------------------------------------

    def _plan_statuses(self, message: WhatsAppMessage, plan: StatusPlan) -> None:
        if plan.drop or self.webhook_url is None:
            return
        sender = asyncio.create_task(
            self._send_statuses(message, self.webhook_url, plan.delay_s),
            name=f"whatsapp-statuses-{message.id[:16]}",
        )
        self._senders.add(sender)
        sender.add_done_callback(self._senders.discard)

    async def _send_statuses(self, message: WhatsAppMessage, url: str, delay_s: float) -> None:
        if delay_s:
            await asyncio.sleep(delay_s)  # the scripted provider delay, not a synchronisation
        for status in ("sent", "delivered"):
            body = status_update(
                message_id=message.id,
                status=status,
                recipient_id=message.to,
                biz_opaque_callback_data=message.biz_opaque_callback_data,
                phone_number_id=self.phone_number_id,
                display_phone_number=self.display_phone_number,
                business_account_id=self.business_account_id,
            )
            record = StatusCallback(message.id, status, url, body)
            self._callbacks.append(record)
            await self._post_callback(record)
            self._notify()

    async def _post_callback(self, record: StatusCallback) -> None:
        assert self._session is not None, "status callbacks are only planned while serving"
        raw = encode(record.body)
        headers = {"Content-Type": "application/json", **sign(raw, self.app_secret)}
        try:
            async with self._session.post(record.url, data=raw, headers=headers) as response:
                record.answered = response.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            # Meta would retry later; the stand-in records the miss for the test to see.
            record.error = f"{type(exc).__name__}: {exc}"

    # Control (for a stand-in run as a subprocess) ---------------------------------------------

    async def _control_script(self, request: web.Request) -> web.StreamResponse:
        try:
            payload = await request.json()
            fault = fault_from_json(payload["fault"])
            times = payload.get("times", 1)
            self.script(fault, None if times is None else int(times))
        except (ValueError, KeyError, TypeError) as exc:
            return web.json_response({"error": f"expected {{'fault', 'times'}}: {exc}"}, status=400)
        return web.json_response({"ok": True})

    async def _control_statuses(self, request: web.Request) -> web.StreamResponse:
        try:
            payload = await request.json()
            plan = status_plan_from_json(payload["plan"])
            times = payload.get("times", 1)
            self.script_statuses(plan, None if times is None else int(times))
        except (ValueError, KeyError, TypeError) as exc:
            return web.json_response({"error": f"expected {{'plan', 'times'}}: {exc}"}, status=400)
        return web.json_response({"ok": True})

    async def _control_hold(self, request: web.Request) -> web.StreamResponse:
        try:
            held = (await request.json())["held"]
        except (ValueError, KeyError, TypeError) as exc:
            return web.json_response({"error": f"expected {{'held': bool}}: {exc}"}, status=400)
        if held:
            self.hold_answers()
        else:
            self.release_answers()
        return web.json_response({"ok": True})

    async def _control_webhook(self, request: web.Request) -> web.StreamResponse:
        try:
            url = (await request.json())["url"]
        except (ValueError, KeyError, TypeError) as exc:
            return web.json_response({"error": f"expected {{'url': str}}: {exc}"}, status=400)
        if url is not None and not isinstance(url, str):
            return web.json_response({"error": "url must be a string or null"}, status=400)
        self.webhook_url = url
        return web.json_response({"ok": True})

    async def _control_requests(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"requests": [c.to_json() for c in self._calls]})

    async def _control_messages(self, request: web.Request) -> web.StreamResponse:
        shown = self.messages(request.query.get("to"))
        return web.json_response({"messages": [asdict(m) for m in shown]})

    async def _control_callbacks(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"callbacks": [c.to_json() for c in self._callbacks]})

    async def _control_reset(self, request: web.Request) -> web.StreamResponse:
        self.reset()
        return web.json_response({"ok": True})

    async def _control_health(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"ok": True})


# Command line ---------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m tether.testing.whatsapp_server [--host H] [--port P] [--access-token T]
    [--app-secret S] [--webhook-url URL]`."""

    def options(parser: Any) -> None:
        parser.add_argument("--access-token", default=DEFAULT_ACCESS_TOKEN)
        parser.add_argument("--app-secret", default=DEFAULT_APP_SECRET)
        parser.add_argument("--phone-number-id", default=DEFAULT_PHONE_NUMBER_ID)
        parser.add_argument("--webhook-url", default=None)

    run_cli(
        __doc__,
        lambda args: WhatsAppServer(
            args.host,
            args.port,
            access_token=args.access_token,
            app_secret=args.app_secret,
            phone_number_id=args.phone_number_id,
            webhook_url=args.webhook_url,
        ),
        argv,
        extra=options,
    )


if __name__ == "__main__":
    main()
