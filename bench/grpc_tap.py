"""Counting gRPC between processes from outside them: a tap is a TCP relay on loopback in front
of one service, forwarding bytes both ways untouched while it reads the HTTP/2 frames as they
pass. A call is a stream the client opens (its method read from `:path`); a message is one
length-prefixed gRPC message in a stream's DATA, in either direction.

`TappedServiceSet` starts the services with each one's callers (other services and the bench's
own clients) given its tap's address, so every call between the processes crosses a tap.

The method names come from a small HPACK decoder: gRPC's encoder sends `:path` as a plain
literal that enters the dynamic table, and most other headers as references into that table,
which the decoder therefore keeps as the encoder does (sizes, eviction). A header block with a
Huffman-coded string entering the table would leave the table's sizes unknown: from there on
that connection's calls are counted under "?" (reported, never guessed).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import pkgutil
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2

import tether.v1
from tether.stack.processes import ServiceProcess, ServiceSet

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST, CONTINUATION = 0x0, 0x1, 0x3, 0x9
END_STREAM, END_HEADERS, PADDED, PRIORITY = 0x1, 0x4, 0x8, 0x20
UNKNOWN = "?"

_NAMES_ONLY = [
    b"accept-language",
    b"accept-ranges",
    b"accept",
    b"access-control-allow-origin",
    b"age",
    b"allow",
    b"authorization",
    b"cache-control",
    b"content-disposition",
    b"content-encoding",
    b"content-language",
    b"content-length",
    b"content-location",
    b"content-range",
    b"content-type",
    b"cookie",
    b"date",
    b"etag",
    b"expect",
    b"expires",
    b"from",
    b"host",
    b"if-match",
    b"if-modified-since",
    b"if-none-match",
    b"if-range",
    b"if-unmodified-since",
    b"last-modified",
    b"link",
    b"location",
    b"max-forwards",
    b"proxy-authenticate",
    b"proxy-authorization",
    b"range",
    b"referer",
    b"refresh",
    b"retry-after",
    b"server",
    b"set-cookie",
    b"strict-transport-security",
    b"transfer-encoding",
    b"user-agent",
    b"vary",
    b"via",
    b"www-authenticate",
]
# RFC 7541 Appendix A: the names matter (an entry's size counts its name), the values only for
# the few this decoder could be pointed at.
STATIC_TABLE: list[tuple[bytes, bytes]] = [
    (b":authority", b""),
    (b":method", b"GET"),
    (b":method", b"POST"),
    (b":path", b"/"),
    (b":path", b"/index.html"),
    (b":scheme", b"http"),
    (b":scheme", b"https"),
    *[(b":status", s) for s in (b"200", b"204", b"206", b"304", b"400", b"404", b"500")],
    (b"accept-charset", b""),
    (b"accept-encoding", b"gzip, deflate"),
    *[(name, b"") for name in _NAMES_ONLY],
]
assert len(STATIC_TABLE) == 61


class Desynced(Exception):
    """The decoder can no longer follow the dynamic table."""


@dataclass
class HpackDecoder:
    """The request side of one connection: enough of HPACK to read each block's `:path`."""

    max_size: int = 4096  # SETTINGS_HEADER_TABLE_SIZE's default
    table: list[tuple[bytes, bytes | None]] = field(default_factory=list)  # newest first
    desynced: bool = False

    def _size(self) -> int:
        return sum(len(n) + len(v or b"") + 32 for n, v in self.table)

    def _evict(self) -> None:
        while self.table and self._size() > self.max_size:
            self.table.pop()

    def _entry(self, index: int) -> tuple[bytes, bytes | None]:
        if 1 <= index <= len(STATIC_TABLE):
            return STATIC_TABLE[index - 1]
        if 0 <= index - len(STATIC_TABLE) - 1 < len(self.table):
            return self.table[index - len(STATIC_TABLE) - 1]
        raise Desynced(f"index {index} is not in the table")

    @staticmethod
    def _integer(block: bytes, pos: int, prefix_bits: int) -> tuple[int, int]:
        mask = (1 << prefix_bits) - 1
        value = block[pos] & mask
        pos += 1
        if value < mask:
            return value, pos
        shift = 0
        while True:
            byte = block[pos]
            pos += 1
            value += (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return value, pos

    def _string(self, block: bytes, pos: int) -> tuple[bytes | None, int]:
        """A string literal, None when Huffman-coded (not decoded here)."""
        huffman = bool(block[pos] & 0x80)
        length, pos = self._integer(block, pos, 7)
        return (None if huffman else block[pos : pos + length]), pos + length

    def path(self, block: bytes) -> str:
        """Decode one header block, keeping the dynamic table; its `:path` or UNKNOWN."""
        if self.desynced:
            return UNKNOWN
        try:
            return self._decode(block)
        except (Desynced, IndexError):
            self.desynced = True
            return UNKNOWN

    def _decode(self, block: bytes) -> str:
        path: bytes | None = None
        pos = 0
        while pos < len(block):
            first = block[pos]
            value: bytes | None
            if first & 0x80:  # indexed field
                index, pos = self._integer(block, pos, 7)
                name, value = self._entry(index)
            elif first & 0xE0 == 0x20:  # dynamic table size update
                self.max_size, pos = self._integer(block, pos, 5)
                self._evict()
                continue
            else:  # a literal: with incremental indexing (01), without or never indexed (000)
                indexing = bool(first & 0x40)
                index, pos = self._integer(block, pos, 6 if indexing else 4)
                if index:
                    name = self._entry(index)[0]
                else:
                    raw_name, pos = self._string(block, pos)
                    if raw_name is None:
                        if indexing:
                            raise Desynced("a Huffman-coded name entered the table")
                        _, pos = self._string(block, pos)
                        continue
                    name = raw_name
                value, pos = self._string(block, pos)
                if indexing:
                    if value is None:
                        raise Desynced("a Huffman-coded value entered the table")
                    self.table.insert(0, (name, value))
                    self._evict()
            if name == b":path":
                path = value
        return path.decode() if path is not None else UNKNOWN


@dataclass
class _Framing:
    """Where one direction of a stream is in its gRPC messages (5-byte prefix, then body)."""

    prefix: bytearray = field(default_factory=bytearray)
    remaining: int = 0

    def messages(self, payload: bytes) -> int:
        """How many messages start in this DATA payload."""
        started = pos = 0
        while pos < len(payload):
            if self.remaining:
                taken = min(self.remaining, len(payload) - pos)
                self.remaining -= taken
                pos += taken
                continue
            needed = 5 - len(self.prefix)
            self.prefix += payload[pos : pos + needed]
            pos += needed
            if len(self.prefix) == 5:
                self.remaining = int.from_bytes(self.prefix[1:5], "big")
                self.prefix.clear()
                started += 1
        return started


@dataclass
class _Stream:
    method: str
    request: _Framing = field(default_factory=_Framing)
    response: _Framing = field(default_factory=_Framing)


@dataclass
class RpcCounts:
    """Calls opened and messages carried, by method (`/package.Service/Method`)."""

    calls: Counter[str] = field(default_factory=Counter)
    requests: Counter[str] = field(default_factory=Counter)  # messages client -> server
    responses: Counter[str] = field(default_factory=Counter)  # messages server -> client

    def copy(self) -> RpcCounts:
        return RpcCounts(Counter(self.calls), Counter(self.requests), Counter(self.responses))

    def __add__(self, other: RpcCounts) -> RpcCounts:
        return RpcCounts(
            self.calls + other.calls,
            self.requests + other.requests,
            self.responses + other.responses,
        )

    def __sub__(self, earlier: RpcCounts) -> RpcCounts:
        return RpcCounts(
            self.calls - earlier.calls,
            self.requests - earlier.requests,
            self.responses - earlier.responses,
        )

    def units(self) -> Counter[str]:
        """Per method, what `rpc_calls_per_run` counts: a unary call once; on a streaming
        method, every message either way (the opening request included); a method of unknown
        kind by its calls."""
        counted: Counter[str] = Counter()
        for method in self.calls | self.requests | self.responses:
            if streaming(method):
                counted[method] = self.requests[method] + self.responses[method]
            else:
                counted[method] = self.calls[method]
        return +counted


@functools.cache
def _descriptors() -> descriptor_pool.DescriptorPool:
    """The default pool, with every generated module of tether.v1 (and grpc.health.v1) in it."""
    for module in pkgutil.iter_modules(tether.v1.__path__):
        if module.name.endswith("_pb2"):
            importlib.import_module(f"tether.v1.{module.name}")
    assert health_pb2.DESCRIPTOR is not None
    return descriptor_pool.Default()


def streaming(method: str) -> bool:
    """Whether a method (`/package.Service/Method`) streams either way; False when unknown."""
    try:
        found = _descriptors().FindMethodByName(method.strip("/").replace("/", "."))
    except KeyError:
        return False
    return bool(found.client_streaming or found.server_streaming)


class _Direction:
    """Frames one way on one connection."""

    def __init__(self, client_side: bool, streams: dict[int, _Stream], counts: RpcCounts):
        self.client_side = client_side
        self.streams = streams
        self.counts = counts
        self.buffer = bytearray()
        self.preface = client_side
        self.hpack = HpackDecoder()
        self.block: tuple[int, bytearray] | None = None  # a header block awaiting CONTINUATION

    def feed(self, data: bytes) -> None:
        self.buffer += data
        if self.preface:
            if len(self.buffer) < len(PREFACE):
                return
            del self.buffer[: len(PREFACE)]
            self.preface = False
        while len(self.buffer) >= 9:
            length = int.from_bytes(self.buffer[0:3], "big")
            if len(self.buffer) < 9 + length:
                return
            kind, flags = self.buffer[3], self.buffer[4]
            stream = int.from_bytes(self.buffer[5:9], "big") & 0x7FFFFFFF
            payload = bytes(self.buffer[9 : 9 + length])
            del self.buffer[: 9 + length]
            self._frame(kind, flags, stream, payload)

    def _frame(self, kind: int, flags: int, stream: int, payload: bytes) -> None:
        if flags & PADDED and kind in (DATA, HEADERS):
            payload = payload[1 : len(payload) - payload[0]]
        if kind == DATA:
            self._data(stream, payload)
        elif kind == HEADERS and self.client_side:
            self.block = (stream, bytearray(payload[5:] if flags & PRIORITY else payload))
            if flags & END_HEADERS:
                self._headers()
        elif kind == CONTINUATION and self.block is not None:
            self.block[1].extend(payload)
            if flags & END_HEADERS:
                self._headers()
        if (kind == HEADERS and flags & END_STREAM and not self.client_side) or kind == RST:
            self.streams.pop(stream, None)  # the call is over

    def _headers(self) -> None:
        assert self.block is not None
        stream, block = self.block
        self.block = None
        method = self.hpack.path(bytes(block))
        if stream not in self.streams:
            self.streams[stream] = _Stream(method)
            self.counts.calls[method] += 1

    def _data(self, stream_id: int, payload: bytes) -> None:
        stream = self.streams.setdefault(stream_id, _Stream(UNKNOWN))
        if self.client_side:
            self.counts.requests[stream.method] += stream.request.messages(payload)
        else:
            self.counts.responses[stream.method] += stream.response.messages(payload)


@dataclass
class Tap:
    """A counting relay in front of `upstream` (host:port)."""

    upstream: str
    counts: RpcCounts = field(default_factory=RpcCounts)
    server: asyncio.Server | None = None
    port: int = 0
    writers: set[asyncio.StreamWriter] = field(default_factory=set)
    relays: set[asyncio.Task[Any]] = field(default_factory=set)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        """Stop accepting, cut every relayed connection and wait for its relay to end."""
        if self.server is not None:
            self.server.close()
            for writer in list(self.writers):
                writer.close()
            if self.relays:
                await asyncio.wait(self.relays)
            await self.server.wait_closed()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host, _, port = self.upstream.rpartition(":")
        try:
            up_reader, up_writer = await asyncio.open_connection(host, int(port))
        except OSError:
            writer.close()
            return
        streams: dict[int, _Stream] = {}
        requests = _Direction(True, streams, self.counts)
        responses = _Direction(False, streams, self.counts)
        self.writers |= {writer, up_writer}
        relay = asyncio.current_task()
        assert relay is not None
        self.relays.add(relay)
        try:
            await asyncio.gather(
                _pump(reader, up_writer, requests), _pump(up_reader, writer, responses)
            )
        finally:
            self.writers -= {writer, up_writer}
            self.relays.discard(relay)


async def _pump(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: _Direction
) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            seen.feed(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(ConnectionError, OSError, RuntimeError):
            writer.close()


@dataclass
class TappedServiceSet(ServiceSet):
    """Services whose callers reach each of them through its tap."""

    taps: dict[str, Tap] = field(default_factory=dict)
    # What the taps of restarted instances counted before they were replaced.
    rpc_retired: RpcCounts = field(default_factory=RpcCounts)

    def addresses(self) -> dict[str, str]:
        """Service name -> the address its callers use: its tap's."""
        return {
            name: self.taps[name].address if name in self.taps else proc.address
            for name, proc in self.procs.items()
        }

    async def start(self, name: str, **options: Any) -> ServiceProcess:
        """Start one service, then its tap."""
        proc = await super().start(name, **options)
        tap = Tap(proc.address)
        await tap.start()
        old = self.taps.pop(proc.name, None)
        if old is not None:
            self.rpc_retired = self.rpc_retired + old.counts
            await old.close()
        self.taps[proc.name] = tap
        return proc

    def rpc_counts(self) -> RpcCounts:
        """Everything every tap has counted so far."""
        total = self.rpc_retired.copy()
        for tap in self.taps.values():
            total = total + tap.counts
        return total

    async def stop_all(self, *, grace: float = 15.0) -> None:
        """Stop every service, then the taps."""
        await super().stop_all(grace=grace)
        for tap in self.taps.values():
            await tap.close()
        self.taps.clear()
