"""Who a run belongs to, and who may see and act on it, with the services as real processes.

A request body never names a principal: a webhook's `sender_id` is actor data, never the
authenticated principal whose grants and connected accounts a run may use. Inside a tenant a
chat run is private to the principal whose key sent it; a run admitted by an integration key
belongs to that key's principal; a key holding `runs:all` sees and acts on every run of its
tenant. Another principal's run is NOT_FOUND with the same message as an absent one, on every
id-taking call, over gRPC and over the HTTP bridge.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx2
import pytest
import pytest_asyncio

from tests.system.execution_support import ExecStack, exec_stack, run_row, wait_for_status
from tether import apikeys
from tether.db.engine import create_engine
from tether.testing.model_server import TextTurn, ToolUseTurn
from tether.v1 import admission_pb2, gateway_pb2, gateway_pb2_grpc

ABSENT = "run_" + "0" * 32
# Scope names as strings: the regression tests must also run against code that predates them.
RUNS_ALL = "runs:all"
APPROVALS_DECIDE = "approvals:decide"
EVERYDAY = ["runs:read", "runs:write", "interactions:write", APPROVALS_DECIDE]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(
    pg_server_url: str, template_db: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[ExecStack]:
    async with exec_stack(
        pg_server_url,
        template_db,
        redis_url,
        Path(tmp_path_factory.mktemp("principals")),
        workers=1,
        # A conversation stream with nothing to show sends its first keepalive this soon.
        extra_env={"TETHER_GATEWAY_KEEPALIVE_INTERVAL_S": "0.3"},
    ) as running:
        yield running


@dataclass
class Team:
    """One tenant with keys for several principals."""

    tenant_id: str
    alice: str  # a person
    bob: str  # another person of the same tenant
    hooks: str  # the integration key webhooks and task events come in with
    admin: str  # a person holding runs:all
    no_decide: str  # alice again, without approvals:decide


async def team(stack: ExecStack) -> Team:
    tenant = await stack.tenant()
    engine = create_engine(stack.db_url, pool_size=1)
    try:
        async with engine.begin() as conn:

            async def key(principal: str, scopes: list[str]) -> str:
                secret, _ = await apikeys.create_key(conn, tenant.tenant_id, principal, scopes)
                return secret

            keys = Team(
                tenant.tenant_id,
                alice=await key("alice", EVERYDAY),
                bob=await key("bob", EVERYDAY),
                hooks=await key("hooks", EVERYDAY),
                admin=await key("ops-admin", [*EVERYDAY, RUNS_ALL]),
                no_decide=await key("alice", ["runs:read", "runs:write", "interactions:write"]),
            )
    finally:
        await engine.dispose()
    return keys


def prompt(label: str) -> str:
    return f"{label} {uuid.uuid4().hex}"


def metadata(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


async def chat(stack: ExecStack, key: str, text: str, conversation: str = "") -> str:
    async with grpc.aio.insecure_channel(stack.addr("gateway")) as channel:
        response = await gateway_pb2_grpc.GatewayServiceStub(channel).SendMessage(
            gateway_pb2.SendMessageRequest(
                text=text,
                conversation_id=conversation or f"c-{uuid.uuid4().hex[:8]}",
                event_id=f"e-{uuid.uuid4().hex}",
            ),
            metadata=metadata(key),
        )
    return str(response.run.run_id)


async def webhook(stack: ExecStack, key: str, text: str, sender: str) -> str:
    """A messaging webhook delivered with `key`, its body naming `sender`."""
    async with grpc.aio.insecure_channel(stack.addr("gateway")) as channel:
        response = await gateway_pb2_grpc.GatewayServiceStub(channel).SubmitEvent(
            gateway_pb2.SubmitEventRequest(
                messaging=admission_pb2.MessagingWebhookInput(
                    provider="whatsapp",
                    provider_event_id=f"wa-{uuid.uuid4().hex}",
                    sender_id=sender,
                    sender_type="user",
                    thread_id=f"th-{uuid.uuid4().hex[:8]}",
                    text=text,
                )
            ),
            metadata=metadata(key),
        )
    return str(response.run.run_id)


async def decide(stack: ExecStack, key: str, run_id: str, decision: str, scope: str = "") -> Any:
    async with grpc.aio.insecure_channel(stack.addr("gateway")) as channel:
        return await gateway_pb2_grpc.GatewayServiceStub(channel).DecideApproval(
            gateway_pb2.DecideApprovalRequest(run_id=run_id, decision=decision, always_scope=scope),
            metadata=metadata(key),
        )


def consent_state(login_url: str) -> str:
    return login_url.split("state=")[1].split("&")[0]


# -- a body never names a principal ------------------------------------------------------------


async def test_a_webhook_naming_a_principal_as_sender_does_not_get_their_standing_grant(
    stack: ExecStack,
) -> None:
    keys = await team(stack)
    first = prompt("alice publishes")
    stack.model.script(first, [ToolUseTurn("publish_post", {"text": "alice 1"}), TextTurn("ok")])
    alice_run = await chat(stack, keys.alice, first)
    await wait_for_status(stack.db_url, alice_run, "waiting-for-approval")
    decided = await decide(stack, keys.alice, alice_run, "allow-always", "principal")
    assert decided.grant_id
    await wait_for_status(stack.db_url, alice_run, "completed")

    forged = prompt("a webhook claiming to be alice")
    stack.model.script(forged, [ToolUseTurn("publish_post", {"text": "forged"}), TextTurn("ok")])
    webhook_run = await webhook(stack, keys.hooks, forged, sender="alice")
    run = await wait_for_status(
        stack.db_url, webhook_run, "waiting-for-approval", "completed", "failed"
    )
    assert run.status == "waiting-for-approval", "alice's grant ran a webhook's gated call"
    assert (run.owner_principal_id, run.visibility) == ("hooks", "tenant")
    assert "forged" not in [r.body["text"] for r in stack.ledger.records]

    # The grant still covers the principal who decided it.
    again = prompt("alice publishes again")
    stack.model.script(again, [ToolUseTurn("publish_post", {"text": "alice 2"}), TextTurn("ok")])
    await wait_for_status(stack.db_url, await chat(stack, keys.alice, again), "completed")
    assert "alice 2" in [r.body["text"] for r in stack.ledger.records]


async def test_a_webhook_naming_a_principal_as_sender_does_not_use_their_connection(
    stack: ExecStack,
) -> None:
    keys = await team(stack)
    first = prompt("alice's calendar")
    stack.model.script(first, [ToolUseTurn("calendar_list_events"), TextTurn("Two meetings.")])
    alice_run = await chat(stack, keys.alice, first)
    await wait_for_status(stack.db_url, alice_run, "waiting-for-connection")
    async with grpc.aio.insecure_channel(stack.addr("gateway")) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        offer = (
            await stub.GetPendingConnection(
                gateway_pb2.GetPendingConnectionRequest(run_id=alice_run),
                metadata=metadata(keys.alice),
            )
        ).connection
        done = await stub.CompleteConnection(
            gateway_pb2.CompleteConnectionRequest(
                run_id=alice_run,
                state=consent_state(offer.login_url),
                code=stack.oauth.code_for("calendar.read"),
            ),
            metadata=metadata(keys.alice),
        )
    assert done.resumed
    await wait_for_status(stack.db_url, alice_run, "completed")

    forged = prompt("a webhook reading alice's calendar")
    stack.model.script(forged, [ToolUseTurn("calendar_list_events"), TextTurn("Leaked.")])
    webhook_run = await webhook(stack, keys.hooks, forged, sender="alice")
    run = await wait_for_status(
        stack.db_url, webhook_run, "waiting-for-connection", "completed", "failed"
    )
    assert run.status == "waiting-for-connection", "a webhook used alice's connected account"

    # The connection still serves the principal who connected it.
    again = prompt("alice's calendar again")
    stack.model.script(again, [ToolUseTurn("calendar_list_events"), TextTurn("Still two.")])
    await wait_for_status(stack.db_url, await chat(stack, keys.alice, again), "completed")


async def test_an_event_key_another_principal_claimed_is_a_conflict_not_their_run(
    stack: ExecStack,
) -> None:
    keys = await team(stack)
    delivery = gateway_pb2.SubmitEventRequest(
        messaging=admission_pb2.MessagingWebhookInput(
            provider="whatsapp",
            provider_event_id=f"wa-{uuid.uuid4().hex}",
            sender_id="carol",
            thread_id=f"th-{uuid.uuid4().hex[:8]}",
            text=prompt("one delivery"),
        )
    )
    async with grpc.aio.insecure_channel(stack.addr("gateway")) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        first = await stub.SubmitEvent(delivery, metadata=metadata(keys.hooks))
        again = await stub.SubmitEvent(delivery, metadata=metadata(keys.hooks))
        assert again.run.run_id == first.run.run_id, "the same principal's redelivery attaches"
        with pytest.raises(grpc.aio.AioRpcError) as other:
            await stub.SubmitEvent(delivery, metadata=metadata(keys.bob))
    assert other.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert first.run.run_id not in (other.value.details() or "")


# -- who may see and act on which run ----------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """What a call answered: "OK" and its body, or the status name and message."""

    status: str
    message: str = ""
    body: Any = None


class Surface:
    """The gateway's id-taking calls, over one transport."""

    name: str

    async def get_run(self, key: str, run_id: str) -> Outcome: ...
    async def cancel(self, key: str, run_id: str) -> Outcome: ...
    async def stream_run(self, key: str, run_id: str) -> Outcome: ...
    async def stream_conversation(self, key: str, conversation_id: str) -> Outcome: ...
    async def list_runs(self, key: str, conversation_id: str) -> list[str]: ...
    async def pending(self, key: str, kind: str, run_id: str) -> Outcome: ...
    async def resolve(self, key: str, kind: str, run_id: str, body: dict[str, Any]) -> Outcome: ...


