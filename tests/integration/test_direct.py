"""Statements run on the driver's connection (`tether.db.direct`) against the real PostgreSQL:
they send and return what `execute` would, commit alone or with their transaction exactly as
`execute` would, and a lost connection is an outage that leaves the pool, as for the engine."""

from __future__ import annotations

from dataclasses import fields, replace

import pytest
from sqlalchemy import bindparam, insert, literal, select, text
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.types import Text

from services.admission import repository as admission
from services.admission.domain import FreshnessPolicy
from services.admission.service import Admitter
from tests.integration.test_admission import _tenant, chat
from tether.db import direct
from tether.db.direct import Direct
from tether.db.schema import runs, tenants
from tether.domain import Run
from tether.errors import Unavailable
from tether.ids import new_id

pytestmark = pytest.mark.asyncio(loop_scope="session")

_RUN_FIELDS = [f.name for f in fields(Run)]

_ADD_TENANT = Direct(
    insert(tenants)
    .values(tenant_id=bindparam("tenant_id"), name=bindparam("name"))
    .returning(tenants.c.tenant_id)
)


async def _tenant_ids(engine: AsyncEngine) -> set[str]:
    async with engine.connect() as conn:
        return set((await conn.execute(select(tenants.c.tenant_id))).scalars())


async def test_a_run_admitted_directly_reads_back_as_execute_reads_it(
    engine: AsyncEngine,
) -> None:
    await _tenant(engine, "t1")
    admitted = await Admitter(engine, max_attempts=3, freshness=FreshnessPolicy()).admit(
        replace(chat("e1"), context={"thread": {"ts": "1.5"}})
    )
    async with engine.connect() as conn:
        stored = (
            await conn.execute(select(runs).where(runs.c.run_id == admitted.run.run_id))
        ).one()
    # Every column the run carries: equal values of the same types (JSONB decoded, timestamps
    # aware, arrays as lists), so callers cannot tell the paths apart.
    for name in _RUN_FIELDS:
        mine, theirs = getattr(admitted.run, name), stored._mapping[name]
        assert (mine, type(mine)) == (theirs, type(theirs)), name


async def test_the_admission_statement_returns_the_same_shape_through_either_path(
    engine: AsyncEngine,
) -> None:
    await _tenant(engine, "t1")

    async def admit(conn: AsyncConnection, event_id: str) -> Run | None:
        return await admission.admit_new(
            conn,
            admission.admit_params(
                event=replace(chat(event_id, conversation=event_id), context={"n": 1}),
                request_hash=b"h" * 32,
                run_id=new_id("run"),
                session_id=new_id("ses"),
                message_id=new_id("msg"),
                max_attempts=3,
                traceparent=None,
            ),
        )

    # Inside SQLAlchemy's own transaction the statement goes through `execute`.
    async with engine.begin() as conn:
        through_execute = await admit(conn, "a")
    async with engine.execution_options(isolation_level="AUTOCOMMIT").connect() as conn:
        through_driver = await admit(conn, "b")
    assert through_execute is not None and through_driver is not None
    # Each call's own ids and times differ; every other value, and every type, is the same.
    own = {"run_id", "root_run_id", "session_id", "message_id", "conversation_id"}
    own |= {"created_at", "updated_at"}
    own |= {"fair_key"}  # the tenant's second run takes the tag after its first
    for name in _RUN_FIELDS:
        mine, theirs = getattr(through_driver, name), getattr(through_execute, name)
        assert type(mine) is type(theirs), name
        assert name in own or mine == theirs, name


async def test_parameters_go_through_their_types_and_come_back_decoded(
    engine: AsyncEngine,
) -> None:
    echo = Direct(
        select(
            bindparam("doc", type_=JSONB).label("doc"),
            bindparam("words", type_=ARRAY(Text)).label("words"),
            literal(7).label("seven"),
        )
    )
    doc = {"a": [1, "two", None], "é": {"nested": True}}
    async with engine.execution_options(isolation_level="AUTOCOMMIT").connect() as conn:
        row = await echo.first(conn, {"doc": doc, "words": ["x", "y"]})
    assert row is not None
    assert (row.doc, row.words, row.seven) == (doc, ["x", "y"], 7)


