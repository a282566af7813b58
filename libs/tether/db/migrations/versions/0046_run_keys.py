"""run_keys: the lookup keys of a run, written once, out of the row its updates rewrite (expand)

A run's row is updated twice without HOT (the claim and the completion: each changes `status`,
which the claim's partial indexes name), and a non-HOT update adds an entry to every index of
the table: to the four lookup indexes too (by tenant, by tenant and owner, by session, by
message), whose keys never change. They were twelve index entries a run, 1,334 bytes of its WAL
(issue 34).

`run_keys` holds those keys (tenant, created_at, run id, owner, session, message), one row a run,
inserted once and never updated; its primary key and three indexes are the four lookups.
Triggers on `runs` keep it in step: every insert of runs adds their keys, every delete removes
them (statement triggers), and an update that sets a key (the services' never do) moves them,
whichever release's process writes (the release before's admissions during the
rollout too). Existing runs are backfilled here, in the transaction that creates the trigger,
so no run is missed between the two. This release's reads by those keys go through `run_keys`.

Expand only: runs keeps its four lookup indexes, which the release before reads by. The next
release's migration drops them (contract), once nothing older runs.

Revision ID: 0046
Revises: 0045
"""

import sqlalchemy as sa
from alembic import op

revision = "0046"
down_revision = "0045"
branch_labels = None
depends_on = None

KEYS = "tenant_id, created_at, run_id, owner_principal_id, session_id, message_id"
OLD_KEYS = ", ".join(f"OLD.{key}" for key in KEYS.split(", "))
NEW_KEYS = ", ".join(f"NEW.{key}" for key in KEYS.split(", "))

TRIGGERS = [
    f"""CREATE FUNCTION tether_run_keys_added() RETURNS trigger LANGUAGE plpgsql AS $function$
BEGIN
    INSERT INTO run_keys ({KEYS}) SELECT {KEYS} FROM added_runs;
    RETURN NULL;
END
$function$""",
    """CREATE FUNCTION tether_run_keys_removed() RETURNS trigger LANGUAGE plpgsql AS $function$
BEGIN
    DELETE FROM run_keys k USING removed_runs r
    WHERE k.tenant_id = r.tenant_id AND k.created_at = r.created_at AND k.run_id = r.run_id;
    RETURN NULL;
END
$function$""",
    """CREATE FUNCTION tether_run_keys_moved() RETURNS trigger LANGUAGE plpgsql AS $function$
BEGIN
    UPDATE run_keys SET tenant_id = NEW.tenant_id, created_at = NEW.created_at,
        run_id = NEW.run_id, owner_principal_id = NEW.owner_principal_id,
        session_id = NEW.session_id, message_id = NEW.message_id
    WHERE tenant_id = OLD.tenant_id AND created_at = OLD.created_at AND run_id = OLD.run_id;
    RETURN NULL;
END
$function$""",
    """CREATE TRIGGER run_keys_added AFTER INSERT ON runs REFERENCING NEW TABLE AS added_runs
    FOR EACH STATEMENT EXECUTE FUNCTION tether_run_keys_added()""",
    """CREATE TRIGGER run_keys_removed AFTER DELETE ON runs REFERENCING OLD TABLE AS removed_runs
    FOR EACH STATEMENT EXECUTE FUNCTION tether_run_keys_removed()""",
    # Only an UPDATE that sets a key fires it (none of the services' does; an operator's may):
    # the run's updates set other columns, and pay nothing for it.
    f"""CREATE TRIGGER run_keys_moved AFTER UPDATE OF {KEYS} ON runs FOR EACH ROW
    WHEN (({OLD_KEYS}) IS DISTINCT FROM ({NEW_KEYS}))
    EXECUTE FUNCTION tether_run_keys_moved()""",
]


def upgrade() -> None:
    op.create_table(
        "run_keys",
        sa.Column("tenant_id", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("run_id", sa.Text(), nullable=False),
        sa.Column("owner_principal_id", sa.Text(), nullable=True),
        sa.Column("session_id", sa.Text(), nullable=False),
        sa.Column("message_id", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("tenant_id", "created_at", "run_id", name="pk_run_keys"),
    )
    # The trigger first: a run inserted once it exists has its keys added by it, and one
    # inserted before is in the backfill (CREATE TRIGGER holds inserts of runs until commit).
    for statement in TRIGGERS:
        op.execute(statement)
    op.execute(f"INSERT INTO run_keys ({KEYS}) SELECT {KEYS} FROM runs")
    op.create_index(
        "ix_run_keys_tenant_id_owner_principal_id_created_at_run_id",
        "run_keys",
        ["tenant_id", "owner_principal_id", "created_at", "run_id"],
    )
    op.create_index("ix_run_keys_session_id_created_at", "run_keys", ["session_id", "created_at"])
    op.create_index("ix_run_keys_message_id", "run_keys", ["message_id"])


def downgrade() -> None:
    op.execute("DROP TRIGGER run_keys_moved ON runs")
    op.execute("DROP TRIGGER run_keys_removed ON runs")
    op.execute("DROP TRIGGER run_keys_added ON runs")
    op.execute("DROP FUNCTION tether_run_keys_moved()")
    op.execute("DROP FUNCTION tether_run_keys_removed()")
    op.execute("DROP FUNCTION tether_run_keys_added()")
    op.drop_table("run_keys")
