"""sessions: a thread's or a task's conversation belongs to one principal

A messaging thread's session was keyed `thread` and a task's `task`, without the principal that
submitted the event, so a second principal of the tenant naming the same provider thread (or
task id) joined the first one's conversation: its runs were authorised by the first one's
allow-conversation grants and sent the first one's history. The actor scope now names the
principal (`thread:alice`, `task:alice`, as a chat's `principal:alice` always did), and an
existing session belongs to the principal of its first run with a known owner: its history and
its grants (bound to its session id, which stays) keep serving that principal, and any other
principal's next message opens a conversation of its own. A session no run of a known owner
names (runs of a webhook admitted before 0007, or removed by retention) keeps its bare scope,
which no event names any more: its runs stay readable, nobody joins it again.

No column or constraint changes, so the release before keeps running during the rollout; it
still writes bare `thread` and `task` sessions, which this release leaves alone.

Revision ID: 0019
Revises: 0018
"""

from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        """
        UPDATE sessions s SET actor_scope = s.actor_scope || ':' || first.owner_principal_id
        FROM (
            SELECT DISTINCT ON (r.session_id) r.session_id, r.owner_principal_id
            FROM runs r JOIN sessions shared ON shared.session_id = r.session_id
            WHERE shared.actor_scope IN ('thread', 'task') AND r.owner_principal_id IS NOT NULL
            ORDER BY r.session_id, r.created_at, r.run_id
        ) first
        WHERE s.session_id = first.session_id
        """
    )


def downgrade() -> None:
    # Nothing to undo that could be undone safely: one thread may now hold a session per
    # principal, which the bare scope cannot tell apart. The release before reads these
    # sessions' runs as they are and opens bare ones for new messages.
    pass
