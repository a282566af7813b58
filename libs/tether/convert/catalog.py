"""The tool catalog on the wire, both halves in one place: the worker's hello announces its
tools (`announcements_to_proto`), the orchestrator decodes them (`announcements_from_proto`,
refusing what a catalog cannot hold), and the catalog's entries go out to the gateway and the
CLI (`cataloged_to_proto`)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from datetime import UTC

from tether.domain import CatalogedTool, ToolAnnouncement
from tether.errors import InvalidArgument
from tether.ids import is_identifier
from tether.v1 import common_pb2, orchestrator_pb2

# Far more tools than a worker offers (an agent names at most 64): a hello announcing more is a
# bug or an attack, and the catalog's every row is read by each apply that names a tool.
MAX_ANNOUNCED_TOOLS = 1024
# A risk category is a short word (read, publish, ..., interaction).
MAX_RISK_LENGTH = 64
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def announcements_to_proto(
    tools: Iterable[ToolAnnouncement],
) -> list[orchestrator_pb2.ToolAnnouncement]:
    """The hello's `tools`."""
    return [
        orchestrator_pb2.ToolAnnouncement(
            name=t.name,
            input_schema_sha256=t.schema_sha256,
            risk=t.risk,
            writes_externally=t.writes_externally,
        )
        for t in tools
    ]


def announcements_from_proto(
    tools: Iterable[orchestrator_pb2.ToolAnnouncement],
) -> list[ToolAnnouncement]:
    """The announced tools, or InvalidArgument naming the first that a catalog cannot hold (a
    name outside the identifier rules, a digest that is no sha256, a repeated name)."""
    out: dict[str, ToolAnnouncement] = {}
    for index, tool in enumerate(tools):
        if index >= MAX_ANNOUNCED_TOOLS:
            raise InvalidArgument(f"a hello announces at most {MAX_ANNOUNCED_TOOLS} tools")
        where = f"hello.tools[{index}]"
        if not is_identifier(tool.name):
            raise InvalidArgument(f"{where}.name {tool.name!r} is not a tool name")
        if tool.name in out:
            raise InvalidArgument(f"{where}: tool {tool.name!r} is announced twice")
        if not _SHA256_HEX.fullmatch(tool.input_schema_sha256):
            raise InvalidArgument(f"{where}.input_schema_sha256 must be 64 lowercase hex digits")
        if not is_identifier(tool.risk, max_length=MAX_RISK_LENGTH):
            raise InvalidArgument(f"{where}.risk {tool.risk!r} is not a risk category")
        out[tool.name] = ToolAnnouncement(
            tool.name, tool.input_schema_sha256, tool.risk, tool.writes_externally
        )
    return list(out.values())


def cataloged_to_proto(found: CatalogedTool) -> common_pb2.CatalogTool:
    """One entry of the catalog as ListTools answers it."""
    message = common_pb2.CatalogTool(
        name=found.tool.name,
        risk=found.tool.risk,
        writes_externally=found.tool.writes_externally,
        schema_sha256=found.tool.schema_sha256,
        announced_by=found.announced_by,
    )
    message.announced_at.FromDatetime(found.announced_at.astimezone(UTC))
    return message
