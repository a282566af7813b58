"""Bridge v2 with the services as processes, driven by a real HTTP client: every body and SSE
frame is the gRPC message in protobuf's JSON mapping; browser sessions (cookie + CSRF) and
tokens; another tenant's run is a 404 like an absent one, on the live list too; the edge rules
(no credentials in URLs, CORS for a configured origin, security headers, the console)."""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import httpx2
import pytest
import pytest_asyncio
import redis.asyncio as redis
from google.protobuf import json_format
from google.protobuf.message import Message
from sqlalchemy import select, text, update

from tests.system.execution_support import (
    ExecStack,
    Tenant,
    exec_stack,
    run_row,
    wait_for_status,
)
from tests.system.streaming_support import prompt
from tether import apikeys
from tether.db.engine import create_engine
from tether.db.schema import api_keys, browser_credentials
from tether.hints import EVENTS_PATTERN, Audience, LiveMessage, decode_events
from tether.testing.eventually import eventually
from tether.testing.model_server import TextTurn
from tether.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

ALLOWED_ORIGIN = "https://app.example.com"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(
    pg_server_url: str, template_db: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ExecStack]:
    console = Path(tmp_path_factory.mktemp("console"))
    (console / "assets").mkdir()
    (console / "index.html").write_text("<!doctype html><title>console</title>")
    (console / "assets" / "app.js").write_text("console.log('app')")
    async with exec_stack(
        pg_server_url,
        template_db,
        redis_url,
        Path(tmp_path_factory.mktemp("v2")),
        workers=1,
        extra_env={
            "TETHER_GATEWAY_CORS_ORIGINS": f"{ALLOWED_ORIGIN}, https://other.example.com",
            "TETHER_GATEWAY_CONSOLE_DIR": str(console),
            "TETHER_GATEWAY_LIVE_LIST_REREAD_S": "30",  # changes must arrive woken, not polled
            "TETHER_GATEWAY_KEY_CACHE_TTL_S": "1",  # expiry and revocation tests wait it out
        },
    ) as running:
        yield running


def base(stack: ExecStack) -> str:
    return f"http://{stack.services.http_addresses()['gateway']}"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def parsed(data: dict[str, Any], into: Message) -> Any:
    """`data` parsed strictly (no unknown field ignored) into the message `into`."""
    json_format.ParseDict(data, into)
    return into


async def key_of(stack: ExecStack, tenant_id: str, scopes: Sequence[str]) -> tuple[str, str]:
    """Another key of the tenant with `scopes`: (secret, key id)."""
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.begin() as conn:
            secret, principal = await apikeys.create_key(conn, tenant_id, "tester", list(scopes))
    finally:
        await engine.dispose()
    return secret, principal.key_id


async def execute(stack: ExecStack, statement: Any) -> Any:
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.begin() as conn:
            return (await conn.execute(statement)).all()
    finally:
        await engine.dispose()


async def completed_run(stack: ExecStack, tenant: Tenant, words: str = "done") -> str:
    text_ = prompt("v2")
    stack.model.script(text_, [TextTurn(words)])
    run_id = await tenant.send(text_)
    await wait_for_status(stack.db_url, run_id, "completed")
    return run_id


@asynccontextmanager
async def sse(
    http: httpx2.AsyncClient, url: str, headers: dict[str, str]
) -> AsyncIterator[AsyncIterator[httpx2.ServerSentEvent]]:
    async with http.stream("GET", url, headers=headers) as response:
        assert response.status_code == 200, await response.aread()
        yield httpx2.EventSource(response).__aiter__()


async def frame_until(
    frames: AsyncIterator[httpx2.ServerSentEvent], done: Any, timeout: float = 20.0
) -> list[httpx2.ServerSentEvent]:
    """Frames until one for which `done(frame)` holds (included)."""
    seen: list[httpx2.ServerSentEvent] = []
    async with asyncio.timeout(timeout):
        async for frame in frames:
            seen.append(frame)
            if done(frame):
                return seen
    raise AssertionError(f"the stream ended first: {[f.event for f in seen]}")


# -- one JSON --------------------------------------------------------------------------------


