"""The `tether` command.

Every subcommand accepts `--stack <data-dir>/stack.json` (before or after its arguments) or
reads TETHER_GATEWAY / TETHER_API_KEY. `--json` prints one JSON object per line. A refused
command exits 1 with the gRPC status code and message on stderr. A command that is safe to
repeat (send, with the event id it chose once; reads; cancel) rides out an outage: the client
retries UNAVAILABLE with backoff for a while, saying so on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import grpc

from tether.cli import agents, docs, interactions, operations, tools, trees, watch
from tether.cli import channels as channels_cli
from tether.cli import schedules as schedules_cli
from tether.cli import secrets as secrets_cli
from tether.cli import webhooks as webhooks_cli
from tether.client import TetherClient, run_to_dict
from tether.convert import disposition_name, status_to_proto
from tether.priorities import PRIORITIES
from tether.states import RunStatus
from tether.transport import part_to_json

Command = Callable[[argparse.Namespace], Awaitable[int]]
# Python's own exit code when its output pipe breaks (the signal module's "Note on SIGPIPE").
EPIPE_EXIT_CODE = 1


def _emit(args: argparse.Namespace, data: dict[str, Any], text: str) -> None:
    print(json.dumps(data, sort_keys=True) if args.json else text, flush=True)


def _client(args: argparse.Namespace) -> TetherClient:
    return TetherClient.from_env(getattr(args, "stack", None), tenant=getattr(args, "tenant", ""))


async def cmd_up(args: argparse.Namespace) -> int:
    """Start the whole stack in the foreground."""
    from tether.stack.up import run_until_signalled

    data_dir = Path(args.data_dir or os.environ.get("TETHER_DATA_DIR") or ".tether").resolve()
    await run_until_signalled(data_dir)
    return 0


async def cmd_send(args: argparse.Namespace) -> int:
    """Send a chat message."""
    async with _client(args) as client:
        response = await client.send(
            args.text,
            conversation_id=args.conversation,
            event_id=args.event_id or f"cli-{uuid.uuid4().hex}",
            channel=args.channel,
            priority=args.priority,
        )
    run = run_to_dict(response.run)
    disposition = disposition_name(response.disposition)
    _emit(
        args,
        {**run, "disposition": disposition},
        f"run {run['run_id']} {disposition} status={run['status']}",
    )
    if args.follow:
        async with _client(args) as client:
            return await watch.follow(client, run["run_id"], as_json=args.json)
    return 0


async def cmd_run(args: argparse.Namespace) -> int:
    """Show one run; with --json, its persisted parts too (the last --parts N of them); with
    --attempts, its attempts, lineage, stage durations and usage by model turn instead."""
    if args.tree:
        async with _client(args) as client:
            root, runs = await trees.tree_runs(client, args.run_id)
        _emit(
            args, {"root": root, "runs": trees.tree_nodes(root, runs)}, trees.tree_text(root, runs)
        )
        return 0
    if args.attempts:
        async with _client(args) as client:
            record = await client.get_run_attempts(args.run_id)
        _emit(args, operations.attempts_json(record), operations.attempts_text(record))
        return 0
    async with _client(args) as client:
        response = await client.get_run(args.run_id)
    run = run_to_dict(response.run)
    text = f"run {run['run_id']} status={run['status']} attempt={run.get('attempt', 0)}"
    if response.run.HasField("waiting_for"):
        waiting = response.run.waiting_for
        text += f" waiting_for={waiting.reason} (cap {waiting.cap})"
    if response.run.result_text:
        text += f"\n{response.run.result_text}"
    if response.run.HasField("delivery"):
        text += "\n" + _delivery_line(response.run.delivery)
    parts = list(response.parts)
    shown = parts if args.parts is None else parts[max(len(parts) - args.parts, 0) :]
    data = {**run, "part_count": len(parts), "parts": [part_to_json(p) for p in shown]}
    _emit(args, data, text)
    return 0


def _delivery_line(delivery: Any) -> str:
    """A channel run's answer going out, in one line: its outcome, where, and why not."""
    line = f"delivery {delivery.state} via {delivery.kind} {delivery.channel_id}"
    if delivery.provider_message_id:
        line += f" (message {delivery.provider_message_id})"
    if delivery.HasField("error"):
        line += f": {delivery.error.message or delivery.error.code}"
    return line


