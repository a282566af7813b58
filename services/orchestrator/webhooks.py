"""Run-event webhook subscriptions: what a tenant may subscribe to, and the acts on its
subscriptions and delivery log, each with its audit record in its own transaction. The signing
secret is sealed by interactions (the orchestrator never stores one) and no read returns it."""

from __future__ import annotations

import base64
import binascii
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

from sqlalchemy.ext.asyncio import AsyncEngine

from services.orchestrator.repositories import webhooks as repo
from services.orchestrator.repositories.webhooks import Delivery, Subscription
from tether import audit
from tether.errors import FailedPrecondition, InvalidArgument, NotFound
from tether.ids import new_id
from tether.targets import TargetPolicy, check_url

# What a subscription may name: a run's end, its three ways of waiting for a person, and the
# outcome of delivering its answer to a channel.
EVENT_TYPES = (
    "run.completed",
    "run.failed",
    "run.cancelled",
    "question.requested",
    "approval.requested",
    "connection.requested",
    "delivery.sent",
    "delivery.failed",
    "delivery.unknown",
    "delivery.denied",
)
# A URL longer than this is no endpoint anyone types or configures.
MAX_URL_CHARS = 2048
SECRET_PREFIX = "whsec_"
MAX_DELIVERIES_LISTED = 1000
DEFAULT_DELIVERIES_LISTED = 100


class SecretKeeper(Protocol):
    """Where subscriptions' signing secrets are sealed (interactions)."""

    async def seal(self, tenant_id: str, subscription_id: str, secret: str) -> None: ...
    async def discard(self, tenant_id: str, subscription_id: str) -> None: ...


@dataclass(frozen=True, slots=True)
class Actor:
    """Who acts: the key and principal, for the audit record."""

    tenant_id: str
    key_id: str
    principal_id: str

    def audit(self) -> Mapping[str, str]:
        """The audit record's actor."""
        return {"key_id": self.key_id, "principal_id": self.principal_id}


def check_events(events: Sequence[str]) -> list[str]:
    """The subscribed types, each once in the order given; INVALID_ARGUMENT naming the allowed
    ones for an unknown or missing one."""
    allowed = ", ".join(EVENT_TYPES)
    if not events:
        raise InvalidArgument(f"name at least one event type: {allowed}")
    unknown = [e for e in events if e not in EVENT_TYPES]
    if unknown:
        raise InvalidArgument(f"unknown event type {unknown[0][:60]!r}; use {allowed}")
    return list(dict.fromkeys(events))


def check_secret(secret: str) -> None:
    """A Standard Webhooks secret: "whsec_" and the base64 of 24 to 64 random bytes (the
    specification's range), else INVALID_ARGUMENT."""
    body = secret.strip().removeprefix(SECRET_PREFIX)
    try:
        key = base64.b64decode(body + "=" * (-len(body) % 4), validate=True)
    except binascii.Error:
        key = b""
    if not secret.strip().startswith(SECRET_PREFIX) or not 24 <= len(key) <= 64:
        raise InvalidArgument(
            "secret is not a Standard Webhooks secret: whsec_ followed by the base64 of 24 to "
            "64 random bytes (e.g. whsec_$(head -c 32 /dev/urandom | base64))"
        )


def retry_delay(
    attempts: int, base_s: float, most_s: float, jitter: Callable[[], float] = random.random
) -> timedelta:
    """How long after its `attempts`-th failed try a delivery is tried again: doubling from
    `base_s`, at most `most_s`, less up to half at random so that endpoints recovering from an
    outage are not hit by every retry at once."""
    ceiling = min(most_s, base_s * 2 ** min(max(attempts - 1, 0), 32))
    return timedelta(seconds=ceiling * (1 - jitter() / 2))


