"""Where a channel run's answer goes, and the stored form of where its message came from.

A message a verified channel connection delivered is stored with its `ChannelOrigin`
(`messages.channel_origin`): the `ReplyTarget` its answer goes to and the agent the connection
routes to. Both come from the verified webhook, never from a request body. The stored JSON
records its format (`v`); this release writes `ORIGIN_FORMAT` and refuses a newer one or a field
it does not know, as `tether.formats` does for every stored payload.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tether.errors import StoredFormatTooNew

ORIGIN_FORMAT = 1
CHANNEL_PRINCIPAL_PREFIX = "channel:"
"""A channel connection's runs belong to the principal `channel:<channel_id>`; no API key is
issued to a principal so named."""
PIN_SEPARATOR = "/"
"""Joins a channel and the agent its runs are pinned to into the channel a run is routed by
(`slack/support`): channels and agent names are identifiers, which never hold a `/`."""
_REPLY_FIELDS = frozenset({"channel_id", "kind", "address", "thread", "reply_to"})
_ORIGIN_FIELDS = frozenset({"v", "reply", "agent"})


def channel_principal(channel_id: str) -> str:
    """The principal a channel connection's runs belong to."""
    return CHANNEL_PRINCIPAL_PREFIX + channel_id


@dataclass(frozen=True, slots=True)
class ReplyTarget:
    """Where an answer goes: the connection, the provider's address (Slack channel, WhatsApp
    sender, the webhook's thread), the thread within it (Slack's thread_ts) and the provider's
    id of the message answered."""

    channel_id: str
    kind: str
    address: str
    thread: str = ""
    reply_to: str = ""


@dataclass(frozen=True, slots=True)
class ChannelOrigin:
    """A channel message's origin: where its answer goes, and the agent its connection routes
    to ("" for the tenant's routes)."""

    reply: ReplyTarget
    agent: str = ""


def pinned_channel(channel: str, agent: str) -> str:
    """The channel a run of `channel` pinned to `agent` is routed by."""
    return f"{channel}{PIN_SEPARATOR}{agent}"


def origin_to_json(origin: ChannelOrigin) -> dict[str, Any]:
    """The stored form."""
    reply = origin.reply
    return {
        "v": ORIGIN_FORMAT,
        "reply": {
            "channel_id": reply.channel_id,
            "kind": reply.kind,
            "address": reply.address,
            "thread": reply.thread,
            "reply_to": reply.reply_to,
        },
        "agent": origin.agent,
    }


def origin_from_json(stored: Mapping[str, Any] | None) -> ChannelOrigin | None:
    """The origin a stored form records (None for a message that came through no channel)."""
    if stored is None:
        return None
    version = stored.get("v")
    unknown = (set(stored) - _ORIGIN_FIELDS) | (set(stored.get("reply", {})) - _REPLY_FIELDS)
    if version != ORIGIN_FORMAT or unknown:
        raise StoredFormatTooNew(
            f"a channel origin is stored in format {version} with fields {sorted(unknown)}; "
            f"this release reads format {ORIGIN_FORMAT}",
            details={"format": version, "readable": [ORIGIN_FORMAT]},
        )
    reply = stored["reply"]
    return ChannelOrigin(
        ReplyTarget(
            reply["channel_id"],
            reply["kind"],
            reply["address"],
            reply.get("thread", ""),
            reply.get("reply_to", ""),
        ),
        stored.get("agent", ""),
    )
