"""Sealing: AES-GCM bound to tenant and name, keys that rotate, a missing key refused."""

from __future__ import annotations

import dataclasses

import pytest

from services.interactions.sealing import Keyring, associated_data
from tether.errors import FailedPrecondition

AAD = associated_data("t1", "secret", "slack-bot")


def test_seals_and_opens_without_the_value_in_the_ciphertext() -> None:
    ring = Keyring.parse(Keyring.generate_setting("k1"))
    sealed = ring.seal(b"xoxb-value-1234", AAD)
    assert b"xoxb-value-1234" not in sealed.ciphertext
    assert sealed.key_id == "k1"
    assert len(sealed.nonce) == 12
    assert ring.open(sealed, AAD) == b"xoxb-value-1234"
    assert ring.seal(b"xoxb-value-1234", AAD).nonce != sealed.nonce


@pytest.mark.parametrize(
    "moved", [associated_data("t2", "secret", "slack-bot"), associated_data("t1", "secret", "x")]
)
def test_a_row_moved_to_another_tenant_or_name_does_not_open(moved: bytes) -> None:
    ring = Keyring.parse(Keyring.generate_setting())
    sealed = ring.seal(b"value", AAD)
    with pytest.raises(FailedPrecondition) as info:
        ring.open(sealed, moved)
    assert info.value.code == "secret_corrupt"


def test_rotation_first_key_seals_all_keys_open() -> None:
    old = Keyring.generate_setting("old")
    sealed_before = Keyring.parse(old).seal(b"value", AAD)
    rotated = Keyring.parse(f"{Keyring.generate_setting('new')},{old}")
    assert rotated.open(sealed_before, AAD) == b"value"
    assert rotated.seal(b"value", AAD).key_id == "new"
    retired = Keyring.parse(Keyring.generate_setting("new"))
    with pytest.raises(FailedPrecondition) as info:
        retired.open(sealed_before, AAD)
    assert info.value.code == "secrets_key_retired"
    tampered = dataclasses.replace(sealed_before, key_id="new")
    with pytest.raises(FailedPrecondition):
        rotated.open(tampered, AAD)


def test_without_the_setting_the_store_refuses_naming_it() -> None:
    ring = Keyring.parse("")
    with pytest.raises(FailedPrecondition, match="TETHER_SECRETS_KEY"):
        ring.seal(b"value", AAD)


@pytest.mark.parametrize(
    "setting", ["nokey", "k1:not-base64!", "k1:AAAA", "bad id:" + "A" * 44, "k:{0},k:{0}"]
)
def test_a_malformed_setting_is_refused_at_startup(setting: str) -> None:
    with pytest.raises(ValueError, match="TETHER_SECRETS_KEY"):
        Keyring.parse(setting.format(Keyring.generate_setting().split(":")[1]))
