"""What is read back of a tenant's knowledge document: its listed columns (its text stays in
the table), built once per row by the orchestrator's documents repository."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Self


@dataclass(frozen=True, slots=True)
class Document:
    """A stored document as a list shows it: its size in characters, not its text."""

    document_id: str
    title: str
    chars: int
    created_by: str
    created_at: datetime

    @classmethod
    def from_row(cls, row: Mapping[Any, Any]) -> Self:
        """The document of a row carrying its listed columns."""
        return cls(
            row["document_id"], row["title"], row["chars"], row["created_by"], row["created_at"]
        )
