"""Three boundaries, checked by walking imports.

The server core never imports the client side: the client SDK (`tether.client`, `tether.watch`),
the CLI, the dev stack and the test kit. A server image can then leave them out, and a change to
the CLI cannot break a service.

Protobuf stops at a service's edges: only the modules declared below import generated code
(`tether.v1.*_pb2`, `*_pb2_grpc`) or the protobuf runtime; everything behind them speaks domain
types.

The gateway keeps to its rooms: its two edges, `grpc/` and `http/`, never import each other,
the streams of `live/` import neither, and nothing outside the gateway imports it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLIENT_SIDE = (
    "tether.client",
    "tether.client_agents",
    "tether.watch",
    "tether.cli",
    "tether.stack",
    "tether.testing",
)
CLIENT_FILES = ("libs/tether/client.py", "libs/tether/client_agents.py", "libs/tether/watch.py")
CLIENT_DIRS = ("libs/tether/cli", "libs/tether/stack", "libs/tether/testing", "libs/tether/v1")

# Where protobuf may appear under services/, each with why it is an edge.
WIRE_EDGES = {
    "services/admission/servicer.py": "admission's gRPC edge",
    "services/admission/adapters.py": "admission's calls to the orchestrator and interactions",
    "services/admission/stream.py": "the AdmitStream, admission's end: each call as Admit's",
    "services/orchestrator/servicer.py": "the orchestrator's gRPC edge",
    "services/orchestrator/worker_edge.py": "the worker-facing calls, converted to domain types",
    "services/orchestrator/model_limit_edge.py": "the Work stream's model-limit writes",
    "services/orchestrator/work.py": "the Work stream, the orchestrator's end",
    "services/orchestrator/work_session.py": "one Work stream's hello read and its messages "
    "queued (the orchestrator's end, beside work.py)",
    "services/orchestrator/lease_histories.py": "a pushed lease told how its history stands "
    "to what the stream's worker holds (LeaseHistory)",
    "services/orchestrator/channel_statuses.py": "RecordChannelStatuses' request read into "
    "the repository's ChannelStatus",
    "services/interactions/servicer.py": "interactions' gRPC edge",
    "services/interactions/channels_edge.py": "the channel-connection RPCs of interactions' edge",
    "services/interactions/clients.py": "interactions' calls to the orchestrator",
    "services/interactions/webhook_secrets_edge.py": "the webhook-secret RPCs of interactions' "
    "edge",
    "services/orchestrator/webhooks_edge.py": "the run-event webhook RPCs of the orchestrator's "
    "edge, and its calls to interactions for their secrets",
    "services/worker/orchestrator_client.py": "the worker's writes, built into their requests",
    "services/worker/interactions.py": "the worker's calls to interactions",
    "services/worker/work_stream.py": "the Work stream, the worker's end: a lease becomes an "
    "Assignment here",
    "services/worker/history_cache.py": "a pushed lease made whole from the histories the "
    "worker holds, then an Assignment (the Work stream's end, beside work_stream.py)",
}
# Every main.py wires its servicers and channels (the composition root).
WIRE_MAINS = "main.py"
# The gateway relays the internal services' messages to callers by design.
WIRE_PACKAGES = ("services/gateway/",)
WIRE_MODULES = ("tether.v1", "google.protobuf")


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
    assert "services/gateway/http/bridge_v1.py" in paths
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


def service_modules() -> list[Path]:
    return sorted((ROOT / "services").rglob("*.py"))


def is_wire_edge(relative: str) -> bool:
    return (
        relative in WIRE_EDGES
        or relative.rsplit("/", 1)[-1] == WIRE_MAINS
        or relative.startswith(WIRE_PACKAGES)
    )


def reaches_the_wire(name: str) -> bool:
    return any(name == wire or name.startswith(wire + ".") for wire in WIRE_MODULES)


def test_every_declared_wire_edge_exists() -> None:
    missing = sorted(edge for edge in WIRE_EDGES if not (ROOT / edge).is_file())
    assert not missing, f"declared wire edges that are gone: {missing}"


@pytest.mark.parametrize("path", service_modules(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_protobuf_stops_at_a_service_edge(path: Path) -> None:
    relative = path.relative_to(ROOT).as_posix()
    if is_wire_edge(relative):
        return
    wrong = sorted(name for name in imported(path) if reaches_the_wire(name))
    assert not wrong, f"{relative} imports {wrong}: convert to domain types at an edge"


def test_the_check_sees_a_protobuf_import(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from tether.v1 import orchestrator_pb2\nimport tether.v1.common_pb2\n"
        "from google.protobuf import json_format\nfrom tether.domain import Part\n"
    )
    assert {n for n in imported(probe) if reaches_the_wire(n)} == {
        "tether.v1",
        "tether.v1.orchestrator_pb2",
        "tether.v1.common_pb2",
        "google.protobuf",
        "google.protobuf.json_format",
    }


# The gateway's rooms. `grpc/` and `http/` are its two edges and both serve the streams of
# `live/`; an edge never imports the other (a bridge is handed the servicer it calls), and `live/`
# imports neither, so a stream means the same whichever edge serves it. What stays at the
# gateway's root is shared by every room (who the caller is, the settings) and imports none of
# them, but main.py and __main__.py, which wire the rooms together.
GATEWAY = "services.gateway"
GATEWAY_ROOMS = ("grpc", "http", "live")
GATEWAY_ROOM_MAY_NOT_IMPORT = {
    "grpc": ("http",),
    "http": ("grpc",),
    "live": ("grpc", "http"),
}
GATEWAY_WIRING = ("services/gateway/main.py", "services/gateway/__main__.py")


def gateway_modules() -> list[Path]:
    return sorted((ROOT / "services/gateway").rglob("*.py"))


def room_of(relative: str) -> str | None:
    """The gateway room a module of the gateway stands in; None at the gateway's root."""
    parts = relative.split("/")
    return parts[2] if len(parts) > 3 else None


