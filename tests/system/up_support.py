"""`tether up` as a subprocess: started as a new user starts it, its output collected line by
line while it runs, stopped with Ctrl-C and checked to leave nothing behind."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from tether.testing.eventually import eventually

READY_PREFIX = "tether ready gateway="
# A cold start initialises PostgreSQL and starts six processes on a shared machine.
START_TIMEOUT_S = 120.0


class UpProcess:
    """A running `tether up` and everything it has printed so far."""

    def __init__(self, data_dir: Path, **env: str) -> None:
        self.data_dir = data_dir
        inherited = {
            k: v
            for k, v in os.environ.items()
            if k not in ("TETHER_DATABASE_URL", "TETHER_REDIS_URL", "ANTHROPIC_API_KEY")
        }
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tether.cli", "up", "--data-dir", str(data_dir)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**inherited, **env},
        )
        self.lines: list[str] = []
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read, name="tether-up-output", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.startswith(READY_PREFIX):
                self._ready.set()
        self._ready.set()  # ended before it was ready: the waiter looks at the exit code

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    async def ready(self) -> str:
        """Wait for the ready line; returns the gateway's address."""
        await asyncio.to_thread(self._ready.wait, START_TIMEOUT_S)
        ready = [line for line in self.lines if line.startswith(READY_PREFIX)]
        code = self.process.poll()
        assert ready, f"tether up exited with {code} before it was ready:\n{self.output}"
        return ready[0].removeprefix(READY_PREFIX)

    def info(self) -> dict[str, Any]:
        """The stack.json it wrote."""
        info: dict[str, Any] = json.loads((self.data_dir / "stack.json").read_text())
        return info

    async def line(self, matches: Callable[[str], bool], *, timeout: float, what: str) -> str:
        """The first output line that `matches`, waiting for it."""

        async def probe() -> str | None:
            return next((line for line in self.lines if matches(line)), None)

        return await eventually(probe, timeout=timeout, interval=0.05, what=what)

    def children(self, module: str) -> list[psutil.Process]:
        """Its running child processes started as `python -m <module>`."""
        found = []
        for child in psutil.Process(self.process.pid).children(recursive=True):
            try:
                if module in child.cmdline() and child.status() != psutil.STATUS_ZOMBIE:
                    found.append(child)
            except psutil.NoSuchProcess:
                continue
        return found

    async def interrupt(self) -> str:
        """Ctrl-C; asserts a clean exit (code 0) that leaves no process of the stack running.
        Returns the whole output."""
        children = psutil.Process(self.process.pid).children(recursive=True)
        self.process.send_signal(signal.SIGINT)
        try:
            code = await asyncio.to_thread(self.process.wait, 60)
        finally:
            if self.process.poll() is None:
                self.process.kill()
        await asyncio.to_thread(self._reader.join, 10)
        assert code == 0, self.output
        _, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, f"left running after Ctrl-C: {[p.cmdline() for p in alive]}"
        strays = stack_processes(self.data_dir)
        assert not strays, f"started and left running: {[p.cmdline() for p in strays]}"
        return self.output

    async def abandon(self) -> None:
        """For a test that failed before `interrupt`: stop it without checks, then kill
        whatever of it is still running, so nothing outlives the test."""
        children: list[psutil.Process] = []
        with contextlib.suppress(psutil.NoSuchProcess):
            children = psutil.Process(self.process.pid).children(recursive=True)
        self.process.send_signal(signal.SIGINT)
        try:
            await asyncio.to_thread(self.process.wait, 60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        for process in [*children, *stack_processes(self.data_dir)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()


def stack_processes(data_dir: Path) -> list[psutil.Process]:
    """Service processes of the stack in `data_dir`, found by the ready file each was given
    (a service started after the snapshot of children taken at Ctrl-C is found too)."""
    prefix = str(data_dir)
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get("TETHER_READY_FILE", "").startswith(prefix):
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found
