"""The outbound-target rule over real sockets: a receiver on loopback, reached only when the
policy allows it, checked again when connecting (a name, an IP literal, a redirect's hop)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web

from tether.errors import InvalidArgument
from tether.targets import TargetPolicy, check_url, refused_target, target_session

NONE = TargetPolicy.parse("")
LOOPBACK = TargetPolicy.parse("loopback")


@dataclass
class Receiver:
    """A loopback HTTP server that counts the requests that reached it."""

    port: int
    hits: list[str] = field(default_factory=list)


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    hits: list[str] = []

    async def hook(request: web.Request) -> web.Response:
        hits.append(request.path)
        return web.Response(text="reached")

    async def redirect(request: web.Request) -> web.Response:
        hits.append(request.path)
        raise web.HTTPFound(request.query["to"])

    app = web.Application()
    app.router.add_get("/hook", hook)
    app.router.add_get("/redirect", redirect)
    runner = web.AppRunner(app)
    await runner.setup()
    # Both loopbacks, so ::1 and ::ffff:127.0.0.1 would reach it were they not refused.
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    await web.TCPSite(runner, "::1", port).start()
    try:
        yield Receiver(port, hits)
    finally:
        await runner.cleanup()


async def get(policy: TargetPolicy, url: str) -> str:
    async with target_session(policy) as session, session.get(url) as response:
        response.raise_for_status()
        return await response.text()


async def refused(policy: TargetPolicy, url: str) -> str:
    """The refusal's reason for a GET of `url`; fails the test if anything else happens."""
    with pytest.raises(aiohttp.ClientError) as failed:
        await get(policy, url)
    found = refused_target(failed.value)
    assert found is not None, f"not refused by the policy: {failed.value!r}"
    return found.reason


async def test_a_loopback_receiver_is_refused_by_default_and_reached_when_allowed(
    receiver: Receiver,
) -> None:
    url = f"http://127.0.0.1:{receiver.port}/hook"
    with pytest.raises(InvalidArgument, match=r"loopback address.*TETHER_ALLOW_PRIVATE_TARGETS"):
        await check_url(url, NONE)
    assert "loopback" in await refused(NONE, url)
    assert receiver.hits == []
    assert await check_url(url, LOOPBACK) == url
    assert await get(LOOPBACK, url) == "reached"
    assert receiver.hits == ["/hook"]


async def test_a_name_accepted_earlier_is_refused_when_it_resolves_to_loopback_at_connect_time(
    receiver: Receiver,
) -> None:
    # Accepted while loopback was allowed; the policy is then tightened. The connection is
    # judged by what `localhost` resolves to when connecting, not by the earlier check.
    url = f"http://localhost:{receiver.port}/hook"
    assert await check_url(url, LOOPBACK) == url
    assert await get(LOOPBACK, url) == "reached"
    reason = await refused(NONE, url)
    assert "127.0.0.1 is a loopback address" in reason
    assert receiver.hits == ["/hook"]
    with pytest.raises(
        InvalidArgument, match=r"localhost resolves to 127\.0\.0\.1: 127\.0\.0\.1 is a loopback"
    ):
        await check_url(url, NONE)


@pytest.mark.parametrize("host", ["[::1]", "[::ffff:127.0.0.1]"])
async def test_ipv6_loopback_literals_are_refused_at_connect_time(
    receiver: Receiver, host: str
) -> None:
    url = f"http://{host}:{receiver.port}/hook"
    assert "loopback" in await refused(NONE, url)
    assert "loopback" in await refused(TargetPolicy.parse("private,link-local"), url)
    assert receiver.hits == []
    assert await get(LOOPBACK, url) == "reached"


async def test_the_metadata_endpoint_is_refused_before_any_packet() -> None:
    url = "http://169.254.169.254/latest/meta-data/"
    for policy in (NONE, TargetPolicy.parse("loopback,private")):
        with pytest.raises(InvalidArgument, match="link-local"):
            await check_url(url, policy)
        assert "link-local" in await refused(policy, url)


@pytest.mark.parametrize(
    "target", ["http://169.254.169.254/latest/meta-data/", "http://10.0.0.1/", "http://[fd00::1]/"]
)
async def test_a_redirect_to_a_forbidden_target_is_refused_at_its_hop(
    receiver: Receiver, target: str
) -> None:
    start = f"http://127.0.0.1:{receiver.port}/redirect"
    # Control: a redirect to an allowed target is followed, so the refusal below is the rule's.
    allowed = f"http://127.0.0.1:{receiver.port}/hook"
    async with target_session(LOOPBACK) as session:
        async with session.get(start, params={"to": allowed}) as response:
            assert await response.text() == "reached"
        with pytest.raises(aiohttp.ClientError) as failed:
            async with session.get(start, params={"to": target}):
                pass
    assert refused_target(failed.value) is not None, repr(failed.value)
    assert receiver.hits == ["/redirect", "/hook", "/redirect"]
