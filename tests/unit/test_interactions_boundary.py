"""No module of the interactions service can reach the run aggregate's tables: it imports none
of them, nor the schema module whole, nor the transitions that write runs, and holds no raw SQL
naming them. It asks the orchestrator, the aggregate's one authority, over gRPC."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

SERVICE = Path(__file__).resolve().parents[2] / "services" / "interactions"
RUN_AGGREGATE = {"runs", "run_events", "run_parts", "attempts", "effects", "usage_turns"}
# Modules through which the aggregate's tables are reached whole.
GATEWAYS = {"tether.db.schema"}
_RAW_SQL = re.compile(rf"(?i)\b(from|join|update|into)\s+({'|'.join(RUN_AGGREGATE)})\b")


def _reaches(tree: ast.Module) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            for alias in node.names:
                if module == "tether.db.schema" and alias.name in RUN_AGGREGATE:
                    found.append(f"imports {alias.name} from {module}")
                if f"{module}.{alias.name}" in GATEWAYS or module.startswith(
                    "services.orchestrator"
                ):
                    found.append(f"imports {module}.{alias.name}")
        elif isinstance(node, ast.Import):
            found += [f"imports {a.name}" for a in node.names if a.name in GATEWAYS]
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and (match := _RAW_SQL.search(node.value))
        ):
            found.append(f"holds SQL {match.group(0)!r}")
    return found


@pytest.mark.parametrize("path", sorted(SERVICE.glob("*.py")), ids=lambda p: p.name)
def test_an_interactions_module_never_reaches_the_run_tables(path: Path) -> None:
    assert _reaches(ast.parse(path.read_text())) == []


@pytest.mark.parametrize(
    "source",
    [
        "from tether.db.schema import interactions, runs",
        "from tether.db import schema",
        "import tether.db.schema",
        "from services.orchestrator.repositories.transitions import apply",
        "q = 'SELECT status FROM runs WHERE run_id = :r'",
    ],
)
def test_the_check_sees_each_way_in(source: str) -> None:
    assert _reaches(ast.parse(source))
