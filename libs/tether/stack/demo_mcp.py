"""`tether up`'s demo MCP server: the local MCP stand-in (`tether.testing.mcp_server`: an order
desk with `lookup_order` read-only, `cancel_order` destructive, `slow_report`) as a supervised
child on a port kept across restarts, so the demo agent document naming it
(`examples/agents/shop.yaml`, its URL written `${TETHER_DEMO_MCP_URL}`) keeps working. Opt out
with TETHER_UP_DEMO_MCP=false (the shop document is then skipped, its URL unresolved)."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

MODULE = "tether.testing.mcp_server"
STACK_KEY = "mcp_demo_url"
"""Where stack.json names the stand-in's MCP endpoint."""
PLACEHOLDER = "${TETHER_DEMO_MCP_URL}"
"""What an agent document in the agents folder writes for the stand-in's URL."""
START_TIMEOUT_S = 30.0


def port_for(previous: dict[str, Any]) -> int:
    """The port it had before when free (the applied demo agent names it), else a free one."""
    before = urlsplit(str(previous.get(STACK_KEY, ""))).port or 0
    for port in (before, 0):
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(probe.getsockname()[1])
    raise RuntimeError("no free port for the MCP stand-in")


@dataclass
class McpStandIn:
    """The stand-in as a child process; `start()` again (the supervisor's restart) keeps its
    port: its ledger (orders, executions) starts afresh, as the demo's does on any restart."""

    log_path: Path
    port: int
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        """Its MCP endpoint, `http://127.0.0.1:PORT/mcp`."""
        return f"http://127.0.0.1:{self.port}/mcp"

    async def start(self) -> None:
        """Start it on its port; RuntimeError or TimeoutError when it does not announce itself."""
        command = [sys.executable, "-m", MODULE, "--host", "127.0.0.1", "--port", str(self.port)]
        with self.log_path.open("ab") as errors:
            process = subprocess.Popen(
                command, stdout=subprocess.PIPE, stderr=errors, start_new_session=True
            )
        self.process = process
        assert process.stdout is not None
        async with asyncio.timeout(START_TIMEOUT_S):
            line = (await asyncio.to_thread(process.stdout.readline)).decode().strip()
        if not line.endswith(f"listening {self.url}"):
            process.kill()
            raise RuntimeError(f"the MCP stand-in did not start: {line!r}; see {self.log_path}")

    def current(self) -> subprocess.Popen[bytes]:
        """The running process (the supervisor watches it)."""
        assert self.process is not None
        return self.process

    async def stop(self) -> None:
        """Stop it (SIGTERM) and wait."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            await asyncio.to_thread(self.process.wait)


def resolve(text: str, url: str | None) -> str:
    """An agent document with the stand-in's URL in place of `PLACEHOLDER` (left as it is
    without a stand-in: the apply then refuses the URL, and the document is skipped)."""
    return text if url is None else text.replace(PLACEHOLDER, url)
