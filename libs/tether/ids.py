"""Identifiers: a type prefix plus a time-ordered UUIDv7, so ids sort by creation and read well."""

from __future__ import annotations

import os
import re
import time
import uuid

# Matched with fullmatch: a `$` anchor would also match before a trailing newline.
_IDENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]*")


def uuid7() -> uuid.UUID:
    """A UUIDv7 (RFC 9562): 48-bit Unix milliseconds, then random bits."""
    ms = time.time_ns() // 1_000_000
    rand = int.from_bytes(os.urandom(10), "big")
    value = (ms & ((1 << 48) - 1)) << 80 | rand
    value = (value & ~(0xF << 76)) | (0x7 << 76)  # version 7
    value = (value & ~(0x3 << 62)) | (0x2 << 62)  # RFC 4122 variant
    return uuid.UUID(int=value)


def new_id(prefix: str) -> str:
    """A new id such as `run_0193c1d2e3f47a8b9c0d1e2f3a4b5c6d`."""
    return f"{prefix}_{uuid7().hex}"


def is_identifier(value: str, *, max_length: int = 128) -> bool:
    """Whether `value` is a safe external identifier: 1..max_length of [A-Za-z0-9._:@-]."""
    return 0 < len(value) <= max_length and _IDENT.fullmatch(value) is not None
