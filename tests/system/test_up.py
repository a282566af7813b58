"""`tether up` as a new user runs it: embedded PostgreSQL and Redis, ready line, Ctrl-C, restart."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import aiohttp
import psutil
import pytest
import yaml

from tests.system.up_support import UpProcess
from tether.client import TetherClient, run_to_dict
from tether.stack.up import EXAMPLE_AGENTS
from tether.testing.eventually import eventually
from tether.testing.slack_wire import DEMO_BOT_TOKEN, DEMO_SIGNING_SECRET

# `make slow`: the whole `tether up` three times, under a minute.
pytestmark = pytest.mark.slow


async def listed_agents(stack_file: str) -> list[tuple[str, int, bool]]:
    """`tether agents list --json` as the dev key: (name, published version, default) each."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tether.cli",
        "agents",
        "list",
        "--json",
        "--stack",
        stack_file,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, err.decode()
    rows = [json.loads(line) for line in out.decode().splitlines()]
    return [(r["name"], r["published_version"], r["default"]) for r in rows]


async def demo_channels(stack_file: str) -> list[tuple[str, str, str]]:
    """The dev tenant's connections named demo-slack: (id, API base URL, webhook URL) each."""
    async with TetherClient.from_env(stack_file) as client:
        listed = (await client.list_channels()).channels
        found = [c for c in listed if c.name == "demo-slack"]
        hints = [{s.name: s.last_four for s in c.secrets} for c in found]
        assert hints == [
            {"signing_secret": DEMO_SIGNING_SECRET[-4:], "bot_token": DEMO_BOT_TOKEN[-4:]}
        ] * len(found), "the stand-in's demo secrets"
        shown = [await client.get_channel(c.channel_id) for c in found]
    pairs = zip(found, shown, strict=True)
    return [(c.channel_id, c.api_base_url, s.webhook_url) for c, s in pairs]


async def slack_webhook(up: UpProcess) -> str | None:
    """Where the running Slack stand-in delivers a person's messages."""
    base = up.info()["slack_api_url"].removesuffix("/api/")
    async with aiohttp.ClientSession(base) as control, control.get("/_webhook") as answer:
        assert answer.status == 200
        url: str | None = (await answer.json())["url"]
        return url


