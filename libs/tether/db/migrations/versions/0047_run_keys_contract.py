"""runs: the contract of 0046, the lookup indexes of runs dropped and the references moved

0046 (the release before) gave every run a row in `run_keys` and moved every read of runs by
tenant, owner, session and message to it. This drops the four lookup indexes of `runs` that those
reads used (`ix_runs_tenant_created`, `ix_runs_tenant_owner_created`, `ix_runs_session_created`,
`ix_runs_message`): each of a run row's two non-HOT updates (the claim and the completion) added
an entry to each of them again, about 1,330 bytes of WAL a run (issue 34).

Two of them also served the foreign keys of `runs` to `sessions` and to `messages`: removing a
session or a message (retention, a tenant's deletion) checks that no run names it, and without
an index by that key the check reads all of `runs`, once for every row removed. So the two
foreign keys move to `run_keys`, which holds the same session and message for every run (its
triggers insert them with the run and delete them with it) and has an index by each. They stay
what they were (NO ACTION, on the session's and the message's id): a run still cannot name a
session or a message that is not there (its keys' insert, in the same statement, is refused),
and neither can go while a run names it. The new ones are added NOT VALID, then validated; the
old ones are dropped after. Every migration runs in one transaction (`tether.db.migrate`), so
the locks adding them takes are held until it commits: inserts of runs (their keys), sessions
and messages wait for the validation's scan of `run_keys`, 0.74 to 0.79 s for 500,000 runs on
the 2-core machine the benches run on.

The release before (0.1.1) reads by `run_keys` already and writes runs as this one does, so it
keeps running on this schema during the rollout. An older one still reads runs by these indexes
(0.1.0 at a lease and a session's hand-over): upgrade from 0.1.1.

Revision ID: 0047
Revises: 0046
"""

from alembic import op

revision = "0047"
down_revision = "0046"
branch_labels = None
depends_on = None

# (what it refers to, the column) for each foreign key that moves from runs to run_keys.
_REFERENCES = (("sessions", "session_id"), ("messages", "message_id"))
# (name, its definition) of each lookup index of runs dropped here.
_LOOKUPS = (
    ("ix_runs_tenant_created", "(tenant_id, created_at DESC, run_id DESC)"),
    (
        "ix_runs_tenant_owner_created",
        "(tenant_id, owner_principal_id, created_at DESC, run_id DESC)",
    ),
    ("ix_runs_session_created", "(session_id, created_at)"),
    ("ix_runs_message", "(message_id)"),
)


def _refer(table: str, referred: str, column: str) -> None:
    name = f"fk_{table}_{column}_{referred}"
    op.execute(
        f"ALTER TABLE {table} ADD CONSTRAINT {name} FOREIGN KEY ({column}) "
        f"REFERENCES {referred} ({column}) NOT VALID"
    )
    op.execute(f"ALTER TABLE {table} VALIDATE CONSTRAINT {name}")


def upgrade() -> None:
    for referred, column in _REFERENCES:
        _refer("run_keys", referred, column)
    for referred, column in _REFERENCES:
        op.execute(f"ALTER TABLE runs DROP CONSTRAINT fk_runs_{column}_{referred}")
    for name, _ in _LOOKUPS:
        op.execute(f"DROP INDEX {name}")


def downgrade() -> None:
    for name, columns in _LOOKUPS:
        op.execute(f"CREATE INDEX {name} ON runs {columns}")
    for referred, column in _REFERENCES:
        _refer("runs", referred, column)
    for referred, column in _REFERENCES:
        op.execute(f"ALTER TABLE run_keys DROP CONSTRAINT fk_run_keys_{column}_{referred}")
