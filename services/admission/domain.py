"""The normalised inbound event and the rules that identify it."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from tether.domain.channels import ChannelOrigin
from tether.priorities import NORMAL, PRIORITIES
from tether.visibility import Visibility

INBOUND_SCOPE = "inbound"


class ConversationKind(StrEnum):
    """What kind of conversation an event joins: the first part of its session's actor scope,
    so one principal's chat, provider thread and task with the same id stay apart."""

    CHAT = "principal"  # the form chat sessions were always stored in
    THREAD = "thread"
    TASK = "task"
    SCHEDULE = "schedule"


@dataclass(frozen=True)
class InboundEvent:
    """One admitted event, whatever adapter it came through.

    `tenant_id` and `principal_id` are the authenticated caller's; the payload never chooses them.
    The run belongs to `principal_id` (its grants and connections, who sees it); the actor is who
    the event says spoke (a webhook's sender), context for the agent and never a principal.
    The session is identified by (tenant, channel, conversation, actor scope), and the actor
    scope names `principal_id`: an external thread or task id is a correlation value, so two
    tenants, or two principals of one tenant, naming the same one never share a conversation,
    its history or its allow-conversation grants.
    """

    tenant_id: str
    principal_id: str
    source: str
    event_id: str
    idempotency_key: str
    actor_type: str
    actor_id: str
    conversation_kind: ConversationKind
    channel: str
    conversation_id: str
    text: str
    context: dict[str, Any] = field(default_factory=dict)
    idempotency_scope: str = INBOUND_SCOPE
    # Who besides runs:all keys sees the run (tether.visibility.Visibility).
    visibility: Visibility = Visibility.PRIVATE
    # Where the answer goes, for a message a verified channel connection delivered.
    channel_origin: ChannelOrigin | None = None
    # Its order within its tenant's queued runs (tether.priorities: the stored rank).
    priority: int = PRIORITIES[NORMAL]

    @property
    def actor_scope(self) -> str:
        """Whose conversation the session is, e.g. `thread:alice`: built here, from the
        authenticated principal, so no adapter can leave the principal out."""
        return f"{self.conversation_kind.value}:{self.principal_id}"

    def request_hash(self) -> bytes:
        """SHA-256 of what the event says (not how it was delivered).

        Same key with a different hash is a conflict, never a replay.
        """
        content = {
            "source": self.source,
            "channel": self.channel,
            "conversation_id": self.conversation_id,
            "actor_type": self.actor_type,
            "actor_id": self.actor_id,
            "text": self.text,
            "context": self.context,
        }
        canonical = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return hashlib.sha256(canonical.encode()).digest()


@dataclass(frozen=True)
class FreshnessPolicy:
    """What to do with a duplicate of a completed event.

    Inside `replay_window_s` the stored outcome is replayed. Outside it, `stale` decides: "refuse"
    (FAILED_PRECONDITION: an old answer is never replayed into a new conversation turn) or
    "reprocess" (a fresh run with lineage to the old one).
    """

    replay_window_s: float = 86_400.0
    stale: str = "refuse"
