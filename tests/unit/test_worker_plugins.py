"""A worker's tools and context providers are told only the settings meant for them: loaded
through their entry points as the worker loads them, from an environment that holds the
database URL, the worker's credential, its Redis URL and the model key, they see none of them."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.worker.context.providers import FactRequest
from services.worker.plugins import load_plugins
from services.worker.tools.base import Tool

# What each probe was built with, by the entry point that built it.
SEEN: dict[str, Mapping[str, str]] = {}

WORKER_ENVIRONMENT = {
    "TETHER_DATABASE_URL": "postgresql://postgres@127.0.0.1/tether",
    "TETHER_SERVICE_CREDENTIAL": "the-workers-own-secret",
    "TETHER_SERVICE_VERIFIERS": "gateway=" + "0" * 64,
    "TETHER_REDIS_URL": "redis://tether-worker:secret@127.0.0.1:6379/0",
    "TETHER_WORKER_ANTHROPIC_API_KEY": "sk-ant-worker",
    "ANTHROPIC_API_KEY": "sk-ant-environment",
    "PATH": "/usr/bin",
    "TETHER_TOOL_LEDGER_URL": "http://ledger.example",
    "TETHER_TOOL_PROBE_REGION": "eu",
}


class ProbeTools:
    """A tool provider that keeps what it was told and offers no tool."""

    def tools(self, settings: Mapping[str, str]) -> Sequence[Tool]:
        SEEN["tools"] = dict(settings)
        return []


@dataclass
class ProbeFact:
    name: str = "probe"
    required: bool = False
    deadline_s: float = 1.0

    async def fact(self, request: FactRequest) -> str | None:
        return None


def probe_fact(settings: Mapping[str, str]) -> ProbeFact:
    SEEN["facts"] = dict(settings)
    return ProbeFact()


@pytest.fixture
def installed_probes(tmp_path: Path) -> Iterator[None]:
    """A distribution on sys.path whose entry points name the probes, as a plugin package
    installed beside the worker would."""
    dist = tmp_path / "tether_probe-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: tether-probe\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        f"[tether.tools]\nprobe = {__name__}:ProbeTools\n\n"
        f"[tether.facts]\nprobe = {__name__}:probe_fact\n"
    )
    sys.path.insert(0, str(tmp_path))
    SEEN.clear()
    try:
        yield
    finally:
        sys.path.remove(str(tmp_path))


@pytest.mark.usefixtures("installed_probes")
def test_tools_and_context_providers_see_only_tool_settings() -> None:
    registry, providers = load_plugins(WORKER_ENVIRONMENT)

    meant = {"TETHER_TOOL_LEDGER_URL": "http://ledger.example", "TETHER_TOOL_PROBE_REGION": "eu"}
    assert {"tools": meant, "facts": meant} == SEEN
    assert "probe" in providers.facts
    assert "publish_post" in registry.names, "the demo tools load beside the probe"
