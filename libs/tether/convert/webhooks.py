"""The body of a run-event webhook: one codec, used by the orchestrator's dispatcher (and by
anyone reading what a subscriber receives)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from google.protobuf import json_format

from tether import formats
from tether.convert import event_to_proto
from tether.errors import StoredFormatTooNew


def _stamp(value: datetime) -> str:
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")


def webhook_body(
    run_id: str,
    seq: int,
    type_: str,
    payload: Mapping[str, Any],
    created_at: datetime,
    *,
    format: int = formats.CURRENT,
) -> str:
    """What a subscriber receives: Standard Webhooks' {type, timestamp, data}, `data` the event
    as the run's event stream carries it (protobuf's JSON mapping of RunEvent)."""
    try:
        event = event_to_proto(run_id, seq, type_, payload, created_at, format=format)
        data: dict[str, Any] = json_format.MessageToDict(event)
    except StoredFormatTooNew:
        # A type this release cannot parse yet: its stored JSON as it is, in the same shape.
        data = {
            "runId": run_id,
            "seq": str(seq),
            "createdAt": _stamp(created_at),
            "type": type_,
            type_.replace(".", "_").replace("-", "_"): dict(payload),
        }
    document = {"type": type_, "timestamp": _stamp(created_at), "data": data}
    return json.dumps(document, separators=(",", ":"))