def _grpc_error(exc: grpc.aio.AioRpcError) -> Outcome:
    return Outcome(exc.code().name, exc.details() or "")


_PENDING_RPC = {
    "question": ("GetPendingQuestion", gateway_pb2.GetPendingQuestionRequest),
    "approval": ("GetPendingApproval", gateway_pb2.GetPendingApprovalRequest),
    "connection": ("GetPendingConnection", gateway_pb2.GetPendingConnectionRequest),
}
_RESOLVE_RPC = {
    "question": ("AnswerQuestion", gateway_pb2.AnswerQuestionRequest),
    "approval": ("DecideApproval", gateway_pb2.DecideApprovalRequest),
    "connection": ("CompleteConnection", gateway_pb2.CompleteConnectionRequest),
}
_HTTP_RESOLVE = {"question": "answer", "approval": "decision", "connection": "connection"}


class GrpcSurface(Surface):
    name = "grpc"

    def __init__(self, stub: gateway_pb2_grpc.GatewayServiceStub) -> None:
        self._stub = stub

    async def _unary(self, rpc: str, request: Any, key: str) -> Outcome:
        try:
            response = await getattr(self._stub, rpc)(request, metadata=metadata(key))
        except grpc.aio.AioRpcError as exc:
            return _grpc_error(exc)
        return Outcome("OK", body=response)

    async def _first(self, call: Any) -> Outcome:
        try:
            async for item in call:
                call.cancel()
                return Outcome("OK", body=item)
        except grpc.aio.AioRpcError as exc:
            return _grpc_error(exc)
        return Outcome("ENDED")

    async def get_run(self, key: str, run_id: str) -> Outcome:
        return await self._unary("GetRun", gateway_pb2.GetRunRequest(run_id=run_id), key)

    async def cancel(self, key: str, run_id: str) -> Outcome:
        return await self._unary("CancelRun", gateway_pb2.CancelRunRequest(run_id=run_id), key)

    async def stream_run(self, key: str, run_id: str) -> Outcome:
        request = gateway_pb2.StreamRunRequest(run_id=run_id)
        outcome = await self._first(self._stub.StreamRun(request, metadata=metadata(key)))
        if outcome.status != "OK":
            return outcome
        first = "snapshot" if outcome.body.HasField("snapshot") else outcome.body.event.type
        return Outcome("OK", body={"type": first, "run_id": run_id})

    async def stream_conversation(self, key: str, conversation_id: str) -> Outcome:
        request = gateway_pb2.StreamConversationRequest(conversation_id=conversation_id)
        outcome = await self._first(self._stub.StreamConversation(request, metadata=metadata(key)))
        if outcome.status != "OK":
            return outcome
        event = outcome.body.event
        return Outcome("OK", body={"type": event.type, "run_id": event.run_id})

    async def list_runs(self, key: str, conversation_id: str) -> list[str]:
        outcome = await self._unary(
            "ListRuns", gateway_pb2.ListRunsRequest(conversation_id=conversation_id), key
        )
        assert outcome.status == "OK", outcome
        return [r.run_id for r in outcome.body.runs]

    async def pending(self, key: str, kind: str, run_id: str) -> Outcome:
        rpc, request_type = _PENDING_RPC[kind]
        outcome = await self._unary(rpc, request_type(run_id=run_id), key)
        if outcome.status != "OK":
            return outcome
        return Outcome("OK", body=outcome.body.HasField(kind))

    async def resolve(self, key: str, kind: str, run_id: str, body: dict[str, Any]) -> Outcome:
        rpc, request_type = _RESOLVE_RPC[kind]
        request = request_type(run_id=run_id)
        if kind == "question":
            for question, values in body["answers"].items():
                request.answers[question].values.extend(values["values"])
        else:
            for field, value in body.items():
                setattr(request, field, value)
        return await self._unary(rpc, request, key)