async def test_up_serves_a_run_stops_cleanly_and_keeps_data_on_restart(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    up = UpProcess(data_dir)
    gateway = await up.ready()
    try:
        info = json.loads((data_dir / "stack.json").read_text())
        assert info["gateway"] == gateway
        assert info["http"].startswith("127.0.0.1:"), "stack.json names the HTTP bridge"
        assert info["tenant_id"] and info["api_key"].startswith("tk_")
        console = f"http://{info['http']}/console"
        assert f"console: {console}\n" in up.output, "the console's URL on the terminal"
        assert info["api_key"] in up.output, "and the dev key"
        (interactions,) = up.children("services.interactions")
        redirect = interactions.environ()["TETHER_INTERACTIONS_OAUTH_REDIRECT_URI"]
        assert redirect == f"{console}/connected", "a login comes back to the console"
        (worker, *_) = up.children("services.worker")
        for service in (interactions, worker):
            assert service.environ()["TETHER_ALLOW_PRIVATE_TARGETS"] == "loopback", (
                "the stand-ins on loopback are allowed targets"
            )
        async with TetherClient.from_env(str(data_dir / "stack.json")) as client:
            sent = await client.send("hello", conversation_id="first", event_id="evt-hello")
            assert run_to_dict(sent.run)["status"] == "queued"
        # The generated operator credential creates a tenant and a key there.
        stack_file = str(data_dir / "stack.json")
        async with TetherClient.from_env(stack_file, operator=True) as operator:
            founded = await operator.create_key("acme", "founder")
        assert founded.tenant_id == "acme"
        # examples/agents, applied as the dev tenant: the demo first, so it is the default.
        assert await listed_agents(stack_file) == [
            ("default", 1, True),
            ("shop", 1, False),
            ("support", 1, False),
        ]
        # The MCP stand-in, a supervised child, named by the shop agent: a message on the
        # `shop` channel makes the demo model call shop__lookup_order at the stand-in.
        mcp_url = info["mcp_demo_url"]
        assert mcp_url.startswith("http://127.0.0.1:") and mcp_url.endswith("/mcp")
        assert f"MCP stand-in (agent shop): {mcp_url}" in up.output
        (mcp,) = up.children("tether.testing.mcp_server")
        assert mcp.pid == info["mcp_pid"]
        async with TetherClient.from_env(stack_file) as client:
            asked = await client.send(
                "where is order A-1001", conversation_id="shop", event_id="e-shop", channel="shop"
            )

            async def answered() -> str | None:
                run = (await client.get_run(asked.run.run_id)).run
                return run.result_text if run_to_dict(run)["status"] == "completed" else None

            text = await eventually(answered, timeout=60, what="the shop run")
        assert "shop__lookup_order returned" in text and "shipped" in text, text
        # A change the tenant makes to an example survives a restart (version 2, below).
        changed = yaml.safe_load((EXAMPLE_AGENTS / "support.yaml").read_text())
        async with TetherClient.from_env(stack_file) as client:
            answer = await client.apply_agent(json.dumps({**changed, "instructions": "Be brief."}))
        assert (answer.name, answer.version) == ("support", 2)

        # The Slack stand-in, a supervised child, and the dev tenant's demo connection to it,
        # whose webhook URL the stand-in delivers a person's messages to.
        slack_api = info["slack_api_url"]
        assert slack_api.startswith("http://127.0.0.1:") and slack_api.endswith("/api/")
        assert f"slack stand-in (channel demo-slack): {slack_api.removesuffix('/api/')}" in (
            up.output
        )
        ((channel_id, api_base_url, webhook_url),) = await demo_channels(stack_file)
        assert api_base_url == slack_api
        assert webhook_url == f"http://{info['http']}/v2/webhooks/slack/{channel_id}"
        assert await slack_webhook(up) == webhook_url
        (slack,) = up.children("tether.testing.slack_server")
        assert slack.pid == info["slack_pid"]
        slack.kill()

        async def restarted() -> int | None:
            pid = up.info().get("slack_pid")
            return pid if pid != slack.pid and psutil.pid_exists(pid) else None

        await eventually(restarted, timeout=30, interval=0.1, what="the stand-in restarted")
        assert up.info()["slack_api_url"] == slack_api, "on its port"
        assert await slack_webhook(up) == webhook_url, "still delivering to the demo channel"
    finally:
        out = await up.interrupt()
    assert "tether stopped" in out

    up = UpProcess(data_dir)
    await up.ready()
    try:
        assert up.info()["http"] == info["http"], "the console keeps its URL across restarts"
        async with TetherClient.from_env(str(data_dir / "stack.json")) as client:
            again = await client.get_run(sent.run.run_id)
            assert again.run.input_text == "hello"
            replay = await client.send("hello", conversation_id="first", event_id="evt-hello")
            assert replay.run.run_id == sent.run.run_id, "the claim survived the restart"
        assert await listed_agents(str(data_dir / "stack.json")) == [
            ("default", 1, True),
            ("shop", 1, False),
            ("support", 2, False),
        ], "an example the tenant has is not applied again: its change is kept"
        assert await demo_channels(str(data_dir / "stack.json")) == [
            (channel_id, slack_api, webhook_url)
        ], "the demo connection once, after two starts, at the stand-in kept on its port"
        assert await slack_webhook(up) == webhook_url
    finally:
        await up.interrupt()

    # Opted out: no stand-in; the tenant's demo connection is left as it is.
    up = UpProcess(data_dir, TETHER_UP_DEMO_SLACK="false")
    await up.ready()
    try:
        assert "slack_api_url" not in up.info()
        assert up.children("tether.testing.slack_server") == []
        assert [c for c, _, _ in await demo_channels(str(data_dir / "stack.json"))] == [channel_id]
    finally:
        await up.interrupt()
