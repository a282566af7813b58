"""Model rate limits, from the worker's side: each model call's room reserved before it starts
and settled when it ends, with the orchestrator that keeps the shared buckets (see
services/orchestrator/rate_limits.py). Only when the replica says it keeps limits
(WorkWelcome.model_limits): otherwise nothing is sent and a call costs what it always did.

A call the buckets cannot hold now is not made: `RateLimited` ends the attempt, and the run
waits retry-pending (reason `rate_limited`) until the buckets refill, holding no worker.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import anthropic

from services.worker import sse
from services.worker.orchestrator_client import Orchestrator
from tether.domain import Lease
from tether.errors import TetherError
from tether.ratelimits import credential_id

log = logging.getLogger(__name__)


class RateLimited(Exception):
    """The call would exceed a shared model rate limit: ask again in `wait_s` seconds."""

    def __init__(self, model: str, wait_s: float) -> None:
        super().__init__(
            f"the call to {model} would exceed the pool's model rate limit; "
            f"the bucket holds it again in {wait_s:.1f} s"
        )
        self.model = model
        self.wait_s = wait_s


class ModelReservations:
    """One attempt's reservations."""

    def __init__(self, orchestrator: Orchestrator, lease: Lease, client: Any) -> None:
        self._orchestrator = orchestrator
        self._lease = lease
        self._credential = credential_id(str(getattr(client, "api_key", "") or ""))

    @property
    def on(self) -> bool:
        return self._orchestrator.model_limits

    async def reserve(self, request: Mapping[str, Any], input_tokens: int) -> int:
        """Reserve the call's room; its reservation id (0 while limits are off). Raises
        RateLimited when the buckets cannot hold it now."""
        if not self.on:
            return 0
        model = str(request["model"])
        reservation_id, wait_s = await self._orchestrator.reserve_model(
            self._lease, self._credential, model, input_tokens, int(request["max_tokens"])
        )
        if not reservation_id:
            raise RateLimited(model, wait_s)
        return reservation_id

    async def settle(
        self,
        reservation_id: int,
        request: Mapping[str, Any],
        usage: Mapping[str, int] | None,
        headers: Mapping[str, str],
        headers_age_s: float = 0.0,
    ) -> None:
        """The call ended: what it used (None: it reported nothing) and what the provider's
        headers said, `headers_age_s` ago. A settlement that cannot be written is dropped: the
        reservation is let go with the lease anyway."""
        if not self.on:
            return
        used = None
        if usage is not None:
            used = (
                usage.get("input_tokens", 0)
                + usage.get("cache_creation_input_tokens", 0)
                + usage.get("cache_read_input_tokens", 0),
                usage.get("output_tokens", 0),
            )
        try:
            await self._orchestrator.settle_model(
                reservation_id,
                self._credential,
                str(request["model"]),
                used,
                dict(headers),
                headers_age_s,
            )
        except TetherError as exc:
            log.warning("settling a model reservation failed: %s", exc)


def headers_of(exc: BaseException) -> dict[str, str]:
    """The rate-limit headers of a refused call (a 429 carries them), else none."""
    if isinstance(exc, anthropic.APIStatusError):
        return sse.rate_limit_headers(exc.response.headers)
    return {}
