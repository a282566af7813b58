"""Approvals: a worker asks before a risky tool call, a person decides once (a standing decision
mints a grant), and the resumed attempt claims the decision for exactly one execution."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy.engine import Row
from sqlalchemy.ext.asyncio import AsyncEngine

from services.interactions import repository as repo
from services.interactions.domain import ALWAYS_SCOPES, DECISIONS, Orchestrator, Policy
from services.interactions.lifecycle import Lifecycle
from tether import audit
from tether.agent_spec.document import (
    DEFAULT_ALWAYS_ALLOW_SCOPES,
    approval_ttl_seconds,
    offered_decisions,
)
from tether.agent_spec.validation import violations
from tether.agent_spec.violations import refusal
from tether.domain import EventType
from tether.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from tether.ids import new_id
from tether.visibility import Viewer


@dataclass(frozen=True)
class ApprovalOffer:
    """What one approval offers, from its run's agent's approval policy: None for the
    decisions and scopes of a run without one (the tenant's policy decides them)."""

    decisions: list[str] | None
    always_allow_scopes: list[str] | None
    ttl_s: float

    @classmethod
    def of(cls, policy: str, tool: str, risk: str, default_ttl_s: float) -> ApprovalOffer:
        """The offer `policy` (JSON text, "" for none) makes on `tool` of category `risk`."""
        if not policy:
            return cls(None, None, default_ttl_s)
        try:
            parsed = json.loads(policy)
        except ValueError as exc:
            raise InvalidArgument(f"approval_policy is not JSON: {exc}") from exc
        # The document's own schema: a policy of the wrong shape is the caller's mistake, never
        # an INTERNAL from reading it.
        found = list(violations({"name": "approval-policy", "approvals": parsed}))
        if found:
            raise refusal(found)
        return cls(
            offered_decisions(parsed, tool, risk, DECISIONS),
            list(parsed.get("always_allow_scopes", DEFAULT_ALWAYS_ALLOW_SCOPES)),
            approval_ttl_seconds(parsed, tool, risk, default_ttl_s),
        )


class Approvals:
    """The only writer of an approval's transitions (requested, decided, claimed) and of the
    grants a standing decision mints."""

    def __init__(
        self, engine: AsyncEngine, orchestrator: Orchestrator, lifecycle: Lifecycle, policy: Policy
    ) -> None:
        self._engine = engine
        self._orchestrator = orchestrator
        self._lifecycle = lifecycle
        self._policy = policy

    async def check_grant(
        self, run_id: str, epoch: int, tool_name: str, risk_category: str
    ) -> str | None:
        """The id of a standing grant covering this call of the lease holder, or None. A
        principal grant covers only runs its principal owns: never one whose body names them
        as its sender."""
        run = await self._orchestrator.leased_run(run_id, epoch)
        async with self._engine.connect() as conn:
            grant = await repo.find_grant(
                conn,
                tenant_id=run.tenant_id,
                session_id=run.session_id,
                principal_id=run.owner_principal_id,
                tool_name=tool_name,
                risk_category=risk_category,
            )
        return None if grant is None else str(grant.grant_id)

    async def request_approval(
        self,
        run_id: str,
        epoch: int,
        *,
        tool_call_id: str,
        tool_name: str,
        input: dict[str, Any],
        risk_category: str,
        summary: str,
        estimated_cost_micros: int,
        idempotency_key: str,
    ) -> str:
        """Store a pending approval with the normalised input that will run if allowed, and
        what the approval policy of the run's pinned agent offers on it: its decisions, the
        scopes allow-always may grant, its expiry. Without a policy (a run routed before agents
        were documents) the tenant's policy decides when it is decided."""
        if not tool_name or not risk_category:
            raise InvalidArgument("tool_name and risk_category are required")
        # The policy is the orchestrator's to tell, never the lease holder's: a worker naming
        # its own could offer a person wider decisions or allow-always scopes.
        run = await self._orchestrator.leased_run(run_id, epoch)
        offer = ApprovalOffer.of(
            run.approval_policy, tool_name, risk_category, self._policy.approval_ttl_s
        )
        return await self._lifecycle.store(
            run_id,
            epoch,
            "approval",
            tool_call_id,
            run=run,
            tool_name=tool_name,
            input=input,
            risk_category=risk_category,
            summary=summary or f"Run {tool_name}",
            estimated_cost_micros=estimated_cost_micros,
            idempotency_key=idempotency_key,
            expires_at=datetime.now(UTC) + timedelta(seconds=offer.ttl_s),
            offered_decisions=offer.decisions,
            always_allow_scopes=offer.always_allow_scopes,
        )

    async def allowed_decisions(self, tenant_id: str, approval: Row[Any]) -> list[str]:
        """Decisions offered on `approval`: its agent's, else the tenant's policy's."""
        if approval.offered_decisions is not None:
            return list(approval.offered_decisions)
        async with self._engine.connect() as conn:
            policy = await repo.tenant_policy(conn, tenant_id)
        scopes = policy.get("always_allow_scopes", ["principal"])
        return [d for d in DECISIONS if d != "allow-always" or scopes]

    async def decide(
        self, viewer: Viewer, run_id: str, decision: str, always_scope: str
    ) -> tuple[str, bool, str]:
        """Record a decision once (minting a grant for standing ones) and resume once.

        A principal-scoped grant is the decider's: it covers the runs the deciding principal
        owns, whoever's run it was decided on."""
        if decision not in DECISIONS:
            raise InvalidArgument(f"decision must be one of {list(DECISIONS)}")
        tenant_id, principal_id = viewer.tenant_id, viewer.principal_id
        grant_id = ""
        run = await self._orchestrator.visible_run(viewer, run_id)
        async with self._engine.begin() as conn:
            pending = await self._lifecycle.open(
                conn, run_id, "approval", run.bound("approval"), lock=True
            )
            if pending is None:
                raise FailedPrecondition(f"run {run_id!r} has no open approval to decide")
            offered = pending.offered_decisions
            if offered is not None and decision not in offered:
                raise FailedPrecondition(
                    f"the agent's approval policy does not offer {decision} on "
                    f"{pending.tool_name}; offered: {list(offered)}"
                )
            if decision == "allow-always":
                scope = always_scope or "principal"
                permitted = pending.always_allow_scopes
                if permitted is None:
                    permitted = (await repo.tenant_policy(conn, tenant_id)).get(
                        "always_allow_scopes", ["principal"]
                    )
                if scope not in ALWAYS_SCOPES:
                    raise InvalidArgument(f"always_scope must be one of {list(ALWAYS_SCOPES)}")
                if scope not in permitted:
                    raise PermissionDenied(
                        f"tenant policy does not permit always-allow for the {scope} scope; "
                        f"permitted: {permitted}"
                    )
            resolved = await repo.resolve(
                conn, pending.interaction_id, "decided", decision=decision, decided_by=principal_id
            )
            if resolved is None:
                raise FailedPrecondition("the approval was decided meanwhile")
            await audit.record(
                conn,
                tenant_id=tenant_id,
                run_id=run_id,
                action=EventType.APPROVAL_DECIDED,
                actor={"kind": "principal", "principal_id": principal_id},
                interaction_id=pending.interaction_id,
                decision=decision,
            )
            if decision in ("allow-conversation", "allow-always"):
                # Standing permissions only: allow-once mints no grant, by definition.
                grant_id = new_id("grt")
                scope = (
                    "conversation"
                    if decision == "allow-conversation"
                    else (always_scope or "principal")
                )
                await repo.insert_grant(
                    conn,
                    grant_id=grant_id,
                    tenant_id=tenant_id,
                    scope=scope,
                    session_id=run.session_id if scope == "conversation" else None,
                    principal_id=principal_id if scope == "principal" else None,
                    tool_name=pending.tool_name if scope != "category" else None,
                    risk_category=pending.risk_category if scope == "category" else None,
                    granted_by=principal_id,
                    interaction_id=pending.interaction_id,
                )
        resumed = await self._lifecycle.try_resume(
            tenant_id, run_id, "approval", pending.interaction_id, decision
        )
        return pending.interaction_id, resumed, grant_id

    async def claim_approval(
        self, run_id: str, epoch: int, tool_name: str, tool_call_id: str
    ) -> Row[Any] | None:
        """Claim the decided approval of this tool call for exactly one execution.

        Fails closed: an undecided approval cannot be claimed, a claim names one tool, one call
        and one run, an orphan (never parked on, so never decided) cannot be claimed, and two
        racing claimers get one claim.
        """
        async with self._engine.connect() as conn:
            if not await repo.has_interactions(conn, run_id):
                return None  # nothing was ever requested for this run
        await self._orchestrator.leased_run(run_id, epoch)
        async with self._engine.begin() as conn:
            return await repo.claim_approval(conn, run_id, tool_call_id, tool_name, epoch)

    async def pending_approval(self, viewer: Viewer, run_id: str) -> Row[Any] | None:
        """The run's open approval, or None once decided."""
        bound = (await self._orchestrator.visible_run(viewer, run_id)).bound("approval")
        async with self._engine.connect() as conn:
            return await self._lifecycle.open(conn, run_id, "approval", bound)
