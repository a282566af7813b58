"""Connections: a worker finds whether the run's owner has a usable account at a provider, offers
an OAuth consent when not, and the owner completes it once (its state single-use)."""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlencode

from sqlalchemy.engine import Row
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from services.interactions import repository as repo
from services.interactions.domain import GAPS, Orchestrator, Policy, RunFacts, TokenExchange
from services.interactions.lifecycle import Lifecycle
from services.interactions.mcp_oauth import (
    MCP_PREFIX,
    McpEndpoints,
    McpOAuth,
    TokenSet,
    pkce_pair,
)
from services.interactions.sealing import Sealed
from services.interactions.secret_store import ConnectionTokens
from tether import audit
from tether.domain import EventType
from tether.errors import FailedPrecondition, InvalidArgument, NotFound, TetherError
from tether.visibility import Viewer

log = logging.getLogger(__name__)
# What else is sealed under a connection's provider, each bound to its purpose.
PKCE_PURPOSE = "#pkce-verifier"
REFRESH_PURPOSE = "#refresh-token"


def _hash_state(state: str) -> bytes:
    return hashlib.sha256(state.encode()).digest()


class Connections:
    """The only writer of a consent offer's transitions (offered, completed) and of the
    accounts a completed consent connects."""

    def __init__(
        self,
        engine: AsyncEngine,
        orchestrator: Orchestrator,
        lifecycle: Lifecycle,
        policy: Policy,
        tokens: ConnectionTokens,
        exchange: TokenExchange | None = None,
        mcp: McpOAuth | None = None,
    ) -> None:
        self._engine = engine
        self._orchestrator = orchestrator
        self._lifecycle = lifecycle
        self._policy = policy
        self._tokens = tokens
        self._exchange = exchange
        self._mcp = mcp

    async def resolve_connection(
        self,
        run_id: str,
        epoch: int,
        provider: str,
        scopes: Sequence[str],
        *,
        refused_sha256: str = "",
    ) -> tuple[str | None, str, str]:
        """(gap or None, access token, credential ref) for the run's owner principal: a
        connection serves only runs its principal owns. `refused_sha256` names a token the
        provider refused before its expiry: refreshed when it is still the stored one (once,
        however many workers report it: the first refresh replaces it)."""
        run = await self._orchestrator.leased_run(run_id, epoch)
        owner = run.owner_principal_id
        async with self._engine.connect() as conn:
            row = (
                None
                if owner is None
                else await repo.find_connection(conn, run.tenant_id, owner, provider)
            )
        ref = f"connection:{provider}/{owner or '(unknown owner)'}"
        if row is None:
            return "absent", "", ref
        if row.expires_at <= datetime.now(UTC):
            refreshed = await self._refreshed(row)
            if refreshed is None:
                return "expired", "", ref
            row = refreshed
        if not set(scopes) <= set(row.scopes):
            return "insufficient_scope", "", ref
        token = await self._token_of(row)
        if refused_sha256 and hmac.compare_digest(
            hashlib.sha256(token.encode()).hexdigest(), refused_sha256
        ):
            refreshed = await self._refreshed(row)
            if refreshed is None:
                return "expired", "", ref
            token = await self._token_of(refreshed)
        return None, token, ref

    async def leased_run(self, run_id: str, epoch: int) -> RunFacts:
        """The run the caller holds the live lease of (FailedPrecondition for a stale lease,
        NotFound for no such run), as `resolve_connection` checks it."""
        return await self._orchestrator.leased_run(run_id, epoch)

    async def _token_of(self, row: Row[Any]) -> str:
        """The connection's token: opened, or (stored plaintext by the previous release during a
        rollout) sealed and cleared now, so it stays in the table no longer than one read."""
        if not row.access_token:
            sealed = Sealed(row.token_ciphertext, row.token_nonce, row.token_key_id)
            return self._tokens.open(row.tenant_id, row.principal_id, row.provider, sealed)
        plaintext = str(row.access_token)
        token = self._tokens.seal(row.tenant_id, row.principal_id, row.provider, plaintext)
        async with self._engine.begin() as conn:
            await repo.seal_connection_token(
                conn, row.tenant_id, row.principal_id, row.provider, plaintext, token
            )
        return plaintext

    async def request_connection(
        self,
        run_id: str,
        epoch: int,
        *,
        tool_call_id: str,
        provider: str,
        gap: str,
        scopes: Sequence[str],
        mcp: McpEndpoints | None = None,
    ) -> tuple[str, str] | None:
        """A consent offer (interaction id, login URL), or None when the provider has no login
        URL (a token integration: the caller fails the run instead of pausing for ever). An
        `mcp:<server>` provider's URL is built from the server's discovered `mcp` endpoints."""
        if gap not in GAPS:
            raise InvalidArgument(f"gap must be one of {list(GAPS)}")
        if provider.startswith(MCP_PREFIX):
            return await self._mcp_offer(run_id, epoch, tool_call_id, provider, gap, scopes, mcp)
        offer = self._policy.providers.get(provider)
        if offer is None:
            return None
        state = secrets.token_urlsafe(24)
        url = (
            offer.authorize_url
            + "?"
            + urlencode(
                {
                    "client_id": offer.client_id,
                    "state": state,
                    "redirect_uri": offer.redirect_uri,
                    "scope": " ".join(scopes),
                    "response_type": "code",
                }
            )
        )
        interaction_id = await self._lifecycle.store(
            run_id,
            epoch,
            "connection",
            tool_call_id,
            provider=provider,
            gap=gap,
            scopes=list(scopes),
            oauth_state_hash=_hash_state(state),
            login_url=url,
            expires_at=datetime.now(UTC) + timedelta(seconds=self._policy.consent_ttl_s),
        )
        return interaction_id, url

    async def _mcp_offer(
        self,
        run_id: str,
        epoch: int,
        tool_call_id: str,
        provider: str,
        gap: str,
        scopes: Sequence[str],
        endpoints: McpEndpoints | None,
    ) -> tuple[str, str] | None:
        """An MCP server's consent offer: PKCE, its verifier sealed with the offer. None (the
        run fails naming the gap) without an MCP OAuth client, endpoints, or a run owner."""
        if self._mcp is None or endpoints is None:
            return None
        run = await self._orchestrator.leased_run(run_id, epoch)
        owner = run.owner_principal_id
        if owner is None:
            return None
        state = secrets.token_urlsafe(24)
        verifier, challenge = pkce_pair()
        url = await self._mcp.consent_url(endpoints, state, challenge, scopes)
        sealed = self._tokens.seal(run.tenant_id, owner, provider + PKCE_PURPOSE, verifier)
        interaction_id = await self._lifecycle.store(
            run_id,
            epoch,
            "connection",
            tool_call_id,
            run=run,
            provider=provider,
            gap=gap,
            scopes=list(scopes),
            oauth_state_hash=_hash_state(state),
            login_url=url,
            oauth_token_endpoint=endpoints.token_endpoint,
            oauth_client_id=self._mcp.client_id,
            verifier_ciphertext=sealed.ciphertext,
            verifier_nonce=sealed.nonce,
            verifier_key_id=sealed.key_id,
            expires_at=datetime.now(UTC) + timedelta(seconds=self._policy.consent_ttl_s),
        )
        return interaction_id, url

    async def _mcp_exchange(self, conn: AsyncConnection, offer: Row[Any], code: str) -> None:
        """The callback's code exchanged at the server's token endpoint with the offer's
        verifier; the access and refresh tokens sealed per principal under the provider."""
        if self._mcp is None:
            raise FailedPrecondition("no MCP OAuth client is configured")
        tenant_id, principal_id, provider = offer.tenant_id, offer.principal_id, offer.provider
        verifier = self._tokens.open(
            tenant_id,
            principal_id,
            provider + PKCE_PURPOSE,
            Sealed(offer.verifier_ciphertext, offer.verifier_nonce, offer.verifier_key_id),
        )
        got = await self._mcp.exchange(
            offer.oauth_token_endpoint, offer.oauth_client_id, code, verifier
        )
        await self._store_mcp(
            conn,
            tenant_id,
            principal_id,
            provider,
            got,
            offer.oauth_token_endpoint,
            offer.oauth_client_id,
            got.scopes or tuple(offer.scopes or ()),
        )

    async def _store_mcp(
        self,
        conn: AsyncConnection,
        tenant_id: str,
        principal_id: str,
        provider: str,
        got: TokenSet,
        token_endpoint: str,
        client_id: str,
        scopes: Sequence[str],
    ) -> None:
        refresh = (
            self._tokens.seal(
                tenant_id, principal_id, provider + REFRESH_PURPOSE, got.refresh_token
            )
            if got.refresh_token
            else None
        )
        await repo.upsert_connection(
            conn,
            tenant_id=tenant_id,
            principal_id=principal_id,
            provider=provider,
            scopes=scopes,
            token=self._tokens.seal(tenant_id, principal_id, provider, got.access_token),
            expires_at=datetime.now(UTC) + timedelta(seconds=got.lifetime_s),
            refresh=refresh,
            token_endpoint=token_endpoint,
            client_id=client_id,
        )

    async def _refreshed(self, row: Row[Any]) -> Row[Any] | None:
        """An expired MCP connection refreshed at its token endpoint (the row as stored then),
        or None when it cannot be (no refresh token, or the endpoint refused it: the run then
        pauses `expired`, and the person connects again)."""
        if self._mcp is None or row.refresh_ciphertext is None or not row.oauth_token_endpoint:
            return None
        tenant_id, principal_id, provider = row.tenant_id, row.principal_id, row.provider
        refresh_token = self._tokens.open(
            tenant_id,
            principal_id,
            provider + REFRESH_PURPOSE,
            Sealed(row.refresh_ciphertext, row.refresh_nonce, row.refresh_key_id),
        )
        try:
            got = await self._mcp.refresh(
                row.oauth_token_endpoint, row.oauth_client_id, refresh_token
            )
        except TetherError as exc:
            log.info("connection %s of %s could not be refreshed: %s", provider, principal_id, exc)
            return None
        if not got.refresh_token:
            got = replace(got, refresh_token=refresh_token)  # the old one stays good
        async with self._engine.begin() as conn:
            await self._store_mcp(
                conn,
                tenant_id,
                principal_id,
                provider,
                got,
                row.oauth_token_endpoint,
                row.oauth_client_id,
                got.scopes or tuple(row.scopes),
            )
            return await repo.find_connection(conn, tenant_id, principal_id, provider)

    async def complete_connection(self, viewer: Viewer, run_id: str, state: str, code: str) -> bool:
        """Complete consent: the state is single-use and bound to the tenant and the principal
        the offer was made for (the run's owner: the account connected becomes theirs, so not
        even a runs:all key completes it for them), and the run must be visible to the caller.
        Absent and not-yours give the same answer; a repeat resumes nothing (`False`)."""
        tenant_id, principal_id = viewer.tenant_id, viewer.principal_id
        not_found = NotFound(f"run {run_id!r} has no connection to complete")
        if not state:
            raise InvalidArgument("state is required")
        try:
            run = await self._orchestrator.visible_run(viewer, run_id)
        except NotFound:
            raise not_found from None
        if run.status.terminal:
            raise FailedPrecondition(f"run {run_id!r} already finished ({run.status})")
        async with self._engine.begin() as conn:
            offer = await repo.interaction_by_state(conn, _hash_state(state))
            if (
                offer is None
                or offer.run_id != run_id
                or offer.tenant_id != tenant_id
                or offer.principal_id != principal_id
            ):
                raise not_found
            if offer.status == "completed":
                return False  # double click, retried redirect, prefetch: queued once already
            if offer.status == "expired" or offer.expires_at <= datetime.now(UTC):
                raise FailedPrecondition("this consent link expired; the run was failed")
            if offer.status != "pending" or not run.parked_on("connection", offer.interaction_id):
                raise FailedPrecondition(
                    f"run {run_id!r} is not waiting for this consent; use the link of its "
                    "pending connection"
                )
            if offer.oauth_token_endpoint:
                await self._mcp_exchange(conn, offer, code)
            else:
                if self._exchange is None:
                    raise FailedPrecondition("no OAuth token exchange is configured")
                token, lifetime, granted = await self._exchange.exchange(offer.provider, code)
                await repo.upsert_connection(
                    conn,
                    tenant_id=tenant_id,
                    principal_id=principal_id,
                    provider=offer.provider,
                    scopes=granted or offer.scopes,
                    token=self._tokens.seal(tenant_id, principal_id, offer.provider, token),
                    expires_at=datetime.now(UTC) + timedelta(seconds=lifetime),
                )
            if await repo.resolve(conn, offer.interaction_id, "completed") is None:
                return False
            await audit.record(
                conn,
                tenant_id=tenant_id,
                run_id=run_id,
                action=EventType.CONNECTION_COMPLETED,
                actor={"kind": "principal", "principal_id": principal_id},
                interaction_id=offer.interaction_id,
                provider=offer.provider,
            )
        return await self._lifecycle.try_resume(
            tenant_id, run_id, "connection", offer.interaction_id
        )

    async def pending_connection(self, viewer: Viewer, run_id: str) -> Row[Any] | None:
        """The run's open consent offer, or None once completed."""
        bound = (await self._orchestrator.visible_run(viewer, run_id)).bound("connection")
        async with self._engine.connect() as conn:
            return await self._lifecycle.open(conn, run_id, "connection", bound)
