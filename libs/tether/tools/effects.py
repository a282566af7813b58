"""The effects record as the registry sees it, and the idempotency key that names an effect.

Every call of a tool that writes externally goes through `EffectsPort.begin` before it fires and
`EffectsPort.finish` after it returned. The worker implements the port over gRPC to the
orchestrator's BeginEffect/FinishEffect, which own the `effects(tenant, key)` rows; the
registry never sees the transport.

What `begin` answers, and what the registry does with it:

- `BEGUN`: nobody held this key; the caller owns it now and fires.
- `DONE`: the effect already happened; the stored result is returned and the tool does not fire.
- `IN_PROGRESS`: an earlier holder began the effect and never finished it: a worker that crashed
  or lost its lease (the reaper moved the run on) between firing and recording. Whether the
  external write happened is unknown, so the registry fires again with the SAME key: the external
  system deduplicates on it and answers with the original result if the write did happen. Then the
  record is finished. Two live holders cannot race here: the lease epoch fences the run, so only
  the current attempt reaches the registry.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any, Protocol

from tether.domain import EffectState

KEY_PREFIX = "eff_"


class EffectsPort(Protocol):
    """The effects record (see the module docstring for what each state obliges)."""

    async def begin(self, key: str, tool_name: str) -> tuple[EffectState, dict[str, Any] | None]:
        """Begin the effect named `key`; DONE carries the stored result, the others None."""
        ...

    async def finish(self, key: str, result: dict[str, Any]) -> None:
        """Record the result of the effect `key`; a later `begin` answers DONE with it."""
        ...


def idempotency_key(
    tenant_id: str, root_run_id: str, tool_name: str, arguments: Mapping[str, Any]
) -> str:
    """The key of one effect: tenant, run lineage, tool name and canonical arguments.

    The lineage root, not the run, so that a resumed or re-claimed run (a new run in the same
    lineage) finds the effects its predecessor fired. The model's tool_use id is left out on
    purpose: a resumed attempt regenerates the call with a new id, and it must land on the same
    key. The price is that two identical calls in one lineage are one effect.

    Canonical JSON (sorted keys at every depth, no whitespace, UTF-8) makes the key independent
    of argument order; lone surrogates, which JSON input can carry, are hashed as they are rather
    than rejected. NaN and infinities raise ValueError: JSON cannot carry them, and the schema
    check refuses them before a key is computed.
    """
    canonical = json.dumps(
        [tenant_id, root_run_id, tool_name, arguments],
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
        allow_nan=False,
    )
    digest = hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()
    return KEY_PREFIX + digest
