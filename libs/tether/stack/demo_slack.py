"""`tether up`'s demo Slack channel: the local Slack stand-in (`tether.testing.slack_server`) as
a supervised child on a port kept across restarts, and, for the development tenant, a Slack
connection named `demo-slack` pointing at it (created only while the tenant has none of that
name), whose webhook URL the stand-in delivers a person's messages to, signed with the demo
signing secret. Opt out with TETHER_UP_DEMO_SLACK=false."""

from __future__ import annotations

import asyncio
import logging
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import grpc

from tether.cli.channels import DEMO_NAME
from tether.client import TetherClient
from tether.testing.slack_wire import DEMO_BOT_TOKEN, DEMO_SIGNING_SECRET
from tether.v1 import gateway_pb2, interactions_pb2

log = logging.getLogger(__name__)

MODULE = "tether.testing.slack_server"
STACK_KEY = "slack_api_url"
"""Where stack.json names the stand-in's API (`tether channels add slack --demo` reads it)."""
START_TIMEOUT_S = 30.0


def port_for(previous: dict[str, Any]) -> int:
    """The stand-in's port: the one it had before when free (the demo connection's API base URL
    names it), else a free one."""
    before = urlsplit(str(previous.get(STACK_KEY, ""))).port or 0
    for port in (before, 0):
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(probe.getsockname()[1])
    raise RuntimeError("no free port for the Slack stand-in")


@dataclass
class SlackStandIn:
    """The stand-in as a child process; `start()` again (the supervisor's restart) keeps its
    port and the webhook it was told."""

    log_path: Path
    port: int
    webhook_url: str | None = None
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def base_url(self) -> str:
        """`http://127.0.0.1:PORT`: its control API."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def api_url(self) -> str:
        """The Web API base a Slack connection names (`api_base_url`)."""
        return f"{self.base_url}/api/"

    async def start(self) -> None:
        """Start it on its port (with the webhook, when told one); raises RuntimeError or
        TimeoutError when it does not announce itself."""
        command = [sys.executable, "-m", MODULE, "--host", "127.0.0.1", "--port", str(self.port)]
        if self.webhook_url is not None:
            command += ["--webhook-url", self.webhook_url, "--signing-secret", DEMO_SIGNING_SECRET]
        with self.log_path.open("ab") as errors:
            process = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=errors, start_new_session=True
            )
        self.process = process
        assert process.stdout is not None
        async with asyncio.timeout(START_TIMEOUT_S):
            line = (await asyncio.to_thread(process.stdout.readline)).decode().strip()
        if not line.endswith(f"listening {self.base_url}"):
            process.kill()
            raise RuntimeError(f"the Slack stand-in did not start: {line!r}; see {self.log_path}")

    def current(self) -> subprocess.Popen[bytes]:
        """The running process (the supervisor watches it)."""
        assert self.process is not None
        return self.process

    async def deliver_to(self, webhook_url: str) -> None:
        """Tell the running stand-in (and any restart of it) where a person's messages go."""
        self.webhook_url = webhook_url
        body = {"url": webhook_url, "signing_secret": DEMO_SIGNING_SECRET}
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http,
            http.post(f"{self.base_url}/_webhook", json=body) as answer,
        ):
            if answer.status != 200:
                raise RuntimeError(f"the Slack stand-in refused its webhook: {await answer.text()}")

    async def stop(self) -> None:
        """Stop it (SIGTERM) and wait."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            await asyncio.to_thread(self.process.wait)


async def ensure_demo_channel(gateway: str, api_key: str, api_url: str) -> str | None:
    """The development tenant's `demo-slack` connection, added pointing at `api_url` when the
    tenant has none of that name (one it has is kept as it is, whatever it names): its webhook
    URL, or None when it could not be added (logged; the stack serves without it)."""
    async with TetherClient(gateway, api_key) as client:
        try:
            held = [c for c in (await client.list_channels()).channels if c.name == DEMO_NAME]
            if held:
                found = held[0]
                if found.api_base_url != api_url:
                    log.warning(
                        "channel %s (%s) names %s, not the Slack stand-in at %s: replies go there",
                        DEMO_NAME,
                        found.channel_id,
                        found.api_base_url,
                        api_url,
                    )
                return (await client.get_channel(found.channel_id)).webhook_url
            added = await client.add_channel(
                gateway_pb2.AddChannelRequest(
                    kind="slack",
                    name=DEMO_NAME,
                    api_base_url=api_url,
                    secrets=interactions_pb2.ChannelSecrets(
                        signing_secret=DEMO_SIGNING_SECRET, bot_token=DEMO_BOT_TOKEN
                    ),
                )
            )
        except grpc.aio.AioRpcError as exc:
            log.warning("channel %s not added: %s", DEMO_NAME, exc.details())
            return None
    log.info("channel %s added (%s) at %s", DEMO_NAME, added.channel_id, added.webhook_url)
    return added.webhook_url
