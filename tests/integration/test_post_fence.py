"""A channel answer's post whose lease lapses while the post is on its way to being written (the
sender's own work, the name's resolution, the connect) is never written: the delivery's session
checks `posting_before` once its connection is had, right before the request goes out. The
drill found the double post this prevents: a worker SIGSTOPped in that window woke after the
attempt that took its run over had looked, found nothing and posted, and posted too.

The stall is a hook of aiohttp's own (the session's, before the fence) that waits past the
deadline, as a process frozen there would; Slack is the local stand-in, called through the real
`slack_sdk` client and a real connection."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from services.worker.senders import Sending, delivery_session, posting_before, sender_for
from tether.domain import ReplyTarget
from tether.errors import StaleLease
from tether.targets import TargetPolicy
from tether.testing.slack_server import SlackServer

pytestmark = pytest.mark.asyncio(loop_scope="session")

CHANNEL = "C0FENCE"
STALL_S = 0.3
LOOPBACK = TargetPolicy.parse("loopback")


@pytest_asyncio.fixture(loop_scope="session")
async def slack() -> AsyncIterator[SlackServer]:
    server = SlackServer()
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


def _stall() -> aiohttp.TraceConfig:
    stall = aiohttp.TraceConfig()

    async def stalled(*_: Any) -> None:
        await asyncio.sleep(STALL_S)

    stall.on_connection_create_start.append(stalled)
    return stall


async def _post(slack: SlackServer, deadline: datetime) -> str:
    sending = Sending("slack", slack.api_url, "", {}, slack.bot_token.encode(), b"")
    target = ReplyTarget("ch_fence", "slack", CHANNEL)
    async with delivery_session(LOOPBACK, (_stall(),)) as session:
        sender = sender_for(sending, target, session, status=_no_status, reconcile_s=0)
        with posting_before(deadline):
            return await sender.send("dlv_fence", "The one answer.")


async def _no_status(callback_data: str) -> str | None:
    return None


async def test_a_post_stalled_past_its_deadline_before_its_request_is_written_is_never_made(
    slack: SlackServer,
) -> None:
    deadline = datetime.now(UTC) + timedelta(seconds=STALL_S / 3)
    with pytest.raises(StaleLease, match="too late to write it"):
        await _post(slack, deadline)
    assert slack.posts(CHANNEL) == []
    assert not [c for c in slack.calls if c.method == "chat.postMessage"]


async def test_a_post_whose_stall_ends_before_its_deadline_is_made_once(
    slack: SlackServer,
) -> None:
    ts = await _post(slack, datetime.now(UTC) + timedelta(seconds=30))
    assert [(m.ts, m.text) for m in slack.posts(CHANNEL)] == [(ts, "The one answer.")]
