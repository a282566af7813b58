"""Async engine construction; the only place a database URL is interpreted."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine


def async_url(url: str) -> str:
    """Turn a `postgresql://` URL (as users and pgserver write it) into the asyncpg dialect's."""
    for prefix in ("postgresql+asyncpg://", "postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+asyncpg://" + url[len(prefix) :]
    raise ValueError(f"not a PostgreSQL URL: {url!r}")


def create_engine(url: str, *, pool_size: int = 10) -> AsyncEngine:
    """An engine with a bounded pool; statements are prepared and cached per connection."""
    return create_async_engine(
        async_url(url),
        pool_size=pool_size,
        max_overflow=pool_size,
        pool_pre_ping=False,
        # Every transaction here is short; a stuck one should fail, not hold locks for minutes.
        connect_args={"command_timeout": 30, "server_settings": {"application_name": "tether"}},
    )
