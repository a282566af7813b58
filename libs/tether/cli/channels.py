"""`tether channels add|list|show|rm|rotate-secret`: the tenant's channel connections (Slack,
WhatsApp, any system signing its webhooks). Secrets are read from files, sealed by the
interactions service and never printed: a read shows each secret's name and last four
characters at most.

`tether channels add slack --demo [--name N] [--api-base-url URL]` connects the local Slack
stand-in with its well-known demo signing secret and bot token (`tether.testing.slack_wire`), so
the demo needs no files; the stand-in's URL defaults to the one `tether up` wrote to stack.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
from pathlib import Path
from typing import Any

from google.protobuf import json_format

from tether.cli.secrets import _read
from tether.client import TetherClient
from tether.testing.slack_wire import DEMO_BOT_TOKEN, DEMO_SIGNING_SECRET
from tether.v1 import gateway_pb2, interactions_pb2

Emit = Any

_GRACE = re.compile(r"(\d+)([smhd])")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}

# Each kind's secret options and the ChannelSecrets field each fills.
_SECRET_FILES = {
    "slack": (("signing_secret_file", "signing_secret"), ("bot_token_file", "bot_token")),
    "whatsapp": (
        ("app_secret_file", "app_secret"),
        ("verify_token_file", "verify_token"),
        ("access_token_file", "access_token"),
    ),
    "webhook": (("secret_file", "secret"),),
}
_SETTINGS = {
    "slack": (),
    "whatsapp": ("phone_number_id",),
    "webhook": ("text_field", "thread_field", "sender_field", "event_id_field"),
}


DEMO_NAME = "demo-slack"
"""The demo Slack connection's name when `--demo` is given none (the one `tether up` creates)."""
STACK_SLACK_URL = "slack_api_url"
"""The stand-in's API URL in the stack.json `tether up` writes."""


def _client(args: argparse.Namespace) -> TetherClient:
    return TetherClient.from_env(getattr(args, "stack", None))


def _dict(message: Any) -> dict[str, Any]:
    data: dict[str, Any] = json_format.MessageToDict(message, preserving_proto_field_name=True)
    return data


def parse_grace(text: str) -> int:
    """Seconds of a duration such as 90s, 30m, 24h or 7d."""
    found = _GRACE.fullmatch(text.strip())
    if found is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration such as 30m, 24h or 7d")
    return int(found.group(1)) * _UNIT_SECONDS[found.group(2)]


def _summary(channel: interactions_pb2.ChannelInfo) -> str:
    hints = ", ".join(f"{s.name} …{s.last_four}" for s in channel.secrets)
    target = channel.api_base_url or channel.reply_url or "-"
    return f"{channel.channel_id}  {channel.kind:<8}  {channel.name}  {target}  [{hints}]"


def _stack_slack_url(stack: str | None) -> str:
    """The Slack stand-in's API URL named by the stack file, or ""."""
    if not stack or not Path(stack).is_file():
        return ""
    found = json.loads(Path(stack).read_text()).get(STACK_SLACK_URL)
    return found if isinstance(found, str) else ""


def _check_slack(args: argparse.Namespace) -> None:
    """`--demo` or both secret files, never both; a name without `--demo`. A usage error (exit
    code 2, with the usage) otherwise, before anything is read or sent."""
    files = [f"--{o.replace('_', '-')}" for o, _ in _SECRET_FILES["slack"] if getattr(args, o)]
    if args.demo:
        if files:
            args.usage_error(
                f"--demo uses the stand-in's demo signing secret and bot token: leave out "
                f"{' and '.join(files)}"
            )
        args.name = args.name or DEMO_NAME
        args.api_base_url = args.api_base_url or _stack_slack_url(getattr(args, "stack", None))
        if not args.api_base_url:
            args.usage_error(
                "--demo needs the Slack stand-in's URL: pass --api-base-url "
                "http://HOST:PORT/api/ or --stack with a stack.json from `tether up`"
            )
        return
    if len(files) < len(_SECRET_FILES["slack"]):
        args.usage_error("give --signing-secret-file and --bot-token-file, or --demo")
    if not args.name:
        args.usage_error("--name is required (without --demo)")


async def _secrets(args: argparse.Namespace) -> interactions_pb2.ChannelSecrets:
    if args.kind == "slack" and args.demo:
        return interactions_pb2.ChannelSecrets(
            signing_secret=DEMO_SIGNING_SECRET, bot_token=DEMO_BOT_TOKEN
        )
    secrets = interactions_pb2.ChannelSecrets()
    for option, field in _SECRET_FILES[args.kind]:
        setattr(secrets, field, await asyncio.to_thread(_read, getattr(args, option)))
    return secrets