async def test_on_an_autocommit_connection_each_statement_commits_alone(
    engine: AsyncEngine,
) -> None:
    async with engine.execution_options(isolation_level="AUTOCOMMIT").connect() as conn:
        await _ADD_TENANT.first(conn, {"tenant_id": "alone", "name": "a"})
    assert "alone" in await _tenant_ids(engine)


async def test_in_a_driver_transaction_statements_commit_together_or_not_at_all(
    engine: AsyncEngine,
) -> None:
    autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
    with pytest.raises(RuntimeError, match="after both"):
        async with autocommit.connect() as conn, direct.transaction(conn):
            await _ADD_TENANT.first(conn, {"tenant_id": "x1", "name": "x"})
            await conn.execute(text("INSERT INTO tenants (tenant_id, name) VALUES ('x2', 'x')"))
            raise RuntimeError("after both")
    assert not {"x1", "x2"} & await _tenant_ids(engine)

    async with autocommit.connect() as conn, direct.transaction(conn):
        await _ADD_TENANT.first(conn, {"tenant_id": "y1", "name": "y"})
        await conn.execute(text("INSERT INTO tenants (tenant_id, name) VALUES ('y2', 'y')"))
    assert {"y1", "y2"} <= await _tenant_ids(engine)


async def test_first_in_a_sqlalchemy_transaction_it_joins_that_transaction(
    engine: AsyncEngine,
) -> None:
    # SQLAlchemy sends BEGIN with a transaction's first statement; run on the driver first,
    # the statement would commit alone and survive the rollback.
    with pytest.raises(RuntimeError, match="rolled back"):
        async with engine.begin() as conn:
            await _ADD_TENANT.first(conn, {"tenant_id": "z1", "name": "z"})
            raise RuntimeError("rolled back")
    assert "z1" not in await _tenant_ids(engine)


async def test_a_driver_transaction_needs_an_autocommit_connection(engine: AsyncEngine) -> None:
    async with engine.connect() as conn:
        with pytest.raises(ValueError, match="autocommit"):
            async with direct.transaction(conn):
                pass


async def test_a_missing_or_expanding_parameter_is_refused_before_anything_is_sent(
    engine: AsyncEngine,
) -> None:
    async with engine.execution_options(isolation_level="AUTOCOMMIT").connect() as conn:
        with pytest.raises(ValueError, match="a value is required for name"):
            await _ADD_TENANT.first(conn, {"tenant_id": "n1"})
        expanding = Direct(
            select(tenants.c.tenant_id).where(
                tenants.c.tenant_id.in_(bindparam("ids", expanding=True))
            )
        )
        with pytest.raises(ValueError, match="ids expands per call"):
            await expanding.all(conn, {"ids": ["a"]})
    assert "n1" not in await _tenant_ids(engine)


async def test_a_lost_connection_is_an_outage_and_the_pool_lets_it_go(
    engine: AsyncEngine,
) -> None:
    await _tenant(engine, "t1")
    autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
    async with autocommit.connect() as conn:
        pid = (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one()
        async with engine.connect() as other:
            await other.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        with pytest.raises(Unavailable) as lost:
            await _ADD_TENANT.first(conn, {"tenant_id": "after", "name": "a"})
        assert lost.value.code == "dependency_unavailable"
    # Every connection the pool hands out next is a live one: the dead one was dropped.
    for _ in range(engine.pool.size() + 1):
        async with autocommit.connect() as conn:
            assert await _ADD_TENANT.first(conn, {"tenant_id": new_id("t"), "name": "a"})


async def test_a_connection_lost_inside_a_driver_transaction_is_an_outage(
    engine: AsyncEngine,
) -> None:
    autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
    with pytest.raises(Unavailable):
        async with autocommit.connect() as conn, direct.transaction(conn):
            await _ADD_TENANT.first(conn, {"tenant_id": "lost1", "name": "a"})
            pid = (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one()
            async with engine.connect() as other:
                await other.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
            await _ADD_TENANT.first(conn, {"tenant_id": "lost2", "name": "a"})
    assert not {"lost1", "lost2"} & await _tenant_ids(engine)
    for _ in range(engine.pool.size() + 1):
        async with autocommit.connect() as conn, direct.transaction(conn):
            assert await _ADD_TENANT.first(conn, {"tenant_id": new_id("t"), "name": "a"})
