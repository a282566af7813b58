"""The run-event webhook dispatcher: records a delivery for each new event of a subscribed type,
then sends due deliveries signed per Standard Webhooks, at least once and in order per run.

One round, on every replica: scan the enabled subscriptions no other replica is scanning
(SKIP LOCKED) for new events, each recorded once per subscription (unique per run and seq; its
id is the webhook-id of every try); then claim due deliveries (SKIP LOCKED, then a lease as long
as a send may take) whose run has no earlier one pending, send each, and record the outcome
fenced by its try number. A failed try is retried with doubling, jittered, bounded backoff; a
delivery is given up, and its endpoint's subscription disabled with an audit record, once it
has failed for the disable window."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Protocol

import aiohttp
from sqlalchemy.ext.asyncio import AsyncEngine
from standardwebhooks import Webhook

from services.orchestrator.repositories import webhook_dispatch as repo
from services.orchestrator.repositories.webhooks import Claimed
from services.orchestrator.webhooks import retry_delay
from tether import audit
from tether.convert.webhooks import webhook_body
from tether.targets import TargetPolicy, refused_target, target_session

log = logging.getLogger(__name__)

# What the audit trail names as the actor of an act no person asked for.
DISPATCHER = {"service": "orchestrator", "principal_id": "webhook-dispatcher"}
# An error kept in the log is for a person to read, not a copy of the endpoint's page.
MAX_ERROR_CHARS = 300


class SecretSource(Protocol):
    """Opens a subscription's signing secret (interactions)."""

    async def open(self, tenant_id: str, subscription_id: str) -> str: ...


@dataclass(frozen=True)
class DispatchSettings:
    """How the dispatcher paces itself."""

    disable_after: timedelta
    backoff_base_s: float
    backoff_max_s: float
    send_timeout_s: float
    scan_lookback: timedelta
    batch: int
    secret_ttl_s: float
    # How long the log keeps a finished run's deliveries; far longer than scan_lookback.
    log_keep: timedelta = timedelta(days=7)
    # How often new events are looked for; sends due sooner go sooner.
    scan_every_s: float = 1.0
    # How often the runs waiting now are looked at too (the dearer look; a waiting event is
    # otherwise sent when its run finishes).
    waiting_scan_every_s: float = 10.0


class SecretCache:
    """Signing secrets opened from interactions, each kept in memory `ttl_s` at most (a rotated
    or removed secret stops signing within that)."""

    def __init__(self, source: SecretSource, ttl_s: float) -> None:
        self._source = source
        self._ttl_s = ttl_s
        self._held: dict[tuple[str, str], tuple[float, Webhook]] = {}

    async def signer(self, tenant_id: str, subscription_id: str) -> Webhook:
        """The subscription's signer, opened again once it is `ttl_s` old."""
        key = (tenant_id, subscription_id)
        now = time.monotonic()
        held = self._held.get(key)
        if held is not None and now - held[0] < self._ttl_s:
            return held[1]
        signer = Webhook(await self._source.open(tenant_id, subscription_id))
        self._held = {k: v for k, v in self._held.items() if now - v[0] < self._ttl_s}
        self._held[key] = (now, signer)
        return signer


def signed_headers(signer: Webhook, webhook_id: str, body: str, now: datetime) -> dict[str, str]:
    """The Standard Webhooks headers of one try: the id stays, the timestamp is the try's."""
    return {
        "webhook-id": webhook_id,
        "webhook-timestamp": str(int(now.timestamp())),
        "webhook-signature": signer.sign(webhook_id, now, body),
        "content-type": "application/json",
    }


