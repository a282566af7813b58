"""The test ledger over real HTTP, in process and as a CLI subprocess, and `publish_post` writing
to it through the tool registry: a re-fired call under one key is delivered twice, recorded once.
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx2
import pytest

import tether.testing.ledger as ledger_module
from services.worker.tools import (
    CallContext,
    EffectState,
    ToolRegistry,
    ToolResult,
    idempotency_key,
)
from services.worker.tools.base import Authorization
from services.worker.tools.demo import DemoProvider
from tests.unit.test_tool_registry import MemoryEffects
from tether.testing.ledger import Ledger

LIBS_DIR = Path(ledger_module.__file__).resolve().parents[2]
CALL = CallContext(tenant_id="ten_1", run_id="run_2", root_run_id="run_1", tool_call_id="toolu_1")


@pytest.fixture
async def ledger() -> AsyncIterator[Ledger]:
    async with Ledger() as running:
        yield running


@pytest.fixture
async def http(ledger: Ledger) -> AsyncIterator[httpx2.AsyncClient]:
    async with httpx2.AsyncClient(base_url=ledger.base_url, timeout=10) as client:
        yield client


# The ledger itself ------------------------------------------------------------------------------


async def test_a_key_is_recorded_once_and_replayed_with_the_same_id(
    ledger: Ledger, http: httpx2.AsyncClient
) -> None:
    first = await http.post("/effects", json={"n": 1}, headers={"Idempotency-Key": "k1"})
    assert first.status_code == 201
    assert first.json()["replayed"] is False
    again = await http.post("/effects", json={"n": 2}, headers={"Idempotency-Key": "k1"})
    assert again.status_code == 200
    assert again.json() == {"id": first.json()["id"], "replayed": True}

    [record] = ledger.records
    assert (record.id, record.key, record.body) == (first.json()["id"], "k1", {"n": 1})
    assert ledger.deliveries("k1") == 2

    listing = (await http.get("/effects")).json()
    assert listing["deliveries"] == {"k1": 2}
    [listed] = listing["records"]
    assert listed == {
        "id": record.id,
        "key": "k1",
        "body": {"n": 1},
        "received_at": record.received_at,
    }


async def test_without_a_key_every_request_is_recorded(
    ledger: Ledger, http: httpx2.AsyncClient
) -> None:
    ids = [(await http.post("/effects", json={"same": True})).json()["id"] for _ in range(2)]
    assert len(set(ids)) == 2
    assert [record.key for record in ledger.records] == [None, None]
    assert (await http.get("/effects")).json()["deliveries"] == {}


async def test_concurrent_requests_with_one_key_are_recorded_once(
    ledger: Ledger, http: httpx2.AsyncClient
) -> None:
    responses = await asyncio.gather(
        *(http.post("/effects", json={}, headers={"Idempotency-Key": "race"}) for _ in range(10))
    )
    assert sorted(response.status_code for response in responses) == [200] * 9 + [201]
    assert len({response.json()["id"] for response in responses}) == 1
    assert len(ledger.records) == 1
    assert ledger.deliveries("race") == 10


async def test_reset_forgets_everything(ledger: Ledger, http: httpx2.AsyncClient) -> None:
    await http.post("/effects", json={}, headers={"Idempotency-Key": "k"})
    assert (await http.post("/_reset")).json() == {"ok": True}
    assert (await http.get("/effects")).json() == {"records": [], "deliveries": {}}
    again = await http.post("/effects", json={}, headers={"Idempotency-Key": "k"})
    assert again.status_code == 201


async def test_a_body_that_is_not_json_is_refused(ledger: Ledger, http: httpx2.AsyncClient) -> None:
    response = await http.post("/effects", content=b"not json", headers={"Idempotency-Key": "k"})
    assert response.status_code == 400
    assert ledger.records == []
    assert ledger.deliveries("k") == 0


async def test_the_cli_serves_in_a_separate_process() -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(LIBS_DIR), env.get("PYTHONPATH")]))
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tether.testing.ledger",
        "--port",
        "0",
        stdout=asyncio.subprocess.PIPE,
        env=env,
    )
    try:
        assert process.stdout is not None
        async with asyncio.timeout(30):
            line = (await process.stdout.readline()).decode()
        announced = re.fullmatch(r"ledger listening (http://127\.0\.0\.1:\d+)\n", line)
        assert announced, line
        async with httpx2.AsyncClient(base_url=announced.group(1), timeout=10) as client:
            for _ in range(2):
                await client.post("/effects", json={"x": 1}, headers={"Idempotency-Key": "cli"})
            listing = (await client.get("/effects")).json()
        assert listing["deliveries"] == {"cli": 2}
        assert [record["body"] for record in listing["records"]] == [{"x": 1}]
    finally:
        if process.returncode is None:
            process.terminate()
        await process.communicate()
    assert process.returncode == 0  # SIGTERM is a clean shutdown


# publish_post through the registry --------------------------------------------------------------


async def publish(registry: ToolRegistry, effects: MemoryEffects, text: str) -> ToolResult:
    return await registry.execute(
        "publish_post",
        {"text": text},
        CALL,
        effects=effects,
        allowlist=["publish_post"],
        max_inline_bytes=10_000,
        output_ref="out_1",
        # The approval gate has its own tests; here a standing grant stands in for it.
        authorization=Authorization("grant", "grt_test", "publish_post", CALL.run_id),
    )


async def test_a_refired_publish_reaches_the_ledger_twice_and_is_recorded_once(
    ledger: Ledger,
) -> None:
    registry = ToolRegistry(DemoProvider().tools({"TETHER_TOOL_LEDGER_URL": ledger.base_url}))
    effects = MemoryEffects()
    key = idempotency_key(CALL.tenant_id, CALL.root_run_id, "publish_post", {"text": "hello"})

    first = await publish(registry, effects, "hello")
    assert first.content.startswith("published post led_")
    assert first.idempotency_key == key

    # The worker that fired died before the record was finished: the next attempt finds the
    # effect in progress and fires again under the same key.
    effects.states[key] = (EffectState.IN_PROGRESS, None)
    refired = await publish(registry, effects, "hello")
    assert (refired.content, refired.replayed) == (first.content, False)
    assert refired.data == {"post_id": first.content.split()[-1], "replayed": True}

    # Once the record is done, a retry does not reach the ledger at all.
    replayed = await publish(registry, effects, "hello")
    assert (replayed.content, replayed.replayed) == (first.content, True)

    [record] = ledger.records
    assert record.key == key
    assert record.body == {
        "tool": "publish_post",
        "text": "hello",
        "tenant_id": "ten_1",
        "run_id": "run_2",
    }
    assert ledger.deliveries(key) == 2
    assert first.content == f"published post {record.id}"


async def test_an_unreachable_ledger_leaves_the_effect_open() -> None:
    async with Ledger() as gone:
        url = gone.base_url
    registry = ToolRegistry(DemoProvider().tools({"TETHER_TOOL_LEDGER_URL": url}))
    effects = MemoryEffects()
    result = await publish(registry, effects, "hello")
    assert (result.is_error, result.error_code) == (True, "tool_crashed")
    assert "LedgerUnavailable" in result.content
    assert effects.finishes == []
