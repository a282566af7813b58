"""Async engine construction; the only place a database URL is interpreted, and the one place
a PostgreSQL outage becomes `tether.errors.Unavailable`."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import asyncpg
from sqlalchemy import event
from sqlalchemy.engine import Dialect, ExceptionContext
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import ConnectionPoolEntry

from tether.errors import Unavailable

# What PostgreSQL being down, restarting or cut off looks like from here: no socket or a
# refused or reset connection (OSError, TimeoutError among them), the server ending sessions
# as it shuts down or crashes (57P01-57P03), and a connection already gone.
_OUTAGES: tuple[type[BaseException], ...] = (
    OSError,
    asyncpg.PostgresConnectionError,
    asyncpg.AdminShutdownError,
    asyncpg.CrashShutdownError,
    asyncpg.CannotConnectNowError,
    asyncpg.TooManyConnectionsError,
)


def is_outage(exc: BaseException | None) -> bool:
    """Whether `exc` (or what it was raised from) says the database is unreachable, rather
    than that a statement was refused."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, _OUTAGES):
            return True
        if isinstance(exc, asyncpg.InterfaceError) and "connection is closed" in str(exc):
            return True
        exc = exc.__cause__
    return False


def _outage() -> Unavailable:
    return Unavailable.outage("PostgreSQL")


def _connect(dialect: Dialect, _record: ConnectionPoolEntry, cargs: Any, cparams: Any) -> Any:
    """Open a connection as SQLAlchemy would, translating a refused one."""
    try:
        return dialect.connect(*cargs, **cparams)
    except Exception as exc:
        if is_outage(exc):
            raise _outage() from exc
        raise


def _translate(context: ExceptionContext) -> BaseException | None:
    """A statement, commit or rollback that failed because the server went away. A cancelled
    one stays cancelled: the task was cancelled, nothing is down."""
    if isinstance(context.original_exception, asyncio.CancelledError):
        return None
    if not (context.is_disconnect or is_outage(context.original_exception)):
        return None
    context.is_disconnect = True  # so the pool drops this connection and the ones beside it
    return _outage()


def async_url(url: str) -> str:
    """Turn a `postgresql://` URL (as users and pgserver write it) into the asyncpg dialect's."""
    for prefix in ("postgresql+asyncpg://", "postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+asyncpg://" + url[len(prefix) :]
    raise ValueError(f"not a PostgreSQL URL: {url!r}")


def application_name(application: str | None) -> str:
    """What a pool's connections call themselves on the server (pg_stat_activity's
    application_name): `tether-<application>` for a service's pool (`tether-orchestrator`),
    `tether` for one that names none (a test's)."""
    return "tether" if application is None else f"tether-{application}"


def create_engine(
    url: str,
    *,
    pool_size: int = 10,
    planner: Mapping[str, str] | None = None,
    application: str | None = None,
) -> AsyncEngine:
    """An engine with a bounded pool; statements are prepared and cached per connection.
    `planner`: settings every connection of the pool plans its statements with (for a pool
    that runs one statement whose plan must not depend on the statistics of the moment).
    `application`: what uses the pool (a service, a tool), as its connections' application_name:
    an operator's pg_stat_activity, lock waits and logs say which service a backend serves,
    and a bench can count PostgreSQL's work by service.

    A database outage raises `Unavailable` from every use of it (connecting, executing,
    committing), never the driver's own exception."""
    engine = create_async_engine(
        async_url(url),
        pool_size=pool_size,
        # No overflow: a connection opened past the pool is closed when handed back, so a
        # burst above it opened and closed a PostgreSQL backend per statement (a fork, a
        # catalog warm-up and the prepared statements made again, each time). Past the pool,
        # callers wait their turn: the server has no more cores for them anyway.
        max_overflow=0,
        pool_pre_ping=False,
        # Every transaction here is short; a stuck one should fail, not hold locks for minutes.
        connect_args={
            "command_timeout": 30,
            "server_settings": {
                "application_name": application_name(application),
                **(planner or {}),
            },
        },
        # A failed statement's parameters (message text, tool inputs) never reach an error
        # message, a log line or a span: the statement and the error say what went wrong.
        hide_parameters=True,
    )
    event.listen(engine.sync_engine, "do_connect", _connect)
    event.listen(engine.sync_engine, "handle_error", _translate)
    return engine
