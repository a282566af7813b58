"""PostgreSQL access: the schema (every table, with its owner), the engine and the migrations."""
