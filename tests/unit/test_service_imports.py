"""Only the worker talks to the model provider, so only the worker loads its SDK: importing it
costs a second or more per process start (every stack start, every restart in a drill)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("service", ["admission", "orchestrator", "interactions", "gateway"])
def test_a_service_that_never_calls_the_model_does_not_load_the_provider_sdk(service: str) -> None:
    probe = (
        f"import sys, services.{service}.main; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'anthropic'))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert loaded == "[]", f"services.{service} loads {loaded}"


def test_the_worker_loads_it() -> None:
    """The probe above can see the SDK when it is loaded."""
    probe = "import sys, services.worker.main; print('anthropic' in sys.modules)"
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    )
    assert loaded.stdout.strip() == "True"
