"""A caller's cancel has one error, built by one constructor (`tether.domain.cancelled_error`):
no server module spells its code or its default reason itself."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tether.domain import CANCELLED_BY_CALLER, RunError, cancelled_error

ROOT = Path(__file__).resolve().parents[2]
OWNER = "libs/tether/domain/outcomes.py"


def test_a_cancel_without_a_reason_says_a_caller_cancelled_it() -> None:
    assert cancelled_error() == RunError("cancelled", CANCELLED_BY_CALLER, retryable=True)
    assert cancelled_error("") == cancelled_error(None) == cancelled_error()
    assert cancelled_error("changed my mind").message == "changed my mind"
    assert cancelled_error("x").retryable, "the same inbound event may make a new run"


def spelled_cancels(path: Path) -> list[str]:
    """Where `path` builds a cancel's error itself, or spells its default reason."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "RunError"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and node.args[0].value == "cancelled"
        ):
            found.append(f"line {node.lineno}: RunError('cancelled', ...)")
        elif isinstance(node, ast.Constant) and node.value == CANCELLED_BY_CALLER:
            found.append(f"line {node.lineno}: {CANCELLED_BY_CALLER!r}")
    return found


def server_modules() -> list[Path]:
    paths = [*(ROOT / "services").rglob("*.py"), *(ROOT / "libs/tether").rglob("*.py")]
    return sorted(p for p in paths if "libs/tether/v1" not in p.as_posix())


@pytest.mark.parametrize("path", server_modules(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_only_the_domain_builds_a_cancels_error(path: Path) -> None:
    if path.relative_to(ROOT).as_posix() == OWNER:
        return
    assert not spelled_cancels(path), f"{path.relative_to(ROOT)}: use tether.domain.cancelled_error"
