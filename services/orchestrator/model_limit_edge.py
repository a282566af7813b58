"""The Work stream's model-limit writes (issue 32): a worker's reservation of a model call's
room, granted from this replica's memory (`rate_limits.ModelLimits`), and its settlement with
what the call used and what the provider's headers said. Protobuf stops here."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from typing import Any

from google.protobuf.message import Message

from services.orchestrator.rate_limits import ModelLimits
from services.orchestrator.work import Write
from tether.errors import InvalidArgument
from tether.ratelimits import Headers
from tether.v1 import orchestrator_pb2

# What a replica that keeps no limits grants: a reservation no replica that keeps them issues
# (a worker's reserve re-sent to it after a reconnect, during a deploy that turns limits on).
UNLIMITED_RESERVATION = 2**64 - 1
# The most a settlement's headers_age_s is taken at (a call's stream and the trip here).
MAX_HEADERS_AGE_S = 600.0


def model_limit_writes(limits: ModelLimits | None) -> dict[type[Message], Write]:
    """The Work stream's reservation and settlement of model calls, granted from memory; with
    no limits kept, every reservation is granted and every settlement dropped."""

    async def reserve(request: Any) -> Message:
        if limits is None:
            return orchestrator_pb2.ReserveModelResponse(reservation_id=UNLIMITED_RESERVATION)
        if not request.model:
            raise InvalidArgument("a reservation names its model")
        reservation_id, wait = limits.reserve(
            request.run_id,
            request.epoch,
            request.credential_id,
            request.model,
            request.input_tokens,
            request.output_tokens,
        )
        return orchestrator_pb2.ReserveModelResponse(
            reservation_id=reservation_id, wait_ms=int(wait * 1000) + (1 if wait else 0)
        )

    async def settle(request: Any) -> Message:
        if limits is None:
            return orchestrator_pb2.SettleModelResponse()
        used = (
            {"input_tokens": float(request.input_tokens), "output_tokens": request.output_tokens}
            if request.used
            else None
        )
        # The -reset times as of when the worker received them (what they say is "full in so
        # many seconds from then").
        age = request.headers_age_s if math.isfinite(request.headers_age_s) else 0.0
        received = datetime.now(UTC) - timedelta(seconds=min(max(0.0, age), MAX_HEADERS_AGE_S))
        headers = Headers.read(dict(request.headers), now=received)
        limits.settle(request.reservation_id, request.credential_id, request.model, used, headers)
        return orchestrator_pb2.SettleModelResponse()

    return {
        orchestrator_pb2.ReserveModelRequest: reserve,
        orchestrator_pb2.SettleModelRequest: settle,
    }