async def test_every_v2_body_and_frame_is_the_grpc_message_in_protobufs_json(
    stack: ExecStack,
) -> None:
    tenant = await stack.tenant()
    docs_key, _ = await key_of(
        stack, tenant.tenant_id, ["documents:read", "documents:write", "runs:read"]
    )
    text_ = prompt("json")
    stack.model.script(text_, [TextTurn("the answer")])
    conversation = f"c-{uuid.uuid4().hex[:8]}"
    auth = bearer(tenant.api_key)
    async with httpx2.AsyncClient(base_url=base(stack), timeout=30) as http:
        async with sse(http, "/v2/runs/live?pageSize=5", auth) as live:
            first = await anext(live)
            assert first.event == "runs"
            parsed(first.json(), gateway_pb2.ListRunsResponse())
            sent = await http.post(
                "/v2/messages",
                json={"text": text_, "conversationId": conversation},
                headers={**auth, "Idempotency-Key": f"e-{uuid.uuid4().hex}"},
            )
            assert sent.status_code == 200, sent.text
            assert "disposition" in sent.json() and "run" in sent.json()
            run_id = parsed(sent.json(), gateway_pb2.SendMessageResponse()).run.run_id
            changed = await frame_until(
                live, lambda f: f.event == "run" and f.json()["run"]["runId"] == run_id
            )
            parsed(changed[-1].json(), gateway_pb2.StreamRunsResponse())
        await wait_for_status(stack.db_url, run_id, "completed")
        async with sse(http, f"/v2/runs/{run_id}/events", auth) as frames:
            seen = [frame async for frame in frames]
        assert seen[0].event == "snapshot"
        snapshot = parsed(seen[0].json(), gateway_pb2.StreamRunResponse())
        assert snapshot.snapshot.run.run_id == run_id
        events = [parsed(f.json(), gateway_pb2.StreamRunResponse()) for f in seen[1:]]
        assert [f.id for f in seen[1:]] == [str(e.event.seq) for e in events]
        assert events[-1].event.type == "run.completed"
        assert "runId" in seen[-1].json()["event"], "lowerCamelCase"
        durable_ids = [f.id for f in seen[1:] if f.id]
        resume = {**auth, "Last-Event-ID": durable_ids[1]}
        async with sse(http, f"/v2/runs/{run_id}/events?deltas=false", resume) as frames:
            resumed = [frame async for frame in frames]
        assert resumed[0].event == "snapshot"
        assert [f.id for f in resumed[1:]] == durable_ids[2:], "after the cursor, no delta"
        async with sse(http, f"/v2/conversations/{conversation}/events", auth) as frames:
            one = await anext(frames)
        parsed(one.json(), gateway_pb2.StreamConversationResponse())
        assert one.id == one.json()["cursor"]
        got = (await http.get(f"/v2/runs/{run_id}", headers=auth)).json()
        run = parsed(got, gateway_pb2.GetRunResponse()).run
        assert run.status == common_pb2.RUN_STATUS_COMPLETED and got["run"]["status"] == (
            "RUN_STATUS_COMPLETED"
        )
        listed = await http.get(
            "/v2/runs",
            params=[("status", "RUN_STATUS_COMPLETED"), ("conversationId", conversation)],
            headers=auth,
        )
        listed_runs = parsed(listed.json(), gateway_pb2.ListRunsResponse()).runs
        assert [r.run_id for r in listed_runs] == [run_id]
        assert run.routing.model, "a leased run shows the model it was routed to"
        assert listed_runs[0].routing == run.routing, "the list shows what a read by id does"
        attempts = (await http.get(f"/v2/runs/{run_id}/attempts", headers=auth)).json()
        assert parsed(attempts, gateway_pb2.GetRunAttemptsResponse()).attempts
        pending = await http.get(f"/v2/runs/{run_id}/pending-question", headers=auth)
        assert pending.status_code == 200, pending.text
        parsed(pending.json(), gateway_pb2.GetPendingQuestionResponse())
        cancelled = await http.post(f"/v2/runs/{run_id}/cancel", json={}, headers=auth)
        assert not parsed(cancelled.json(), gateway_pb2.CancelRunResponse()).changed
        added = await http.post(
            "/v2/documents", json={"title": "T", "content": "words"}, headers=bearer(docs_key)
        )
        assert added.status_code == 201, added.text
        document_id = parsed(added.json(), gateway_pb2.AddDocumentResponse()).document.document_id
        documents = (await http.get("/v2/documents?pageSize=10", headers=bearer(docs_key))).json()
        assert [
            d.document_id for d in parsed(documents, gateway_pb2.ListDocumentsResponse()).documents
        ] == [document_id]
        removed = await http.delete(f"/v2/documents/{document_id}", headers=bearer(docs_key))
        parsed(removed.json(), gateway_pb2.RemoveDocumentResponse())
        bad = await http.post("/v2/messages", json={"text": "x", "nope": 1}, headers=auth)
        assert bad.status_code == 400 and bad.json()["error"]["status"] == "INVALID_ARGUMENT"
        bad_status = await http.get("/v2/runs?status=RUNNING", headers=auth)
        assert bad_status.status_code == 400
        bad_time = await http.get("/v2/runs?createdAfter=yesterday", headers=auth)
        assert bad_time.status_code == 400 and "createdAfter" in bad_time.json()["error"]["message"]
        since = run.created_at.ToJsonString()
        later = await http.get("/v2/runs", params={"createdAfter": since}, headers=auth)
        assert run_id in [
            r.run_id for r in parsed(later.json(), gateway_pb2.ListRunsResponse()).runs
        ]
        # v1 is unchanged: snake_case.
        v1 = (await http.get(f"/v1/runs/{run_id}", headers=auth)).json()
        assert v1["run"]["run_id"] == run_id


