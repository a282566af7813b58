"""The worker's side of the three pauses: the built-in interaction tools, the interactions
service under the lease, and the ways a run parks (for a person, or on a `wait_until` timer:
see `timers`).

A tool never blocks on a person: it stores the interaction, the attempt raises Parked, and the
run is parked with its lease released. The resumed attempt finds the resolution and finishes
the call that paused it. Protobuf stops in `LeasedInteractions`: it answers in the frozen types
below.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import grpc
from google.protobuf import json_format

from services.worker.mcp.gap import McpConnectionGap
from services.worker.senders import Sending
from services.worker.timers import WAIT_UNTIL, WAIT_UNTIL_SPEC
from tether.domain import Lease, ToolAnnouncement, schema_sha256
from tether.states import RunStatus
from tether.tools.base import ConnectionGap, RiskCategory
from tether.v1 import interactions_pb2, interactions_pb2_grpc

ASK_QUESTIONS = "ask_questions"
REQUEST_APPROVAL = "request_approval"

BUILTIN_SPECS: dict[str, dict[str, Any]] = {
    ASK_QUESTIONS: {
        "name": ASK_QUESTIONS,
        "description": (
            "Ask the user one or more questions when a consequential ambiguity cannot be "
            "resolved from context or tools. Ask everything you need in ONE call."
        ),
        "input_schema": {
            "type": "object",
            "properties": {
                "questions": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "properties": {
                            "key": {"type": "string"},
                            "prompt": {"type": "string"},
                            "options": {"type": "array", "items": {"type": "string"}},
                            "multiple": {"type": "boolean"},
                            "allow_other": {"type": "boolean"},
                        },
                        "required": ["key", "prompt"],
                    },
                }
            },
            "required": ["questions"],
        },
    },
    REQUEST_APPROVAL: {
        "name": REQUEST_APPROVAL,
        "description": (
            "Ask a person to approve a policy-classified action (publishing, scheduling, "
            "sending, deleting, sharing, paid marketing) before it runs."
        ),
        "input_schema": {
            "type": "object",
            "properties": {
                "tool_name": {"type": "string"},
                "input": {"type": "object"},
                "summary": {"type": "string"},
            },
            "required": ["tool_name", "input"],
        },
    },
    WAIT_UNTIL: WAIT_UNTIL_SPEC,
}


def builtin_announcements() -> list[ToolAnnouncement]:
    """The built-in interaction tools as the Work hello announces them: the worker runs them
    (they park the run for a person), so an agent names them as any other tool."""
    return [
        ToolAnnouncement(name, schema_sha256(spec["input_schema"]), RiskCategory.INTERACTION, False)
        for name, spec in BUILTIN_SPECS.items()
    ]


_GAP_PROTO = {
    "absent": interactions_pb2.CONNECTION_GAP_ABSENT,
    "expired": interactions_pb2.CONNECTION_GAP_EXPIRED,
    "insufficient_scope": interactions_pb2.CONNECTION_GAP_INSUFFICIENT_SCOPE,
}
_GAP_NAME = {v: k for k, v in _GAP_PROTO.items()}


class Parked(Exception):
    """The attempt stops here: the run waits for a person (`status`, one of the waiting ones),
    for its timer (waiting-for-timer: until `wake_at`, on the call `tool_call_id`), or for its
    children (waiting-for-children: those of the delegate calls `tool_call_ids`; parked already
    when `done`, with the last of them)."""

    def __init__(
        self,
        status: RunStatus,
        interaction_id: str,
        *,
        wake_at: datetime | None = None,
        tool_call_id: str = "",
        tool_call_ids: Sequence[str] = (),
        done: bool = False,
    ) -> None:
        super().__init__(interaction_id or tool_call_id or ",".join(tool_call_ids))
        self.status = status
        self.interaction_id = interaction_id
        self.wake_at = wake_at
        self.tool_call_id = tool_call_id
        # waiting-for-children: the delegate calls whose children it waits for.
        self.tool_call_ids = tuple(tool_call_ids)
        # Whether the orchestrator parked it already (with the turn's last child): no park is
        # sent.
        self.done = done


@dataclass(frozen=True, slots=True)
class Question:
    """One question as it was asked."""

    key: str
    prompt: str


@dataclass(frozen=True, slots=True)
class AnsweredQuestion:
    """A person's answers to the questions one call asked (values by question key)."""

    interaction_id: str
    tool_call_id: str
    questions: tuple[Question, ...]
    answers: Mapping[str, tuple[str, ...]]


