"""The tools and context providers a worker loads, and what they are told.

They run inside the worker's process, beside its credential, its Redis user and the model key.
They are handed only the settings meant for them (`TETHER_TOOL_...`), never the worker's
environment whole, so a well-behaved tool never holds the worker's secrets by accident. This is
not isolation: code in the process can still read `os.environ` or `/proc/self/environ`. A tool
the operator does not trust runs in a process (or pod) of its own, as the README says.
"""

from __future__ import annotations

from collections.abc import Mapping

from services.worker.context.providers import ContextProviders
from services.worker.tools.registry import ToolRegistry
from tether.settings import TOOL_PREFIX


def plugin_settings(environ: Mapping[str, str]) -> dict[str, str]:
    """The settings of `environ` meant for tools and context providers."""
    return {name: value for name, value in environ.items() if name.startswith(TOOL_PREFIX)}


def load_plugins(environ: Mapping[str, str]) -> tuple[ToolRegistry, ContextProviders]:
    """Every installed tool provider and context provider, told `plugin_settings(environ)`."""
    settings = plugin_settings(environ)
    return (
        ToolRegistry.from_entry_points(settings=settings),
        ContextProviders.from_entry_points(settings=settings),
    )
