"""Where a database's schema stands against the migrations this release ships: the rule the
readiness gate applies (tether.runtime.readiness)."""

from __future__ import annotations

import subprocess
import sys

from alembic.script import ScriptDirectory

from tether.db.migrate import SchemaState, alembic_config, schema_state, shipped_revisions


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


def test_the_shipped_revisions_are_alembics_own_reading_of_the_scripts() -> None:
    scripts = ScriptDirectory.from_config(alembic_config())
    assert shipped_revisions() == (
        scripts.get_current_head(),
        tuple(rev.revision for rev in scripts.walk_revisions()),
    )


def test_a_services_readiness_gate_does_not_import_alembic() -> None:
    # Every service checks its schema before it is ready; only what migrates needs Alembic.
    probe = "import sys, tether.runtime.readiness; print('alembic' in sys.modules)"
    ran = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert ran.stdout.strip() == "False"
