"""The outbound-target rule's pure parts: the setting's grammar, how an address is classed and
what `check_url` refuses without resolving anything (IP-literal hosts)."""

from __future__ import annotations

import ipaddress

import pytest
from pydantic import ValidationError

from tether.errors import InvalidArgument
from tether.settings import PlatformSettings
from tether.targets import AddressClass, TargetPolicy, check_url, classify

NONE = TargetPolicy.parse("")
LOOPBACK = TargetPolicy.parse("loopback")


@pytest.mark.parametrize(
    ("value", "allowed"),
    [
        ("", set()),
        ("loopback", {AddressClass.LOOPBACK}),
        ("private", {AddressClass.PRIVATE}),
        (" Loopback , private ", {AddressClass.LOOPBACK, AddressClass.PRIVATE}),
        ("link-local", {AddressClass.LINK_LOCAL}),
        ("all", {AddressClass.LOOPBACK, AddressClass.PRIVATE, AddressClass.LINK_LOCAL}),
    ],
)
def test_the_setting_names_the_classes_it_allows(value: str, allowed: set[AddressClass]) -> None:
    assert TargetPolicy.parse(value).allowed == allowed


@pytest.mark.parametrize("value", ["yes", "multicast", "unspecified", "public,loopback"])
def test_an_unknown_word_is_refused_naming_the_choices(value: str) -> None:
    with pytest.raises(ValueError, match="loopback, private, link-local, all"):
        TargetPolicy.parse(value)


@pytest.mark.parametrize(
    ("address", "kind"),
    [
        ("127.0.0.1", AddressClass.LOOPBACK),
        ("127.255.0.9", AddressClass.LOOPBACK),
        ("::1", AddressClass.LOOPBACK),
        ("::ffff:127.0.0.1", AddressClass.LOOPBACK),
        ("64:ff9b::7f00:1", AddressClass.LOOPBACK),
        ("2002:7f00:1::", AddressClass.LOOPBACK),
        ("10.1.2.3", AddressClass.PRIVATE),
        ("172.31.255.1", AddressClass.PRIVATE),
        ("192.168.0.1", AddressClass.PRIVATE),
        ("100.64.0.1", AddressClass.PRIVATE),
        ("fd12::1", AddressClass.PRIVATE),
        ("::ffff:10.0.0.1", AddressClass.PRIVATE),
        ("169.254.169.254", AddressClass.LINK_LOCAL),
        ("::ffff:169.254.169.254", AddressClass.LINK_LOCAL),
        ("fe80::1", AddressClass.LINK_LOCAL),
        ("0.0.0.0", AddressClass.UNSPECIFIED),
        ("0.1.2.3", AddressClass.UNSPECIFIED),
        ("::", AddressClass.UNSPECIFIED),
        ("224.0.0.1", AddressClass.MULTICAST),
        ("ff02::1", AddressClass.MULTICAST),
        ("240.0.0.1", AddressClass.RESERVED),
        ("255.255.255.255", AddressClass.RESERVED),
        ("192.0.2.1", AddressClass.RESERVED),
        ("2001:db8::1", AddressClass.RESERVED),
        ("172.32.0.1", AddressClass.PUBLIC),
        ("8.8.8.8", AddressClass.PUBLIC),
        ("::ffff:8.8.8.8", AddressClass.PUBLIC),
        ("2606:4700::1111", AddressClass.PUBLIC),
    ],
)
def test_each_address_has_its_class(address: str, kind: AddressClass) -> None:
    assert classify(ipaddress.ip_address(address)) is kind


@pytest.mark.parametrize("address", ["0.0.0.0", "::", "224.0.0.1", "240.0.0.1", "192.0.2.1"])
def test_what_is_never_a_receiver_stays_refused_under_all(address: str) -> None:
    assert not TargetPolicy.parse("all").allows(ipaddress.ip_address(address))


async def test_an_ip_literal_is_refused_naming_its_class_and_the_setting() -> None:
    with pytest.raises(InvalidArgument) as refused:
        await check_url("https://169.254.169.254/latest/meta-data/", LOOPBACK)
    assert "link-local" in refused.value.message
    assert "TETHER_ALLOW_PRIVATE_TARGETS=link-local" in refused.value.message
    with pytest.raises(InvalidArgument, match=r"::1 is a loopback address.*=loopback"):
        await check_url("https://[::1]:8443/hook", NONE)
    with pytest.raises(InvalidArgument, match=r"reaches 127.0.0.1\) is a loopback address"):
        await check_url("https://[::ffff:127.0.0.1]/hook", NONE)
    with pytest.raises(InvalidArgument, match="unspecified address, never a target"):
        await check_url("https://0.0.0.0/", TargetPolicy.parse("all"))


