"""The soak's channel traffic: people writing in Slack, as the local Slack stand-in delivers
their messages to each tenant's Slack connection (signed, through a random gateway replica,
some delivered twice as Slack's retries are), and the agent's answer going back out to the
stand-in's thread. What the senders saw is kept for the checker, which then reads the threads:
every admitted channel event answered at most once, and no delivery left without an outcome."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
import uuid
from dataclasses import dataclass, field

from tests.drill.infra import World
from tether.testing.model_script import TextTurn
from tether.testing.slack_push import Pushed, WebhookTarget, push

log = logging.getLogger("drill.channels")

# A provider retries a delivery it got no 2xx for; Slack gives up after three retries within
# an hour. The soak retries through an outage until this long after the first try.
RETRY_FOR_S = 30.0
PEOPLE_PER_TENANT = 2


@dataclass
class ChannelObservations:
    """What the senders saw: each Slack event id with the run ids its deliveries were answered
    with (first delivery and Slack-style retries), and where each message lives in Slack."""

    runs_by_event: dict[str, set[str]] = field(default_factory=dict)
    threads: dict[str, tuple[str, str]] = field(default_factory=dict)  # event id -> (C, ts)
    sent: int = 0
    redelivered: int = 0
    refused: dict[int, int] = field(default_factory=dict)


class ChannelLoad:
    """People writing to each tenant's Slack connection until `run`'s deadline."""

    def __init__(self, world: World, rng: random.Random, obs: ChannelObservations) -> None:
        self._world = world
        self._rng = rng
        self._obs = obs

    async def run(self, until: float) -> None:
        """A sender per person per tenant, until `until` (monotonic)."""
        await asyncio.gather(
            *(
                self._person(index, person, random.Random(self._rng.random()), until)
                for index in range(len(self._world.tenants))
                for person in range(PEOPLE_PER_TENANT)
            )
        )

    async def _person(self, index: int, person: int, rng: random.Random, until: float) -> None:
        connection = self._world.slack_connections[self._world.tenants[index].tenant_id]
        channel = f"C{index:03d}"
        while time.monotonic() < until:
            tag = uuid.uuid4().hex[:12]
            text = f"drill channel {tag}"
            # The model server keys a conversation by its first text: the thread's own message.
            self._world.model.script(text, [TextTurn(f"answer {tag}")])
            body = self._world.slack.user_message(channel, f"U{person}", text)
            event_id = str(body["event_id"])
            self._obs.threads[event_id] = (channel, str(body["event"]["ts"]))
            self._obs.sent += 1
            retries = [self._deliver(connection, event_id, body, rng)]
            if rng.random() < 0.3:  # Slack's retry of a delivery it timed out on
                self._obs.redelivered += 1
                retries.append(self._deliver(connection, event_id, body, rng))
            await asyncio.gather(*retries)
            await asyncio.sleep(rng.uniform(0.2, 0.8))  # a person's pace, not synchronisation

    async def _deliver(
        self,
        connection: tuple[str, str],
        event_id: str,
        body: dict[str, object],
        rng: random.Random,
    ) -> None:
        channel_id, signing_secret = connection
        give_up = time.monotonic() + RETRY_FOR_S
        delay = 0.2
        while True:
            address = rng.choice(self._world.gateway_http())
            url = f"http://{address}/v2/webhooks/slack/{channel_id}"
            answer: Pushed = await push(WebhookTarget(url, signing_secret), body)
            if answer.status == 200:
                run_id = json.loads(answer.text).get("run_id")
                if run_id:
                    self._obs.runs_by_event.setdefault(event_id, set()).add(run_id)
                return
            self._obs.refused[answer.status] = self._obs.refused.get(answer.status, 0) + 1
            if time.monotonic() + delay > give_up:
                log.warning("channel event %s not admitted: answered %d", event_id, answer.status)
                return
            await asyncio.sleep(delay)  # backoff against an outage, as a provider's retry
            delay = min(delay * 2, 2.0)
