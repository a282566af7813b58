"""`tether webhooks add|list|rm|deliveries|redeliver`: the tenant's run-event webhook
subscriptions and their delivery log. The signing secret is read from a file, sealed by the
interactions service and never printed."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from google.protobuf import json_format

from tether.cli.secrets import _read
from tether.client import TetherClient
from tether.v1 import common_pb2, gateway_pb2

Emit = Any


def _client(args: argparse.Namespace) -> TetherClient:
    return TetherClient.from_env(getattr(args, "stack", None))


def _dict(message: Any) -> dict[str, Any]:
    data: dict[str, Any] = json_format.MessageToDict(message, preserving_proto_field_name=True)
    return data


def _when(message: Any, field: str) -> str:
    if not message.HasField(field):
        return "-"
    return str(getattr(message, field).ToDatetime().isoformat(timespec="seconds")) + "Z"


def _subscription_line(found: common_pb2.WebhookSubscription) -> str:
    return f"{found.subscription_id}  {found.status:<8}  {found.url}  [{','.join(found.events)}]"


def _delivery_line(found: common_pb2.WebhookDelivery) -> str:
    last = str(found.last_http_status) if found.last_http_status else "-"
    error = f"  {found.last_error}" if found.last_error else ""
    return (
        f"{found.delivery_id}  {found.event_type:<20}  {found.status:<7}  "
        f"attempts={found.attempts}  http={last}  next={_when(found, 'next_attempt_at')}  "
        f"run={found.run_id}#{found.seq}{error}"
    )


def _events(text: str) -> list[str]:
    return [e.strip() for e in text.split(",") if e.strip()]


async def cmd_add(args: argparse.Namespace, emit: Emit) -> int:
    """Subscribe an endpoint to run events; the signing secret is read from a file."""
    secret = await asyncio.to_thread(_read, args.secret_file)
    request = gateway_pb2.AddWebhookRequest(url=args.url, events=args.events, secret=secret)
    async with _client(args) as client:
        added = await client.stub.AddWebhook(request, metadata=client.metadata)
    emit(
        args,
        {"subscription_id": added.subscription_id},
        f"webhook {added.subscription_id} added: {_subscription_line(added.subscription)}",
    )
    return 0


async def cmd_list(args: argparse.Namespace, emit: Emit) -> int:
    """List the tenant's subscriptions (a disabled one says so)."""
    async with _client(args) as client:
        listed = await client.stub.ListWebhooks(
            gateway_pb2.ListWebhooksRequest(), metadata=client.metadata
        )
    for found in listed.subscriptions:
        emit(args, _dict(found), _subscription_line(found))
    return 0


async def cmd_rm(args: argparse.Namespace, emit: Emit) -> int:
    """Remove a subscription and its delivery log."""
    async with _client(args) as client:
        await client.stub.RemoveWebhook(
            gateway_pb2.RemoveWebhookRequest(subscription_id=args.subscription_id),
            metadata=client.metadata,
        )
    emit(args, {"subscription_id": args.subscription_id, "removed": True}, "removed")
    return 0


async def cmd_deliveries(args: argparse.Namespace, emit: Emit) -> int:
    """A subscription's delivery log, newest first."""
    request = gateway_pb2.ListWebhookDeliveriesRequest(
        subscription_id=args.subscription_id, page_size=args.limit
    )
    async with _client(args) as client:
        listed = await client.stub.ListWebhookDeliveries(request, metadata=client.metadata)
    for found in listed.deliveries:
        emit(args, _dict(found), _delivery_line(found))
    return 0


async def cmd_redeliver(args: argparse.Namespace, emit: Emit) -> int:
    """Send a delivery again, with the same webhook-id."""
    async with _client(args) as client:
        requeued = await client.stub.RedeliverWebhook(
            gateway_pb2.RedeliverWebhookRequest(delivery_id=args.delivery_id),
            metadata=client.metadata,
        )
    emit(args, _dict(requeued.delivery), f"queued again: {_delivery_line(requeued.delivery)}")
    return 0


def register(sub: Any, common: Any, wrap: Any) -> None:
    """Add `webhooks` and its commands to the CLI's subparsers."""
    webhooks = sub.add_parser("webhooks", help="run-event webhooks (secrets never shown)")
    webhooks_sub = webhooks.add_subparsers(dest="webhooks_command", required=True)
    add = webhooks_sub.add_parser("add", help="subscribe an endpoint to run events")
    add.add_argument("url")
    add.add_argument(
        "--events",
        required=True,
        type=_events,
        help="comma-separated: run.completed, run.failed, run.cancelled, question.requested, "
        "approval.requested, connection.requested, delivery.sent, delivery.failed, "
        "delivery.unknown, delivery.denied",
    )
    add.add_argument(
        "--secret-file", required=True, help="the whsec_ signing secret, or - for standard input"
    )
    listed = webhooks_sub.add_parser("list", help="list subscriptions")
    rm = webhooks_sub.add_parser("rm", help="remove a subscription")
    rm.add_argument("subscription_id")
    deliveries = webhooks_sub.add_parser("deliveries", help="a subscription's delivery log")
    deliveries.add_argument("subscription_id")
    deliveries.add_argument("--limit", type=int, default=0, help="at most this many (100)")
    redeliver = webhooks_sub.add_parser("redeliver", help="send a delivery again")
    redeliver.add_argument("delivery_id")
    for command, func in (
        (add, cmd_add),
        (listed, cmd_list),
        (rm, cmd_rm),
        (deliveries, cmd_deliveries),
        (redeliver, cmd_redeliver),
    ):
        common(command)
        command.set_defaults(func=wrap(func))
