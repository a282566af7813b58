"""The hot-path bench's CPU clocks against real processes."""

from __future__ import annotations

import subprocess
import sys

from bench.cpu import cpu_s, tree_cpu_s

BURN = (
    "import sys, time\n"
    "while time.process_time() < 0.3: pass\n"
    "print('burnt', flush=True)\n"
    "sys.stdin.readline()\n"
)
PARENT = (
    "import subprocess, sys\n"
    f"subprocess.run([sys.executable, '-c', {BURN!r}], input=b'')\n"
    "print('reaped', flush=True)\n"
    "sys.stdin.readline()\n"
)


def test_cpu_counts_a_process_and_its_reaped_children() -> None:
    burner = subprocess.Popen(
        [sys.executable, "-c", BURN], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert burner.stdout is not None and parent.stdout is not None
        assert burner.stdout.readline() == b"burnt\n"
        assert parent.stdout.readline() == b"burnt\n"  # the child's line, passed through
        assert parent.stdout.readline() == b"reaped\n"
        # The kernel's per-process times are sampled by the tick: allow a few ticks.
        assert 0.25 <= cpu_s(burner.pid) < 1.5
        assert 0.25 <= tree_cpu_s(parent.pid) - cpu_s(parent.pid) < 1.5  # the child, reaped
    finally:
        for process in (burner, parent):
            process.communicate(b"\n", timeout=30)
    assert cpu_s(burner.pid) == 0.0  # gone