class Dispatcher:
    """Records and sends run-event webhook deliveries (see the module's docstring)."""

    def __init__(
        self,
        engine: AsyncEngine,
        secrets: SecretSource,
        policy: TargetPolicy,
        settings: DispatchSettings,
    ) -> None:
        self._engine = engine
        self._settings = settings
        self._signers = SecretCache(secrets, settings.secret_ttl_s)
        self._policy = policy
        self._session: aiohttp.ClientSession | None = None
        self._scanned_at = -math.inf
        self._waiting_scanned_at = -math.inf

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = target_session(self._policy)
        return self._session

    async def close(self) -> None:
        """Close the HTTP session."""
        if self._session is not None:
            await self._session.close()

    async def round(self) -> float:
        """Scan when a scan is due, then send what is due; the seconds until either is due
        again (0 after a send: a run's next event may be due at once)."""
        if time.monotonic() - self._scanned_at >= self._settings.scan_every_s:
            self._scanned_at = time.monotonic()
            await self.scan()
        if await self.send_due():
            return 0.0
        until_scan = self._scanned_at + self._settings.scan_every_s - time.monotonic()
        async with self._engine.connect() as conn:
            due = await repo.earliest_due(conn)
        if due is not None:
            until_scan = min(until_scan, (due - datetime.now(UTC)).total_seconds())
        return max(until_scan, 0.0)

    async def scan(self) -> int:
        """Record the new events of subscribed types; how many deliveries were recorded."""
        recorded = 0
        waiting = time.monotonic() - self._waiting_scanned_at >= self._settings.waiting_scan_every_s
        if waiting:
            self._waiting_scanned_at = time.monotonic()
        async with self._engine.begin() as conn:
            for subscription in await repo.lock_subscriptions_to_scan(conn, self._settings.batch):
                recorded += await repo.record_new_deliveries(
                    conn, subscription, self._settings.scan_lookback, waiting=waiting
                )
                await repo.prune_log(
                    conn, subscription, self._settings.log_keep, self._settings.batch
                )
        return recorded

    async def send_due(self) -> int:
        """Claim and send the due deliveries; how many were tried."""
        # A claim lasts as long as a send may, twice over: no other replica takes it meanwhile.
        lease = timedelta(seconds=2 * self._settings.send_timeout_s + 5)
        async with self._engine.begin() as conn:
            claimed = await repo.claim_due(conn, self._settings.batch, lease)
        if claimed:
            async with asyncio.TaskGroup() as group:
                for one in claimed:
                    group.create_task(self._deliver(one))
        return len(claimed)

    async def _deliver(self, claimed: Claimed) -> None:
        delivery = claimed.delivery
        async with self._engine.connect() as conn:
            row = await repo.stored_event(conn, delivery.run_id, delivery.seq)
        if row is None:
            await self._postpone(claimed, "the event was removed with its run (retention)", None)
            return
        body = webhook_body(
            row.run_id, row.seq, row.type, row.payload, row.created_at, format=row.format
        )
        try:
            signer = await self._signers.signer(delivery.tenant_id, delivery.subscription_id)
        except Exception as exc:
            # Not the endpoint's failure: no step towards disabling it.
            delay = retry_delay(
                delivery.attempts, self._settings.backoff_base_s, self._settings.backoff_max_s
            )
            await self._postpone(claimed, f"the signing secret could not be opened: {exc}", delay)
            return
        headers = signed_headers(signer, delivery.delivery_id, body, datetime.now(UTC))
        status, error = await self._post(claimed.url, body, headers)
        if error is None:
            async with self._engine.begin() as conn:
                await repo.mark_sent(conn, delivery, status)
            return
        await self._failed(claimed, status or None, error)

    async def _post(
        self, url: str, body: str, headers: Mapping[str, str]
    ) -> tuple[int, str | None]:
        """POST one try: (HTTP status, None) on a 2xx, else what went wrong."""
        timeout = aiohttp.ClientTimeout(total=self._settings.send_timeout_s)
        try:
            async with self._http().post(
                url,
                data=body.encode(),
                headers=dict(headers),
                timeout=timeout,
                allow_redirects=False,
            ) as response:
                await response.read()
                if 200 <= response.status < 300:
                    return response.status, None
                return response.status, f"the endpoint answered HTTP {response.status}"
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            refused = refused_target(exc)
            if refused is not None:
                return 0, f"refused: {refused.reason}"
            if isinstance(exc, TimeoutError):
                return 0, f"no answer within {self._settings.send_timeout_s:g} s"
            return 0, f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]

    async def _postpone(self, claimed: Claimed, error: str, delay: timedelta | None) -> None:
        async with self._engine.begin() as conn:
            await repo.postpone(
                conn, claimed.delivery, error=error[:MAX_ERROR_CHARS], retry_in=delay
            )

    async def _failed(self, claimed: Claimed, http_status: int | None, error: str) -> None:
        settings = self._settings
        delivery = claimed.delivery
        delay = retry_delay(delivery.attempts, settings.backoff_base_s, settings.backoff_max_s)
        async with self._engine.begin() as conn:
            await repo.mark_failed(
                conn,
                delivery,
                http_status=http_status,
                error=error[:MAX_ERROR_CHARS],
                retry_in=delay,
                give_up_after=settings.disable_after,
            )
            disabled = await repo.disable_if_failing(
                conn, delivery.tenant_id, delivery.subscription_id, settings.disable_after
            )
            if disabled is not None:
                await audit.record(
                    conn,
                    tenant_id=disabled.tenant_id,
                    action="webhook.disabled",
                    actor=DISPATCHER,
                    subscription_id=disabled.subscription_id,
                    url=disabled.url,
                    failing_since=str(disabled.failing_since),
                    reason=error[:MAX_ERROR_CHARS],
                )
        if disabled is not None:
            log.warning(
                "webhook subscription %s disabled: its endpoint failed for %s",
                disabled.subscription_id,
                settings.disable_after,
            )
