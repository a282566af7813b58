"""The soak's steady load: scripted conversations across several tenants, each message one
seeded scenario (plain streaming, a tool, a gated external write, a question, a connection,
a provider fault, a cancel), sent through a random gateway replica, watched to its end on a
stream that is dropped and resumed from its cursor, with the person's part (answers,
decisions, consent) played by a scripted client. Everything a client saw is kept in
`Observations` for the checker."""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from tests.drill.infra import World
from tether.testing.model_script import (
    Cut,
    ErrorTurn,
    MidStreamError,
    Stall,
    TextTurn,
    ToolUseTurn,
    Turn,
)
from tether.v1 import gateway_pb2, gateway_pb2_grpc

log = logging.getLogger("drill.load")

T = TypeVar("T")

TERMINAL_EVENTS = frozenset({"run.completed", "run.failed", "run.cancelled"})
CALL_TIMEOUT_S = 10.0
# A call refused for a reason the load cannot fix by waiting: stop retrying it.
FINAL_CODES = frozenset(
    {
        grpc.StatusCode.OK,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.FAILED_PRECONDITION,
    }
)
SCENARIOS = (
    ("text", 3),
    ("tool", 2),
    ("publish", 3),
    ("question", 2),
    ("connection", 1),
    ("provider_fault", 3),
    ("cancel", 2),
    ("timer", 2),
    ("tree", 2),
)


@dataclass
class Call:
    """One gRPC call (or stream connection) the load made and how it ended."""

    at: float
    method: str
    code: str
    detail: str = ""


@dataclass
class Transcript:
    """What one client saw of one run on its stream: durable events by seq and the last
    version of every part they carried."""

    run_id: str
    tenant_id: str
    seqs: set[int] = field(default_factory=set)
    # index -> {"kind", "final", "text"}: the last version a durable event carried ...
    parts: dict[int, dict[str, Any]] = field(default_factory=dict)
    # ... and the last version a stream's opening snapshot (the persisted state) showed
    snapshot_parts: dict[int, dict[str, Any]] = field(default_factory=dict)
    terminal: str = ""
    resumes: int = 0


@dataclass
class Observations:
    """Everything the clients saw, for the checker."""

    calls: list[Call] = field(default_factory=list)
    transcripts: dict[str, Transcript] = field(default_factory=dict)
    accepted_cancels: list[str] = field(default_factory=list)
    # event id -> run ids SendMessage answered with (first delivery and its duplicates)
    deliveries: dict[str, set[str]] = field(default_factory=dict)
    # conflicting re-deliveries (same event id, other content) answered OK
    conflicts_accepted: list[str] = field(default_factory=list)
    conflicts_sent: int = 0
    duplicates_sent: int = 0
    # decisions of one approval sent through two replicas at once that both claimed to resume
    decisions_accepted_twice: list[str] = field(default_factory=list)
    duplicate_decisions_sent: int = 0
    scenarios: dict[str, int] = field(default_factory=dict)
    sends_failed: int = 0

    def record(self, method: str, code: grpc.StatusCode, detail: str = "") -> None:
        """Note how a call ended."""
        self.calls.append(Call(time.monotonic(), method, code.name, detail[:200]))


def child_text(tag: str) -> str:
    """The message a tree scenario's delegate call gives its child (its script key)."""
    return f"drill child {tag}"


def turns_for(scenario: str, tag: str, rng: random.Random) -> list[Turn]:
    """The model's scripted answers for one message of `scenario` (`tag` makes them unique)."""
    words = [f"{tag[:4]}{i} " for i in range(rng.randint(20, 60))]
    streamed = TextTurn("".join(words), chunks=words, delay_ms=rng.choice((5, 15, 30)))
    if scenario == "text":
        return [streamed, TextTurn(f"again {tag}")]
    if scenario == "tool":
        return [ToolUseTurn("get_time"), TextTurn(f"it is late {tag}")]
    if scenario == "publish":
        return [ToolUseTurn("publish_post", {"text": f"post {tag}"}), TextTurn(f"posted {tag}")]
    if scenario == "question":
        ask = {"questions": [{"key": "pick", "prompt": "Which?", "options": ["a", "b"]}]}
        return [ToolUseTurn("ask_questions", ask), TextTurn(f"picked {tag}")]
    if scenario == "connection":
        return [ToolUseTurn("calendar_list_events"), TextTurn(f"calendar read {tag}")]
    if scenario == "provider_fault":
        faults: list[Turn] = [
            ErrorTurn(429, retry_after=1),
            ErrorTurn(529),
            ErrorTurn(500),
            TextTurn("".join(words), chunks=words, fault=MidStreamError(after_events=4)),
            TextTurn("".join(words), chunks=words, fault=Cut(after_events=4)),
            TextTurn("".join(words), chunks=words, fault=Stall(after_events=4, seconds=2)),
        ]
        fault = rng.choice(faults)
        return [fault, TextTurn(f"recovered {tag}")]
    if scenario == "timer":
        return [ToolUseTurn("wait_until", {"seconds": 1}), TextTurn(f"woke {tag}")]
    if scenario == "tree":
        call = {"agent": "helper", "message": child_text(tag)}
        return [ToolUseTurn("delegate", call), TextTurn(f"delegated {tag}")]
    if scenario == "cancel":
        slow = [f"{tag[:4]}{i} " for i in range(200)]
        return [TextTurn("".join(slow), chunks=slow, delay_ms=30), TextTurn(f"late {tag}")]
    raise ValueError(f"unknown scenario {scenario!r}")


