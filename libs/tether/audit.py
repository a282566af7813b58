"""The audit trail: who did what, when, in the `audit_log` table.

Every key creation and revocation (the gateway) and every decision, answer and completed
connection (the interactions service) writes one row, in the transaction of the act itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import insert
from sqlalchemy.ext.asyncio import AsyncConnection

from tether.db.schema import audit_log


async def record(
    conn: AsyncConnection,
    *,
    tenant_id: str,
    action: str,
    actor: Mapping[str, str],
    run_id: str | None = None,
    **what: Any,
) -> None:
    """Append one audit row: `action` (e.g. "key.created") by `actor` (who: key id and
    principal, or the operator), with `what` it acted on; `created_at` says when."""
    await conn.execute(
        insert(audit_log).values(
            tenant_id=tenant_id,
            run_id=run_id,
            action=action,
            detail={"actor": dict(actor), **what},
        )
    )