@dataclass(frozen=True, slots=True)
class ApprovalClaim:
    """A decided approval this attempt claimed: what a person decided ("approve", "deny",
    "expired"), and the stored, normalised input they were shown."""

    interaction_id: str
    decision: str
    tool_call_id: str
    tool_name: str
    input: Mapping[str, Any]
    idempotency_key: str = ""


@dataclass(frozen=True, slots=True)
class ConnectionOffer:
    """A consent offer: the interaction that waits for it and where a person connects."""

    interaction_id: str
    login_url: str


class Interactions:
    """The interactions service's client."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._stub = interactions_pb2_grpc.InteractionsServiceStub(channel)

    def under(self, lease: Lease) -> LeasedInteractions:
        """The calls of one attempt, under its lease."""
        return LeasedInteractions(self._stub, lease)


class LeasedInteractions:
    """The interactions service, called under one lease (every call is fenced there)."""

    def __init__(self, stub: interactions_pb2_grpc.InteractionsServiceStub, lease: Lease) -> None:
        self._stub = stub
        self._run_id = lease.run_id
        self._epoch = lease.epoch

    async def ask(self, tool_call_id: str, questions: Sequence[dict[str, Any]]) -> str:
        """Store the questions; returns the interaction id."""
        specs = [
            interactions_pb2.QuestionSpec(
                key=str(q["key"]),
                prompt=str(q["prompt"]),
                options=[str(o) for o in q.get("options", [])],
                multiple=bool(q.get("multiple", False)),
                allow_other=bool(q.get("allow_other", False)),
            )
            for q in questions
        ]
        response = await self._stub.AskQuestions(
            interactions_pb2.AskQuestionsRequest(
                run_id=self._run_id,
                epoch=self._epoch,
                tool_call_id=tool_call_id,
                questions=specs,
            )
        )
        return str(response.interaction_id)

    async def answered(self) -> list[AnsweredQuestion]:
        """The run's answered questions."""
        response = await self._stub.FindAnsweredQuestions(
            interactions_pb2.FindAnsweredQuestionsRequest(run_id=self._run_id, epoch=self._epoch)
        )
        return [
            AnsweredQuestion(
                interaction_id=a.interaction_id,
                tool_call_id=a.tool_call_id,
                questions=tuple(Question(q.key, q.prompt) for q in a.questions),
                answers={key: tuple(answer.values) for key, answer in a.answers.items()},
            )
            for a in response.answered
        ]

    async def check_grant(self, tool_name: str, risk: str) -> str | None:
        """A standing grant's id, or None."""
        response = await self._stub.CheckGrant(
            interactions_pb2.CheckGrantRequest(
                run_id=self._run_id, epoch=self._epoch, tool_name=tool_name, risk_category=risk
            )
        )
        return str(response.grant_id) if response.allowed else None

    async def request_approval(
        self,
        *,
        tool_call_id: str,
        tool_name: str,
        input: dict[str, Any],
        risk: str,
        summary: str,
        policy: str,
        idempotency_key: str,
    ) -> str:
        """Store a pending approval; returns its id. `policy` (the agent's approvals, JSON text)
        is read only by interactions replicas of the previous release, during a rollout: this
        release takes it from the orchestrator."""
        request = interactions_pb2.RequestApprovalRequest(
            run_id=self._run_id,
            epoch=self._epoch,
            tool_call_id=tool_call_id,
            tool_name=tool_name,
            risk_category=risk,
            summary=summary,
            idempotency_key=idempotency_key,
            approval_policy=policy,
        )
        json_format.ParseDict(input, request.input)
        response = await self._stub.RequestApproval(request)
        return str(response.interaction_id)

    async def claim(self, tool_name: str, tool_call_id: str) -> ApprovalClaim | None:
        """Claim the decided approval of this tool call, or None."""
        response: interactions_pb2.ClaimApprovalResponse = await self._stub.ClaimApproval(
            interactions_pb2.ClaimApprovalRequest(
                run_id=self._run_id,
                epoch=self._epoch,
                tool_name=tool_name,
                tool_call_id=tool_call_id,
            )
        )
        return approval_claim_from_proto(response) if response.claimed else None

    async def offer_connection(
        self, tool_call_id: str, gap: ConnectionGap
    ) -> ConnectionOffer | None:
        """A consent offer, or None when none can be made."""
        response = await self._stub.RequestConnection(
            interactions_pb2.RequestConnectionRequest(
                run_id=self._run_id,
                epoch=self._epoch,
                tool_call_id=tool_call_id,
                provider=gap.provider,
                gap=_GAP_PROTO[gap.gap],
                scopes=list(gap.scopes),
                credential_ref=gap.credential_ref,
                mcp=_mcp_authorization(gap),
            )
        )
        if not response.interaction_id:
            return None
        return ConnectionOffer(response.interaction_id, response.login_url)

    async def channel_sending(self, channel_id: str) -> Sending:
        """What sends this run's answer through its channel connection, for this one delivery;
        NotFound when the connection was removed."""
        response = await self._stub.LookupChannelDelivery(
            interactions_pb2.LookupChannelDeliveryRequest(
                run_id=self._run_id, epoch=self._epoch, channel_id=channel_id
            )
        )
        return Sending(
            kind=response.kind,
            api_base_url=response.api_base_url,
            reply_url=response.reply_url,
            settings=dict(response.settings),
            credential=response.credential,
            signing_secret=response.signing_secret,
        )

    async def token(self, provider: str, scopes: Sequence[str], refused: str = "") -> str:
        """The run principal's token for `provider`, or ConnectionGap. `refused`: a token the
        provider refused before its expiry, refreshed by the store if it still holds it."""
        response = await self._stub.ResolveConnection(
            interactions_pb2.ResolveConnectionRequest(
                run_id=self._run_id,
                epoch=self._epoch,
                provider=provider,
                scopes=list(scopes),
                refused_token_sha256=hashlib.sha256(refused.encode()).hexdigest()
                if refused
                else "",
            )
        )
        gap = _GAP_NAME.get(response.gap)
        if gap is not None:
            raise ConnectionGap(
                provider=provider, gap=gap, scopes=scopes, credential_ref=response.credential_ref
            )
        return str(response.access_token)

    async def secret(self, name: str) -> str:
        """The value of the run tenant's secret `name` (NotFound when there is none)."""
        response = await self._stub.RevealRunSecret(
            interactions_pb2.RevealRunSecretRequest(
                run_id=self._run_id, epoch=self._epoch, name=name
            )
        )
        return bytes(response.value).decode("utf-8", "replace")


def _mcp_authorization(gap: ConnectionGap) -> interactions_pb2.McpAuthorization | None:
    """An MCP server's discovered endpoints, for its consent URL and code exchange."""
    if not isinstance(gap, McpConnectionGap):
        return None
    return interactions_pb2.McpAuthorization(
        authorization_endpoint=gap.challenge.authorization_endpoint,
        token_endpoint=gap.challenge.token_endpoint,
        resource=gap.challenge.resource,
    )


def approval_claim_from_proto(response: interactions_pb2.ClaimApprovalResponse) -> ApprovalClaim:
    """The claim a ClaimApprovalResponse (claimed) carries."""
    return ApprovalClaim(
        interaction_id=response.interaction_id,
        decision=response.decision,
        tool_call_id=response.tool_call_id,
        tool_name=response.tool_name,
        input=json_format.MessageToDict(response.input),
        idempotency_key=response.idempotency_key,
    )


def answers_text(answered: AnsweredQuestion) -> str:
    """The user-role line the model reads: each prompt with its answer(s)."""
    lines = ["The user answered:"]
    for question in answered.questions:
        values = answered.answers.get(question.key, ())
        lines.append(f"- {question.prompt} -> {', '.join(values) or '(no answer)'}")
    return "\n".join(lines)
