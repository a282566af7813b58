"""A run's priority: its order among its own tenant's queued runs (never against another
tenant's, whose share the fair lease keeps), set at admission by a key holding `runs:priority`."""

from __future__ import annotations

from tether.errors import InvalidArgument

# Stored as its rank (runs.priority): ascending is the order a tenant's runs lease in.
PRIORITIES = {"high": 0, "normal": 1, "low": 2}
NORMAL = "normal"
NAMES = {rank: name for name, rank in PRIORITIES.items()}


def rank(name: str) -> int:
    """The stored rank of a priority named by a caller ('' is normal); InvalidArgument for a
    name not among PRIORITIES."""
    if not name:
        return PRIORITIES[NORMAL]
    try:
        return PRIORITIES[name]
    except KeyError:
        raise InvalidArgument(
            f"unknown priority {name!r}; use one of {', '.join(PRIORITIES)}"
        ) from None


def name_of(stored: int) -> str:
    """The name of a stored rank."""
    return NAMES.get(stored, NORMAL)