# -- tenancy ---------------------------------------------------------------------------------


async def test_another_tenants_run_is_absent_on_v2_and_never_on_its_live_list(
    stack: ExecStack,
) -> None:
    owner, other = await stack.tenant(), await stack.tenant()
    async with httpx2.AsyncClient(base_url=base(stack), timeout=30) as http:
        async with sse(http, "/v2/runs/live", bearer(other.api_key)) as live:
            page = (await anext(live)).json()
            assert page.get("runs", []) == []
            theirs = await completed_run(stack, owner)
            absent = f"run_{uuid.uuid4().hex}"
            for suffix, method in (
                ("", "GET"),
                ("/attempts", "GET"),
                ("/events", "GET"),
                ("/pending-question", "GET"),
                ("/cancel", "POST"),
                ("/retry", "POST"),
            ):
                answers = [
                    await http.request(
                        method, f"/v2/runs/{run}{suffix}", headers=bearer(other.api_key)
                    )
                    for run in (theirs, absent)
                ]
                assert [a.status_code for a in answers] == [404, 404], suffix
                assert answers[0].content == answers[1].content.replace(
                    absent.encode(), theirs.encode()
                ), suffix
            mine = await completed_run(stack, other)
            frames = await frame_until(
                live, lambda f: f.event == "run" and f.json()["run"]["runId"] == mine
            )
        assert theirs not in str([f.data for f in frames]), "another tenant's run never shows"


# -- the live list ---------------------------------------------------------------------------


async def test_a_runs_live_messages_say_whose_run_it_is(stack: ExecStack, redis_url: str) -> None:
    """Every committed event the orchestrator publishes names the run's tenant and owner: a
    gateway's live lists wake only for runs their callers may see (tests/integration's
    test_event_hub), so a message that named nobody would wake every list of every tenant."""
    tenant = await stack.tenant()
    client = redis.Redis.from_url(redis_url)
    listening = client.pubsub()
    try:
        await listening.psubscribe(EVENTS_PATTERN)
        confirmed = await listening.get_message(timeout=10)
        assert confirmed is not None and confirmed["type"] == "psubscribe"
        run_id = await completed_run(stack, tenant)
        heard: list[LiveMessage] = []
        while not any(m.type == "run.completed" for m in heard):
            message = await listening.get_message(timeout=10)
            assert message is not None, f"heard only {[m.type for m in heard]}"
            heard += [m for m in decode_events(message["data"]) if m.run_id == run_id and m.seq]
        owner = (await run_row(stack.db_url, run_id)).owner_principal_id
        assert owner, "a chat run has an owner"
        assert {m.audience for m in heard} == {Audience(tenant.tenant_id, owner)}
    finally:
        await listening.aclose()
        await client.aclose()


