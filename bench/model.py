"""The local model server (tether.testing.model_server) as the benches run it: out of process,
so the bench's own load does not slow its answers; and the one request every bare call makes."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
from anthropic import AsyncAnthropic

MODEL = "claude-sonnet-5-5"  # the routing default, so bare calls name the same model
PROMPT = "bench: reply in one short sentence"  # no tool intent: the demo agent answers at once
BENCH_REQUEST: dict[str, Any] = {
    "model": MODEL,
    "max_tokens": 4096,
    "messages": [{"role": "user", "content": PROMPT}],
}


@dataclass
class Model:
    """A model server process: its base URL and its scripting endpoint."""

    base_url: str
    http: aiohttp.ClientSession
    pid: int

    async def script(self, key: str, turns: list[dict[str, Any]]) -> None:
        """Queue turns for requests whose script key is `key`."""
        async with self.http.post(
            f"{self.base_url}/_script", json={"key": key, "turns": turns}
        ) as response:
            response.raise_for_status()


@contextlib.asynccontextmanager
async def model_server(*args: str) -> AsyncIterator[Model]:
    """`python -m tether.testing.model_server --port 0 ARGS...`, stopped on exit."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tether.testing.model_server",
        "--port",
        "0",
        *args,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        line = (await asyncio.wait_for(process.stdout.readline(), 30)).decode()
        if not line.startswith("model-server listening "):
            raise RuntimeError(f"model server did not start: {line!r}")
        async with aiohttp.ClientSession() as http:
            yield Model(line.split()[-1], http, process.pid)
    finally:
        if process.returncode is None:
            process.terminate()
            await process.wait()


async def streamed_call(
    sdk: AsyncAnthropic, request: dict[str, Any], headers: dict[str, str] | None = None
) -> None:
    """One streamed Messages call made straight with the SDK, every event consumed."""
    stream = await sdk.messages.create(**request, stream=True, extra_headers=headers or {})
    async for _event in stream:
        pass
