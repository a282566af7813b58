"""`tether tools list`: the tool catalog, the tools the workers announced, which an agent's
document may name (an apply naming any other is refused)."""

from __future__ import annotations

import argparse
from typing import Any

from tether.cli.operations import add_tenant_flag
from tether.client import TetherClient

Emit = Any


async def cmd_list(args: argparse.Namespace, emit: Emit) -> int:
    """List the catalog's tools by name."""
    client = TetherClient.from_env(getattr(args, "stack", None), tenant=getattr(args, "tenant", ""))
    async with client:
        found = await client.list_tools()
    for tool in found.tools:
        writes = "  writes externally" if tool.writes_externally else ""
        emit(
            args,
            {
                "name": tool.name,
                "risk": tool.risk,
                "writes_externally": tool.writes_externally,
                "schema_sha256": tool.schema_sha256,
                "announced_by": tool.announced_by,
            },
            f"{tool.name}  {tool.risk}{writes}  (announced by {tool.announced_by})",
        )
    return 0


def register(sub: Any, common: Any, wrap: Any) -> None:
    """Add `tether tools` and its command to the CLI's subparsers."""
    tools = sub.add_parser("tools", help="the tool catalog: the tools agents may name")
    tools_sub = tools.add_subparsers(dest="tools_command", required=True)
    listed: argparse.ArgumentParser = tools_sub.add_parser(
        "list", help="list the tools the workers announced"
    )
    add_tenant_flag(listed)
    common(listed)
    listed.set_defaults(func=wrap(cmd_list))
