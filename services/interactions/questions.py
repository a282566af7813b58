"""Questions: a worker asks one or more at once, a person answers them once, and the resumed
attempt reads the answers back as history."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy.engine import Row
from sqlalchemy.ext.asyncio import AsyncEngine

from services.interactions import repository as repo
from services.interactions.domain import (
    Orchestrator,
    QuestionSpec,
    validate_answers,
    validate_specs,
)
from services.interactions.lifecycle import Lifecycle
from tether import audit
from tether.domain import EventType
from tether.errors import FailedPrecondition
from tether.visibility import Viewer


class Questions:
    """The only writer of a question's transitions: asked (pending), then answered."""

    def __init__(
        self, engine: AsyncEngine, orchestrator: Orchestrator, lifecycle: Lifecycle
    ) -> None:
        self._engine = engine
        self._orchestrator = orchestrator
        self._lifecycle = lifecycle

    async def ask(
        self, run_id: str, epoch: int, tool_call_id: str, specs: Sequence[QuestionSpec]
    ) -> str:
        """Store one interaction carrying every question; the run parks on it."""
        validate_specs(specs)
        return await self._lifecycle.store(
            run_id, epoch, "question", tool_call_id, questions=[s.to_json() for s in specs]
        )

    async def answer(
        self, viewer: Viewer, run_id: str, answers: Mapping[str, Sequence[str]]
    ) -> tuple[str, bool]:
        """Record the answers once and resume the run once."""
        bound = (await self._orchestrator.visible_run(viewer, run_id)).bound("question")
        async with self._engine.begin() as conn:
            pending = await self._lifecycle.open(conn, run_id, "question", bound, lock=True)
            if pending is None:
                raise FailedPrecondition(f"run {run_id!r} has no open question to answer")
            specs = [QuestionSpec.from_json(s) for s in pending.questions]
            checked = validate_answers(specs, answers)
            resolved = await repo.resolve(
                conn,
                pending.interaction_id,
                "answered",
                answers=checked,
                decided_by=viewer.principal_id,
            )
            if resolved is None:
                raise FailedPrecondition("the question was answered meanwhile")
            await audit.record(
                conn,
                tenant_id=viewer.tenant_id,
                run_id=run_id,
                action=EventType.QUESTION_ANSWERED,
                actor={"kind": "principal", "principal_id": viewer.principal_id},
                interaction_id=pending.interaction_id,
            )
        resumed = await self._lifecycle.try_resume(
            viewer.tenant_id, run_id, "question", pending.interaction_id
        )
        return pending.interaction_id, resumed

    async def pending_question(self, viewer: Viewer, run_id: str) -> Row[Any] | None:
        """The run's open question, or None once answered."""
        bound = (await self._orchestrator.visible_run(viewer, run_id)).bound("question")
        async with self._engine.connect() as conn:
            return await self._lifecycle.open(conn, run_id, "question", bound)

    async def answered(self, run_id: str, epoch: int) -> Sequence[Row[Any]]:
        """The run's answered questions, for the resumed attempt (no claim: answers are
        history, and history is idempotent)."""
        await self._orchestrator.leased_run(run_id, epoch)
        async with self._engine.connect() as conn:
            return await repo.answered_questions(conn, run_id)