async def cmd_add(args: argparse.Namespace, emit: Emit) -> int:
    """Connect a channel of the kind named; its secrets are read from the files given (or, for
    `slack --demo`, are the stand-in's demo ones)."""
    if args.kind == "slack":
        _check_slack(args)
    secrets = await _secrets(args)
    settings = interactions_pb2.ChannelSettings(
        **{name: getattr(args, name) for name in _SETTINGS[args.kind]}
    )
    request = gateway_pb2.AddChannelRequest(
        kind=args.kind,
        name=args.name,
        agent=args.agent or "",
        api_base_url=getattr(args, "api_base_url", None) or "",
        reply_url=getattr(args, "reply_url", None) or "",
        secrets=secrets,
        settings=settings,
    )
    async with _client(args) as client:
        added = await client.add_channel(request)
    emit(
        args,
        {"channel_id": added.channel_id, "webhook_url": added.webhook_url},
        f"channel {added.channel_id} added; give the provider {added.webhook_url}",
    )
    return 0


async def cmd_list(args: argparse.Namespace, emit: Emit) -> int:
    """List the tenant's channel connections by name."""
    async with _client(args) as client:
        listed = await client.list_channels()
    for channel in listed.channels:
        emit(args, _dict(channel), _summary(channel))
    return 0


async def cmd_show(args: argparse.Namespace, emit: Emit) -> int:
    """Show one channel connection and its webhook URL."""
    async with _client(args) as client:
        found = await client.get_channel(args.channel_id)
    shown = _dict(found.channel) | {"webhook_url": found.webhook_url}
    emit(args, shown, f"{_summary(found.channel)}\nwebhook_url: {found.webhook_url}")
    return 0


async def cmd_rm(args: argparse.Namespace, emit: Emit) -> int:
    """Remove a channel connection by its id."""
    async with _client(args) as client:
        removed = await client.remove_channel(args.channel_id)
    emit(args, {"channel_id": removed.channel_id, "removed": True}, "removed")
    return 0


async def cmd_rotate(args: argparse.Namespace, emit: Emit) -> int:
    """Replace the verification secret; the old one still verifies during the grace."""
    secret = await asyncio.to_thread(_read, args.file)
    async with _client(args) as client:
        rotated = await client.rotate_channel_secret(args.channel_id, secret, args.grace)
    channel = rotated.channel
    until = channel.previous_secret_expires_at.ToDatetime().isoformat(timespec="seconds")
    emit(args, _dict(channel), f"rotated; the previous secret verifies until {until}Z")
    return 0


def _add_parsers(channels_sub: Any) -> list[Any]:
    add = channels_sub.add_parser("add", help="connect a channel (secrets read from files)")
    kinds = add.add_subparsers(dest="kind", required=True)
    slack = kinds.add_parser("slack", help="a Slack app (Events API)")
    slack.add_argument("--signing-secret-file", help="required without --demo")
    slack.add_argument("--bot-token-file", help="required without --demo")
    slack.add_argument(
        "--demo",
        action="store_true",
        help="the local Slack stand-in's demo secrets (no files); name default " + DEMO_NAME,
    )
    slack.set_defaults(usage_error=slack.error)
    whatsapp = kinds.add_parser("whatsapp", help="a WhatsApp Cloud API number")
    whatsapp.add_argument("--app-secret-file", required=True)
    whatsapp.add_argument("--verify-token-file", required=True)
    whatsapp.add_argument("--access-token-file", required=True)
    whatsapp.add_argument("--phone-number-id", required=True)
    webhook = kinds.add_parser("webhook", help="any system signing Standard Webhooks")
    webhook.add_argument("--secret-file", required=True)
    for name in _SETTINGS["webhook"]:
        flag = "--" + name.replace("_", "-")
        webhook.add_argument(flag, required=True, help="a JSON pointer into the body, e.g. /text")
    webhook.add_argument("--reply-url", help="where replies are posted")
    for parser in (slack, whatsapp):
        parser.add_argument("--api-base-url", help="the provider's API (default its real one)")
    slack.add_argument("--name", help="required without --demo")
    for parser in (whatsapp, webhook):
        parser.add_argument("--name", required=True)
    for parser in (slack, whatsapp, webhook):
        parser.add_argument("--agent", help="the agent it routes to (default: the routes)")
    return [slack, whatsapp, webhook]


def register(sub: Any, common: Any, wrap: Any) -> None:
    """Add `channels` and its commands to the CLI's subparsers."""
    channels = sub.add_parser("channels", help="channel connections (secrets never shown)")
    channels_sub = channels.add_subparsers(dest="channels_command", required=True)
    adders = _add_parsers(channels_sub)
    listed = channels_sub.add_parser("list", help="list channel connections")
    show = channels_sub.add_parser("show", help="show one channel connection")
    show.add_argument("channel_id")
    rm = channels_sub.add_parser("rm", help="remove a channel connection")
    rm.add_argument("channel_id")
    rotate = channels_sub.add_parser("rotate-secret", help="replace the verification secret")
    rotate.add_argument("channel_id")
    rotate.add_argument("--file", required=True, help="the new secret, or - for standard input")
    rotate.add_argument(
        "--grace", type=parse_grace, help="how long the old secret still verifies (default 24h)"
    )
    for command in adders:
        common(command)
        command.set_defaults(func=wrap(cmd_add))
    for command, func in ((listed, cmd_list), (show, cmd_show), (rm, cmd_rm), (rotate, cmd_rotate)):
        common(command)
        command.set_defaults(func=wrap(func))
