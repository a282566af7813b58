"""What verifies a channel connection's webhooks, as the gateway keeps it: looked up from
interactions (LookupChannelVerification, the gateway's power alone) and kept in this process's
memory for at most a minute, so a rotation or a removal takes effect within it. An absent
connection is remembered for a few seconds only, so one just added works at once. The previous
secret of a rotation stops verifying when its grace ends, whatever the cache holds; and a
signature that no kept secret verifies asks again (at most every few seconds per connection),
so a provider signing with a secret just rotated in is not refused for a minute."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from tether.errors import NotFound
from tether.ids import is_identifier
from tether.v1 import interactions_pb2, interactions_pb2_grpc

# How long a looked-up connection is trusted without asking again.
FOUND_TTL_S = 60.0
# How long an absent connection is: a few seconds keep a flood of unknown ids off interactions.
ABSENT_TTL_S = 2.0
# A kept answer at least this old is asked for again when no secret of it verifies a request.
REFRESH_AFTER_S = 3.0
# Connections remembered at once; past it the expired go first, then the oldest.
MAX_ENTRIES = 10_000


def absent() -> NotFound:
    """The one answer for an unknown connection, another tenant's, a removed one or a URL of
    another kind: the same body whatever the reason, naming nothing."""
    return NotFound(
        "no channel connection at this URL; check the webhook URL `tether channels show` gives",
        code="channel_not_found",
    )


@dataclass(frozen=True)
class ChannelVerification:
    """A connection's tenant and kind, the secrets its webhooks verify with (the current one,
    then the previous one in a rotation's grace), WhatsApp's verify token, its settings and the
    agent it routes to. Never a secret that sends."""

    channel_id: str
    tenant_id: str
    kind: str
    secrets: tuple[str, ...]
    verify_token: str = ""
    settings: dict[str, str] = field(default_factory=dict)
    agent: str = ""
    previous_expires_at: datetime | None = None

    def valid_secrets(self, now: datetime | None = None) -> tuple[str, ...]:
        """The secrets that verify now: the previous one only until its grace ends."""
        if self.previous_expires_at is None:
            return self.secrets
        if (now or datetime.now(UTC)) < self.previous_expires_at:
            return self.secrets
        return self.secrets[:1]

    def __repr__(self) -> str:  # never a secret in a log line or a traceback
        return f"ChannelVerification({self.channel_id!r}, kind={self.kind!r})"


def _from_proto(
    channel_id: str, found: interactions_pb2.LookupChannelVerificationResponse
) -> ChannelVerification:
    settings = {f.name: v for f, v in found.settings.ListFields() if isinstance(v, str)}
    return ChannelVerification(
        channel_id=channel_id,
        tenant_id=found.tenant_id,
        kind=found.kind,
        secrets=tuple(found.secrets),
        verify_token=found.verify_token,
        settings=settings,
        agent=found.agent,
        previous_expires_at=(
            found.previous_secret_expires_at.ToDatetime(tzinfo=UTC)
            if found.HasField("previous_secret_expires_at")
            else None
        ),
    )


class Verifications:
    """The per-process cache of connections' verifications, keyed by channel id; concurrent
    requests for one connection share one lookup."""

    def __init__(
        self,
        interactions: interactions_pb2_grpc.InteractionsServiceStub,
        *,
        found_ttl_s: float = FOUND_TTL_S,
        absent_ttl_s: float = ABSENT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._interactions = interactions
        self._found_ttl_s = found_ttl_s
        self._absent_ttl_s = absent_ttl_s
        self._clock = clock
        # channel id -> (trusted until, asked at, the answer)
        self._known: dict[str, tuple[float, float, ChannelVerification | None]] = {}
        self._pending: dict[str, asyncio.Future[ChannelVerification | None]] = {}

    async def of(self, channel_id: str, kind: str) -> ChannelVerification:
        """The connection `channel_id` of `kind`; NotFound (always the same) otherwise."""
        if not is_identifier(channel_id):
            raise absent()
        found = await self._lookup(channel_id)
        if found is None or found.kind != kind:
            raise absent()
        return found

    async def _lookup(self, channel_id: str) -> ChannelVerification | None:
        known = self._known.get(channel_id)
        if known is not None and known[0] > self._clock():
            return known[2]
        pending = self._pending.get(channel_id)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[ChannelVerification | None] = (
            asyncio.get_running_loop().create_future()
        )
        self._pending[channel_id] = future
        try:
            found = await self._ask(channel_id)
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: a lookup no one else waited on is not an error
            raise
        else:
            future.set_result(found)
            self._remember(channel_id, found)
            return found
        finally:
            del self._pending[channel_id]

    async def _ask(self, channel_id: str) -> ChannelVerification | None:
        try:
            found = await self._interactions.LookupChannelVerification(
                interactions_pb2.LookupChannelVerificationRequest(channel_id=channel_id)
            )
        except NotFound:
            return None
        return _from_proto(channel_id, found)

    def _remember(self, channel_id: str, found: ChannelVerification | None) -> None:
        now = self._clock()
        if len(self._known) >= MAX_ENTRIES:
            for key in [k for k, (until, _, _) in self._known.items() if until <= now]:
                del self._known[key]
            while len(self._known) >= MAX_ENTRIES:
                del self._known[next(iter(self._known))]
        ttl = self._found_ttl_s if found is not None else self._absent_ttl_s
        self._known[channel_id] = (now + ttl, now, found)

    async def fresher(self, kept: ChannelVerification) -> ChannelVerification | None:
        """After no secret of `kept` verified a request: the connection asked for again, when
        the answer kept is old enough to ask again and the new one differs; None otherwise."""
        known = self._known.get(kept.channel_id)
        if known is None or known[2] is not kept or self._clock() - known[1] < REFRESH_AFTER_S:
            return None
        del self._known[kept.channel_id]
        found = await self._lookup(kept.channel_id)
        if found is None or found.kind != kept.kind or found.secrets == kept.secrets:
            return None
        return found
