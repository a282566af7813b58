"""A delivery on the wire (common.Delivery), both halves: the orchestrator encodes, the worker
and the gateway decode."""

from __future__ import annotations

from tether.convert import error_from_proto, error_to_proto, timestamp
from tether.domain import Delivery
from tether.v1 import common_pb2


def delivery_to_proto(delivery: Delivery) -> common_pb2.Delivery:
    """The wire form of a delivery."""
    message = common_pb2.Delivery(
        delivery_id=delivery.delivery_id,
        channel_id=delivery.channel_id,
        kind=delivery.kind,
        state=delivery.state,
        text=delivery.text,
        provider_message_id=delivery.provider_message_id,
        attempts=delivery.attempts,
        created_at=timestamp(delivery.created_at),
        finished_at=timestamp(delivery.finished_at),
    )
    if delivery.error is not None:
        message.error.CopyFrom(error_to_proto(delivery.error))
    return message


def delivery_from_proto(message: common_pb2.Delivery, run_id: str) -> Delivery:
    """The delivery a wire form carries (of run `run_id`)."""
    return Delivery(
        delivery_id=message.delivery_id,
        run_id=run_id,
        channel_id=message.channel_id,
        kind=message.kind,
        state=message.state,
        text=message.text,
        provider_message_id=message.provider_message_id,
        attempts=message.attempts,
        error=error_from_proto(message.error) if message.HasField("error") else None,
        created_at=message.created_at.ToDatetime() if message.HasField("created_at") else None,
        finished_at=message.finished_at.ToDatetime() if message.HasField("finished_at") else None,
    )