def _part_limit(value: str) -> int:
    try:
        limit = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, not {value!r}") from None
    if limit < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {limit}")
    return limit


def _status(value: str) -> RunStatus:
    try:
        return RunStatus(value)
    except ValueError:
        known = ", ".join(s.value for s in RunStatus)
        raise argparse.ArgumentTypeError(f"unknown status {value!r}; one of {known}") from None


async def cmd_runs(args: argparse.Namespace) -> int:
    """List runs, newest first (of some statuses, created since a time, when asked)."""
    filters: dict[str, Any] = {
        "page_size": args.limit,
        "conversation_id": args.conversation or "",
        "statuses": [status_to_proto(s) for s in args.status or ()],
    }
    if args.since is not None:
        filters["created_after"] = operations.since(args.since)
    async with _client(args) as client:
        response = await client.list_runs(**filters)
    for run in response.runs:
        data = run_to_dict(run)
        _emit(
            args,
            data,
            f"{data['run_id']}  {data['status']:<24} {run.conversation_id}  "
            f"{run.input_text[:40]!r}",
        )
    return 0


def _keys_client(args: argparse.Namespace) -> TetherClient:
    return TetherClient.from_env(getattr(args, "stack", None), operator=args.operator)


async def cmd_keys_create(args: argparse.Namespace) -> int:
    """Issue an API key for a tenant's principal."""
    expires_at = None
    if args.expires_in is not None:
        if args.expires_in <= 0:
            raise ValueError("--expires-in must be a positive number of seconds")
        expires_at = datetime.now(UTC) + timedelta(seconds=args.expires_in)
    async with _keys_client(args) as client:
        response = await client.create_key(
            args.tenant, args.principal, args.scope or None, expires_at=expires_at
        )
    expiry = response.expires_at.ToJsonString() if response.HasField("expires_at") else None
    _emit(
        args,
        {
            "api_key": response.api_key,
            "key_id": response.key_id,
            "tenant_id": response.tenant_id,
            "principal_id": response.principal_id,
            "scopes": list(response.scopes),
            "expires_at": expiry,
        },
        f"{response.api_key}\n(key {response.key_id} for {response.tenant_id}/"
        f"{response.principal_id}; shown once" + (f"; expires {expiry})" if expiry else ")"),
    )
    return 0


async def cmd_keys_revoke(args: argparse.Namespace) -> int:
    """Revoke an API key by its id."""
    async with _keys_client(args) as client:
        response = await client.revoke_key(args.key_id)
    what = "revoked" if response.revoked else "was already revoked"
    _emit(
        args,
        {"key_id": response.key_id, "revoked": response.revoked},
        f"key {response.key_id} {what}",
    )
    return 0