def rooms_reached(names: set[str]) -> set[str]:
    """The gateway rooms that imported module names reach."""
    reached = set()
    for name in names:
        parts = name.split(".")
        if parts[:2] == GATEWAY.split(".") and len(parts) > 2 and parts[2] in GATEWAY_ROOMS:
            reached.add(parts[2])
    return reached


def test_the_gateway_has_its_rooms() -> None:
    rooms = {room_of(p.relative_to(ROOT).as_posix()) for p in gateway_modules()}
    assert rooms == {None, *GATEWAY_ROOMS}


@pytest.mark.parametrize("path", gateway_modules(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_a_gateway_room_imports_only_what_it_may(path: Path) -> None:
    relative = path.relative_to(ROOT).as_posix()
    if relative in GATEWAY_WIRING:
        return
    room = room_of(relative)
    forbidden = set(GATEWAY_ROOMS) if room is None else set(GATEWAY_ROOM_MAY_NOT_IMPORT[room])
    wrong = sorted(rooms_reached(imported(path)) & forbidden)
    assert not wrong, f"{relative} ({room or 'the root'}) imports the gateway's {wrong}/"


def test_the_room_check_sees_an_edge_reaching_the_other(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from services.gateway.grpc.servicer import GatewayServicer\n"
        "import services.gateway.http.errors\nfrom services.gateway import auth\n"
    )
    assert rooms_reached(imported(probe)) == {"grpc", "http"}
    assert room_of("services/gateway/live/hub.py") == "live"
    assert room_of("services/gateway/auth.py") is None


def outside_the_gateway() -> list[Path]:
    modules = [p for p in service_modules() if not p.is_relative_to(ROOT / "services/gateway")]
    modules += sorted((ROOT / "libs/tether").rglob("*.py"))
    modules += sorted((ROOT / "bench").rglob("*.py"))
    return [p for p in modules if not p.is_relative_to(ROOT / "libs/tether/v1")]


@pytest.mark.parametrize(
    "path", outside_the_gateway(), ids=lambda p: p.relative_to(ROOT).as_posix()
)
def test_nothing_outside_the_gateway_imports_it(path: Path) -> None:
    wrong = sorted(
        name for name in imported(path) if name == GATEWAY or name.startswith(GATEWAY + ".")
    )
    assert not wrong, f"{path.relative_to(ROOT)} imports {wrong}"


def test_no_relative_import_hides_from_these_checks() -> None:
    relative_imports = sorted(
        path.relative_to(ROOT).as_posix()
        for path in [*service_modules(), *outside_the_gateway()]
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.level > 0
    )
    assert not relative_imports, f"relative imports (write them absolute): {relative_imports}"