async def test_an_allowed_or_public_literal_is_accepted() -> None:
    url = "https://[::1]:8443/hook"
    assert await check_url(url, LOOPBACK) == url
    assert await check_url("https://8.8.8.8/x", NONE) == "https://8.8.8.8/x"
    assert await check_url("http://10.0.0.7:8080/", TargetPolicy.parse("private"))


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("ftp://8.8.8.8/file", "must be an https URL, not ftp"),
        ("8.8.8.8/hook", "must be an https URL, not schemeless"),
        ("https://user:pw@8.8.8.8/", "must not carry a user or password"),
        ("https://token@8.8.8.8/", "must not carry a user or password"),
        ("https:///hook", "names no host"),
        ("https://:443/hook", "names no host"),
        ("https://8.8.8.8:70000/", "not a valid URL"),
        ("https://8.8.8.8:port/", "not a valid URL"),
        ("http://8.8.8.8/hook", "plain http is only for an allowed non-public address"),
        ("https://" + "a" * 64 + ".example/", "does not resolve"),
    ],
)
async def test_a_malformed_url_is_refused_saying_what_is_wrong(url: str, says: str) -> None:
    with pytest.raises(InvalidArgument, match=says):
        await check_url(url, TargetPolicy.parse("all"))


def test_every_service_reads_the_setting_and_refuses_a_misspelt_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TETHER_ALLOW_PRIVATE_TARGETS", "loopback, private")
    assert PlatformSettings().target_policy == TargetPolicy.parse("private,loopback")
    monkeypatch.setenv("TETHER_ALLOW_PRIVATE_TARGETS", "loopbak")
    with pytest.raises(ValidationError, match="'loopbak' is not a class of address"):
        PlatformSettings()
    monkeypatch.delenv("TETHER_ALLOW_PRIVATE_TARGETS")
    assert PlatformSettings().target_policy.allowed == frozenset()


@pytest.mark.parametrize(
    "url",
    [
        "https://bot:xoxb-SECRET-TOKEN@hooks.example.com:80a/x",
        "https://bot:xoxb-SECRET[TOKEN@hooks.example.com/x",
        "https://bot:xoxb-SECRET-TOKEN@hooks.example.com:99999/",
        "https://bot:xoxb/SECRET-TOKEN@hooks.example.com/",
    ],
)
async def test_a_malformed_url_carrying_a_password_is_refused_without_quoting_it(
    url: str,
) -> None:
    with pytest.raises(InvalidArgument, match="not a valid URL") as refused:
        await check_url(url, TargetPolicy.parse("all"))
    assert "SECRET" not in refused.value.message
    assert "xoxb" not in refused.value.message


@pytest.mark.parametrize(
    "address",
    [
        "::127.0.0.1",  # IPv4-compatible (::/96, deprecated by RFC 4291)
        "::a9fe:a9fe",  # the same, embedding 169.254.169.254
        "::ffff:0:7f00:1",  # IPv4-translated (RFC 2765): a SIIT translator reaches 127.0.0.1
        "64:ff9b:1::a9fe:a9fe",  # local-use NAT64 (RFC 8215): a local translator's prefix
        "fec0::1",  # site-local (deprecated by RFC 3879), still routed inside some sites
    ],
)
def test_an_ipv6_address_outside_global_unicast_is_never_public(address: str) -> None:
    assert classify(ipaddress.ip_address(address)) is AddressClass.RESERVED
    assert not TargetPolicy.parse("all").allows(ipaddress.ip_address(address))


@pytest.mark.parametrize(
    "url",
    [
        "https://8.8.8.8\n/x",
        "https://8.8.\t8.8/x",
        "https://8.8.8.8/x\r\nHost: evil",
        "https://8.8.8.8/a b",
    ],
)
async def test_a_url_with_control_characters_or_spaces_is_refused(url: str) -> None:
    # The parser drops tabs and newlines before reading the URL: what it checked would not be
    # what is stored, shown and logged.
    with pytest.raises(InvalidArgument, match="control characters or spaces"):
        await check_url(url, TargetPolicy.parse("all"))