def _common(parser: argparse.ArgumentParser, *, top: bool) -> None:
    default = None if top else argparse.SUPPRESS
    parser.add_argument("--stack", default=default, help="path to <data-dir>/stack.json")
    parser.add_argument(
        "--json",
        action="store_true",
        default=False if top else argparse.SUPPRESS,
        help="one JSON object per line",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(prog="tether", description="Drive a Tether stack.")
    _common(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start the whole stack (embedded PostgreSQL and Redis)")
    up.add_argument("--data-dir", help="data folder (default TETHER_DATA_DIR or .tether)")
    _common(up, top=False)
    up.set_defaults(func=cmd_up)

    send = sub.add_parser("send", help="send a chat message; prints the run")
    send.add_argument("text")
    send.add_argument("--conversation", default="default", help="conversation id")
    send.add_argument("--event-id", help="idempotency key (default: a new unique id)")
    send.add_argument("--channel", default="", help="channel (default chat)")
    send.add_argument(
        "--priority",
        choices=list(PRIORITIES),
        default="",
        help="the run's order among the tenant's queued runs (default normal); the key needs "
        "runs:priority",
    )
    watch.add_follow_flag(send)
    _common(send, top=False)
    send.set_defaults(func=cmd_send)

    run = sub.add_parser("run", help="show one run (with --json, its parts too)")
    run.add_argument("run_id")
    run.add_argument(
        "--parts",
        type=_part_limit,
        metavar="N",
        help="with --json: only the last N parts (0: none; part_count still counts them all)",
    )
    run.add_argument(
        "--attempts",
        action="store_true",
        help="its attempts, lineage, stage durations and usage and cost by model turn",
    )
    run.add_argument(
        "--tree",
        action="store_true",
        help="its run tree from the root: each run its delegate calls started, with its status "
        "and spend (its own and its subtree's)",
    )
    operations.add_tenant_flag(run)
    _common(run, top=False)
    run.set_defaults(func=cmd_run)

    runs = sub.add_parser("runs", help="list runs, newest first")
    runs.add_argument("--limit", type=int, default=50)
    runs.add_argument("--conversation", help="only this conversation")
    runs.add_argument(
        "--status", action="append", type=_status, help="only runs in this status (repeatable)"
    )
    runs.add_argument(
        "--since", help="only runs created since: a time (2025-01-31T09:00:00Z) or an age (2h)"
    )
    operations.add_tenant_flag(runs)
    _common(runs, top=False)
    runs.set_defaults(func=cmd_runs)

    keys = sub.add_parser("keys", help="manage API keys")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    create = keys_sub.add_parser(
        "create", help="issue a key (a keys:admin key: its own tenant; --operator: any)"
    )
    create.add_argument("--tenant", default="", help="tenant (default: the caller's own)")
    create.add_argument("--principal", required=True)
    create.add_argument("--scope", action="append", help="scope (repeatable)")
    create.add_argument("--expires-in", type=float, help="seconds until the key expires")
    revoke = keys_sub.add_parser("revoke", help="revoke a key by its id")
    revoke.add_argument("key_id")
    for command, func in ((create, cmd_keys_create), (revoke, cmd_keys_revoke)):
        command.add_argument(
            "--operator",
            action="store_true",
            help="act as the platform operator (the stack's operator_credential or "
            "TETHER_OPERATOR_CREDENTIAL)",
        )
        _common(command, top=False)
        command.set_defaults(func=func)

    def wrap(command: Callable[[argparse.Namespace, Any], Awaitable[int]]) -> Command:
        async def run(args: argparse.Namespace) -> int:
            return await command(args, _emit)

        return run

    interactions.register(sub, lambda p: _common(p, top=False), wrap)
    docs.register(sub, lambda p: _common(p, top=False), wrap)
    secrets_cli.register(sub, lambda p: _common(p, top=False), wrap)
    channels_cli.register(sub, lambda p: _common(p, top=False), wrap)
    webhooks_cli.register(sub, lambda p: _common(p, top=False), wrap)
    schedules_cli.register(sub, lambda p: _common(p, top=False), wrap)
    watch.register(sub, lambda p: _common(p, top=False), wrap)
    operations.register(sub, lambda p: _common(p, top=False), wrap)
    agents.register(sub, lambda p: _common(p, top=False), wrap)
    tools.register(sub, lambda p: _common(p, top=False), wrap)
    return parser


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `tether` script."""
    args = build_parser().parse_args(argv)
    retries = logging.StreamHandler(sys.stderr)
    retries.setFormatter(logging.Formatter("%(message)s"))
    client_log = logging.getLogger("tether.client")
    client_log.addHandler(retries)
    client_log.setLevel(logging.INFO)
    try:
        code = asyncio.run(args.func(args))
    except grpc.aio.AioRpcError as exc:
        print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        code = 1
    except (ValueError, FileNotFoundError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        code = 130
    except BrokenPipeError:
        # Whoever read our output is gone (`tether runs | head -1`): stop without a word, as
        # Python's docs advise (signal, "Note on SIGPIPE"), and point stdout at devnull so the
        # interpreter's last flush at exit cannot fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = EPIPE_EXIT_CODE
    sys.exit(code)
