"""The local MCP server's authorisation: a bearer check for `auth: {bearer: SECRET}` and a tiny
OAuth 2.1 authorisation server (authorisation code with PKCE, refresh, dynamic registration) for
`auth: oauth`, both plugged into the SDK's own auth routes and middleware, so the 401s, the
`WWW-Authenticate` challenge and the metadata documents are the SDK's.

The authorisation endpoint consents at once (no login page): a test follows the redirect it
answers to read the code, then exchanges it at `/token` with its verifier as any client does."""

from __future__ import annotations

import secrets
import time

from mcp.server.auth.provider import (
    AccessToken,
    AuthorizationCode,
    AuthorizationParams,
    IdentityAssertionParams,
    RefreshToken,
    TokenError,
    construct_redirect_uri,
)
from mcp.shared.auth import OAuthClientInformationFull, OAuthToken
from pydantic import AnyUrl

PUBLIC_CLIENT_ID = "tether-worker"
"""A public client (no secret, PKCE only) registered from the start."""
SCOPE = "orders"
"""The scope the server requires; a token without it is refused 403 insufficient_scope."""
CODE_TTL_SECONDS = 300
ACCESS_TOKEN_TTL_SECONDS = 3600


class BearerVerifier:
    """`auth: {bearer: SECRET}`: the one token that is accepted."""

    def __init__(self, secret: str) -> None:
        self._secret = secret

    async def verify_token(self, token: str) -> AccessToken | None:
        """The token's grant when it is the secret, else None (the SDK answers 401)."""
        if not secrets.compare_digest(token.encode(), self._secret.encode()):
            return None
        return AccessToken(token=token, client_id="bearer", scopes=[SCOPE])


class OAuthProvider:
    """An in-memory authorisation server: clients, codes, access and refresh tokens."""

    def __init__(self, redirect_uris: list[str]) -> None:
        self.clients: dict[str, OAuthClientInformationFull] = {
            PUBLIC_CLIENT_ID: OAuthClientInformationFull(
                client_id=PUBLIC_CLIENT_ID,
                redirect_uris=[AnyUrl(u) for u in redirect_uris],
                token_endpoint_auth_method="none",
                grant_types=["authorization_code", "refresh_token"],
                scope=SCOPE,
            )
        }
        self.codes: dict[str, AuthorizationCode] = {}
        self.access: dict[str, AccessToken] = {}
        self.refresh: dict[str, RefreshToken] = {}

    def expire_access_tokens(self) -> None:
        """Every access token issued so far is expired from now (refresh tokens stay good)."""
        now = int(time.time()) - 1
        self.access = {t: a.model_copy(update={"expires_at": now}) for t, a in self.access.items()}

    def issue(self, scopes: list[str], client_id: str = PUBLIC_CLIENT_ID) -> str:
        """An access token granted directly (a test that needs one without the flow)."""
        token = secrets.token_urlsafe(32)
        self.access[token] = AccessToken(
            token=token,
            client_id=client_id,
            scopes=scopes,
            expires_at=int(time.time()) + ACCESS_TOKEN_TTL_SECONDS,
        )
        return token

    async def get_client(self, client_id: str) -> OAuthClientInformationFull | None:
        return self.clients.get(client_id)

    async def register_client(self, client_info: OAuthClientInformationFull) -> None:
        self.clients[client_info.client_id] = client_info

    async def authorize(
        self, client: OAuthClientInformationFull, params: AuthorizationParams
    ) -> str:
        code = secrets.token_urlsafe(32)
        self.codes[code] = AuthorizationCode(
            code=code,
            scopes=params.scopes or [SCOPE],
            expires_at=time.time() + CODE_TTL_SECONDS,
            client_id=client.client_id,
            code_challenge=params.code_challenge,
            redirect_uri=params.redirect_uri,
            redirect_uri_provided_explicitly=params.redirect_uri_provided_explicitly,
            resource=params.resource,
        )
        return construct_redirect_uri(str(params.redirect_uri), code=code, state=params.state)

    async def load_authorization_code(
        self, client: OAuthClientInformationFull, authorization_code: str
    ) -> AuthorizationCode | None:
        code = self.codes.get(authorization_code)
        return code if code is not None and code.client_id == client.client_id else None

    async def exchange_authorization_code(
        self, client: OAuthClientInformationFull, authorization_code: AuthorizationCode
    ) -> OAuthToken:
        if self.codes.pop(authorization_code.code, None) is None:
            raise TokenError("invalid_grant", "authorization code already used")
        return self._tokens(client.client_id, authorization_code.scopes)

    async def load_refresh_token(
        self, client: OAuthClientInformationFull, refresh_token: str
    ) -> RefreshToken | None:
        found = self.refresh.get(refresh_token)
        return found if found is not None and found.client_id == client.client_id else None

    async def exchange_refresh_token(
        self,
        client: OAuthClientInformationFull,
        refresh_token: RefreshToken,
        scopes: list[str],
    ) -> OAuthToken:
        self.refresh.pop(refresh_token.token, None)
        return self._tokens(client.client_id, scopes or refresh_token.scopes)

    async def load_access_token(self, token: str) -> AccessToken | None:
        found = self.access.get(token)
        if found is None or (found.expires_at is not None and found.expires_at < time.time()):
            return None
        return found

    async def revoke_token(self, token: AccessToken | RefreshToken) -> None:
        self.access.pop(token.token, None)
        self.refresh.pop(token.token, None)

    async def exchange_identity_assertion(
        self, client: OAuthClientInformationFull, params: IdentityAssertionParams
    ) -> OAuthToken:
        raise TokenError("unsupported_grant_type", "this server takes no identity assertions")

    def _tokens(self, client_id: str, scopes: list[str]) -> OAuthToken:
        access = self.issue(scopes, client_id)
        refresh = secrets.token_urlsafe(32)
        self.refresh[refresh] = RefreshToken(token=refresh, client_id=client_id, scopes=scopes)
        return OAuthToken(
            access_token=access,
            token_type="Bearer",
            expires_in=ACCESS_TOKEN_TTL_SECONDS,
            scope=" ".join(scopes),
            refresh_token=refresh,
        )