async def test_the_live_list_shows_a_new_run_and_its_changes_and_a_reconnect_misses_nothing(
    stack: ExecStack,
) -> None:
    tenant = await stack.tenant()
    auth = bearer(tenant.api_key)
    async with httpx2.AsyncClient(base_url=base(stack), timeout=30) as http:
        async with sse(http, "/v2/runs/live", auth) as live:
            assert (await anext(live)).event == "runs"
            text_ = prompt("live")
            # Long enough to be seen running (then cancelled: the test never waits it out).
            stack.model.script(text_, [TextTurn("w " * 200, chunks=["w "] * 200, delay_ms=50)])
            run_id = await tenant.send(text_)

            def run_in(status: str) -> Any:
                return lambda f: (
                    f.event == "run"
                    and f.json()["run"]["runId"] == run_id
                    and f.json()["run"]["status"] == status
                )

            await frame_until(live, run_in("RUN_STATUS_RUNNING"))
            cancelled = await http.post(f"/v2/runs/{run_id}/cancel", json={}, headers=auth)
            assert cancelled.status_code == 200, cancelled.text
            await frame_until(live, run_in("RUN_STATUS_CANCELLED"))
        # Away: a run is made and finishes while no stream is open.
        while_away = await completed_run(stack, tenant)
        async with sse(http, "/v2/runs/live?status=RUN_STATUS_COMPLETED", auth) as live:
            page = parsed((await anext(live)).json(), gateway_pb2.ListRunsResponse())
        assert [r.run_id for r in page.runs] == [while_away], "what changed while away"
        async with sse(http, "/v2/runs/live", auth) as live:
            page = parsed((await anext(live)).json(), gateway_pb2.ListRunsResponse())
        assert [r.run_id for r in page.runs] == [while_away, run_id], "newest first"


async def test_a_quiet_live_list_sends_keepalive_comments(stack: ExecStack) -> None:
    tenant = await stack.tenant()
    async with (
        httpx2.AsyncClient(base_url=base(stack), timeout=30) as http,
        http.stream("GET", "/v2/runs/live", headers=bearer(tenant.api_key)) as response,
    ):
        assert response.status_code == 200
        lines = aiter(response.aiter_lines())
        async with asyncio.timeout(20):  # the keepalive interval is 5 s; re-reads every 30 s
            seen = [line async for line in _until(lines, ": keepalive")]
    assert "event: runs" in seen, seen
    assert not any(line.startswith("event: run") and line != "event: runs" for line in seen)


async def _until(lines: AsyncIterator[str], wanted: str) -> AsyncIterator[str]:
    async for line in lines:
        yield line
        if line == wanted:
            return
    raise AssertionError(f"the stream ended before {wanted!r}")


async def test_stream_runs_over_grpc_with_a_token(stack: ExecStack) -> None:
    tenant = await stack.tenant()
    async with httpx2.AsyncClient(base_url=base(stack), timeout=30) as http:
        minted = await http.post(
            "/v2/tokens", json={"scopes": ["runs:read"]}, headers=bearer(tenant.api_key)
        )
    token = minted.json()["token"]
    metadata = (("authorization", f"Bearer {token}"),)
    async with grpc.aio.insecure_channel(stack.addr("gateway")) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        listed = await stub.ListRuns(gateway_pb2.ListRunsRequest(), metadata=metadata)
        assert list(listed.runs) == []
        call = stub.StreamRuns(gateway_pb2.StreamRunsRequest(page_size=3), metadata=metadata)
        first = await call.read()
        assert first.HasField("page")
        run_id = await completed_run(stack, tenant)
        async with asyncio.timeout(20):
            while True:
                item = await call.read()
                if item.run.run_id == run_id and item.run.status == common_pb2.RUN_STATUS_COMPLETED:
                    break
        call.cancel()
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.SendMessage(
                gateway_pb2.SendMessageRequest(text="x", conversation_id="c", event_id="e"),
                metadata=metadata,
            )
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.aio.AioRpcError) as bad_limit:
            await stub.StreamRuns(
                gateway_pb2.StreamRunsRequest(conversation_id="no spaces allowed"),
                metadata=metadata,
            ).read()
        assert bad_limit.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# -- sessions --------------------------------------------------------------------------------


