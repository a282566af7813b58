"""Bridge v2 as a browser meets it, against the real gateway over HTTP: an empty Authorization
header is no header (the CSRF check holds), a session cookie that is not UTF-8 is a signed-out
caller."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
import pytest_asyncio

from tests.system.execution_support import ExecStack, exec_stack
from tests.system.streaming_support import prompt

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