class Subscriptions:
    """Adds, lists and removes a tenant's subscriptions; lists and redelivers deliveries."""

    def __init__(
        self, engine: AsyncEngine, secrets: SecretKeeper | None, policy: TargetPolicy
    ) -> None:
        self._engine = engine
        self._secrets = secrets
        self._policy = policy

    def _keeper(self) -> SecretKeeper:
        if self._secrets is None:
            raise FailedPrecondition(
                "run-event webhooks need the interactions service: set TETHER_INTERACTIONS_ADDR "
                "and TETHER_SERVICE_CREDENTIAL on the orchestrator",
                code="webhooks_unconfigured",
            )
        return self._secrets

    async def add(self, actor: Actor, url: str, events: Sequence[str], secret: str) -> Subscription:
        """Check, seal the secret, then store the subscription with its audit record."""
        if not actor.tenant_id:
            raise InvalidArgument("tenant_id is required")
        if len(url) > MAX_URL_CHARS:
            raise InvalidArgument(f"url is over {MAX_URL_CHARS} characters")
        await check_url(url, self._policy, what="url")
        subscribed = check_events(events)
        check_secret(secret)
        keeper = self._keeper()
        subscription_id = new_id("whsub")
        # Sealed first: a subscription never exists without its secret. A failure after it
        # leaves a secret no subscription names, removed at once below when it can be.
        await keeper.seal(actor.tenant_id, subscription_id, secret.strip())
        try:
            async with self._engine.begin() as conn:
                added = await repo.insert_subscription(
                    conn,
                    tenant_id=actor.tenant_id,
                    subscription_id=subscription_id,
                    url=url,
                    events=subscribed,
                    created_by=actor.principal_id,
                )
                await audit.record(
                    conn,
                    tenant_id=actor.tenant_id,
                    action="webhook.added",
                    actor=actor.audit(),
                    subscription_id=subscription_id,
                    url=url,
                    events=subscribed,
                )
        except BaseException:
            await keeper.discard(actor.tenant_id, subscription_id)
            raise
        return added

    async def listed(self, tenant_id: str) -> list[Subscription]:
        """The tenant's subscriptions, oldest first."""
        async with self._engine.connect() as conn:
            return await repo.list_subscriptions(conn, tenant_id)

    async def remove(self, actor: Actor, subscription_id: str) -> None:
        """Remove a subscription, its log and then its secret; absent and another tenant's
        answer alike."""
        async with self._engine.begin() as conn:
            if not await repo.delete_subscription(conn, actor.tenant_id, subscription_id):
                raise NotFound(f"no webhook subscription {subscription_id!r}")
            await audit.record(
                conn,
                tenant_id=actor.tenant_id,
                action="webhook.removed",
                actor=actor.audit(),
                subscription_id=subscription_id,
            )
        if self._secrets is not None:
            await self._secrets.discard(actor.tenant_id, subscription_id)

    async def deliveries(self, tenant_id: str, subscription_id: str, limit: int) -> list[Delivery]:
        """A subscription's log, newest first; absent and another tenant's answer alike."""
        if limit < 0 or limit > MAX_DELIVERIES_LISTED:
            raise InvalidArgument(f"page_size must be 0..{MAX_DELIVERIES_LISTED}")
        async with self._engine.connect() as conn:
            if not await repo.subscription_exists(conn, tenant_id, subscription_id):
                raise NotFound(f"no webhook subscription {subscription_id!r}")
            return await repo.list_deliveries(
                conn, tenant_id, subscription_id, limit or DEFAULT_DELIVERIES_LISTED
            )

    async def redeliver(self, actor: Actor, delivery_id: str) -> Delivery:
        """Make a delivery due again with its webhook-id, with its audit record."""
        async with self._engine.begin() as conn:
            requeued = await repo.requeue_delivery(conn, actor.tenant_id, delivery_id)
            if requeued is None:
                raise NotFound(f"no webhook delivery {delivery_id!r}")
            await audit.record(
                conn,
                tenant_id=actor.tenant_id,
                action="webhook.redelivered",
                actor=actor.audit(),
                subscription_id=requeued.subscription_id,
                delivery_id=delivery_id,
            )
        return requeued
