"""Browser credentials: a console's session and an embedding app's short-lived token, minted
from an API key. All SQL for the `browser_credentials` table (the gateway's) is here.

Only the secret's SHA-256 is stored: secrets carry 256 random bits, so a slow hash would add
nothing. A credential is refused once it expired, was revoked, or its API key was (the lookup
joins the key); a deleted key takes its credentials along (ON DELETE CASCADE). Expired ones are
removed by the gateway's sweep (`sweep`), and a key's by its next mint.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from sqlalchemy import bindparam, delete, func, insert, or_, select, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from tether.apikeys import KEYS_ADMIN, Principal
from tether.db.schema import api_keys, browser_credentials
from tether.ids import new_id

SESSION_PREFIX = "ts_"
TOKEN_PREFIX = "tt_"
Kind = Literal["session", "token"]
# A browser credential never manages keys: it would outlive the sign-in's purpose.
NEVER_CARRIED = frozenset({KEYS_ADMIN})


@dataclass(frozen=True)
class BrowserCredential:
    """A verified session or token: who it speaks for and until when."""

    kind: Kind
    principal: Principal
    expires_at: datetime


def _hash(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


def csrf_token(session_secret: str) -> str:
    """The CSRF token of a session: derived from its secret, so a page that lost it gets it
    again from GET /v2/session, and one without the (HttpOnly) cookie cannot compute it."""
    digest = hashlib.sha256(b"tether-csrf:" + session_secret.encode()).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


async def mint(
    conn: AsyncConnection,
    kind: Kind,
    key: Principal,
    scopes: Iterable[str],
    ttl_s: float,
) -> tuple[str, BrowserCredential]:
    """Store a new credential of `key` expiring in `ttl_s`; returns its secret (shown once).
    The key's expired and revoked credentials go first (the table cleans itself as keys use
    it: nothing else removes them)."""
    await conn.execute(
        delete(browser_credentials).where(
            browser_credentials.c.key_id == key.key_id,
            or_(
                browser_credentials.c.expires_at <= func.now(),
                browser_credentials.c.revoked_at.is_not(None),
            ),
        )
    )
    secret = (SESSION_PREFIX if kind == "session" else TOKEN_PREFIX) + secrets.token_urlsafe(32)
    carried = sorted(set(scopes) - NEVER_CARRIED)
    expires_at: Any = func.now() + func.make_interval(0, 0, 0, 0, 0, 0, ttl_s)
    if key.expires_at is not None:
        expires_at = func.least(expires_at, key.expires_at)
    row: Any = (
        await conn.execute(
            insert(browser_credentials)
            .values(
                credential_id=new_id("cred"),
                kind=kind,
                secret_hash=_hash(secret),
                key_id=key.key_id,
                tenant_id=key.tenant_id,
                principal_id=key.principal_id,
                scopes=carried,
                expires_at=expires_at,
            )
            .returning(browser_credentials.c.expires_at)
        )
    ).one()
    principal = Principal(
        key.key_id, key.tenant_id, key.principal_id, frozenset(carried), row.expires_at
    )
    return secret, BrowserCredential(kind, principal, row.expires_at)


async def find(conn: AsyncConnection, secret: str, kind: Kind) -> BrowserCredential | None:
    """The credential of `secret` when it is of `kind`, unexpired and unrevoked, and its key is
    too; else None."""
    c, k = browser_credentials.c, api_keys.c
    row: Any = (
        await conn.execute(
            select(c.key_id, c.tenant_id, c.principal_id, c.scopes, c.expires_at)
            .join_from(browser_credentials, api_keys, c.key_id == k.key_id)
            .where(
                c.secret_hash == _hash(secret),
                c.kind == kind,
                c.revoked_at.is_(None),
                c.expires_at > func.now(),
                k.revoked_at.is_(None),
                or_(k.expires_at.is_(None), k.expires_at > func.now()),
            )
        )
    ).first()
    if row is None:
        return None
    principal = Principal(
        row.key_id, row.tenant_id, row.principal_id, frozenset(row.scopes), row.expires_at
    )
    return BrowserCredential(kind, principal, row.expires_at)


# The expired credentials, soonest expired first, each taken by one sweeping replica.
_EXPIRED = (
    select(browser_credentials.c.credential_id)
    .where(browser_credentials.c.expires_at <= func.now())
    .order_by(browser_credentials.c.expires_at)
    .limit(bindparam("limit"))
    .with_for_update(skip_locked=True)
    .scalar_subquery()
)
_SWEEP = delete(browser_credentials).where(browser_credentials.c.credential_id.in_(_EXPIRED))
_NEXT_EXPIRY_IN = select(
    func.extract("epoch", func.min(browser_credentials.c.expires_at) - func.now())
)


async def sweep(conn: AsyncConnection, limit: int) -> tuple[int, float | None]:
    """Remove up to `limit` expired credentials (a revoked one goes once it expires too: it is
    refused meanwhile); how many went, and the seconds until the next one expires (0 when more
    are expired already, None when none is left)."""
    removed = (await conn.execute(_SWEEP, {"limit": limit})).rowcount
    if removed == limit:
        return removed, 0.0
    next_in = (await conn.execute(_NEXT_EXPIRY_IN)).scalar()
    return removed, None if next_in is None else max(float(next_in), 0.0)


class Sweep:
    """The gateway's sweep of expired credentials (the lookup refuses them already; the sweep
    keeps the table to the live ones). A round removes a batch and sleeps until the next expiry
    it saw; a credential minted here that expires sooner wakes it (`minted`), and one minted on
    another replica is that replica's to sweep, or this one's within `most_s`."""

    BATCH = 500

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self.nudge = asyncio.Event()
        self._due_at: float | None = None  # monotonic: when the next expiry seen falls due

    async def round(self) -> float | None:
        """Remove a batch of expired credentials; the seconds until the next one expires."""
        async with self._engine.begin() as conn:
            _, next_in = await sweep(conn, self.BATCH)
        self._due_at = None if next_in is None else time.monotonic() + next_in
        return next_in

    def minted(self, ttl_s: float) -> None:
        """A credential lasting `ttl_s` was minted here: wake the sweep if it expires before
        the round's next look."""
        if self._due_at is None or time.monotonic() + ttl_s < self._due_at:
            self.nudge.set()


async def revoke(conn: AsyncConnection, secret: str, kind: Kind) -> bool:
    """Revoke a credential; False when it was unknown or revoked already (a miss changes
    nothing)."""
    c = browser_credentials.c
    result = await conn.execute(
        update(browser_credentials)
        .where(c.secret_hash == _hash(secret), c.kind == kind, c.revoked_at.is_(None))
        .values(revoked_at=func.now())
    )
    return bool(result.rowcount)
