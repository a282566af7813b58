"""Bridge v2 as a browser meets it, against the real gateway over HTTP: an empty Authorization
header is no header (the CSRF check holds), a session cookie that is not UTF-8 is a signed-out
caller, and the runs list shows what a parked run has cost so far, as its run page does."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
import pytest_asyncio

from tests.system.execution_support import ExecStack, exec_stack, wait_for_status
from tests.system.streaming_support import prompt
from tether.testing.model_server import TextTurn, ToolUseTurn

UNAUTHENTICATED = {"status": "UNAUTHENTICATED", "code": "unauthenticated"}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(
    pg_server_url: str, template_db: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ExecStack]:
    async with exec_stack(
        pg_server_url,
        template_db,
        redis_url,
        Path(tmp_path_factory.mktemp("v2-edges")),
        workers=1,
    ) as running:
        yield running


def base(stack: ExecStack) -> str:
    return f"http://{stack.services.http_addresses()['gateway']}"


def listed(response: httpx2.Response) -> list[dict[str, Any]]:
    assert response.status_code == 200, response.text
    runs: list[dict[str, Any]] = response.json().get("runs", [])
    return runs


async def test_an_empty_authorization_header_does_not_skip_the_csrf_check(
    stack: ExecStack,
) -> None:
    tenant = await stack.tenant()
    async with httpx2.AsyncClient(base_url=base(stack), timeout=30) as http:
        opened = await http.post("/v2/session", json={"apiKey": tenant.api_key})
        assert opened.status_code == 201, opened.text
        message = {"text": prompt("csrf"), "conversationId": "c-csrf", "eventId": "e-csrf"}
        # A blank header is an empty one on the wire: HTTP strips a value's surrounding spaces.
        empty = {"Authorization": ""}
        refused = await http.post(
            "/v2/messages", json=message, headers={**empty, "Origin": "https://evil.example"}
        )
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"]["code"] == "cross_origin"
        without_token = await http.post("/v2/messages", json=message, headers=empty)
        assert without_token.status_code == 403, without_token.text
        assert without_token.json()["error"]["code"] == "csrf_required"
        assert listed(await http.get("/v2/runs")) == [], "nothing was created"
        # Read without a mutation, an empty header still means the cookie signs the call in.
        assert (await http.get("/v2/runs", headers=empty)).status_code == 200


async def test_a_session_cookie_that_is_not_utf8_is_a_signed_out_caller(stack: ExecStack) -> None:
    tenant = await stack.tenant()
    async with httpx2.AsyncClient(base_url=base(stack), timeout=30) as http:
        signed_in = await http.post("/v2/session", json={"apiKey": tenant.api_key})
        csrf = signed_in.json()["csrfToken"]
        cookie = b"tether_session=ts_\xff\xfe" + signed_in.cookies["tether_session"][3:].encode()
        message = {"text": prompt("latin"), "conversationId": "c-latin", "eventId": "e-latin"}
        answers: dict[str, tuple[int, str]] = {}
        sent = json.dumps(message).encode()
        for method, path, extra, body in (
            ("GET", "/v2/runs", {}, b""),
            ("GET", "/v2/session", {}, b""),
            ("GET", f"/v2/runs/run_{uuid.uuid4().hex}/events", {}, b""),
            ("POST", "/v2/messages", {"X-CSRF-Token": csrf}, sent),
            ("DELETE", "/v2/session", {"X-CSRF-Token": csrf}, b""),
            # A JSON escape makes the same lone surrogate in a signing-in key.
            ("POST", "/v2/session", {}, rb'{"apiKey": "tk_\udcff"}'),
        ):
            async with httpx2.AsyncClient(base_url=base(stack), timeout=30) as stranger:
                answer = await stranger.request(
                    method, path, headers={"Cookie": cookie, **extra}, content=body
                )
            answers[f"{method} {path}"] = (answer.status_code, answer.text)
        for what, (status, body_text) in answers.items():
            assert status == 401, {w: (s, t[:60]) for w, (s, t) in answers.items()}
            error = json.loads(body_text)["error"]
            assert {k: error[k] for k in UNAUTHENTICATED} == UNAUTHENTICATED, (what, error)
        assert listed(await http.get("/v2/runs")) == [], "nothing was created"


async def test_the_runs_list_shows_what_a_parked_run_has_cost_so_far(stack: ExecStack) -> None:
    tenant = await stack.tenant()
    text = prompt("publish")
    stack.model.script(text, [ToolUseTurn("publish_post", {"text": "hello"}), TextTurn("ok")])
    run_id = await tenant.send(text)
    await wait_for_status(stack.db_url, run_id, "waiting-for-approval")
    auth = {"Authorization": f"Bearer {tenant.api_key}"}
    async with httpx2.AsyncClient(base_url=base(stack), timeout=30) as http:
        # The run page's cost: the running total of the run's usage.updated event.
        page_cost = None
        async with (
            asyncio.timeout(20),
            http.stream("GET", f"/v2/runs/{run_id}/events?deltas=false", headers=auth) as events,
        ):
            assert events.status_code == 200
            async for frame in httpx2.EventSource(events):
                if frame.event == "usage.updated":
                    page_cost = frame.json()["event"]["usageUpdated"]["total"]["costMicros"]
                    break
        assert page_cost is not None and int(page_cost) > 0
        runs = listed(await http.get("/v2/runs", headers=auth))
        assert [(r["runId"], r.get("usage", {}).get("costMicros")) for r in runs] == [
            (run_id, page_cost)
        ]
        by_id = (await http.get(f"/v2/runs/{run_id}", headers=auth)).json()["run"]
        assert by_id["usage"]["costMicros"] == page_cost