class Load:
    """The clients. `run(until)` sends messages until `until` (monotonic); the watchers and
    resolvers of runs in flight keep going until `settle_until`."""

    def __init__(self, world: World, rng: random.Random, obs: Observations) -> None:
        self._world = world
        self._rng = rng
        self._obs = obs
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.settle_until = float("inf")

    def _stub(self, address: str | None = None) -> gateway_pb2_grpc.GatewayServiceStub:
        address = address or self._rng.choice(self._world.gateways())
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = grpc.aio.insecure_channel(address)
        return gateway_pb2_grpc.GatewayServiceStub(channel)

    async def close(self) -> None:
        """Close every channel."""
        for channel in self._channels.values():
            await channel.close()

    async def _call(
        self, method: str, call: Callable[[], Awaitable[T]], *, retry_until: float
    ) -> T | grpc.aio.AioRpcError:
        """`call()` until it answers for good or `retry_until`; every answer is recorded."""
        delay = 0.1
        while True:
            try:
                result = await call()
            except grpc.aio.AioRpcError as exc:
                self._obs.record(method, exc.code(), exc.details() or "")
                if exc.code() in FINAL_CODES or time.monotonic() + delay > retry_until:
                    return exc
            else:
                self._obs.record(method, grpc.StatusCode.OK)
                return result
            await asyncio.sleep(delay)  # backoff against an outage, not a synchronisation
            delay = min(delay * 2, 1.0)

    async def run(self, conversations: int, until: float) -> None:
        """`conversations` conversation loops per tenant, sending until `until`."""
        loops = [
            self._conversation_loop(tenant_index, c, random.Random(self._rng.random()), until)
            for tenant_index in range(len(self._world.tenants))
            for c in range(conversations)
        ]
        await asyncio.gather(*loops)

    async def _conversation_loop(
        self, tenant_index: int, number: int, rng: random.Random, until: float
    ) -> None:
        tenant = self._world.tenants[tenant_index]
        metadata = (("authorization", f"Bearer {tenant.api_key}"),)
        names = [name for name, _ in SCENARIOS]
        weights = [w for _, w in SCENARIOS]
        while time.monotonic() < until:
            conversation = f"conv-{tenant_index}-{number}-{uuid.uuid4().hex[:8]}"
            key = ""
            for message in range(rng.randint(1, 3)):
                if time.monotonic() >= until:
                    return
                scenario = rng.choices(names, weights)[0]
                tag = uuid.uuid4().hex[:12]
                text = f"drill message {message} {scenario} {tag}"
                key = key or text  # the model server keys a conversation by its first text
                self._world.model.drop_script(key)
                self._world.model.script(key, turns_for(scenario, tag, rng))
                if scenario == "tree":
                    self._world.model.script(child_text(tag), [TextTurn(f"child {tag}")])
                self._obs.scenarios[scenario] = self._obs.scenarios.get(scenario, 0) + 1
                await self._message(tenant.tenant_id, metadata, conversation, text, scenario, rng)

    async def _message(
        self,
        tenant_id: str,
        metadata: tuple[tuple[str, str], ...],
        conversation: str,
        text: str,
        scenario: str,
        rng: random.Random,
    ) -> None:
        event_id = f"ev-{uuid.uuid4().hex}"
        request = gateway_pb2.SendMessageRequest(
            event_id=event_id, conversation_id=conversation, text=text
        )
        sent = await self._call(
            "SendMessage",
            lambda: self._stub().SendMessage(request, metadata=metadata, timeout=CALL_TIMEOUT_S),
            retry_until=time.monotonic() + 30,
        )
        if isinstance(sent, grpc.aio.AioRpcError):
            self._obs.sends_failed += 1
            return
        run_id = sent.run.run_id
        self._obs.deliveries.setdefault(event_id, set()).add(run_id)
        self._obs.transcripts[run_id] = Transcript(run_id, tenant_id)
        side: list[asyncio.Task[None]] = []
        if rng.random() < 0.3:
            side.append(asyncio.create_task(self._redeliver(metadata, request, rng)))
        if scenario in ("publish", "question", "connection"):
            side.append(asyncio.create_task(self._resolve(metadata, run_id, scenario, rng)))
        if scenario == "cancel":
            side.append(asyncio.create_task(self._cancel(metadata, run_id, rng)))
        try:
            await self._watch(metadata, run_id, rng)
        finally:
            for task in side:
                task.cancel()
            await asyncio.gather(*side, return_exceptions=True)

    async def _redeliver(
        self,
        metadata: tuple[tuple[str, str], ...],
        request: gateway_pb2.SendMessageRequest,
        rng: random.Random,
    ) -> None:
        """The same event again (same content: one run), or changed (refused)."""
        await asyncio.sleep(rng.uniform(0, 2))  # a moment chosen by the seed
        conflicting = rng.random() < 0.4
        again = gateway_pb2.SendMessageRequest()
        again.CopyFrom(request)
        if conflicting:
            again.text = request.text + " (edited)"
            self._obs.conflicts_sent += 1
        else:
            self._obs.duplicates_sent += 1
        answer = await self._call(
            "SendMessage",
            lambda: self._stub().SendMessage(again, metadata=metadata, timeout=CALL_TIMEOUT_S),
            retry_until=time.monotonic() + 20,
        )
        if isinstance(answer, grpc.aio.AioRpcError):
            return
        if conflicting:
            self._obs.conflicts_accepted.append(request.event_id)
        else:
            self._obs.deliveries.setdefault(request.event_id, set()).add(answer.run.run_id)

    async def _cancel(
        self, metadata: tuple[tuple[str, str], ...], run_id: str, rng: random.Random
    ) -> None:
        await asyncio.sleep(rng.uniform(0.2, 4.0))  # a moment chosen by the seed
        request = gateway_pb2.CancelRunRequest(run_id=run_id, reason="drill cancel")
        answer = await self._call(
            "CancelRun",
            lambda: self._stub().CancelRun(request, metadata=metadata, timeout=CALL_TIMEOUT_S),
            retry_until=time.monotonic() + 20,
        )
        if not isinstance(answer, grpc.aio.AioRpcError) and answer.changed:
            self._obs.accepted_cancels.append(run_id)

    async def _resolve(
        self,
        metadata: tuple[tuple[str, str], ...],
        run_id: str,
        scenario: str,
        rng: random.Random,
    ) -> None:
        """Play the person: look for the run's pause (bounded) and resolve it."""
        resolved = 0
        while time.monotonic() < self.settle_until and resolved < 3:
            pending = await self._pending(metadata, run_id, scenario)
            if pending is not None and await self._answer(metadata, run_id, scenario, pending, rng):
                resolved += 1
            await asyncio.sleep(0.3)  # polling for a person's inbox: nothing to subscribe to

    async def _pending(
        self, metadata: tuple[tuple[str, str], ...], run_id: str, scenario: str
    ) -> Any:
        stub = self._stub()
        retry_until = time.monotonic() + 5
        if scenario == "question":
            question_request = gateway_pb2.GetPendingQuestionRequest(run_id=run_id)
            got: Any = await self._call(
                "GetPendingQuestion",
                lambda: stub.GetPendingQuestion(
                    question_request, metadata=metadata, timeout=CALL_TIMEOUT_S
                ),
                retry_until=retry_until,
            )
            field_name = "question"
        elif scenario == "publish":
            approval_request = gateway_pb2.GetPendingApprovalRequest(run_id=run_id)
            got = await self._call(
                "GetPendingApproval",
                lambda: stub.GetPendingApproval(
                    approval_request, metadata=metadata, timeout=CALL_TIMEOUT_S
                ),
                retry_until=retry_until,
            )
            field_name = "approval"
        else:
            connection_request = gateway_pb2.GetPendingConnectionRequest(run_id=run_id)
            got = await self._call(
                "GetPendingConnection",
                lambda: stub.GetPendingConnection(
                    connection_request, metadata=metadata, timeout=CALL_TIMEOUT_S
                ),
                retry_until=retry_until,
            )
            field_name = "connection"
        if isinstance(got, grpc.aio.AioRpcError) or not got.HasField(field_name):
            return None
        return getattr(got, field_name)

    async def _answer(
        self,
        metadata: tuple[tuple[str, str], ...],
        run_id: str,
        scenario: str,
        pending: Any,
        rng: random.Random,
    ) -> bool:
        retry_until = time.monotonic() + 10
        if scenario == "question":
            request = gateway_pb2.AnswerQuestionRequest(run_id=run_id)
            for spec in pending.questions:
                request.answers[spec.key].values.append(spec.options[0] if spec.options else "x")
            answered = await self._call(
                "AnswerQuestion",
                lambda: self._stub().AnswerQuestion(
                    request, metadata=metadata, timeout=CALL_TIMEOUT_S
                ),
                retry_until=retry_until,
            )
            return not isinstance(answered, grpc.aio.AioRpcError)
        if scenario == "connection":
            state = pending.login_url.split("state=")[1].split("&")[0]
            complete = gateway_pb2.CompleteConnectionRequest(
                run_id=run_id, state=state, code=self._world.oauth.code_for("calendar.read")
            )
            done = await self._call(
                "CompleteConnection",
                lambda: self._stub().CompleteConnection(
                    complete, metadata=metadata, timeout=CALL_TIMEOUT_S
                ),
                retry_until=retry_until,
            )
            return not isinstance(done, grpc.aio.AioRpcError)
        decision = "allow-once" if rng.random() < 0.8 else "deny"
        gateways = self._world.gateways()
        if len(gateways) > 1 and rng.random() < 0.5:
            # The same decision through two replicas at once: one wins, one is told it lost.
            self._obs.duplicate_decisions_sent += 1
            both = await asyncio.gather(
                *(self._decide(metadata, run_id, decision, g, retry_until) for g in gateways[:2])
            )
            won = [a for a in both if not isinstance(a, grpc.aio.AioRpcError)]
            if sum(1 for a in won if a.resumed) > 1:
                self._obs.decisions_accepted_twice.append(run_id)
            return bool(won)
        answer = await self._decide(metadata, run_id, decision, None, retry_until)
        return not isinstance(answer, grpc.aio.AioRpcError)

    async def _decide(
        self,
        metadata: tuple[tuple[str, str], ...],
        run_id: str,
        decision: str,
        gateway: str | None,
        retry_until: float,
    ) -> gateway_pb2.DecideApprovalResponse | grpc.aio.AioRpcError:
        request = gateway_pb2.DecideApprovalRequest(run_id=run_id, decision=decision)
        return await self._call(
            "DecideApproval",
            lambda: self._stub(gateway).DecideApproval(
                request, metadata=metadata, timeout=CALL_TIMEOUT_S
            ),
            retry_until=retry_until,
        )

    async def _watch(
        self, metadata: tuple[tuple[str, str], ...], run_id: str, rng: random.Random
    ) -> None:
        """Follow the run's durable events to its terminal one, dropping the stream now and
        then and resuming after the last seq seen; bounded by `settle_until`."""
        transcript = self._obs.transcripts[run_id]
        cursor = 0
        while not transcript.terminal and time.monotonic() < self.settle_until:
            request = gateway_pb2.StreamRunRequest(run_id=run_id, after_seq=cursor)
            stream = self._stub().StreamRun(request, metadata=metadata)
            drop_after = rng.randint(2, 12) if rng.random() < 0.5 else None
            seen = 0
            try:
                async with asyncio.timeout(max(0.1, self.settle_until - time.monotonic())):
                    async for item in stream:
                        if item.HasField("snapshot"):
                            for part in item.snapshot.parts:
                                transcript.snapshot_parts[part.index] = part_view(part)
                        events = (
                            [item.event]
                            if item.HasField("event")
                            else list(item.batch.events)
                            if item.HasField("batch")
                            else []
                        )
                        for event in events:
                            if event.seq <= 0:
                                continue
                            cursor = max(cursor, event.seq)
                            seen += 1
                            note_event(transcript, event)
                        if transcript.terminal:
                            break
                        if drop_after is not None and seen >= drop_after:
                            transcript.resumes += 1
                            break  # the client goes away; it resumes from its cursor
                self._obs.record("StreamRun", grpc.StatusCode.OK)
            except grpc.aio.AioRpcError as exc:
                self._obs.record("StreamRun", exc.code(), exc.details() or "")
                await asyncio.sleep(0.2)  # the gateway is down or restarting: try again soon
            except TimeoutError:
                pass
            finally:
                stream.cancel()


def note_event(transcript: Transcript, event: Any) -> None:
    """Add one durable event to what the client saw."""
    transcript.seqs.add(event.seq)
    kind = event.WhichOneof("payload")
    if kind in ("part_added", "part_updated"):
        part = getattr(event, kind).part
        transcript.parts[part.index] = part_view(part)
    if event.type in TERMINAL_EVENTS:
        transcript.terminal = event.type


def part_view(part: Any) -> dict[str, Any]:
    """What the checker compares of a part."""
    content = part.WhichOneof("kind")
    return {
        "kind": content,
        "final": part.final,
        "text": part.text.text if content == "text" else None,
    }