async def test_a_browser_session_signs_in_checks_csrf_and_signs_out(stack: ExecStack) -> None:
    tenant = await stack.tenant()
    async with httpx2.AsyncClient(base_url=base(stack), timeout=30) as http:
        opened = await http.post("/v2/session", json={"apiKey": tenant.api_key})
        assert opened.status_code == 201, opened.text
        cookie_header = opened.headers["set-cookie"]
        flags = {part.strip().split("=")[0].lower() for part in cookie_header.split(";")}
        assert {"httponly", "path", "max-age", "samesite"} <= flags
        assert "samesite=strict" in cookie_header.lower()
        assert "secure" not in flags, "no Secure on loopback"
        body = opened.json()
        assert set(body) == {"csrfToken", "expiresAt", "tenantId", "principal", "scopes"}
        assert body["tenantId"] == tenant.tenant_id
        cookie = http.cookies["tether_session"]
        stored = await execute(
            stack, browser_credentials.select().where(browser_credentials.c.kind == "session")
        )
        assert hashlib.sha256(cookie.encode()).digest() in {row.secret_hash for row in stored}
        assert cookie not in str(stored), "the secret itself is never stored"
        again = await http.get("/v2/session")
        assert again.status_code == 200 and again.json()["csrfToken"] == body["csrfToken"]
        assert (await http.get("/v2/runs")).status_code == 200

        text_ = prompt("csrf")
        message = {"text": text_, "conversationId": "c-csrf", "eventId": f"e-{uuid.uuid4().hex}"}
        for headers, code in (
            ({}, "csrf_required"),
            ({"X-CSRF-Token": "wrong"}, "csrf_mismatch"),
            ({"X-CSRF-Token": body["csrfToken"], "Origin": "https://evil.example"}, "cross_origin"),
        ):
            refused = await http.post("/v2/messages", json=message, headers=headers)
            assert refused.status_code == 403, refused.text
            assert refused.json()["error"]["code"] == code
        assert (await http.get("/v2/runs")).json().get("runs", []) == [], "nothing changed"
        origin = base(stack)
        sent = await http.post(
            "/v2/messages",
            json=message,
            headers={"X-CSRF-Token": body["csrfToken"], "Origin": origin},
        )
        assert sent.status_code == 200, sent.text
        # A session is a cookie only: its secret as a bearer credential is refused.
        as_bearer = await httpx2.AsyncClient(base_url=base(stack)).get(
            "/v2/runs", headers=bearer(cookie)
        )
        assert as_bearer.status_code == 401
        # Sign-out needs the CSRF token too; then the session is gone server-side.
        assert (await http.delete("/v2/session")).status_code == 403
        assert (await http.get("/v2/session")).status_code == 200
        async with sse(http, "/v2/runs/live", {}) as live:
            assert (await anext(live)).event == "runs"
            closed = await http.delete("/v2/session", headers={"X-CSRF-Token": body["csrfToken"]})
            assert closed.status_code == 204
            # An open stream of the session ends too, with the error as its last frame.
            ended = await frame_until(live, lambda f: f.event == "error", timeout=10)
        assert ended[-1].json() == {
            "error": {
                "status": "UNAUTHENTICATED",
                "code": "unauthenticated",
                "message": "the session is not valid (unknown, revoked or expired)",
            }
        }
        assert (
            'tether_session=""' in closed.headers["set-cookie"]
            or "Max-Age=0" in (closed.headers["set-cookie"])
        )
        async with httpx2.AsyncClient(base_url=base(stack), timeout=30) as replay:
            replay.cookies.set("tether_session", cookie)
            assert (await replay.get("/v2/session")).status_code == 401
            assert (await replay.get("/v2/runs")).status_code == 401
        # Behind a non-loopback host name the cookie is Secure.
        remote = await http.post(
            "/v2/session", json={"apiKey": tenant.api_key}, headers={"Host": "tether.example.com"}
        )
        assert "secure" in remote.headers["set-cookie"].lower()
        assert (await http.post("/v2/session", json={"apiKey": "tk_nope"})).status_code == 401


