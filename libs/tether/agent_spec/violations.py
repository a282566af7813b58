"""A refused document's violations: each a JSON pointer and what is wrong there, raised as one
InvalidArgument that lists them all."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tether.errors import InvalidArgument

# What a refusal carries at most: its details travel in gRPC trailing metadata (a few KiB), and
# fifty violations are more than anyone fixes before sending the document again.
MAX_REPORTED = 50


@dataclass(frozen=True, slots=True, order=True)
class Violation:
    """What is wrong at `pointer` (RFC 6901; "" is the whole document)."""

    pointer: str
    message: str

    def __str__(self) -> str:
        return f"{self.pointer or '/'}: {self.message}"


def pointer(path: Iterable[str | int]) -> str:
    """The JSON pointer of a path of keys and indexes."""
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in path)


def refusal(violations: Iterable[Violation]) -> InvalidArgument:
    """One InvalidArgument listing every violation once, in pointer order."""
    found = sorted(set(violations))
    shown = found[:MAX_REPORTED]
    more = len(found) - len(shown)
    lines = "; ".join(str(v) for v in shown) + (f"; and {more} more" if more else "")
    details: dict[str, object] = {
        "violations": [{"pointer": v.pointer, "message": v.message} for v in shown]
    }
    if more:
        details["unreported"] = more
    return InvalidArgument(f"agent document refused: {lines}", details=details)


def refuse(pointer: str, message: str) -> InvalidArgument:
    """A refusal of one violation."""
    return refusal([Violation(pointer, message)])
