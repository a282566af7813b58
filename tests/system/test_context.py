"""What the model sees, with the services as processes: a request to the local model server
holds the persona, the selected skills, the live facts and the retrieved knowledge in the
documented order with the stable prefix cache-marked; knowledge is uploaded through the API and
retrieved for the tenant's own runs only; a required live-fact provider that fails (one plugged
in through its entry point, as any plugin would be) fails the run before any model call, and an
optional one is left out with a warning."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import httpx2
import pytest
import pytest_asyncio

from tests.system.execution_support import ExecStack, Tenant, exec_stack, run_row, wait_for_status
from tether import apikeys
from tether.testing.model_server import TextTurn
from tether.v1 import gateway_pb2

DOCUMENT_SCOPES = (*apikeys.CLIENT_SCOPES, apikeys.DOCUMENTS_READ, apikeys.DOCUMENTS_WRITE)

# A plugin package, found by the worker through its entry points like any installed plugin.
PLUGIN = """
import asyncio


class Broken:
    name, required, deadline_s = "crm", True, 0.5

    async def fact(self, request):
        raise RuntimeError("the CRM is down")


class Sluggish:
    name, required, deadline_s = "weather", True, 0.2

    async def fact(self, request):
        await asyncio.sleep(30)


class Gossip:
    name, required, deadline_s = "gossip", False, 0.5

    async def fact(self, request):
        raise RuntimeError("nobody talks")