async def test_sessions_and_tokens_expire_and_die_with_their_key(stack: ExecStack) -> None:
    tenant = await stack.tenant()
    key, key_id = await key_of(stack, tenant.tenant_id, apikeys.CLIENT_SCOPES)
    async with httpx2.AsyncClient(base_url=base(stack), timeout=30) as http:
        session = await http.post("/v2/session", json={"apiKey": key})
        cookie = session.cookies["tether_session"]
        short = await http.post("/v2/session", json={"apiKey": key})
        expiring_cookie = short.cookies["tether_session"]
        token = (await http.post("/v2/tokens", json={}, headers=bearer(key))).json()["token"]
        expiring = (
            await http.post("/v2/tokens", json={"ttlSeconds": 60}, headers=bearer(key))
        ).json()["token"]

        async def works(headers: dict[str, str], cookies: dict[str, str] | None = None) -> int:
            async with httpx2.AsyncClient(base_url=base(stack), cookies=cookies) as one:
                return (await one.get("/v2/runs", headers=headers)).status_code

        assert await works(bearer(token)) == 200
        assert await works({}, {"tether_session": cookie}) == 200
        assert await works(bearer(expiring)) == 200
        assert await works({}, {"tether_session": expiring_cookie}) == 200
        hashes = [hashlib.sha256(s.encode()).digest() for s in (expiring, expiring_cookie)]
        await execute(
            stack,
            update(browser_credentials)
            .where(browser_credentials.c.secret_hash.in_(hashes))
            .values(expires_at=text("now() - interval '1 second'"))
            .returning(browser_credentials.c.credential_id),
        )

        async def refused(headers: dict[str, str], cookies: dict[str, str] | None = None) -> bool:
            return await works(headers, cookies) == 401

        await eventually(lambda: refused(bearer(expiring)), timeout=8, what="expired token")
        await eventually(
            lambda: refused({}, {"tether_session": expiring_cookie}),
            timeout=8,
            what="expired session",
        )
        assert await works(bearer(token)) == 200
        assert await works({}, {"tether_session": cookie}) == 200
        await execute(
            stack,
            update(api_keys)
            .where(api_keys.c.key_id == key_id)
            .values(revoked_at=text("now()"))
            .returning(api_keys.c.key_id),
        )
        await eventually(lambda: refused(bearer(token)), timeout=8, what="token of revoked key")
        await eventually(
            lambda: refused({}, {"tether_session": cookie}),
            timeout=8,
            what="session of revoked key",
        )


async def test_an_expired_credential_leaves_the_table_without_another_mint(
    stack: ExecStack,
) -> None:
    tenant = await stack.tenant()
    key, _ = await key_of(stack, tenant.tenant_id, apikeys.CLIENT_SCOPES)
    async with httpx2.AsyncClient(base_url=base(stack), timeout=30) as http:
        minted = [
            (await http.post("/v2/tokens", json=body, headers=bearer(key))).json()["token"]
            for body in ({}, {"ttlSeconds": 2})
        ]
    lasting, brief = (hashlib.sha256(secret.encode()).digest() for secret in minted)

    async def stored() -> set[bytes]:
        rows = await execute(
            stack,
            select(browser_credentials.c.secret_hash).where(
                browser_credentials.c.secret_hash.in_([lasting, brief])
            ),
        )
        return {row.secret_hash for row in rows}

    assert await stored() == {lasting, brief}

    # The key mints nothing more: the gateway's sweep, woken by the brief token, removes it
    # once it expires.
    async def swept() -> bool:
        return brief not in await stored()

    await eventually(swept, timeout=20, interval=0.2, what="the expired token swept")
    assert await stored() == {lasting}


