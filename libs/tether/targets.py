"""Outbound targets: which addresses Tether may call on a tenant's behalf.

A channel's `api_base_url`, a generic channel's `reply-url` and a run-event webhook are URLs a
tenant chooses and Tether calls with secrets attached, from inside the operator's network. Left
open, that is a way to reach what only the network can: the cloud's metadata endpoint, a database's
admin port, a service on loopback. So a target must be public unless the operator allows a class
of non-public addresses with `TETHER_ALLOW_PRIVATE_TARGETS`, and the rule is applied twice:

- `check_url` when the URL is configured, so a mistake is refused with a message then;
- `target_connector` on every connection, because a name that resolved to a public address at
  configuration time may resolve to 127.0.0.1 a minute later (DNS rebinding). Its resolver drops
  every forbidden address, and its socket factory refuses the address actually connected to, IP
  literals included (aiohttp does not resolve those). A redirect is checked the same way, hop by
  hop: every connection a session opens goes through its connector, the redirected one too.

The setting's grammar: a comma-separated list of classes, case and spaces ignored.

- ``""`` (the default): public addresses only. A tenant's URL never reaches the operator's
  network.
- ``loopback``: 127.0.0.0/8 and ::1, for a stand-in or a receiver on the same machine (`tether up`
  sets it; never on a shared host, where loopback is every other process's too).
- ``private``: RFC 1918 (10/8, 172.16/12, 192.168/16), IPv6 unique-local fc00::/7 and the shared
  address space 100.64.0.0/10 (carrier-grade NAT, which providers also use inside their
  networks), for a receiver on the operator's own network.
- ``link-local``: 169.254.0.0/16 and fe80::/10. It contains the cloud metadata endpoint
  169.254.169.254, which hands out the machine's credentials, so only name it when no such
  endpoint exists.
- ``all``: the three above.

Never allowed, whatever the setting: unspecified addresses (0.0.0.0/8, ::, which Linux connects to
loopback), multicast (not a TCP peer) and every other range that is not globally routable
(240.0.0.0/4, broadcast, documentation and benchmarking ranges, ...): no receiver lives there, so
a URL naming one is a mistake or a trick. An IPv6 address embedding an IPv4 one (IPv4-mapped
::ffff:a.b.c.d, NAT64 64:ff9b::/96, 6to4 2002::/16) is judged by the IPv4 address it reaches.
"""

from __future__ import annotations

import asyncio
import enum
import ipaddress
import re
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult

from tether.errors import InvalidArgument

SETTING = "TETHER_ALLOW_PRIVATE_TARGETS"

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_SHARED = ipaddress.ip_network("100.64.0.0/10")
_THIS_NETWORK = ipaddress.ip_network("0.0.0.0/8")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_UNIQUE_LOCAL = ipaddress.ip_network("fc00::/7")
# IPv6's global unicast (RFC 4291): outside it, what is not named above is deprecated or
# translated (::/96, ::ffff:0:0/96, 64:ff9b:1::/48, fec0::/10), and this Python's is_global
# calls several of those global.
_GLOBAL_UNICAST = ipaddress.ip_network("2000::/3")
# C0 controls, space and DEL: never part of a URL as written (RFC 3986 encodes them).
_UNSAFE_IN_URL = re.compile(r"[\x00-\x20\x7f]")
_RFC1918 = tuple(
    ipaddress.IPv4Network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16")
)


class AddressClass(enum.Enum):
    """Where an address leads; every class but PUBLIC is refused unless the policy allows it."""

    PUBLIC = "public"
    LOOPBACK = "loopback"
    PRIVATE = "private"
    LINK_LOCAL = "link-local"
    UNSPECIFIED = "unspecified"
    MULTICAST = "multicast"
    RESERVED = "reserved"


# The classes an operator may allow; the others are never a receiver.
ALLOWABLE = (AddressClass.LOOPBACK, AddressClass.PRIVATE, AddressClass.LINK_LOCAL)


def _embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address in _NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return address.sixtofour


