"""Who may see and act on which run: the one rule, used by every service that looks a run up.

Every run records its owner, the principal of the authenticated key that admitted it. A key
sees its own principal's runs; a key holding `runs:all` sees every run of its tenant. Nothing
else is visible, and what is not visible is NOT_FOUND with the same message as an absent id:
the owning service filters in the statement that finds the run, so a refusal costs the same
and reads the same as a miss.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TypedDict

from sqlalchemy import ColumnElement, FromClause, and_

from tether.apikeys import RUNS_ALL, Principal
from tether.db.schema import runs


class Visibility(enum.StrEnum):
    """Who a run is shown to besides runs:all keys (recorded on the run, shown on the API)."""

    # A chat run: its owner principal only.
    PRIVATE = "private"
    # Admitted by an integration key (webhooks, task events): the integration's principal.
    TENANT = "tenant"


class ViewerFields(TypedDict):
    """A viewer as the fields every internal request about runs carries."""

    tenant_id: str
    principal_id: str
    all_runs: bool


@dataclass(frozen=True)
class Viewer:
    """The authenticated caller asking about runs: set by the gateway from the API key, never
    from a request body. An empty principal without `all_runs` sees nothing (fail closed)."""

    tenant_id: str
    principal_id: str
    all_runs: bool = False

    def sees(self, table: FromClause = runs) -> ColumnElement[bool]:
        """The condition on `runs` selecting exactly the runs this viewer may see (or on
        `run_keys`, whose tenant and owner are the run's)."""
        same_tenant = table.c.tenant_id == self.tenant_id
        if self.all_runs:
            return same_tenant
        # NULL owners (runs admitted before owners were recorded) match no principal.
        return and_(same_tenant, table.c.owner_principal_id == self.principal_id)

    def may_see(self, tenant_id: str, owner_principal_id: str) -> bool:
        """`sees`, for a run known by its tenant and owner ("" for none) instead of by row."""
        if tenant_id != self.tenant_id:
            return False
        if self.all_runs:
            return True
        # No owner (recorded before owners were) matches no principal, as NULL does in `sees`.
        return bool(owner_principal_id) and owner_principal_id == self.principal_id

    def fields(self) -> ViewerFields:
        """The viewer as the fields of an internal request (`Request(**viewer.fields(), ...)`)."""
        return ViewerFields(
            tenant_id=self.tenant_id, principal_id=self.principal_id, all_runs=self.all_runs
        )


def viewer_of(principal: Principal) -> Viewer:
    """The viewer an authenticated key speaks for."""
    return Viewer(principal.tenant_id, principal.principal_id, RUNS_ALL in principal.scopes)
