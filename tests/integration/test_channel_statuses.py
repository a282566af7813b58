"""What channel providers report of sent messages, against the real PostgreSQL: a status reported
again is one row, a bad request is refused before anything is written, and a deleted tenant's
statuses go in its deletion's batches."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from services.orchestrator.channel_statuses import channel_statuses_of
from services.orchestrator.repositories import channel_statuses as repo
from services.orchestrator.retention import Retention
from tether.db.schema import channel_statuses
from tether.errors import InvalidArgument
from tether.settings import RetainingSettings
from tether.v1 import orchestrator_pb2

pytestmark = pytest.mark.asyncio(loop_scope="session")


def _request(
    tenant: str, *statuses: tuple[str, str, str]
) -> orchestrator_pb2.RecordChannelStatusesRequest:
    request = orchestrator_pb2.RecordChannelStatusesRequest(tenant_id=tenant, channel_id="ch_1")
    for message_id, status, data in statuses:
        added = request.statuses.add(
            provider_message_id=message_id, status=status, callback_data=data,
            errors_json='[{"code":131047}]' if status == "failed" else "",
        )  # fmt: skip
        added.reported_at.FromDatetime(datetime(2026, 1, 1, tzinfo=UTC))
    return request


async def _record(
    engine: AsyncEngine, request: orchestrator_pb2.RecordChannelStatusesRequest
) -> int:
    tenant, channel, statuses = channel_statuses_of(request)
    async with engine.begin() as conn:
        return await repo.record(conn, tenant, channel, statuses)


async def _rows(engine: AsyncEngine, tenant: str) -> int:
    async with engine.connect() as conn:
        query = select(func.count()).where(channel_statuses.c.tenant_id == tenant)
        return int(await conn.scalar(query) or 0)


async def test_a_status_reported_again_is_one_row(engine: AsyncEngine) -> None:
    tenant = "t-statuses"
    first = _request(tenant, ("wamid.1", "sent", "dl_1"), ("wamid.1", "delivered", "dl_1"))
    assert await _record(engine, first) == 2
    assert await _record(engine, first) == 0
    assert await _record(engine, _request(tenant, ("wamid.1", "failed", "dl_1"))) == 1
    async with engine.connect() as conn:
        found = (
            await conn.execute(
                select(channel_statuses.c.status, channel_statuses.c.errors)
                .where(
                    channel_statuses.c.tenant_id == tenant,
                    channel_statuses.c.callback_data == "dl_1",
                )
                .order_by(channel_statuses.c.status)
            )
        ).all()
    assert [(r.status, r.errors) for r in found] == [
        ("delivered", None), ("failed", [{"code": 131047}]), ("sent", None)
    ]  # fmt: skip


@pytest.mark.parametrize(
    "bad",
    [
        _request("", ("m", "sent", "")),
        _request("t", ("", "sent", "")),
        _request("t", ("m", "not a word", "")),
        _request("t", ("m", "sent", "x" * 513)),
    ],
)
async def test_a_bad_request_is_refused_whole(
    bad: orchestrator_pb2.RecordChannelStatusesRequest,
) -> None:
    with pytest.raises(InvalidArgument):
        channel_statuses_of(bad)


async def test_a_deleted_tenants_statuses_go_with_it(engine: AsyncEngine) -> None:
    tenant = "t-statuses-gone"
    await _record(engine, _request(tenant, *((f"wamid.{i}", "sent", "") for i in range(5))))
    retention = Retention(engine, RetainingSettings(retention_batch=2))
    passes = 0
    while True:
        _, left = await retention.delete_tenant(tenant)
        passes += 1
        if not left:
            break
    assert passes == 3 and await _rows(engine, tenant) == 0
