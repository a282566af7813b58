"""Where a database's schema stands against the migrations this release ships: the rule the
readiness gate applies (tether.runtime.readiness)."""

from __future__ import annotations

from tether.db.migrate import SchemaState, schema_state, shipped_revisions


def test_the_shipped_head_is_current() -> None:
    head, shipped = shipped_revisions()
    assert head == shipped[0]
    assert schema_state((head,)) is SchemaState.CURRENT


def test_a_database_never_migrated_or_at_an_earlier_revision_is_behind() -> None:
    _, shipped = shipped_revisions()
    assert schema_state(()) is SchemaState.BEHIND
    for earlier in shipped[1:]:
        assert schema_state((earlier,)) is SchemaState.BEHIND, earlier


def test_a_revision_this_release_does_not_ship_is_a_newer_releases() -> None:
    # Expand-then-contract: the release before keeps serving once the next one migrated.
    assert schema_state(("9999",)) is SchemaState.AHEAD
