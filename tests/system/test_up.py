"""`tether up` as a new user runs it: embedded PostgreSQL and Redis, ready line, Ctrl-C, restart."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil

from tether.client import TetherClient, run_to_dict


async def start_up(data_dir: Path) -> tuple[subprocess.Popen[str], str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TETHER_DATABASE_URL", "TETHER_REDIS_URL", "ANTHROPIC_API_KEY")
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "tether.cli", "up", "--data-dir", str(data_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    assert process.stdout is not None
    while True:
        line = await asyncio.wait_for(asyncio.to_thread(process.stdout.readline), 120)
        assert line, f"tether up exited with {process.poll()} before it was ready"
        if line.startswith("tether ready gateway="):
            return process, line.strip().removeprefix("tether ready gateway=")


async def interrupt(process: subprocess.Popen[str]) -> str:
    children = psutil.Process(process.pid).children(recursive=True)
    process.send_signal(signal.SIGINT)
    out, _ = await asyncio.to_thread(process.communicate, timeout=60)
    assert process.returncode == 0, out
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"left running after Ctrl-C: {[p.cmdline() for p in alive]}"
    return out


async def test_up_serves_a_run_stops_cleanly_and_keeps_data_on_restart(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    process, gateway = await start_up(data_dir)
    try:
        info = json.loads((data_dir / "stack.json").read_text())
        assert info["gateway"] == gateway
        assert info["http"].startswith("127.0.0.1:"), "stack.json names the HTTP bridge"
        assert info["tenant_id"] and info["api_key"].startswith("tk_")
        async with TetherClient.from_env(str(data_dir / "stack.json")) as client:
            sent = await client.send("hello", conversation_id="first", event_id="evt-hello")
            assert run_to_dict(sent.run)["status"] == "queued"
        # The generated operator credential creates a tenant and a key there.
        stack_file = str(data_dir / "stack.json")
        async with TetherClient.from_env(stack_file, operator=True) as operator:
            founded = await operator.create_key("acme", "founder")
        assert founded.tenant_id == "acme"
    finally:
        out = await interrupt(process)
    assert "tether stopped" in out

    process, gateway = await start_up(data_dir)
    try:
        async with TetherClient.from_env(str(data_dir / "stack.json")) as client:
            again = await client.get_run(sent.run.run_id)
            assert again.run.input_text == "hello"
            replay = await client.send("hello", conversation_id="first", event_id="evt-hello")
            assert replay.run.run_id == sent.run.run_id, "the claim survived the restart"
    finally:
        await interrupt(process)