def classify(address: IPAddress) -> AddressClass:
    """The class of `address`; an IPv6 address embedding an IPv4 one is that IPv4 address's."""
    if isinstance(address, ipaddress.IPv6Address):
        embedded = _embedded_ipv4(address)
        if embedded is not None:
            return classify(embedded)
    if address.is_unspecified or address in _THIS_NETWORK:
        return AddressClass.UNSPECIFIED
    if address.is_loopback:
        return AddressClass.LOOPBACK
    if address.is_link_local:
        return AddressClass.LINK_LOCAL
    if address.is_multicast:
        return AddressClass.MULTICAST
    if address in _SHARED:
        return AddressClass.PRIVATE
    if address in _UNIQUE_LOCAL or any(address in net for net in _RFC1918):
        return AddressClass.PRIVATE
    if isinstance(address, ipaddress.IPv6Address) and address not in _GLOBAL_UNICAST:
        return AddressClass.RESERVED
    if not address.is_global:
        return AddressClass.RESERVED
    return AddressClass.PUBLIC


@dataclass(frozen=True)
class TargetPolicy:
    """The non-public address classes outbound calls may reach (public ones always may)."""

    allowed: frozenset[AddressClass] = frozenset()

    @classmethod
    def parse(cls, value: str) -> TargetPolicy:
        """The policy a `TETHER_ALLOW_PRIVATE_TARGETS` value names (grammar: module docstring);
        an unknown word is a ValueError naming the words there are."""
        names = {c.value: c for c in ALLOWABLE}
        allowed: set[AddressClass] = set()
        for word in (w.strip().lower() for w in value.split(",")):
            if not word:
                continue
            if word == "all":
                allowed.update(ALLOWABLE)
            elif word in names:
                allowed.add(names[word])
            else:
                choices = ", ".join([*names, "all"])
                raise ValueError(
                    f"{SETTING}: {word!r} is not a class of address; use a comma-separated "
                    f"list of {choices}, or nothing for public addresses only"
                )
        return cls(frozenset(allowed))

    def allows(self, address: IPAddress) -> bool:
        """Whether a connection to `address` is allowed."""
        kind = classify(address)
        return kind is AddressClass.PUBLIC or kind in self.allowed

    def refusal(self, address: IPAddress) -> str | None:
        """Why `address` is refused, in words an operator can act on; None when it is allowed."""
        kind = classify(address)
        if kind is AddressClass.PUBLIC or kind in self.allowed:
            return None
        if isinstance(address, ipaddress.IPv6Address) and _embedded_ipv4(address) is not None:
            named = f"{address} (which reaches {_embedded_ipv4(address)})"
        else:
            named = str(address)
        if kind in ALLOWABLE:
            return (
                f"{named} is a {kind.value} address, refused unless the operator allows it "
                f"({SETTING}={kind.value})"
            )
        return f"{named} is a {kind.value} address, never a target"


class TargetRefused(OSError):
    """A connection to a target the policy forbids was refused before any packet was sent.

    An OSError so aiohttp reports it like any failed connection (as the `os_error` of a
    ClientConnectorError); `refused_target` finds it for a caller that translates it."""

    def __init__(self, host: str, reason: str) -> None:
        super().__init__(f"outbound connection to {host} refused: {reason}")
        self.host = host
        self.reason = reason


