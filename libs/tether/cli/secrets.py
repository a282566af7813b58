"""`tether secrets add|list|rm`: the tenant's named secrets, sealed by the interactions service.
Nothing here prints a value: a name, its last four characters and when it was stored."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

from google.protobuf import json_format

from tether.client import TetherClient

Emit = Any


def _client(args: argparse.Namespace) -> TetherClient:
    return TetherClient.from_env(getattr(args, "stack", None))


def _read(file: str) -> str:
    """The file's text; a single trailing newline (what an editor or `echo` adds) is no part of
    a token."""
    text = sys.stdin.read() if file == "-" else Path(file).read_text(encoding="utf-8")
    return text.removesuffix("\n").removesuffix("\r")


def _info(message: Any) -> dict[str, Any]:
    data: dict[str, Any] = json_format.MessageToDict(message, preserving_proto_field_name=True)
    return data


async def cmd_add(args: argparse.Namespace, emit: Emit) -> int:
    """Seal the text of FILE ('-' reads standard input) as the secret NAME."""
    value = await asyncio.to_thread(_read, args.file)
    async with _client(args) as client:
        response = await client.add_secret(args.name, value)
    secret = response.secret
    emit(args, _info(secret), f"secret {secret.name} (…{secret.last_four}) stored")
    return 0


async def cmd_list(args: argparse.Namespace, emit: Emit) -> int:
    """List the tenant's secrets by name."""
    async with _client(args) as client:
        listed = await client.list_secrets()
    for secret in listed.secrets:
        created = secret.created_at.ToDatetime().isoformat(timespec="seconds")
        emit(args, _info(secret), f"{secret.name}  …{secret.last_four:<4}  {created}")
    return 0


async def cmd_rm(args: argparse.Namespace, emit: Emit) -> int:
    """Remove a secret by its name."""
    async with _client(args) as client:
        response = await client.remove_secret(args.name)
    emit(args, {"name": response.name, "removed": True}, "removed")
    return 0


def register(sub: Any, common: Any, wrap: Any) -> None:
    """Add `secrets` and its commands to the CLI's subparsers."""
    secrets = sub.add_parser("secrets", help="the tenant's named secrets (values never shown)")
    secrets_sub = secrets.add_subparsers(dest="secrets_command", required=True)
    add = secrets_sub.add_parser("add", help="seal a secret (at most 64 KiB; names are unique)")
    add.add_argument("name")
    add.add_argument(
        "--file", required=True, help="a UTF-8 file holding the value, or - for standard input"
    )
    listed = secrets_sub.add_parser("list", help="list secrets by name, never their values")
    rm = secrets_sub.add_parser("rm", help="remove a secret")
    rm.add_argument("name")
    for command, func in ((add, cmd_add), (listed, cmd_list), (rm, cmd_rm)):
        common(command)
        command.set_defaults(func=wrap(func))
