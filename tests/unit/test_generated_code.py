"""The committed generated code matches what the protos generate today."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_current(tmp_path: Path) -> None:
    protos = sorted((ROOT / "protos/tether/v1").glob("*.proto"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{ROOT / 'protos'}",
            f"--python_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            f"--mypy_out={tmp_path}",
            f"--mypy_grpc_out={tmp_path}",
            *map(str, protos),
        ],
        check=True,
        capture_output=True,
        # The mypy plugins (protoc-gen-mypy) are scripts beside the interpreter.
        env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"},
    )
    fresh = {p.name: p.read_text() for p in (tmp_path / "tether/v1").iterdir()}
    committed = {
        p.name: p.read_text()
        for p in (ROOT / "libs/tether/v1").iterdir()
        if p.name not in ("__init__.py", "py.typed") and p.is_file()
    }
    stale = sorted(n for n in fresh.keys() | committed.keys() if fresh.get(n) != committed.get(n))
    assert not stale, f"generated code is stale, run `make gen`: {stale}"
