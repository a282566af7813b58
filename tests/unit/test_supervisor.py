"""The pieces of `tether up`'s supervisor that need no stack: the restart backoff, how an exit
is described, the exit wait (on a real child process) and the settings' checks."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
from pydantic import ValidationError

from tether.retry import RetryPolicy
from tether.stack.processes import instance_name, service_of
from tether.stack.settings import UpSettings
from tether.stack.supervisor import RestartBackoff, describe_exit, exited

POLICY = RetryPolicy(initial_delay=0.5, max_delay=10.0, jitter=0.0)


def test_the_wait_doubles_for_quick_deaths_up_to_the_cap() -> None:
    backoff = RestartBackoff(POLICY, stable_after_s=30.0)
    assert [backoff.died(1.0) for _ in range(7)] == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


def test_a_process_that_stayed_up_restarts_after_the_shortest_wait_again() -> None:
    backoff = RestartBackoff(POLICY, stable_after_s=30.0)
    assert [backoff.died(0.0) for _ in range(3)] == [0.5, 1.0, 2.0]
    assert backoff.died(30.0) == 0.5
    assert backoff.died(29.9) == 1.0


def test_an_exit_is_described_by_its_code_or_its_signal() -> None:
    assert describe_exit(3) == "exited with code 3"
    assert describe_exit(0) == "exited with code 0"
    assert describe_exit(-signal.SIGKILL) == "was killed by SIGKILL"
    assert describe_exit(-200) == "was killed by signal 200"


async def test_exited_wakes_when_the_child_is_killed() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        child.send_signal(signal.SIGKILL)
        assert await exited(child) == -signal.SIGKILL
    finally:
        child.kill()
        child.wait()


def test_instance_names_map_back_to_their_service() -> None:
    assert [instance_name("worker", n) for n in (1, 2, 3)] == ["worker", "worker-2", "worker-3"]
    assert [service_of(name) for name in ("worker", "worker-2", "gateway")] == [
        "worker",
        "worker",
        "gateway",
    ]


def test_settings_refuse_no_workers_and_delays_out_of_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TETHER_WORKERS", "3")
    assert UpSettings().workers == 3
    monkeypatch.setenv("TETHER_WORKERS", "0")
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        UpSettings()
    monkeypatch.setenv("TETHER_WORKERS", "2")
    monkeypatch.setenv("TETHER_UP_RESTART_DELAY_S", "20")
    with pytest.raises(ValidationError, match="must not exceed TETHER_UP_RESTART_MAX_DELAY_S"):
        UpSettings()
