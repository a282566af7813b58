"""`tether agents ...`: a tenant's agents, as versioned documents the gateway stores.

The document travels as the text the author wrote (YAML or JSON): the server parses and
validates it, so what the CLI accepts is exactly what the API accepts.
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import json
import sys
from pathlib import Path
from typing import Any

from tether.cli.operations import add_tenant_flag
from tether.client import TetherClient
from tether.v1 import common_pb2

Emit = Any


def _client(args: argparse.Namespace) -> TetherClient:
    return TetherClient.from_env(getattr(args, "stack", None), tenant=getattr(args, "tenant", ""))


def _read(file: str) -> str:
    return sys.stdin.read() if file == "-" else Path(file).read_text(encoding="utf-8")


def _version(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a version number, not {value!r}") from None
    if number < 0:
        raise argparse.ArgumentTypeError(f"a version is 0 or more, not {number}")
    return number


def _pretty(normalised: str) -> list[str]:
    """The normalised document as indented JSON lines, so a diff shows one change a line."""
    return json.dumps(json.loads(normalised), indent=2, sort_keys=True).splitlines(keepends=True)


def _created_at(version: common_pb2.AgentVersion) -> str | None:
    return version.created_at.ToJsonString() if version.HasField("created_at") else None


async def cmd_apply(args: argparse.Namespace, emit: Emit) -> int:
    """Apply the document in FILE ('-' reads standard input)."""
    spec = await asyncio.to_thread(_read, args.file)
    async with _client(args) as client:
        applied = await client.apply_agent(spec, base_version=args.base_version)
    verb = "created" if applied.created else "unchanged at"
    emit(
        args,
        {"name": applied.name, "version": applied.version, "created": applied.created},
        f"agent {applied.name} {verb} version {applied.version}",
    )
    return 0


async def cmd_show(args: argparse.Namespace, emit: Emit) -> int:
    """Show one version of an agent (the published one unless --version names another)."""
    async with _client(args) as client:
        found = await client.get_agent(args.name, version=args.version)
    agent = found.agent
    emit(
        args,
        {
            "name": agent.name,
            "version": agent.version,
            "published_version": found.published_version,
            "default": found.default,
            "spec": agent.spec,
            "normalised": json.loads(agent.normalised),
            "digest": agent.digest,
            "created_at": _created_at(agent),
        },
        agent.spec,
    )
    return 0


async def cmd_list(args: argparse.Namespace, emit: Emit) -> int:
    """List the tenant's agents by name."""
    async with _client(args) as client:
        found = await client.list_agents()
    for agent in found.agents:
        updated = agent.updated_at.ToJsonString() if agent.HasField("updated_at") else None
        emit(
            args,
            {
                "name": agent.name,
                "published_version": agent.published_version,
                "default": agent.default,
                "updated_at": updated,
            },
            f"{agent.name}  v{agent.published_version}" + ("  (default)" if agent.default else ""),
        )
    return 0


async def cmd_versions(args: argparse.Namespace, emit: Emit) -> int:
    """List an agent's versions, oldest first."""
    async with _client(args) as client:
        found = await client.list_agent_versions(args.name)
    for version in found.versions:
        emit(
            args,
            {
                "name": version.name,
                "version": version.version,
                "digest": version.digest,
                "created_at": _created_at(version),
            },
            f"v{version.version}  {_created_at(version)}  {version.digest[:12]}",
        )
    return 0


async def cmd_diff(args: argparse.Namespace, emit: Emit) -> int:
    """A unified diff between two versions' normalised documents."""
    async with _client(args) as client:
        before = await client.get_agent(args.name, version=args.a)
        after = await client.get_agent(args.name, version=args.b)
    diff = "".join(
        difflib.unified_diff(
            _pretty(before.agent.normalised),
            _pretty(after.agent.normalised),
            fromfile=f"{args.name}@{args.a}",
            tofile=f"{args.name}@{args.b}",
        )
    )
    emit(args, {"name": args.name, "from": args.a, "to": args.b, "diff": diff}, diff.rstrip("\n"))
    return 0


async def cmd_rollback(args: argparse.Namespace, emit: Emit) -> int:
    """Publish an earlier version again."""
    async with _client(args) as client:
        done = await client.rollback_agent(args.name, args.to, base_version=args.base_version)
    emit(
        args,
        {"name": done.name, "version": done.version},
        f"agent {done.name} published at version {done.version}",
    )
    return 0


