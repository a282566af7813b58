"""The gateway's servicer is composed, not mixed in: it defines every RPC of
tether.v1.GatewayService itself, handing each to a handler object, and no module of the services
reads another object's private fields (a handler gets what it needs through its constructor)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from services.gateway.grpc.servicer import GatewayServicer
from tether.v1 import gateway_pb2, gateway_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"]


@pytest.mark.parametrize("method", list(SERVICE.methods), ids=lambda m: m.name)
def test_the_servicer_defines_every_rpc_itself(method: object) -> None:
    name = method.name  # type: ignore[attr-defined]
    # One left to the generated base class would answer UNIMPLEMENTED to every caller.
    assert name in vars(GatewayServicer), f"{name} falls through to the generated base class"
    defined = vars(GatewayServicer)[name]
    assert defined is not vars(gateway_pb2_grpc.GatewayServiceServicer)[name]
    if method.server_streaming:  # type: ignore[attr-defined]
        assert inspect.isasyncgenfunction(defined), f"{name} must stream as an async generator"
    else:
        assert inspect.iscoroutinefunction(defined), f"{name} must be a coroutine"


def test_the_servicer_is_no_mixin() -> None:
    assert GatewayServicer.__mro__[1:] == gateway_pb2_grpc.GatewayServiceServicer.__mro__


# Public API spelled with a leading underscore so it cannot clash with a column or field name:
# SQLAlchemy's Row and the named tuple's.
PUBLIC_UNDERSCORED = frozenset(
    {"_mapping", "_fields", "_asdict", "_t", "_tuple", "_replace", "_make"}
)


def foreign_private_reads(source: str) -> list[str]:
    """Each `x._name` in `source` whose `x` is not self, cls or super()."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        if not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        if node.attr in PUBLIC_UNDERSCORED:
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
            continue
        if isinstance(owner, ast.Call) and ast.unparse(owner.func) == "super":
            continue
        found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize(
    "path",
    sorted((ROOT / "services").rglob("*.py")),
    ids=lambda p: p.relative_to(ROOT).as_posix(),
)
def test_no_module_reads_another_objects_private_fields(path: Path) -> None:
    wrong = foreign_private_reads(path.read_text())
    assert not wrong, f"{path.relative_to(ROOT)} reaches into private fields: {wrong}"


def test_the_check_sees_a_reach_into_a_host() -> None:
    source = (
        "class Rpcs:\n"
        "    def call(self, host):\n"
        "        self._own = host._auth\n"
        "        super()._setup()\n"
        "        return self._engine, host.public, row._mapping\n"
    )
    assert foreign_private_reads(source) == ["3: host._auth"]