crm, weather, gossip = Broken(), Sluggish(), Gossip()
"""


def install_plugin(directory: Path) -> Path:
    """A distribution on `directory` declaring three `tether.facts` entry points."""
    (directory / "tether_test_facts.py").write_text(PLUGIN)
    info = directory / "tether_test_facts-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tether-test-facts\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[tether.facts]\n"
        + "".join(f"{n} = tether_test_facts:{n}\n" for n in ("crm", "weather", "gossip"))
    )
    return directory


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(
    pg_server_url: str, template_db: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ExecStack]:
    plugins = install_plugin(Path(tmp_path_factory.mktemp("plugins")))
    async with exec_stack(
        pg_server_url, template_db, redis_url, Path(tmp_path_factory.mktemp("ctx")), workers=0
    ) as running:
        await running.start_worker(PYTHONPATH=str(plugins))
        yield running


def prompt(label: str) -> str:
    return f"{label} {uuid.uuid4().hex}"


async def add_document(stack: ExecStack, tenant: Tenant, title: str, content: str) -> str:
    async with grpc.aio.insecure_channel(stack.addr("gateway")) as channel:
        added = await tenant.stub(channel).AddDocument(
            gateway_pb2.AddDocumentRequest(title=title, content=content),
            metadata=tenant.metadata,
        )
    return str(added.document.document_id)


def requests_for(stack: ExecStack, text: str) -> list[dict[str, Any]]:
    return [r.body for r in stack.model.requests if r.script_key == text]


PERSONA = {
    "name": "concierge",
    "version": 3,
    "instructions": "You are the concierge of Hotel Tether. Be warm and precise.",
}
SKILL = {
    "name": "refunds",
    "version": 2,
    "instructions": "You explain the hotel's refund policy, quoting the policy documents.",
    "tools": ["get_time"],
}


async def test_a_request_holds_persona_skills_facts_and_knowledge_in_order(
    stack: ExecStack,
) -> None:
    tenant = await stack.tenant(
        agent={
            "persona": PERSONA,
            "skills": [SKILL],
            "tool_allowlist": [],
            "context": {"timezone": "Europe/Paris"},
        },
        scopes=DOCUMENT_SCOPES,
    )
    await add_document(stack, tenant, "Refund policy", "Refunds are paid within 30 days.")
    await add_document(stack, tenant, "Breakfast", "Breakfast is served from seven.")
    text = prompt("how are refunds paid?")
    stack.model.script(text, [TextTurn("Within 30 days.")])
    run_id = await tenant.send(text)
    await wait_for_status(stack.db_url, run_id, "completed")

    [body] = requests_for(stack, text)
    assert body["system"] == [
        {"type": "text", "text": PERSONA["instructions"]},
        {"type": "text", "text": SKILL["instructions"], "cache_control": {"type": "ephemeral"}},
    ]
    assert [t["name"] for t in body["tools"]] == ["get_time"]
    [message] = body["messages"]
    facts, knowledge, new = (block["text"] for block in message["content"])
    assert facts.startswith("<live_facts>\nchannel: chat (chat)\nactor: tester (user)\ntime: ")
    assert "Europe/Paris" in facts
    assert knowledge.startswith("<retrieved_documents note=")
    assert 'title="Refund policy"' in knowledge and "within 30 days" in knowledge
    assert "Breakfast" not in knowledge, "only what matches the message is retrieved"
    assert new == text
    assert "Refund" not in json.dumps(body["system"]), "retrieved material never in the system"

    # The run shows the routing it is pinned to.
    code, out = await tether_cli(stack, tenant, "run", run_id, "--json")
    assert code == 0, out
    routing = json.loads(out)["routing"]
    assert routing["persona"] == {"name": "concierge", "version": 3}
    assert routing["skills"] == [{"name": "refunds", "version": 2}]
    assert routing["tool_allowlist"] == ["get_time"]


async def tether_cli(stack: ExecStack, tenant: Tenant, *args: str) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tether.cli",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={
            **os.environ,
            "TETHER_GATEWAY": stack.addr("gateway"),
            "TETHER_API_KEY": tenant.api_key,
        },
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, out.decode() + err.decode()


async def test_a_tenant_never_retrieves_another_tenants_documents(
    stack: ExecStack, tmp_path: Path
) -> None:
    ours = await stack.tenant(scopes=DOCUMENT_SCOPES)
    theirs = await stack.tenant(scopes=DOCUMENT_SCOPES)
    await add_document(stack, ours, "Refunds", "Refunds OURS-MARKER are paid within 30 days.")
    secret = await add_document(stack, theirs, "Refunds", "Refunds THEIR-SECRET go to credit.")
    text = prompt("tell me about refunds")
    stack.model.script(text, [TextTurn("Here.")])
    await wait_for_status(stack.db_url, await ours.send(text), "completed")
    [body] = requests_for(stack, text)
    sent = json.dumps(body)
    assert "OURS-MARKER" in sent and "THEIR-SECRET" not in sent

    # Their document is NOT_FOUND to us, exactly as an absent one, and stays.
    async with grpc.aio.insecure_channel(stack.addr("gateway")) as channel:
        stub = ours.stub(channel)
        answers = []
        for document_id in (secret, "doc_absent"):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.RemoveDocument(
                    gateway_pb2.RemoveDocumentRequest(document_id=document_id),
                    metadata=ours.metadata,
                )
            assert refused.value.code() == grpc.StatusCode.NOT_FOUND
            answers.append(refused.value.details().replace(document_id, "ID"))
        assert answers[0] == answers[1]
        listed = await stub.ListDocuments(
            gateway_pb2.ListDocumentsRequest(), metadata=ours.metadata
        )
        assert [d.title for d in listed.documents] == ["Refunds"]
        assert listed.documents[0].content == "", "a list leaves the text out"
        # A key without the documents scopes may not touch them.
        plain = await stack.tenant()
        with pytest.raises(grpc.aio.AioRpcError) as denied:
            await plain.stub(channel).ListDocuments(
                gateway_pb2.ListDocumentsRequest(), metadata=plain.metadata
            )
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED

    # The HTTP bridge: bad input is INVALID_ARGUMENT and stores nothing; theirs is 404.
    base = f"http://{stack.services.http_addresses()['gateway']}"
    headers = {"Authorization": f"Bearer {ours.api_key}"}
    async with httpx2.AsyncClient(timeout=30) as http:
        for bad in ({"title": "", "content": "x"}, {"title": "t", "content": "x" * 64_001}):
            answer = await http.post(f"{base}/v1/documents", json=bad, headers=headers)
            assert answer.status_code == 400, answer.text
            assert answer.json()["error"]["status"] == "INVALID_ARGUMENT"
        listed_http = (await http.get(f"{base}/v1/documents", headers=headers)).json()
        assert [d["title"] for d in listed_http["documents"]] == ["Refunds"]
        gone = await http.delete(f"{base}/v1/documents/{secret}", headers=headers)
        assert gone.status_code == 404
        added = await http.post(
            f"{base}/v1/documents",
            json={"title": "Pets", "content": "Dogs welcome."},
            headers=headers,
        )
        assert added.status_code == 201
        document_id = added.json()["document"]["document_id"]
        removed = await http.delete(f"{base}/v1/documents/{document_id}", headers=headers)
        assert removed.status_code == 200


@pytest.mark.parametrize(
    ("provider", "code", "says"),
    [
        ("crm", "live_fact_failed", "'crm' failed: RuntimeError: the CRM is down"),
        ("weather", "live_fact_timed_out", "'weather' missed its deadline of 0.2 s"),
        ("horoscope", "live_fact_unavailable", "'horoscope', which this worker does not have"),
    ],
)
async def test_a_required_live_fact_that_fails_fails_the_run_before_the_model_call(
    stack: ExecStack, provider: str, code: str, says: str
) -> None:
    tenant = await stack.tenant(agent={"context": {"live_facts": ["channel", provider]}})
    text = prompt(f"needs {provider}")
    run_id = await tenant.send(text)
    run = await wait_for_status(stack.db_url, run_id, "failed")
    assert run.error["code"] == code
    assert says in run.error["message"]
    assert requests_for(stack, text) == [], "no model call was made"


async def test_an_optional_live_fact_that_fails_is_left_out_with_a_warning(
    stack: ExecStack,
) -> None:
    tenant = await stack.tenant(agent={"context": {"live_facts": ["gossip", "channel"]}})
    text = prompt("no gossip")
    stack.model.script(text, [TextTurn("Fine.")])
    run_id = await tenant.send(text)
    await wait_for_status(stack.db_url, run_id, "completed")
    assert "live_fact_omitted:gossip" in (await run_row(stack.db_url, run_id)).warnings
    [body] = requests_for(stack, text)
    facts = body["messages"][-1]["content"][0]["text"]
    assert facts == "<live_facts>\nchannel: chat (chat)\n</live_facts>"
