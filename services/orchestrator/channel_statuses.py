"""RecordChannelStatuses' request checked and read: what a channel provider reported about the
messages it sent for a connection, as the gateway read it from a verified webhook."""

from __future__ import annotations

import json
from datetime import UTC

from services.orchestrator.repositories.channel_statuses import ChannelStatus
from tether.errors import InvalidArgument
from tether.ids import is_identifier
from tether.v1 import orchestrator_pb2

MAX_STATUSES = 1000
MAX_MESSAGE_ID_CHARS = 256
MAX_CALLBACK_DATA_CHARS = 512
MAX_ERRORS_CHARS = 16384
# What datetime can hold: 0001-01-01T00:00:00Z and 9999-12-31T23:59:59Z as Unix seconds.
_FIRST_SECOND, _LAST_SECOND = -62_135_596_800, 253_402_300_799


def _text(what: str, value: str, most: int, *, required: bool = False) -> None:
    if required and not value:
        raise InvalidArgument(f"{what} is required")
    if len(value) > most:
        raise InvalidArgument(f"{what} is {len(value)} characters; the limit is {most}")
    if "\x00" in value:
        raise InvalidArgument(f"{what} contains a NUL character")


def channel_statuses_of(
    request: orchestrator_pb2.RecordChannelStatusesRequest,
) -> tuple[str, str, list[ChannelStatus]]:
    """(tenant, connection, statuses) of a request, each field within its limit."""
    if not request.tenant_id:
        raise InvalidArgument("tenant_id is required")
    if not is_identifier(request.channel_id):
        raise InvalidArgument("channel_id must be a channel connection's id (ch_...)")
    if len(request.statuses) > MAX_STATUSES:
        raise InvalidArgument(f"at most {MAX_STATUSES} statuses go in one call")
    out = []
    for index, status in enumerate(request.statuses):
        where = f"statuses[{index}]"
        _text(f"{where}.provider_message_id", status.provider_message_id, MAX_MESSAGE_ID_CHARS,
              required=True)  # fmt: skip
        if not is_identifier(status.status):
            raise InvalidArgument(f"{where}.status must be a word such as sent or delivered")
        _text(f"{where}.callback_data", status.callback_data, MAX_CALLBACK_DATA_CHARS)
        _text(f"{where}.errors_json", status.errors_json, MAX_ERRORS_CHARS)
        if "\\u0000" in status.errors_json:
            raise InvalidArgument(f"{where}.errors_json holds a NUL, which JSONB cannot store")
        try:
            errors = json.loads(status.errors_json) if status.errors_json else None
            json.dumps(errors, ensure_ascii=False).encode()  # a lone surrogate is not Unicode
        except (ValueError, RecursionError) as exc:
            raise InvalidArgument(f"{where}.errors_json is not JSON of Unicode: {exc}") from exc
        reported = status.reported_at
        in_range = _FIRST_SECOND <= reported.seconds <= _LAST_SECOND
        if not (status.HasField("reported_at") and in_range and 0 <= reported.nanos < 10**9):
            raise InvalidArgument(f"{where}.reported_at must be a time in the years 1 to 9999")
        out.append(
            ChannelStatus(
                provider_message_id=status.provider_message_id,
                status=status.status,
                callback_data=status.callback_data or None,
                errors=errors,
                reported_at=status.reported_at.ToDatetime(tzinfo=UTC),
            )
        )
    return request.tenant_id, request.channel_id, out
