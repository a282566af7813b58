"""run_event_log: a run's run.queued read from its row, and each run.started from its attempt's

Two events restated a record written beside them in the same transaction (issue 34: records
written once), each a `run_events` row of its own with its entry in `pk_run_events`, about 300
bytes of WAL a run apiece:
- run.queued (seq 1), written with the run by its intake: the attempt (1) and why it was queued,
  which the run's own lineage says (a delegate call's child, `tree_parent_run_id`: delegated; a
  retried delivery, `parent_run_id`: redelivered; else admitted). The intake now writes the run
  alone, and the log reads the event from the run's row (its time the run's creation, the same
  transaction's), for a run whose log holds no seq 1 of its own.
- run.started, written with the attempt's row by the claim: the attempt, the worker and the
  lease's epoch again. The claim now writes the attempt alone, with the seq its run.started takes
  (`attempts.event_seq`), and the log reads the event from there (its time the attempt's start).

Both payloads are built as `tether.domain.run_queued` and `run_started` build them (format 2,
unchanged; a test holds them equal). A run or an attempt whose event is a `run_events` row
(stored before this, or by the release before during a rollout: the run with a seq 1 row, the
attempt without `event_seq`) is read as it always was, so no event is read twice.

The release before reads a run's events from `run_event_log` only, so it reads these too: both
releases run on this schema during a rollout, with no stored format to pin.

`downgrade` writes every event read from a run's or an attempt's row back into `run_events`
before it puts back 0045's view and drops the column: no event is lost on the way back.

Revision ID: 0048
Revises: 0047
"""

import importlib.util
from pathlib import Path

from alembic import op

revision = "0048"
down_revision = "0047"
branch_labels = None
depends_on = None

# Each run's run.queued, for a run whose log has no seq 1 row (`run_queued(1, reason)`).
_QUEUED = """SELECT run_id,
    1::bigint AS seq,
    'run.queued'::text AS type,
    jsonb_build_object(
        'reason',
        CASE
            WHEN tree_parent_run_id IS NOT NULL THEN 'delegated'
            WHEN parent_run_id IS NOT NULL THEN 'redelivered'
            ELSE 'admitted'
        END,
        'attempt', 1
    ) AS payload,
    2::smallint AS format,
    created_at,
    1::bigint AS row_seq
FROM runs
WHERE NOT EXISTS (
    SELECT 1 FROM run_events WHERE run_events.run_id = runs.run_id AND run_events.seq = 1
)"""
# Each attempt's run.started, at the seq it holds (`run_started(attempt, worker_id, epoch)`).
_STARTED = """SELECT run_id,
    event_seq AS seq,
    'run.started'::text AS type,
    jsonb_build_object('attempt', attempt, 'workerId', worker_id, 'leaseEpoch', lease_epoch)
        AS payload,
    2::smallint AS format,
    started_at AS created_at,
    event_seq AS row_seq
FROM attempts
WHERE event_seq IS NOT NULL"""


def _view_of_0045() -> str:
    """0045's view, its query alone (what this one adds to, and the way back)."""
    path = Path(__file__).with_name("0045_events_together.py")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return str(module.RUN_EVENT_LOG).removeprefix("CREATE VIEW run_event_log AS\n")


_0045_VIEW = _view_of_0045()
RUN_EVENT_LOG = (
    f"CREATE OR REPLACE VIEW run_event_log AS\n{_0045_VIEW}\n"
    f"UNION ALL\n{_QUEUED}\nUNION ALL\n{_STARTED}"
)


def upgrade() -> None:
    op.execute("ALTER TABLE attempts ADD COLUMN event_seq BIGINT")
    op.execute(RUN_EVENT_LOG)


def downgrade() -> None:
    for derived in (_QUEUED, _STARTED):
        op.execute(
            "INSERT INTO run_events (run_id, seq, type, payload, format, created_at) "
            f"SELECT run_id, seq, type, payload, format, created_at FROM ({derived}) AS derived"
        )
    op.execute(f"CREATE OR REPLACE VIEW run_event_log AS\n{_0045_VIEW}")
    op.execute("ALTER TABLE attempts DROP COLUMN event_seq")
