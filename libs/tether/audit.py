"""The audit trail: who did what, when, in the `audit_log` table.

Every key creation and revocation (the gateway) and every decision, answer and completed
connection (the interactions service) writes one row, in the transaction of the act itself.
A run's records go with the run when retention removes it; a tenant's, when it is deleted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import Text, bindparam, delete, func, insert
from sqlalchemy.dialects.postgresql import ARRAY
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


_FORGET_RUNS = delete(audit_log).where(
    audit_log.c.run_id == func.any(bindparam("run_ids", type_=ARRAY(Text)))
)


async def forget_runs(conn: AsyncConnection, run_ids: Sequence[str]) -> None:
    """Remove the records of runs that were removed (in the transaction that removed them)."""
    if run_ids:
        await conn.execute(_FORGET_RUNS, {"run_ids": list(run_ids)})


async def forget_tenant(conn: AsyncConnection, tenant_id: str) -> int:
    """Remove a deleted tenant's records (its runs' went with them: what is left is its keys'
    and its people's acts, few); how many."""
    result = await conn.execute(delete(audit_log).where(audit_log.c.tenant_id == tenant_id))
    return int(result.rowcount or 0)
