"""The embedded stack: a real PostgreSQL and Redis from wheels, and the services as processes."""