class HttpSurface(Surface):
    name = "http"

    def __init__(self, http: httpx2.AsyncClient) -> None:
        self._http = http

    @staticmethod
    def _outcome(response: httpx2.Response) -> Outcome:
        data = response.json()
        if response.status_code == 200:
            return Outcome("OK", body=data)
        return Outcome(data["error"]["status"], data["error"]["message"])

    @staticmethod
    def _auth(key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"}

    async def _first_frame(self, path: str, key: str) -> Outcome:
        async with self._http.stream("GET", path, headers=self._auth(key)) as response:
            if response.status_code != 200:
                error = json.loads(await response.aread())["error"]
                return Outcome(error["status"], error["message"])
            async for frame in httpx2.EventSource(response):
                data = frame.json() if frame.data else {}
                run_id = data.get("run_id") or data.get("run", {}).get("run_id", "")
                return Outcome("OK", body={"type": frame.event, "run_id": run_id})
        return Outcome("ENDED")

    async def get_run(self, key: str, run_id: str) -> Outcome:
        return self._outcome(await self._http.get(f"/v1/runs/{run_id}", headers=self._auth(key)))

    async def cancel(self, key: str, run_id: str) -> Outcome:
        response = await self._http.post(f"/v1/runs/{run_id}/cancel", headers=self._auth(key))
        return self._outcome(response)

    async def stream_run(self, key: str, run_id: str) -> Outcome:
        return await self._first_frame(f"/v1/runs/{run_id}/events", key)

    async def stream_conversation(self, key: str, conversation_id: str) -> Outcome:
        return await self._first_frame(f"/v1/conversations/{conversation_id}/events", key)

    async def list_runs(self, key: str, conversation_id: str) -> list[str]:
        response = await self._http.get(
            "/v1/runs", params={"conversation_id": conversation_id}, headers=self._auth(key)
        )
        assert response.status_code == 200, response.text
        return [r["run_id"] for r in response.json()["runs"]]

    async def pending(self, key: str, kind: str, run_id: str) -> Outcome:
        response = await self._http.get(
            f"/v1/runs/{run_id}/pending-{kind}", headers=self._auth(key)
        )
        outcome = self._outcome(response)
        if outcome.status != "OK":
            return outcome
        return Outcome("OK", body=kind in outcome.body)

    async def resolve(self, key: str, kind: str, run_id: str, body: dict[str, Any]) -> Outcome:
        response = await self._http.post(
            f"/v1/runs/{run_id}/{_HTTP_RESOLVE[kind]}",
            content=json.dumps(body),
            headers=self._auth(key),
        )
        return self._outcome(response)


@pytest_asyncio.fixture(params=["grpc", "http"], loop_scope="session")
async def surface(stack: ExecStack, request: pytest.FixtureRequest) -> AsyncIterator[Surface]:
    if request.param == "grpc":
        async with grpc.aio.insecure_channel(stack.addr("gateway")) as channel:
            yield GrpcSurface(gateway_pb2_grpc.GatewayServiceStub(channel))
    else:
        base = f"http://{stack.services.http_addresses()['gateway']}"
        async with httpx2.AsyncClient(base_url=base, timeout=30) as http:
            yield HttpSurface(http)


def ask_city() -> dict[str, Any]:
    return {"questions": [{"key": "city", "prompt": "Which city?"}]}


@dataclass
class Parked:
    """Runs parked on each kind of pause: alice's chat runs and an integration's webhook run."""

    conversation: str  # alice's conversation, holding her question run
    question: str
    approval: str
    connection: str
    webhook: str  # admitted with the hooks key, parked on a question
    consent_state: str


async def parked(stack: ExecStack, keys: Team) -> Parked:
    conversation = f"c-{uuid.uuid4().hex[:8]}"
    ask = ask_city()
    texts = {kind: prompt(f"alice {kind}") for kind in ("question", "approval", "connection")}
    stack.model.script(texts["question"], [ToolUseTurn("ask_questions", ask), TextTurn("ok")])
    stack.model.script(
        texts["approval"], [ToolUseTurn("publish_post", {"text": "matrix"}), TextTurn("ok")]
    )
    stack.model.script(texts["connection"], [ToolUseTurn("calendar_list_events"), TextTurn("ok")])
    hook_text = prompt("webhook asks")
    stack.model.script(hook_text, [ToolUseTurn("ask_questions", ask), TextTurn("ok")])
    runs = {
        "question": await chat(stack, keys.alice, texts["question"], conversation),
        "approval": await chat(stack, keys.alice, texts["approval"]),
        "connection": await chat(stack, keys.alice, texts["connection"]),
        "webhook": await webhook(stack, keys.hooks, hook_text, sender="alice"),
    }
    for kind, run_id in runs.items():
        waiting = "question" if kind == "webhook" else kind
        await wait_for_status(stack.db_url, run_id, f"waiting-for-{waiting}")
    async with grpc.aio.insecure_channel(stack.addr("gateway")) as channel:
        offer = (
            await gateway_pb2_grpc.GatewayServiceStub(channel).GetPendingConnection(
                gateway_pb2.GetPendingConnectionRequest(run_id=runs["connection"]),
                metadata=metadata(keys.alice),
            )
        ).connection
    return Parked(conversation, consent_state=consent_state(offer.login_url), **runs)


def same_as_absent(outcome: Outcome, absent: Outcome, run_id: str) -> bool:
    """NOT_FOUND, word for word the answer for an id that does not exist."""
    return outcome.status == absent.status == "NOT_FOUND" and outcome.message.replace(
        run_id, "ID"
    ) == absent.message.replace(ABSENT, "ID")


async def test_another_principals_run_is_not_found_like_an_absent_one_on_every_call(
    stack: ExecStack, surface: Surface
) -> None:
    keys = await team(stack)
    runs = await parked(stack, keys)
    answer = {"answers": {"city": {"values": ["Lisbon"]}}}
    resolve_bodies = {
        "question": answer,
        "approval": {"decision": "deny"},
        "connection": {"state": runs.consent_state, "code": stack.oauth.code_for("calendar.read")},
    }
    # (who, which run) pairs that must not see it: bob on alice's private runs; alice (neither
    # owner nor runs:all) on the integration's webhook run, though its body names her.
    strangers = [
        (keys.bob, runs.question, "question"),
        (keys.bob, runs.approval, "approval"),
        (keys.bob, runs.connection, "connection"),
        (keys.alice, runs.webhook, "question"),
    ]
    leaks: dict[str, Outcome] = {}

    async def check(label: str, outcome: Outcome, absent: Outcome, run_id: str) -> None:
        if not same_as_absent(outcome, absent, run_id):
            leaks[label] = outcome

    for key, run_id, kind in strangers:
        who = "bob" if key == keys.bob else "alice"
        calls: list[tuple[str, Callable[[str], Awaitable[Outcome]]]] = [
            ("GetRun", lambda r, k=key: surface.get_run(k, r)),
            ("StreamRun", lambda r, k=key: surface.stream_run(k, r)),
            (f"GetPending-{kind}", lambda r, k=key, n=kind: surface.pending(k, n, r)),
            (
                f"Resolve-{kind}",
                lambda r, k=key, n=kind: surface.resolve(k, n, r, resolve_bodies[n]),
            ),
            ("CancelRun", lambda r, k=key: surface.cancel(k, r)),
        ]
        for name, call in calls:
            await check(f"{who} {name} {run_id}", await call(run_id), await call(ABSENT), run_id)

    # Listing and following a conversation show only what the caller may see.
    if listed := await surface.list_runs(keys.bob, runs.conversation):
        leaks["bob ListRuns"] = Outcome("OK", body=listed)
    if runs.webhook in await surface.list_runs(keys.alice, ""):
        leaks["alice ListRuns"] = Outcome("OK", body=runs.webhook)
    theirs = await surface.stream_conversation(keys.bob, runs.conversation)
    nobody = await surface.stream_conversation(keys.bob, f"c-absent-{uuid.uuid4().hex[:8]}")
    if not (theirs == nobody and theirs.body["type"] == "keepalive"):
        leaks["bob StreamConversation"] = theirs
    shown = {label: outcome.status for label, outcome in leaks.items()}
    assert shown == {}, f"{surface.name}: another principal's run was visible"

    # Nothing the strangers tried changed anything.
    for run_id, status in (
        (runs.question, "waiting-for-question"),
        (runs.approval, "waiting-for-approval"),
        (runs.connection, "waiting-for-connection"),
        (runs.webhook, "waiting-for-question"),
    ):
        assert (await run_row(stack.db_url, run_id)).status == status

    # The owner sees and acts on its runs; so does a runs:all key, on every run of the tenant.
    for key, run_id in (
        (keys.alice, runs.question),
        (keys.admin, runs.question),
        (keys.hooks, runs.webhook),
        (keys.admin, runs.webhook),
    ):
        assert (await surface.get_run(key, run_id)).status == "OK"
        assert (await surface.stream_run(key, run_id)).body["type"] == "snapshot"
        assert (await surface.pending(key, "question", run_id)).body is True
    assert await surface.list_runs(keys.alice, runs.conversation) == [runs.question]
    assert await surface.list_runs(keys.admin, runs.conversation) == [runs.question]
    assert runs.webhook in await surface.list_runs(keys.hooks, "")
    assert {runs.webhook, runs.approval} <= set(await surface.list_runs(keys.admin, ""))
    followed = await surface.stream_conversation(keys.alice, runs.conversation)
    assert followed.body == {"type": "run.queued", "run_id": runs.question}
    for key in (keys.alice, keys.admin):
        assert (await surface.pending(key, "approval", runs.approval)).body is True
        assert (await surface.pending(key, "connection", runs.connection)).body is True

    # Deciding needs approvals:decide, even on one's own run.
    deny = {"decision": "deny"}
    refused = await surface.resolve(keys.no_decide, "approval", runs.approval, deny)
    assert refused.status == "PERMISSION_DENIED" and APPROVALS_DECIDE in refused.message
    assert (await surface.resolve(keys.admin, "question", runs.webhook, answer)).status == "OK"
    assert (await surface.resolve(keys.admin, "question", runs.question, answer)).status == "OK"
    decided = await surface.resolve(keys.admin, "approval", runs.approval, deny)
    assert decided.status == "OK"
    # A consent connects the owner's account, so only the owner completes it.
    consent = resolve_bodies["connection"]
    admins = await surface.resolve(keys.admin, "connection", runs.connection, consent)
    absent = await surface.resolve(keys.admin, "connection", ABSENT, consent)
    assert same_as_absent(admins, absent, runs.connection)
    completed = await surface.resolve(keys.alice, "connection", runs.connection, consent)
    assert completed.status == "OK"
    for run_id in (runs.question, runs.webhook, runs.approval, runs.connection):
        await wait_for_status(stack.db_url, run_id, "completed")

    # Cancelling: the owner may, and so may runs:all.
    for key in (keys.alice, keys.admin):
        text = prompt("to cancel")
        stack.model.script(text, [ToolUseTurn("ask_questions", ask_city())])
        run_id = await chat(stack, keys.alice, text)
        await wait_for_status(stack.db_url, run_id, "waiting-for-question")
        cancelled = await surface.cancel(key, run_id)
        assert cancelled.status == "OK"
        await wait_for_status(stack.db_url, run_id, "cancelled")
