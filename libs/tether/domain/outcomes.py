"""Run errors, model-turn usage, and the three ways an attempt can end a run."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tether.pricing import TOKEN_FIELDS


@dataclass(frozen=True, slots=True)
class RunError:
    """Why a run, an attempt or a tool call failed: a stable code and words for a person."""

    code: str
    message: str = ""
    retryable: bool = False
    provider_status: int = 0

    def to_row(self) -> dict[str, Any]:
        """The stored form (`runs.error`, `attempts.error`)."""
        return {
            "code": self.code,
            "message": self.message,
            "retryable": self.retryable,
            "provider_status": self.provider_status,
        }

    def to_json(self) -> dict[str, Any]:
        """The form events carry (ErrorInfo's JSON): defaults left out, as protobuf writes it."""
        data: dict[str, Any] = {"code": self.code}
        if self.message:
            data["message"] = self.message
        if self.retryable:
            data["retryable"] = True
        if self.provider_status:
            data["providerStatus"] = self.provider_status
        return data

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> RunError:
        """From the stored form (either spelling of the provider status)."""
        return cls(
            str(row.get("code") or "error"),
            str(row.get("message") or ""),
            bool(row.get("retryable", False)),
            int(row.get("provider_status", row.get("providerStatus", 0)) or 0),
        )


@dataclass(frozen=True, slots=True)
class ModelTurn:
    """The usage of one model call, priced at its own model's rate (0 until priced)."""

    model: str
    input_tokens: int = 0
    output_tokens: int = 0
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    cost_micros: int = 0

    def tokens(self) -> dict[str, int]:
        """The token counts by their stored names."""
        return {k: getattr(self, k) for k in TOKEN_FIELDS}


@dataclass(frozen=True, slots=True)
class Completed:
    """The runtime answered. `task_outcome` says whether the task is done ("resolved") or a
    limit stopped it first ("unresolved"): runtime completion is not business completion."""

    result_text: str = ""
    task_outcome: str = "resolved"
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Failed:
    """The run failed for good."""

    error: RunError


# The reason of a cancel whose caller gave none.
CANCELLED_BY_CALLER = "cancelled by caller"


def cancelled_error(reason: str | None = None) -> RunError:
    """The error a run cancelled by a caller records (the run's and its attempt's): the
    caller's reason, or `CANCELLED_BY_CALLER`. Retryable: the same inbound event delivered again
    makes a new run rather than replaying the cancelled one."""
    return RunError("cancelled", reason or CANCELLED_BY_CALLER, retryable=True)


@dataclass(frozen=True, slots=True)
class Cancelled:
    """A caller's cancel ended the run."""

    reason: str = CANCELLED_BY_CALLER


Ending = Completed | Failed | Cancelled
