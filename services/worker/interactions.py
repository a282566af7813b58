"""The worker's side of the three pauses: the built-in interaction tools, the interactions
service under the lease, and the ways a run parks.

A tool never blocks on a person: it stores the interaction, the attempt raises Parked, and the
run is parked with its lease released. The resumed attempt finds the resolution and finishes
the call that paused it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from google.protobuf import json_format

from services.worker.tools.base import ConnectionGap
from tether.v1 import common_pb2, interactions_pb2, interactions_pb2_grpc

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
}

_GAP_PROTO = {
    "absent": interactions_pb2.CONNECTION_GAP_ABSENT,
    "expired": interactions_pb2.CONNECTION_GAP_EXPIRED,
    "insufficient_scope": interactions_pb2.CONNECTION_GAP_INSUFFICIENT_SCOPE,
}
_GAP_NAME = {v: k for k, v in _GAP_PROTO.items()}


class Parked(Exception):
    """The attempt stops here: the run waits for a person."""

    def __init__(self, status: common_pb2.RunStatus.ValueType, interaction_id: str) -> None:
        super().__init__(interaction_id)
        self.status = status
        self.interaction_id = interaction_id


class LeasedInteractions:
    """The interactions service, called under one lease (every call is fenced there)."""

    def __init__(
        self, stub: interactions_pb2_grpc.InteractionsServiceStub, run_id: str, epoch: int
    ) -> None:
        self._stub = stub
        self._run_id = run_id
        self._epoch = epoch

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

    async def answered(self) -> list[interactions_pb2.AnsweredQuestion]:
        """The run's answered questions."""
        response = await self._stub.FindAnsweredQuestions(
            interactions_pb2.FindAnsweredQuestionsRequest(run_id=self._run_id, epoch=self._epoch)
        )
        return list(response.answered)

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
        idempotency_key: str,
    ) -> str:
        """Store a pending approval; returns its id."""
        request = interactions_pb2.RequestApprovalRequest(
            run_id=self._run_id,
            epoch=self._epoch,
            tool_call_id=tool_call_id,
            tool_name=tool_name,
            risk_category=risk,
            summary=summary,
            idempotency_key=idempotency_key,
        )
        json_format.ParseDict(input, request.input)
        response = await self._stub.RequestApproval(request)
        return str(response.interaction_id)

    async def claim(
        self, tool_name: str, tool_call_id: str
    ) -> interactions_pb2.ClaimApprovalResponse | None:
        """Claim the decided approval of this tool call, or None."""
        response: interactions_pb2.ClaimApprovalResponse = await self._stub.ClaimApproval(
            interactions_pb2.ClaimApprovalRequest(
                run_id=self._run_id,
                epoch=self._epoch,
                tool_name=tool_name,
                tool_call_id=tool_call_id,
            )
        )
        return response if response.claimed else None

    async def offer_connection(
        self, tool_call_id: str, gap: ConnectionGap
    ) -> tuple[str, str] | None:
        """A consent offer (interaction id, login URL), or None when none can be made."""
        response = await self._stub.RequestConnection(
            interactions_pb2.RequestConnectionRequest(
                run_id=self._run_id,
                epoch=self._epoch,
                tool_call_id=tool_call_id,
                provider=gap.provider,
                gap=_GAP_PROTO[gap.gap],
                scopes=list(gap.scopes),
                credential_ref=gap.credential_ref,
            )
        )
        if not response.interaction_id:
            return None
        return str(response.interaction_id), str(response.login_url)

    async def token(self, provider: str, scopes: Sequence[str]) -> str:
        """The run principal's token for `provider`, or ConnectionGap."""
        response = await self._stub.ResolveConnection(
            interactions_pb2.ResolveConnectionRequest(
                run_id=self._run_id, epoch=self._epoch, provider=provider, scopes=list(scopes)
            )
        )
        gap = _GAP_NAME.get(response.gap)
        if gap is not None:
            raise ConnectionGap(
                provider=provider, gap=gap, scopes=scopes, credential_ref=response.credential_ref
            )
        return str(response.access_token)


def answers_text(answered: interactions_pb2.AnsweredQuestion) -> str:
    """The user-role line the model reads: each prompt with its answer(s)."""
    lines = ["The user answered:"]
    for spec in answered.questions:
        values = list(answered.answers[spec.key].values) if spec.key in answered.answers else []
        lines.append(f"- {spec.prompt} -> {', '.join(values) or '(no answer)'}")
    return "\n".join(lines)
