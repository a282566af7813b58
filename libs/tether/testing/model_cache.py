"""The prompt cache as the Messages API keeps it, so that tests measure cache hits instead of
assuming them.

A request's prompt is its blocks in cache order: tools, system blocks, then each message's
content blocks. A block with `cache_control` is a breakpoint (at most four, else 400). At a
breakpoint the prefix up to it (its bytes, `cache_control` left out) is written to the cache
when it is long enough: 1,024 tokens for most models, 2,048 for the smallest (haiku). A request
reads the longest cached prefix that ends at a block boundary up to 20 blocks before any of its
breakpoints (the API's lookback), and pays for it as `cache_read_input_tokens`; the tokens from
there to its last written breakpoint are `cache_creation_input_tokens` (split by lifetime in
`cache_creation`), the rest `input_tokens`. An entry lives five minutes, or an hour when its
breakpoint asks (`"ttl": "1h"`; a one-hour breakpoint may not follow a five-minute one), and each
hit starts its lifetime again. Entries are kept per model. Tokens are counted per block, four
characters of its JSON to a token.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

MAX_BREAKPOINTS = 4
LOOKBACK_BLOCKS = 20
TTL_S = {"5m": 300.0, "1h": 3600.0}
# Entries kept before the expired ones are swept (a test server's memory stays small).
MAX_ENTRIES = 100_000


def minimum_tokens(model: str) -> int:
    """The shortest prefix a breakpoint caches: 2,048 tokens for the smallest models (haiku),
    1,024 for the others."""
    return 2048 if "haiku" in model else 1024


class CacheRequestError(ValueError):
    """The request's breakpoints break the API's rules (the message is the API's 400)."""


@dataclass(frozen=True)
class Block:
    """One block of a prompt in cache order: its key (the hash of the prefix through it), its
    tokens, and its breakpoint's lifetime ("" when it is none)."""

    prefix_key: str
    tokens: int
    ttl: str


@dataclass(frozen=True)
class Accounting:
    """How a request's input tokens were paid."""

    input_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    ephemeral_5m_input_tokens: int = 0
    ephemeral_1h_input_tokens: int = 0


def _tokens(data: Any) -> int:
    return max(1, math.ceil(len(json.dumps(data, sort_keys=True, default=str)) / 4))


def blocks_of(body: Mapping[str, Any]) -> list[Block]:
    """The prompt's blocks in cache order; CacheRequestError for a bad breakpoint."""
    raw: list[tuple[Any, Any]] = [(["tool"], t) for t in body.get("tools") or ()]
    system = body.get("system")
    if isinstance(system, str):
        system = [{"type": "text", "text": system}]
    raw += [(["system"], b) for b in system or ()]
    for message in body.get("messages") or ():
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        for i, block in enumerate(content or ()):
            raw.append((["message", message.get("role"), i == 0], block))
    digest = hashlib.sha256()
    out: list[Block] = []
    for where, block in raw:
        plain = block
        ttl = ""
        if isinstance(block, Mapping) and "cache_control" in block:
            plain = {k: v for k, v in block.items() if k != "cache_control"}
            marker = block["cache_control"] or {}
            ttl = str(marker.get("ttl", "5m")) if isinstance(marker, Mapping) else "5m"
            if ttl not in TTL_S:
                raise CacheRequestError(
                    f"cache_control.ttl: Input should be '5m' or '1h'; got {ttl!r}"
                )
        digest.update(json.dumps([where, plain], sort_keys=True, default=str).encode())
        out.append(Block(digest.copy().hexdigest(), _tokens(plain), ttl))
    marked = [b.ttl for b in out if b.ttl]
    if len(marked) > MAX_BREAKPOINTS:
        raise CacheRequestError(
            f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. "
            f"Found {len(marked)}."
        )
    if "1h" in marked and "5m" in marked[: marked.index("1h")]:
        raise CacheRequestError(
            "a ttl='1h' cache_control block must not come after a ttl='5m' cache_control block"
        )
    return out


def input_tokens_for(body: Mapping[str, Any]) -> int:
    """A request's input tokens, cached or not."""
    try:
        return sum(b.tokens for b in blocks_of(body))
    except CacheRequestError:
        prompt = (body.get("tools"), body.get("system"), body.get("messages"))
        return sum(_tokens(part) for part in prompt)


class PromptCache:
    """Cached prefixes by model, with their expiry on `clock` (seconds)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._entries: dict[tuple[str, str], tuple[float, str]] = {}  # -> (expires at, ttl)

    def clear(self) -> None:
        """Forget every entry."""
        self._entries.clear()

    def account(self, body: Mapping[str, Any]) -> Accounting:
        """Read and write the cache for one request; how its input tokens were paid."""
        model = str(body.get("model", ""))
        blocks = blocks_of(body)
        now = self._clock()
        if len(self._entries) > MAX_ENTRIES:
            self._entries = {k: v for k, v in self._entries.items() if v[0] > now}
        total = sum(b.tokens for b in blocks)
        ends = [0] * len(blocks)  # tokens of the prefix through each block
        running = 0
        for i, block in enumerate(blocks):
            running += block.tokens
            ends[i] = running
        breakpoints = [i for i, b in enumerate(blocks) if b.ttl]
        read = -1  # the last block of the longest cached prefix read
        for point in breakpoints:
            for i in range(point, max(point - LOOKBACK_BLOCKS, -1), -1):
                if i <= read:
                    break
                entry = self._entries.get((model, blocks[i].prefix_key))
                if entry is not None and entry[0] > now:
                    read = i
                    break
        if read >= 0:
            ttl = self._entries[(model, blocks[read].prefix_key)][1]
            self._entries[(model, blocks[read].prefix_key)] = (now + TTL_S[ttl], ttl)
        created = {"5m": 0, "1h": 0}
        written_to = ends[read] if read >= 0 else 0
        for point in breakpoints:
            if point <= read or ends[point] < minimum_tokens(model):
                continue
            ttl = blocks[point].ttl
            self._entries[(model, blocks[point].prefix_key)] = (now + TTL_S[ttl], ttl)
            created[ttl] += ends[point] - written_to
            written_to = ends[point]
        cache_read = ends[read] if read >= 0 else 0
        creation = created["5m"] + created["1h"]
        return Accounting(
            input_tokens=total - cache_read - creation,
            cache_creation_input_tokens=creation,
            cache_read_input_tokens=cache_read,
            ephemeral_5m_input_tokens=created["5m"],
            ephemeral_1h_input_tokens=created["1h"],
        )
