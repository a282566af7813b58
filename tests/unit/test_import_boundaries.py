"""The server core never imports the client side: the client SDK (`tether.client`,
`tether.watch`), the CLI, the dev stack and the test kit. A server image can then leave them out,
and a change to the CLI cannot break a service."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLIENT_SIDE = ("tether.client", "tether.watch", "tether.cli", "tether.stack", "tether.testing")
CLIENT_FILES = ("libs/tether/client.py", "libs/tether/watch.py")
CLIENT_DIRS = ("libs/tether/cli", "libs/tether/stack", "libs/tether/testing", "libs/tether/v1")


def server_modules() -> list[Path]:
    modules = sorted((ROOT / "services").rglob("*.py"))
    for path in sorted((ROOT / "libs/tether").rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative in CLIENT_FILES or relative.startswith(CLIENT_DIRS):
            continue
        modules.append(path)
    return modules


def imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def reaches_client_side(name: str) -> bool:
    return any(name == side or name.startswith(side + ".") for side in CLIENT_SIDE)


def test_there_are_server_modules_to_check() -> None:
    paths = {p.relative_to(ROOT).as_posix() for p in server_modules()}
    assert "services/gateway/http_bridge.py" in paths
    assert "libs/tether/bus.py" in paths
    assert "libs/tether/client.py" not in paths


@pytest.mark.parametrize("path", server_modules(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_a_server_module_does_not_import_the_client_side(path: Path) -> None:
    wrong = sorted(name for name in imported(path) if reaches_client_side(name))
    assert not wrong, f"{path.relative_to(ROOT)} imports {wrong}"


def test_the_check_sees_a_client_import(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("from tether.client import TetherClient\nimport tether.testing.ledger\n")
    assert {n for n in imported(probe) if reaches_client_side(n)} == {
        "tether.client",
        "tether.client.TetherClient",
        "tether.testing.ledger",
    }
