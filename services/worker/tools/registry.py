"""The tool registry: which tools this worker has (from the `tether.tools` entry points), which a
run may use, and the Messages API params and catalog announcements of them.

A call is not run here: `execute` hands it to `tether.tools.path.execute`, the one path every
tool call takes (the test kit, `tether.testing.tools`, takes the same).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping, Sequence
from importlib.metadata import entry_points
from typing import Any

from tether.domain import ToolAnnouncement, schema_sha256
from tether.tools.base import Authorization, CallContext, Tool, ToolProvider
from tether.tools.effects import EffectsPort
from tether.tools.path import (
    PreparedTool,
    ToolErrorCode,
    ToolResult,
    execute,
    truncate_inline,
)

log = logging.getLogger(__name__)

# Agents a worker has built the tool list of; past this many it builds them afresh.
MAX_CACHED_ALLOWLISTS = 1000

ENTRY_POINT_GROUP = "tether.tools"

__all__ = [
    "ENTRY_POINT_GROUP",
    "ToolErrorCode",
    "ToolRegistry",
    "ToolResult",
    "truncate_inline",
]


class ToolRegistry:
    """The tools this worker can run, by name."""

    def __init__(self, tools: Iterable[Tool]) -> None:
        """Index `tools`; raises ValueError on a duplicate name, SchemaError on a bad schema.

        Schemas are checked and compiled here, once, so that a keyword the validator does not
        enforce fails the worker at startup instead of letting input through unchecked.
        """
        self._tools: dict[str, PreparedTool] = {}
        self._specs: dict[tuple[str, ...], list[dict[str, Any]]] = {}
        for tool in tools:
            if tool.spec.name in self._tools:
                raise ValueError(f"two tools are named {tool.spec.name!r}")
            self._tools[tool.spec.name] = PreparedTool(tool)

    @classmethod
    def from_entry_points(
        cls, group: str = ENTRY_POINT_GROUP, *, settings: Mapping[str, str]
    ) -> ToolRegistry:
        """Load every provider registered under the entry-point `group` and collect its tools.

        An entry point names either a ToolProvider or a zero-argument callable returning one
        (e.g. a provider class). A provider that fails to load fails the whole call: a worker
        silently missing tools would turn into confusing "tool not registered" results later.
        """
        tools: list[Tool] = []
        for entry_point in entry_points(group=group):
            provider = _as_provider(entry_point.load(), entry_point.name)
            tools.extend(provider.tools(settings))
        return cls(tools)

    @property
    def names(self) -> list[str]:
        """Registered tool names, in registration order."""
        return list(self._tools)

    def announcements(self) -> list[ToolAnnouncement]:
        """The registered tools as the Work hello announces them to the tool catalog."""
        return [
            ToolAnnouncement(
                t.spec.name,
                schema_sha256(t.spec.input_schema),
                str(t.spec.risk),
                t.spec.writes_externally,
            )
            for t in self._tools.values()
        ]

    def get(self, name: str) -> Tool | None:
        """The tool named `name`, or None."""
        prepared = self._tools.get(name)
        return None if prepared is None else prepared.tool

    def specs(self, allowlist: Sequence[str]) -> list[dict[str, Any]]:
        """Messages API tool params for the allowlisted tools, in allowlist order.

        A name with no registered tool is skipped with a warning, once per process (a routing
        table ahead of the deployed tools is a configuration drift, not a reason to fail the
        run). Built once per allowlist: every attempt of an agent asks for the same.
        """
        key = tuple(allowlist)
        cached = self._specs.get(key)
        if cached is not None:
            return cached
        params: list[dict[str, Any]] = []
        seen: set[str] = set()
        for name in allowlist:
            if name in seen:
                continue
            seen.add(name)
            prepared = self._tools.get(name)
            if prepared is None:
                log.warning("allowlist names unknown tool %r; it is not offered to the model", name)
                continue
            params.append(prepared.spec.to_anthropic())
        if len(self._specs) > MAX_CACHED_ALLOWLISTS:
            self._specs.clear()
        self._specs[key] = params
        return params

    def prepared(self, name: str) -> PreparedTool | None:
        """The tool named `name` with its compiled schema, or None (the call path's catalog)."""
        return self._tools.get(name)

    async def execute(
        self,
        name: str,
        input: dict[str, Any],
        call: CallContext,
        *,
        effects: EffectsPort,
        allowlist: Collection[str],
        max_inline_bytes: int,
        output_ref: str,
        authorization: Authorization | None = None,
    ) -> ToolResult:
        """Run one tool call through `tether.tools.path.execute`, the one path every call takes
        (see there for the order of checks, what is recorded and what propagates)."""
        return await execute(
            self,
            name,
            input,
            call,
            effects=effects,
            allowlist=allowlist,
            max_inline_bytes=max_inline_bytes,
            output_ref=output_ref,
            authorization=authorization,
        )

    def validate_input(self, name: str, input: dict[str, Any]) -> tuple[dict[str, Any], str]:
        """(normalised input, problem or ""): checked before a person is asked to approve it."""
        prepared = self._tools.get(name)
        if prepared is None:
            return input, f"tool {name} is not registered"
        return prepared.check(input)


def _as_provider(loaded: object, entry_point_name: str) -> ToolProvider:
    # A provider class also has a `tools` attribute, so classes are called before the check.
    if isinstance(loaded, ToolProvider) and not isinstance(loaded, type):
        return loaded
    if callable(loaded):
        made = loaded()
        if isinstance(made, ToolProvider) and not isinstance(made, type):
            return made
    raise TypeError(
        f"entry point {entry_point_name!r} is neither a ToolProvider nor a zero-argument "
        "callable returning one"
    )
