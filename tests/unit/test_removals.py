"""What is deprecated leaves by a named release, and this fails when a release comes without it.

A release is a bump of `version` in pyproject.toml. Each removal below names the release that
drops a deprecated surface and how to see that the surface is still here; once `version` reaches
that release (its candidates included) while it is, the release is not ready. The README, buf.yaml
and the protos say the same version.
"""

from __future__ import annotations

import ast
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
ORCHESTRATOR_PROTO = "protos/tether/v1/orchestrator.proto"
BRIDGE_V1 = "services/gateway/http/bridge_v1.py"
INTERACTIONS_TABLES = "libs/tether/db/schema/interactions_tables.py"
RUN_INDEXES = "libs/tether/db/schema/run_indexes.py"


def release(root: Path) -> Version:
    """The release `root` builds: `version` in its pyproject.toml."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    return Version(project["version"])


def v1_routes(root: Path) -> list[str]:
    """Where the gateway's code still names a /v1 path: bridge v1's module, or a string of a
    route or an edge rule under /v1."""
    found = [BRIDGE_V1] if (root / BRIDGE_V1).is_file() else []
    for path in sorted((root / "services/gateway").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            text = node.value if isinstance(node, ast.Constant) else None
            if isinstance(text, str) and (text == "/v1" or text.startswith("/v1/")):
                found.append(f"{path.relative_to(root).as_posix()}:{node.lineno}")
    return found


def rpc_still_served(name: str) -> Callable[[Path], list[str]]:
    """Where the orchestrator's RPC `name` is still declared or implemented."""

    def where(root: Path) -> list[str]:
        found = []
        if re.search(rf"^\s*rpc\s+{name}\s*\(", (root / ORCHESTRATOR_PROTO).read_text(), re.M):
            found.append(ORCHESTRATOR_PROTO)
        for path in sorted((root / "services/orchestrator").rglob("*.py")):
            if re.search(rf"^\s*(async\s+)?def\s+{name}\s*\(", path.read_text(), re.M):
                found.append(path.relative_to(root).as_posix())
        return found

    return where


@dataclass(frozen=True)
class Removal:
    """A deprecated surface and the release that drops it."""

    surface: str
    removed_in: Version
    still_here: Callable[[Path], list[str]]


def plaintext_token_column(root: Path) -> list[str]:
    """Where the schema still declares connections' plaintext access_token (0023 sealed it)."""
    path = root / INTERACTIONS_TABLES
    return [INTERACTIONS_TABLES] if path.is_file() and '"access_token"' in path.read_text() else []


def lookups_on_runs(root: Path) -> list[str]:
    """Which of the lookup indexes of runs that run_keys replaced (0046) the schema still
    declares: an `Index("name", ...)` of theirs in the indexes' module."""
    path = root / RUN_INDEXES
    text = path.read_text() if path.is_file() else ""
    return re.findall(
        r'Index\(\s*"(ix_runs_(?:tenant_created|tenant_owner_created|session_created|message))"',
        text,
    )


REMOVALS = (
    Removal("bridge v1 (the /v1 HTTP routes)", Version("0.3.0"), v1_routes),
    Removal("the orchestrator's unary ClaimRun", Version("0.3.0"), rpc_still_served("ClaimRun")),
    Removal("the orchestrator's unary Heartbeat", Version("0.3.0"), rpc_still_served("Heartbeat")),
    Removal("connections.access_token (plaintext)", Version("0.3.0"), plaintext_token_column),
    Removal("the lookup indexes of runs (0046 moved them)", Version("0.2.0"), lookups_on_runs),
)


def overdue(root: Path) -> list[str]:
    """Each removal whose release `root` builds, or a later one, with its surface still here."""
    built = release(root).release
    return [
        f"{removal.surface} is removed in {removal.removed_in} but is still here: {where}"
        for removal in REMOVALS
        if built >= removal.removed_in.release and (where := removal.still_here(root))
    ]


