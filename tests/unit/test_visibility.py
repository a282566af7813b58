"""`Viewer.may_see`: the visibility rule for a run known by its tenant and owner (a live
message's audience), the same rule `Viewer.sees` puts in SQL."""

from __future__ import annotations

import pytest

from tether.visibility import Viewer

ALICE = Viewer("ten_a", "alice")
WHOLE_TENANT = Viewer("ten_a", "admin", all_runs=True)
NOBODY = Viewer("ten_a", "")


@pytest.mark.parametrize(
    ("viewer", "tenant", "owner", "seen"),
    [
        (ALICE, "ten_a", "alice", True),
        (ALICE, "ten_a", "carol", False),
        (ALICE, "ten_b", "alice", False),  # the same principal name in another tenant
        (ALICE, "ten_a", "", False),  # a run without an owner matches no principal
        (WHOLE_TENANT, "ten_a", "carol", True),
        (WHOLE_TENANT, "ten_a", "", True),
        (WHOLE_TENANT, "ten_b", "carol", False),
        (NOBODY, "ten_a", "", False),  # an empty principal without runs:all sees nothing
    ],
)
def test_a_viewer_sees_its_own_runs_or_with_runs_all_its_tenants(
    viewer: Viewer, tenant: str, owner: str, seen: bool
) -> None:
    assert viewer.may_see(tenant, owner) is seen
