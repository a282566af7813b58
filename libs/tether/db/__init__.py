"""PostgreSQL access: schema, engine, migrations and the guarded run transitions."""
