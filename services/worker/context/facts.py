"""The built-in live facts (entry points `tether.facts` in pyproject.toml): the conversation's
channel, who sent the message, and the time in the tenant's zone. Each is computed from what the
lease carries, so none costs a round trip."""

from __future__ import annotations

from zoneinfo import ZoneInfo

from services.worker.context.providers import FactRequest


class ChannelFact:
    """Where the conversation happens: its channel, and the kind of source it came from.
    Required: the agent's manners depend on it (a WhatsApp guest is not a chat user)."""

    name = "channel"
    required = True
    deadline_s = 0.5

    async def fact(self, request: FactRequest) -> str | None:
        """`whatsapp (messaging)`."""
        if not request.channel:
            return None
        return f"{request.channel} ({request.source})" if request.source else request.channel


class ActorFact:
    """Who sent the message: its name as the channel gives it (the principal for a chat, the
    sender id for a messaging provider), and what kind of actor it is. Optional: a run can be
    answered without it."""

    name = "actor"
    required = False
    deadline_s = 0.5

    async def fact(self, request: FactRequest) -> str | None:
        """`guest-1 (guest)`."""
        if not request.actor_id:
            return None
        kind = f" ({request.actor_type})" if request.actor_type else ""
        return f"{request.actor_id}{kind}"


class TimeFact:
    """The current time in the tenant's zone, to the minute (finer would only change the
    request more often). Required: the agent must not guess the date."""

    name = "time"
    required = True
    deadline_s = 0.5

    async def fact(self, request: FactRequest) -> str | None:
        """`2026-12-01 14:03 Tuesday, Europe/Paris (UTC+01:00)`."""
        local = request.now.astimezone(ZoneInfo(request.timezone or "UTC"))
        offset = local.strftime("%z")
        return (
            f"{local:%Y-%m-%d %H:%M %A}, {request.timezone or 'UTC'} (UTC{offset[:3]}:{offset[3:]})"
        )


channel = ChannelFact()
actor = ActorFact()
time = TimeFact()
