"""An `auth: oauth` MCP server's connection gap: a `ConnectionGap` for provider `mcp:<server>`
that carries what the server's metadata said of its authorisation server, so interactions can
build the consent URL (PKCE) and later exchange the code at the server's own token endpoint."""

from __future__ import annotations

from services.worker.mcp.outcome import AuthChallenge
from tether.tools.base import ConnectionGap

PROVIDER_PREFIX = "mcp:"


def provider(server: str) -> str:
    """The connection provider an MCP server's tokens are kept under, per principal."""
    return f"{PROVIDER_PREFIX}{server}"


class McpConnectionGap(ConnectionGap):
    """The run pauses `waiting-for-connection` for `server`; `challenge` is the discovered
    metadata (authorisation and token endpoints, resource, scopes)."""

    def __init__(
        self, *, server: str, gap: str, challenge: AuthChallenge, credential_ref: str = ""
    ) -> None:
        name = provider(server)
        super().__init__(
            provider=name,
            gap=gap,
            scopes=challenge.scopes,
            credential_ref=credential_ref or f"connection:{name}",
        )
        self.challenge = challenge