async def cmd_default(args: argparse.Namespace, emit: Emit) -> int:
    """Make an agent the tenant's default: it takes the runs no route claims."""
    async with _client(args) as client:
        done = await client.set_default_agent(args.name)
    emit(args, {"name": done.name, "default": True}, f"agent {done.name} is the default")
    return 0


async def cmd_rm(args: argparse.Namespace, emit: Emit) -> int:
    """Remove an agent no unfinished run pins (never the default)."""
    async with _client(args) as client:
        done = await client.remove_agent(args.name)
    emit(
        args,
        {"name": done.name, "version": done.version, "removed": True},
        f"agent {done.name} removed (was at version {done.version})",
    )
    return 0


async def cmd_render(args: argparse.Namespace, emit: Emit) -> int:
    """The request a worker would send first for a message, with no model call and no run."""
    async with _client(args) as client:
        done = await client.render_agent(
            args.name,
            args.message,
            source=args.source,
            channel=args.channel,
            version=args.version,
        )
    request = json.loads(done.request_json)
    emit(
        args,
        {
            "agent": done.agent,
            "version": done.version,
            "system": request.get("system", []),
            "tools": request.get("tools", []),
            "messages": request.get("messages", []),
            "model": request.get("model"),
            "max_tokens": request.get("max_tokens"),
            "estimated_input_tokens": done.estimated_input_tokens,
            # Micro-USD to USD: the estimate's precision, exactly.
            "estimated_cost_usd": done.estimated_cost_micros / 1_000_000,
            "routed_agent": done.routed_agent or None,
            "routed_version": done.routed_version or None,
            "warnings": list(done.warnings),
        },
        json.dumps(request, indent=2, ensure_ascii=False)
        + f"\n# {done.agent} v{done.version}: about {done.estimated_input_tokens} input tokens, "
        f"${done.estimated_cost_micros / 1_000_000:.6f}; the routes pick "
        + (f"{done.routed_agent} v{done.routed_version}" if done.routed_agent else "no agent")
        + "".join(f"\n# warning: {w}" for w in done.warnings),
    )
    return 0


def register(sub: Any, common: Any, wrap: Any) -> None:
    """Add `tether agents` and its commands to the CLI's subparsers."""
    agents = sub.add_parser("agents", help="a tenant's agents: apply, show, roll back, remove")
    agents_sub = agents.add_subparsers(dest="agents_command", required=True)

    def command(name: str, func: Any, help_text: str) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = agents_sub.add_parser(name, help=help_text)
        add_tenant_flag(parser)
        common(parser)
        parser.set_defaults(func=wrap(func))
        return parser

    apply = command("apply", cmd_apply, "apply a document (YAML or JSON); prints the version")
    apply.add_argument("file", help="the document ('-': standard input)")
    apply.add_argument(
        "--base-version",
        type=_version,
        metavar="N",
        help="apply only while N is the published version (0: the agent must not exist yet)",
    )
    show = command("show", cmd_show, "show an agent's published (or --version N) document")
    show.add_argument("name")
    show.add_argument("--version", type=_version, metavar="N")
    command("list", cmd_list, "list the tenant's agents")
    versions = command("versions", cmd_versions, "list an agent's versions, oldest first")
    versions.add_argument("name")
    diff = command("diff", cmd_diff, "a unified diff between two versions of an agent")
    diff.add_argument("name")
    diff.add_argument("a", type=_version)
    diff.add_argument("b", type=_version)
    rollback = command("rollback", cmd_rollback, "publish an earlier version again")
    rollback.add_argument("name")
    rollback.add_argument("--to", type=_version, required=True, metavar="N")
    rollback.add_argument(
        "--base-version",
        type=_version,
        metavar="B",
        help="roll back only while B is the published version",
    )
    default = command("default", cmd_default, "make an agent the tenant's default")
    default.add_argument("name")
    rm = command("rm", cmd_rm, "remove an agent no unfinished run pins")
    rm.add_argument("name")
    render = command(
        "render", cmd_render, "the request a worker would send for a message (no model call)"
    )
    render.add_argument("name")
    render.add_argument("--message", required=True, metavar="TEXT")
    render.add_argument("--source", default="", metavar="S", help="the run's source (any if unset)")
    render.add_argument("--channel", default="", metavar="C", help="the channel (any if unset)")
    render.add_argument("--version", type=_version, metavar="N")
