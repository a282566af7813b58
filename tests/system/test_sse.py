"""The HTTP/SSE bridge with the services as processes, driven by a real HTTP client: events
resume from Last-Event-ID, the JSON endpoints mirror the gRPC calls, and auth answers with the
HTTP status of each gRPC code (another tenant's run looks exactly like a missing one)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx2
import pytest
import pytest_asyncio

from tests.system.execution_support import ExecStack, exec_stack, wait_for_status
from tests.system.streaming_support import key_with, prompt
from tether.testing.model_server import TextTurn, ToolUseTurn
from tether.transport import TERMINAL_TYPES


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(
    pg_server_url: str, template_db: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ExecStack]:
    async with exec_stack(
        pg_server_url, template_db, redis_url, Path(tmp_path_factory.mktemp("sse")), workers=1
    ) as running:
        yield running


def base_url(stack: ExecStack) -> str:
    return f"http://{stack.services.http_addresses()['gateway']}"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def slow_text(words: int = 120, delay_ms: float = 5) -> TextTurn:
    chunks = [f"w{i} " for i in range(words)]
    return TextTurn("".join(chunks), chunks=chunks, delay_ms=delay_ms)


async def read_sse(
    http: httpx2.AsyncClient,
    url: str,
    headers: dict[str, str],
    *,
    stop_after_durable: int | None = None,
    until: Callable[[dict[str, Any]], bool] | None = None,
) -> list[httpx2.ServerSentEvent]:
    """Frames of one connection, until the server ends it, `stop_after_durable` durable events
    arrived or `until` holds for an event (then the client hangs up, as a closing tab does)."""
    frames: list[httpx2.ServerSentEvent] = []
    durable = 0
    async with http.stream("GET", url, headers=headers) as response:
        assert response.status_code == 200, await response.aread()
        async for frame in httpx2.EventSource(response):
            frames.append(frame)
            data = frame.json() if frame.data else {}
            if data.get("seq"):
                durable += 1
            if stop_after_durable is not None and durable >= stop_after_durable:
                break
            if until is not None and until(data):
                break
    return frames


def durable(frames: list[httpx2.ServerSentEvent]) -> list[dict[str, Any]]:
    return [f.json() for f in frames if f.event not in ("snapshot", "error") and f.json()["seq"]]


async def test_sse_resumes_from_last_event_id_losing_nothing(stack: ExecStack) -> None:
    tenant = await stack.tenant()
    text = prompt("sse")
    stack.model.script(text, [ToolUseTurn("get_time", {}, text="Looking."), slow_text()])
    run_id = await tenant.send(text)
    url = f"{base_url(stack)}/v1/runs/{run_id}/events"
    events: list[dict[str, Any]] = []
    connections = 0
    async with httpx2.AsyncClient(timeout=30) as http:
        last_id = ""
        while not events or events[-1]["type"] not in TERMINAL_TYPES:
            connections += 1
            headers = {**bearer(tenant.api_key), **({"Last-Event-ID": last_id} if last_id else {})}
            frames = await read_sse(
                http, url, headers, stop_after_durable=2 if connections < 5 else None
            )
            assert frames[0].event == "snapshot" and frames[0].retry == 1000
            for frame in frames:
                if frame.event not in ("snapshot", "error") and frame.json()["seq"]:
                    assert frame.id == str(frame.json()["seq"]), "id: is the seq"
            events += durable(frames)
            last_id = str(events[-1]["seq"]) if events else ""
        run = (
            await http.get(f"{base_url(stack)}/v1/runs/{run_id}", headers=bearer(tenant.api_key))
        ).json()
        resumed = await read_sse(http, f"{url}?after=5&deltas=0", bearer(tenant.api_key))
    assert connections >= 5
    seqs = [e["seq"] for e in events]
    assert seqs == list(range(1, int(run["run"]["last_seq"]) + 1)), "no duplicate, no gap"
    assert [e["seq"] for e in durable(resumed)] == seqs[5:]
    assert not [f for f in resumed if f.event == "text.delta"]
    parts: dict[int, dict[str, Any]] = {}
    for event in events:
        if event["type"] in ("part.added", "part.updated"):
            part = event["payload"]["part"]
            parts[part.get("index", 0)] = part
    assert [parts[i] for i in sorted(parts)] == run["parts"], "the same transcript as GetRun"
    assert events[-1]["payload"]["resultText"] == run["run"]["result_text"]


async def test_a_conversation_streams_over_sse_and_resumes_from_its_cursor(
    stack: ExecStack,
) -> None:
    tenant = await stack.tenant()
    conversation = f"c-{uuid.uuid4().hex[:8]}"
    first, second = prompt("first"), prompt("second")
    stack.model.script(first, [TextTurn("one")])
    stack.model.script(second, [slow_text(30)])
    runs = [await tenant.send(first, conversation), await tenant.send(second, conversation)]
    url = f"{base_url(stack)}/v1/conversations/{conversation}/events"
    seen: list[tuple[str, int]] = []

    def second_ended(event: dict[str, Any]) -> bool:
        return event.get("run_id") == runs[1] and event.get("type") in TERMINAL_TYPES

    async with httpx2.AsyncClient(timeout=30) as http:
        headers = bearer(tenant.api_key)
        for _ in range(3):  # hang up after a few events, twice, then read to the end
            frames = await read_sse(http, url, headers, stop_after_durable=3, until=second_ended)
            seen += [(e["run_id"], e["seq"]) for e in durable(frames)]
            assert frames[-1].id == frames[-1].json()["cursor"], "id: is the cursor"
            headers = {**bearer(tenant.api_key), "Last-Event-ID": frames[-1].id}
            if second_ended(frames[-1].json()):
                break
        else:
            frames = await read_sse(http, url, headers, until=second_ended)
            seen += [(e["run_id"], e["seq"]) for e in durable(frames)]
    assert len(seen) == len(set(seen))
    for run_id in runs:
        row = await wait_for_status(stack.db_url, run_id, "completed")
        assert [s for rid, s in seen if rid == run_id] == list(range(1, row.last_seq + 1))


async def test_the_json_endpoints_send_read_list_and_cancel(stack: ExecStack) -> None:
    tenant = await stack.tenant()
    text = prompt("json")
    stack.model.script(text, [slow_text(3000, 10)])
    base = base_url(stack)
    conversation = f"c-{uuid.uuid4().hex[:8]}"
    message = {"conversation_id": conversation, "text": text, "event_id": uuid.uuid4().hex}
    async with httpx2.AsyncClient(base_url=base, headers=bearer(tenant.api_key)) as http:
        sent = await http.post("/v1/messages", json=message)
        assert sent.status_code == 200, sent.text
        assert sent.json()["disposition"] == "created"
        run_id = sent.json()["run"]["run_id"]
        assert sent.json()["run"]["status"] == "queued"
        again = await http.post("/v1/messages", json=message)
        assert again.json()["run"]["run_id"] == run_id, "the event id is the idempotency key"
        await wait_for_status(stack.db_url, run_id, "running")
        got = await http.get(f"/v1/runs/{run_id}")
        assert got.status_code == 200 and got.json()["run"]["input_text"] == text
        listed = await http.get("/v1/runs", params={"conversation_id": conversation})
        assert [r["run_id"] for r in listed.json()["runs"]] == [run_id]
        cancelled = await http.post(f"/v1/runs/{run_id}/cancel", json={"reason": "enough"})
        assert cancelled.status_code == 200 and cancelled.json()["changed"] is True
        await wait_for_status(stack.db_url, run_id, "cancelled")
        filtered = await http.get("/v1/runs", params={"status": "cancelled"})
        assert [r["run_id"] for r in filtered.json()["runs"]] == [run_id]
        repeat = await http.post(f"/v1/runs/{run_id}/cancel")
        assert repeat.json() == {"run": repeat.json()["run"], "changed": False}
        bad_body = await http.post("/v1/messages", content=b"{not json")
        assert bad_body.status_code == 400
        assert bad_body.json()["error"]["status"] == "INVALID_ARGUMENT"
        bad_status = await http.get("/v1/runs", params={"status": "sleeping"})
        assert bad_status.status_code == 400


async def test_every_auth_failure_has_its_http_status(stack: ExecStack) -> None:
    owner, stranger = await stack.tenant(), await stack.tenant()
    text = prompt("private")
    stack.model.script(text, [TextTurn("secret")])
    run_id = await owner.send(text)
    read_only = await key_with(stack, owner.tenant_id, ["runs:read"])
    write_only = await key_with(stack, owner.tenant_id, ["runs:write"])
    absent = "run_" + "0" * 32
    async with httpx2.AsyncClient(base_url=base_url(stack)) as http:
        for path in (f"/v1/runs/{run_id}", f"/v1/runs/{run_id}/events"):
            none = await http.get(path)
            assert none.status_code == 401
            assert none.headers["www-authenticate"] == "Bearer"
            assert none.json()["error"]["status"] == "UNAUTHENTICATED"
            forged = await http.get(path, headers=bearer("tk_forged"))
            assert forged.status_code == 401
            denied = await http.get(path, headers=bearer(write_only))
            assert denied.status_code == 403 and "runs:read" in denied.json()["error"]["message"]
            theirs = await http.get(path, headers=bearer(stranger.api_key))
            missing = await http.get(path.replace(run_id, absent), headers=bearer(stranger.api_key))
            assert theirs.status_code == missing.status_code == 404
            assert theirs.text.replace(run_id, "ID") == missing.text.replace(absent, "ID")
        send = await http.post(
            "/v1/messages",
            json={"conversation_id": "c", "text": "x", "event_id": "e"},
            headers=bearer(read_only),
        )
        assert send.status_code == 403
        cancel = await http.post(f"/v1/runs/{run_id}/cancel", headers=bearer(stranger.api_key))
        assert cancel.status_code == 404
