"""What a stack of the system tier starts from: a database of its own, cloned from the migrated
template, with three tenants and the keys the tests call with (one place, for the `stack` and
`hostile_stack` fixtures)."""

from __future__ import annotations

from dataclasses import dataclass

from tests.conftest import clone_database
from tether import apikeys
from tether.db.engine import create_engine
from tether.stack.embedded import database_url


@dataclass(frozen=True)
class SeededDatabase:
    """A fresh database (drop it by `name` when done) and its keys: an admin key of the ops
    tenant with every scope, a client key for alice in tenant-a and one for bob in tenant-b,
    and a read-only key of an auditor in tenant-a."""

    name: str
    url: str
    admin_key: str
    key_a: str
    key_b: str
    read_only_key: str


async def seeded_database(pg_server_url: str, template_db: str) -> SeededDatabase:
    """Clone the template and add the tenants and keys."""
    name = await clone_database(pg_server_url, template_db)
    url = database_url(pg_server_url, name)
    engine = create_engine(url, pool_size=1)
    try:
        async with engine.begin() as conn:
            for tenant in ("tenant-a", "tenant-b", "ops"):
                await apikeys.ensure_tenant(conn, tenant)
            admin_key, _ = await apikeys.create_key(conn, "ops", "root", apikeys.ALL_SCOPES)
            key_a, _ = await apikeys.create_key(conn, "tenant-a", "alice", apikeys.CLIENT_SCOPES)
            key_b, _ = await apikeys.create_key(conn, "tenant-b", "bob", apikeys.CLIENT_SCOPES)
            read_only, _ = await apikeys.create_key(conn, "tenant-a", "auditor", ["runs:read"])
    finally:
        await engine.dispose()
    return SeededDatabase(name, url, admin_key, key_a, key_b, read_only)