def refused_target(exc: BaseException) -> TargetRefused | None:
    """The TargetRefused behind an aiohttp error, if that is why it failed."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, TargetRefused):
            return seen
        if isinstance(seen, aiohttp.ClientConnectorError) and isinstance(
            seen.os_error, TargetRefused
        ):
            return seen.os_error
        seen = seen.__cause__
    return None


def _literal(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


async def check_url(url: str, policy: TargetPolicy, *, what: str = "URL") -> str:
    """`url` when Tether may call it under `policy`, else InvalidArgument saying why.

    https only, except http to a non-public address the policy allows (a local stand-in; over
    the internet a secret must not travel in clear). No user or password in it (they would be
    sent to whoever the URL names, and logged with it). A name is resolved and refused when any
    of its addresses is forbidden: the one connected to later could be any of them.
    """
    if _UNSAFE_IN_URL.search(url):
        # urlsplit drops tabs and newlines before reading: it would check another URL than the
        # one stored, shown and logged.
        raise InvalidArgument(f"{what} must not contain control characters or spaces")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        # Neither the URL nor the parser's words: both can quote a password given in it
        # (the parser reads 'user:pass' before a '/' in it as host and port).
        raise InvalidArgument(
            f"{what} is not a valid URL: its host or port cannot be read "
            "(a port is 0 to 65535, an IPv6 address is in [])"
        ) from None
    if parts.scheme not in ("https", "http"):
        raise InvalidArgument(f"{what} must be an https URL, not {parts.scheme or 'schemeless'}")
    if parts.username is not None or parts.password is not None:
        raise InvalidArgument(
            f"{what} must not carry a user or password; give credentials as a secret"
        )
    host = parts.hostname
    if not host:
        raise InvalidArgument(f"{what} {url!r} names no host")
    literal = _literal(host)
    if literal is not None:
        addresses = [literal]
    else:
        addresses = await _resolve(host, port or 443, what)
    for address in addresses:
        reason = policy.refusal(address)
        if reason is not None:
            named = "" if literal is not None else f"{host} resolves to {address}: "
            raise InvalidArgument(f"{what} {url!r} refused: {named}{reason}")
    if parts.scheme == "http" and any(classify(a) is AddressClass.PUBLIC for a in addresses):
        raise InvalidArgument(
            f"{what} must be https: plain http is only for an allowed non-public address"
        )
    return url


async def _resolve(host: str, port: int, what: str) -> list[IPAddress]:
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        # UnicodeError: a name that is not a valid DNS name (a label over 63 characters).
        raise InvalidArgument(f"{what}: the host {host!r} does not resolve ({exc})") from exc
    return [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]


class TargetResolver(AbstractResolver):
    """Resolves like aiohttp's threaded resolver, then keeps only the addresses `policy` allows,
    so the address connected to is a checked one; none left raises TargetRefused."""

    def __init__(self, policy: TargetPolicy) -> None:
        self._policy = policy
        self._inner = aiohttp.ThreadedResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        results = await self._inner.resolve(host, port, family)
        kept: list[ResolveResult] = []
        reasons: list[str] = []
        for result in results:
            reason = self._policy.refusal(ipaddress.ip_address(result["host"].split("%")[0]))
            if reason is None:
                kept.append(result)
            else:
                reasons.append(reason)
        if not kept:
            raise TargetRefused(host, "; ".join(reasons) or "no address")
        return kept

    async def close(self) -> None:
        await self._inner.close()


def _socket_factory(policy: TargetPolicy) -> Any:
    def open_socket(addr_info: tuple[Any, ...]) -> socket.socket:
        family, kind, proto, _, sockaddr = addr_info
        address = ipaddress.ip_address(str(sockaddr[0]).split("%")[0])
        reason = policy.refusal(address)
        if reason is not None:
            raise TargetRefused(str(address), reason)
        return socket.socket(family, kind, proto)

    return open_socket


def target_connector(policy: TargetPolicy, **kwargs: Any) -> aiohttp.TCPConnector:
    """A connector that connects only to addresses `policy` allows, checked at connection time:
    names through `TargetResolver`, and every socket (IP literals included) before it opens."""
    return aiohttp.TCPConnector(
        resolver=TargetResolver(policy), socket_factory=_socket_factory(policy), **kwargs
    )


def target_session(policy: TargetPolicy, **kwargs: Any) -> aiohttp.ClientSession:
    """A client session for tenant-chosen targets: its connector checks every connection, and
    it ignores the environment's proxy settings (a proxy would connect on its behalf, unchecked)."""
    return aiohttp.ClientSession(connector=target_connector(policy), trust_env=False, **kwargs)
