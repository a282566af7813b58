"""Alembic environment: runs on the connection handed in by `tether.db.migrate`."""

from __future__ import annotations

from alembic import context

from tether.db.schema import metadata

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("run migrations through tether.db.migrate.upgrade(url)")
context.configure(connection=connection, target_metadata=metadata, compare_type=True)
with context.begin_transaction():
    context.run_migrations()
