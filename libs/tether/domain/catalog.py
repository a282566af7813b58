"""The tool catalog's entries: a tool as a worker announces it, and as the catalog keeps it."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any


@dataclass(frozen=True, slots=True)
class ToolAnnouncement:
    """One tool a worker runs: its name, the digest of its input schema, its risk category and
    whether its calls write externally."""

    name: str
    schema_sha256: str
    risk: str
    writes_externally: bool


@dataclass(frozen=True, slots=True)
class CatalogedTool:
    """A tool of the catalog: what the last worker announcing it said, who, and when."""

    tool: ToolAnnouncement
    announced_by: str
    announced_at: datetime


def schema_sha256(schema: Mapping[str, Any]) -> str:
    """sha256 (hex) of `schema` as canonical JSON (keys sorted, no spaces), so two workers
    with the same schema in another key order announce the same digest."""
    text = json.dumps(schema, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