def test_no_release_keeps_what_it_removes() -> None:
    assert not overdue(ROOT), f"release {release(ROOT)} ships what it removes"


def test_the_check_sees_a_release_that_keeps_what_it_removes(tmp_path: Path) -> None:
    (tmp_path / "services/gateway/http").mkdir(parents=True)
    (tmp_path / "services/orchestrator").mkdir(parents=True)
    (tmp_path / "protos/tether/v1").mkdir(parents=True)
    (tmp_path / "services/gateway/http/bridge_v2.py").write_text('ROUTE = "/v2/runs"\n')
    (tmp_path / "services/orchestrator/servicer.py").write_text(
        "class OrchestratorServicer:\n    async def Heartbeat(self):\n        pass\n"
    )
    (tmp_path / ORCHESTRATOR_PROTO).write_text(
        "service OrchestratorService {\n  rpc ClaimRun(ClaimRunRequest) returns (R);\n}\n"
    )
    pyproject = tmp_path / "pyproject.toml"
    (tmp_path / RUN_INDEXES).parent.mkdir(parents=True)
    (tmp_path / RUN_INDEXES).write_text('Index(\n    "ix_runs_message", runs.c.message_id)\n')
    pyproject.write_text('[project]\nversion = "0.1.9"\n')
    assert overdue(tmp_path) == []
    pyproject.write_text('[project]\nversion = "0.2.0"\n')
    assert overdue(tmp_path) == [
        "the lookup indexes of runs (0046 moved them) is removed in 0.2.0 but is still here: "
        "['ix_runs_message']"
    ]
    (tmp_path / RUN_INDEXES).write_text('Index("ix_runs_parent", runs.c.parent_run_id)\n')
    pyproject.write_text('[project]\nversion = "0.2.9"\n')
    assert overdue(tmp_path) == []
    pyproject.write_text('[project]\nversion = "0.3.0rc1"\n')
    assert overdue(tmp_path) == [
        "the orchestrator's unary ClaimRun is removed in 0.3.0 but is still here: "
        f"['{ORCHESTRATOR_PROTO}']",
        "the orchestrator's unary Heartbeat is removed in 0.3.0 but is still here: "
        "['services/orchestrator/servicer.py']",
    ]
    (tmp_path / "services/gateway/edge.py").write_text('API = ("/v1/", "/v2/")\n')
    assert overdue(tmp_path)[0] == (
        "bridge v1 (the /v1 HTTP routes) is removed in 0.3.0 but is still here: "
        "['services/gateway/edge.py:1']"
    )


@pytest.mark.parametrize("rpc", ["ClaimRun", "Heartbeat"])
def test_the_proto_says_when_a_deprecated_rpc_goes(rpc: str) -> None:
    [removal] = [r for r in REMOVALS if r.surface.endswith(f" {rpc}")]
    proto = (ROOT / ORCHESTRATOR_PROTO).read_text()
    declared = re.search(rf"((?:^\s*//.*\n)+)\s*rpc\s+{rpc}\s*\(", proto, re.M)
    assert declared is not None, f"{rpc} has no comment above it"
    comment = " ".join(declared.group(1).split())
    assert f"Removed in {removal.removed_in}" in comment, comment


@pytest.mark.parametrize("document", ["README.md", "buf.yaml"])
def test_the_removals_are_announced(document: str) -> None:
    lines = (ROOT / document).read_text().splitlines()
    names = (
        "bridge v1",
        "`ClaimRun`",
        "`Heartbeat`",
        "`connections.access_token`",
        "`ix_runs_tenant_created`",
    )
    # A column or an index is no API: buf.yaml announces only the surfaces a client calls.
    announced = names if document == "README.md" else names[:3]
    for removal, named in zip(REMOVALS, announced, strict=document == "README.md"):
        version = str(removal.removed_in)
        said = [line for line in lines if named in line and version in line]
        assert said, f"no line of {document} names {named} with its removal in {version}"
