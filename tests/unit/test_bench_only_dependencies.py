"""The bench's peers stay the bench's: what requirements-bench.lock pins (pgqueuer, procrastinate
and what they need) is pinned nowhere else, and no module the services or the libraries ship
imports it, so a deployment never needs it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.test_import_boundaries import imported

ROOT = Path(__file__).resolve().parents[2]
# The importable names of the bench lock's packages a shipped module could reach for.
BENCH_MODULES = ("pgqueuer", "procrastinate", "psycopg", "psycopg_pool", "croniter", "typer")


def pinned(lock: str) -> set[str]:
    lines = (ROOT / lock).read_text().splitlines()
    return {line.split("==")[0].lower() for line in lines if line and not line.startswith("#")}


def shipped_modules() -> list[Path]:
    return sorted([*(ROOT / "services").rglob("*.py"), *(ROOT / "libs").rglob("*.py")])


def test_the_bench_lock_pins_the_peers_and_nothing_the_runtime_pins() -> None:
    bench = pinned("requirements-bench.lock")
    assert {"pgqueuer", "procrastinate"} <= bench
    assert not bench & pinned("requirements.lock")


@pytest.mark.parametrize("path", shipped_modules(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_a_shipped_module_does_not_import_a_bench_peer(path: Path) -> None:
    wrong = sorted(
        name
        for name in imported(path)
        if any(name == m or name.startswith(m + ".") for m in BENCH_MODULES)
    )
    assert not wrong, f"{path.relative_to(ROOT)} imports {wrong}: bench-only"


def test_the_check_sees_a_peer_import(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("from pgqueuer import Queries\nimport psycopg_pool\n")
    assert {n for n in imported(probe) if n.split(".")[0] in BENCH_MODULES} == {
        "pgqueuer",
        "pgqueuer.Queries",
        "psycopg_pool",
    }
