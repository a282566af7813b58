"""The gateway's event hub on the shared subscription, against the real Redis: a followed run's
events reach its feed, a lost connection makes every feed re-read PostgreSQL, and a run's
subscription lingers after its last feed, then goes."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as redis

from services.gateway.live.hub import EventHub, Feed, LiveEvent, RunsWatch, Signal
from tether.hints import Audience, LiveMessage, encode_events, events_channel
from tether.runtime.tasks import Supervisor
from tether.testing.eventually import eventually
from tether.visibility import Viewer

pytestmark = pytest.mark.asyncio(loop_scope="session")

WAIT_S = 10.0


@pytest.fixture
async def admin(redis_url: str) -> AsyncIterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
async def supervisor() -> AsyncIterator[Supervisor]:
    running = Supervisor()
    yield running
    assert not running.failed.is_set(), "the hub's connection died"
    await running.stop()


async def started(hub: EventHub, supervisor: Supervisor) -> None:
    hub.start(supervisor)
    probe = hub.open(deltas=False)
    # The first connection's confirmation tells every feed to re-read PostgreSQL.
    assert await probe.next(WAIT_S) is Signal.RESYNC
    hub.close(probe)


async def next_item(feed: Feed) -> LiveEvent | Signal | None:
    return await feed.next(WAIT_S)


async def test_a_followed_run_streams_and_a_lost_connection_resyncs_its_feed(
    redis_url: str, admin: redis.Redis, supervisor: Supervisor
) -> None:
    run_id = f"run_{uuid.uuid4().hex}"
    hub = EventHub(redis_url, ping_interval_s=0.2)
    try:
        await started(hub, supervisor)
        feed = hub.open(deltas=False)
        assert await hub.follow(feed, run_id) is True
        assert hub.is_live(run_id)
        await admin.publish(
            events_channel(run_id), encode_events([LiveMessage(run_id, 1, "x", {})])
        )
        item = await next_item(feed)
        assert isinstance(item, LiveEvent) and (item.run_id, item.seq) == (run_id, 1)

        [hub_connection] = [
            client["id"]
            for client in await admin.client_list(_type="pubsub")
            if client["name"] == "event-hub"
        ]
        await admin.client_kill_filter(_id=hub_connection)
        assert await next_item(feed) is Signal.RESYNC, "what is published now is lost"

        async def live_again() -> bool:
            return hub.is_live(run_id)

        await eventually(live_again, what="the hub to resubscribe")
        await admin.publish(
            events_channel(run_id), encode_events([LiveMessage(run_id, 2, "x", {})])
        )
        # The RESYNC of the new connection may have merged with the first, or be waiting still.
        item = await next_item(feed)
        while item is Signal.RESYNC:
            item = await next_item(feed)
        assert isinstance(item, LiveEvent) and item.seq == 2
    finally:
        await hub.stop()


async def test_a_run_stays_subscribed_for_the_linger_after_its_last_feed(
    redis_url: str, admin: redis.Redis, supervisor: Supervisor
) -> None:
    run_id = f"run_{uuid.uuid4().hex}"
    channel = events_channel(run_id)
    hub = EventHub(redis_url, linger_s=2.0)
    try:
        await started(hub, supervisor)
        first = hub.open(deltas=False)
        assert await hub.follow(first, run_id) is True
        hub.close(first)
        # A refreshing client within the linger finds the run live without a new SUBSCRIBE.
        assert await admin.pubsub_numsub(channel) == [(channel.encode(), 1)]
        assert hub.is_live(run_id)
        second = hub.open(deltas=False)
        assert await hub.follow(second, run_id) is True
        hub.unfollow(second, run_id)

        async def dropped() -> bool:
            [(_, subscribers)] = await admin.pubsub_numsub(channel)
            return subscribers == 0 and not hub.is_live(run_id)

        await eventually(dropped, what="the linger to end the subscription")
    finally:
        await hub.stop()


async def test_a_live_list_wakes_only_for_runs_its_caller_may_see(
    redis_url: str, admin: redis.Redis, supervisor: Supervisor
) -> None:
    """A live list re-reads its page when woken, so a run it cannot show must not wake it: one
    tenant's runs would otherwise make every open list of every tenant re-read. A message from
    a publisher that does not say whose run it is (the release before) wakes every list."""
    tenant, other = f"ten_{uuid.uuid4().hex}", f"ten_{uuid.uuid4().hex}"
    hub = EventHub(redis_url, ping_interval_s=0.2)
    watches = {
        "whole tenant": hub.watch_runs(Viewer(tenant, "admin", all_runs=True)),
        "alice": hub.watch_runs(Viewer(tenant, "alice")),
        "other tenant": hub.watch_runs(Viewer(other, "bob", all_runs=True)),
    }
    try:
        await started(hub, supervisor)
        assert await hub.hear_every_run()
        runs = {
            "alice's": Audience(tenant, "alice"),
            "carol's": Audience(tenant, "carol"),
            "bob's": Audience(other, "bob"),
            "unowned": Audience(tenant, ""),
            "unsaid": None,  # published last: once it is heard, every message before it was
        }
        for name, audience in runs.items():
            message = LiveMessage(name, 1, "run.started", {}, audience=audience)
            await admin.publish(events_channel(name), encode_events([message]))

        async def woken_by(watch: RunsWatch) -> set[str]:
            heard: set[str] = set()
            while "unsaid" not in heard:
                woken = await watch.next(WAIT_S)
                assert woken is not None, f"heard only {sorted(heard)}"
                heard |= woken[0]
            return heard

        assert await woken_by(watches["whole tenant"]) == {
            "alice's",
            "carol's",
            "unowned",
            "unsaid",
        }
        assert await woken_by(watches["alice"]) == {"alice's", "unsaid"}
        assert await woken_by(watches["other tenant"]) == {"bob's", "unsaid"}
    finally:
        for watch in watches.values():
            hub.unwatch_runs(watch)
        await hub.stop()
