"""What the schema cannot say about an agent's `mcp_servers`: names unique, a risk override
only for an allowlisted tool, each `server__tool` name the model would see short enough for the
Messages API and distinct from every other tool the agent offers, and a bearer secret given by
its name, not as the token itself (as far as a token can be told from a name)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from tether.agent_spec.violations import Violation, pointer
from tether.mcp_wire import MAX_OFFERED_NAME, offered_name


def mcp_violations(doc: Mapping[str, Any]) -> Iterator[Violation]:
    """The violations of `doc`'s `mcp_servers` beyond its schema (parts of the wrong shape
    are the schema's to report)."""
    servers = doc.get("mcp_servers")
    if not isinstance(servers, list):
        return
    taken: dict[str, str] = {}
    for path, tools in _tool_lists(doc):
        for index, name in enumerate(_strings(tools)):
            taken.setdefault(name, pointer([*path, index]))
    seen_servers: dict[str, int] = {}
    for at, server in enumerate(servers):
        if not isinstance(server, Mapping) or not isinstance(server.get("name"), str):
            continue
        name = server["name"]
        if name in seen_servers:
            yield Violation(
                pointer(["mcp_servers", at, "name"]), f"repeats /mcp_servers/{seen_servers[name]}"
            )
            continue
        seen_servers[name] = at
        tools = _strings(server.get("tools"))
        for index, tool in enumerate(tools):
            where = pointer(["mcp_servers", at, "tools", index])
            offered = offered_name(name, tool)
            if len(offered) > MAX_OFFERED_NAME:
                yield Violation(
                    where,
                    f"is offered to the model as {offered!r}, longer than the "
                    f"{MAX_OFFERED_NAME} characters a tool name may have: shorten the "
                    "server's name",
                )
            elif offered in taken:
                yield Violation(
                    where,
                    f"is offered to the model as {offered!r}, which {taken[offered]} already "
                    "names: rename the server or drop one of the two",
                )
            else:
                taken[offered] = where
        auth = server.get("auth")
        secret = auth.get("bearer") if isinstance(auth, Mapping) else None
        if isinstance(secret, str) and looks_like_a_token(secret):
            yield Violation(
                pointer(["mcp_servers", at, "auth", "bearer"]),
                "looks like a token, not a secret's name: store the token with `tether secrets "
                "add NAME` and give NAME here (a document is read back by anyone who may read "
                "the agent)",
            )
        risk = server.get("risk")
        if isinstance(risk, Mapping):
            for tool in sorted(set(risk) - set(tools)):
                yield Violation(
                    pointer(["mcp_servers", at, "risk", tool]),
                    f"names a tool not in /mcp_servers/{at}/tools: allowlist it or drop the entry",
                )


TOKEN_PREFIXES = ("sk-", "sk_", "xox", "ghp_", "gho_", "github_pat_", "eyj", "bearer")
"""How tokens of common issuers begin (an OpenAI/Stripe key, a Slack or GitHub token, a JWT)."""


def looks_like_a_token(name: str) -> bool:
    """Whether a bearer secret's *name* is more likely the token itself: a known token
    prefix, or long and without a separator a person would name a secret with."""
    lowered = name.lower()
    if lowered.startswith(TOKEN_PREFIXES):
        return True
    return len(name) >= 32 and not any(c in name for c in "._:-@") and "_" not in name[:32]


def _tool_lists(doc: Mapping[str, Any]) -> Iterator[tuple[list[str | int], Any]]:
    """Every other list of tools the agent offers: its own, its persona's, personas', skills'."""
    yield ["tools"], doc.get("tools")
    persona = doc.get("persona")
    if isinstance(persona, Mapping):
        yield ["persona", "tools"], persona.get("tools")
    for kind in ("personas", "skills"):
        bundles = doc.get(kind)
        for at, bundle in enumerate(bundles if isinstance(bundles, list) else []):
            if isinstance(bundle, Mapping):
                yield [kind, at, "tools"], bundle.get("tools")


def _strings(value: Any) -> list[str]:
    return [v for v in value if isinstance(v, str)] if isinstance(value, list) else []
