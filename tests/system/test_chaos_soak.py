"""The chaos soak in `make slow` (which .ci/run runs after `make test`): 60 seconds with a fixed
seed (the same fault schedule every time), run as `python -m tests.drill` is by `make drill`; one
test per invariant of its report, so a failure names the promise that broke."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.drill.chaos import OTHER_FAULTS
from tests.drill.checker import INVARIANTS
from tests.drill.soak import SoakConfig

pytestmark = [pytest.mark.system, pytest.mark.slow]

SEED = 20261201
MINUTES = 1
SETTLE_S = 30
ROOT = Path(__file__).resolve().parents[2]
SOAK_BOUND_S = 540
TENANTS, CONVERSATIONS = SoakConfig(0, 0).tenants, SoakConfig(0, 0).conversations


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One soak for the whole module; its JSON report."""
    command = [sys.executable, "-m", "tests.drill", "--minutes", str(MINUTES)]
    command += ["--seed", str(SEED), "--settle-s", str(SETTLE_S)]
    with subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as soak:
        try:
            stdout, stderr = soak.communicate(timeout=SOAK_BOUND_S)
        except subprocess.TimeoutExpired:
            soak.terminate()  # it stops its services on SIGTERM
            stdout, stderr = soak.communicate(timeout=60)
    done = subprocess.CompletedProcess(command, soak.returncode, stdout, stderr)
    log = tmp_path_factory.mktemp("soak") / "stderr.log"
    log.write_text(done.stderr)
    lines = done.stdout.strip().splitlines()
    assert lines, f"the soak printed no report (exit {done.returncode}); stderr in {log}"
    result: dict[str, Any] = json.loads(lines[-1])
    assert done.returncode == (0 if result["ok"] else 1), "the exit code follows the report"
    return result


@pytest.mark.timeout(SOAK_BOUND_S + 120)
def test_the_soak_ran_on_durable_storage_under_every_fault(report: dict[str, Any]) -> None:
    assert report["seed"] == SEED
    assert report["durability"]["fsync"] == "on"
    assert report["durability"]["synchronous_commit"] == "on"
    assert report["faults_failed"] == []
    assert report["faults"].get("kill_worker", 0) >= 3, "several worker kills a minute"
    for kind in OTHER_FAULTS:
        assert report["faults"].get(kind, 0) >= 1, f"{kind} happened"
    # Every conversation loop got messages through (how many depends on the machine's speed).
    assert report["runs"]["admitted"] >= TENANTS * CONVERSATIONS
    assert report["runs"]["completed"] >= 1


@pytest.mark.timeout(SOAK_BOUND_S + 120)
@pytest.mark.parametrize("invariant", INVARIANTS)
def test_invariant_holds(report: dict[str, Any], invariant: str) -> None:
    assert report["invariants"][invariant] == 0, report["examples"].get(invariant)
