"""The effects port and the idempotency key, which live in `tether.tools.effects`; re-exported
here for the worker's modules."""

from tether.tools.effects import KEY_PREFIX, EffectsPort, idempotency_key

__all__ = ["KEY_PREFIX", "EffectsPort", "idempotency_key"]