async def test_tokens_carry_at_most_their_keys_scopes_and_mint_nothing(stack: ExecStack) -> None:
    tenant = await stack.tenant(scopes=[*apikeys.CLIENT_SCOPES, apikeys.KEYS_ADMIN])
    narrow, _ = await key_of(stack, tenant.tenant_id, ["runs:read"])
    async with httpx2.AsyncClient(base_url=base(stack), timeout=30) as http:
        minted = await http.post("/v2/tokens", json={}, headers=bearer(tenant.api_key))
        assert minted.status_code == 201, minted.text
        body = minted.json()
        assert body["token"].startswith("tt_") and "keys:admin" not in body["scopes"]
        assert set(body["scopes"]) == set(apikeys.CLIENT_SCOPES)
        token = body["token"]
        for payload, status in (
            ({"scopes": ["approvals:decide"]}, 403),
            ({"scopes": ["no:such"]}, 400),
            ({"ttlSeconds": 3601}, 400),
            ({"ttlSeconds": 0}, 400),
            ({"extra": 1}, 400),
        ):
            answer = await http.post("/v2/tokens", json=payload, headers=bearer(narrow))
            assert answer.status_code == status, (payload, answer.text)
        assert (await http.post("/v2/tokens", json={}, headers=bearer(token))).status_code == 401
        assert (await http.post("/v2/session", json={"apiKey": token})).status_code == 401
        assert (
            await http.post("/v1/keys", json={"principal_id": "p"}, headers=bearer(token))
        ).status_code == 403
        read_only = (
            await http.post("/v2/tokens", json={"scopes": ["runs:read"]}, headers=bearer(narrow))
        ).json()["token"]
        assert (await http.get("/v2/runs", headers=bearer(read_only))).status_code == 200
        refused = await http.post(
            "/v2/messages", json={"text": "x", "conversationId": "c"}, headers=bearer(read_only)
        )
        assert refused.status_code == 403


# -- the edge --------------------------------------------------------------------------------


async def test_the_edge_rules(stack: ExecStack) -> None:
    tenant = await stack.tenant()
    auth = bearer(tenant.api_key)
    async with httpx2.AsyncClient(base_url=base(stack), timeout=30) as http:
        for url in (
            "/v2/runs?token=x",
            "/v1/runs?API_KEY=x",
            "/v2/runs/live?Session=1",
            "/console?key=1",
        ):
            refused = await http.get(url, headers=auth)
            assert refused.status_code == 400, url
            assert refused.json()["error"]["code"] == "credentials_in_url"

        preflight = {
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization",
        }
        allowed = await http.options(
            "/v2/messages", headers={"Origin": ALLOWED_ORIGIN, **preflight}
        )
        assert allowed.status_code == 204
        assert allowed.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
        assert "Authorization" in allowed.headers["access-control-allow-headers"]
        assert "POST" in allowed.headers["access-control-allow-methods"]
        assert allowed.headers["access-control-max-age"]
        assert "access-control-allow-credentials" not in allowed.headers
        other = await http.options(
            "/v2/messages", headers={"Origin": "https://evil.example", **preflight}
        )
        assert not [h for h in other.headers if h.lower().startswith("access-control-")]
        actual = await http.get("/v2/runs", headers={**auth, "Origin": ALLOWED_ORIGIN})
        assert actual.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
        assert "Origin" in actual.headers["vary"]
        assert "access-control-allow-credentials" not in actual.headers
        stranger = await http.get("/v2/runs", headers={**auth, "Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in stranger.headers

        api = await http.get("/v2/runs", headers=auth)
        assert api.headers["cache-control"] == "no-store"
        assert api.headers["x-content-type-options"] == "nosniff"
        assert api.headers["referrer-policy"] == "no-referrer"
        assert (await http.get("/v1/runs", headers=auth)).headers["cache-control"] == "no-store"

        for path in ("/console", "/console/runs/run_123", "/console/assets/app.js"):
            page = await http.get(path)
            assert page.status_code == 200, path
            csp = page.headers["content-security-policy"]
            assert "frame-ancestors 'none'" in csp and "script-src 'self'" in csp
            assert page.headers["x-frame-options"] == "DENY"
            assert page.headers["x-content-type-options"] == "nosniff"
        assert "<title>console</title>" in (await http.get("/console/runs/run_1")).text
        assert (await http.get("/console/assets/app.js")).text == "console.log('app')"
        escaped = await http.get("/console/%2e%2e/%2e%2e/etc/passwd")
        assert escaped.status_code == 404 and "root:" not in escaped.text
