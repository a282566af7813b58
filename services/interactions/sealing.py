"""Sealing secrets at rest: AES-256-GCM under the keys of `TETHER_SECRETS_KEY`, which only the
interactions service holds.

The setting is `KEYID:base64key[,KEYID:base64key...]`: the first key seals, every key listed
opens, so a key rotates by putting a new one first (interactions then seals again under it
what the older keys sealed: `resealing`) and dropping the old once nothing sealed under it is
left. Each sealed value records its key's id beside it. The associated data binds a
ciphertext to its tenant and its name, so a row copied to another tenant or name does not open.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from tether.credentials import SECRETS_KEY_BYTES, SECRETS_KEY_ENV, new_secrets_key
from tether.errors import FailedPrecondition

SETTING = SECRETS_KEY_ENV
KEY_BYTES = SECRETS_KEY_BYTES
# GCM's standard nonce: 96 random bits, safe for far more values than one key ever seals.
NONCE_BYTES = 12
_KEY_ID = re.compile(r"[A-Za-z0-9_-]{1,32}")


@dataclass(frozen=True)
class Sealed:
    """A value sealed at rest: what the table stores, never the value."""

    ciphertext: bytes
    nonce: bytes
    key_id: str


def associated_data(tenant_id: str, kind: str, name: str) -> bytes:
    """What a ciphertext is bound to; JSON so no two (tenant, kind, name) encode alike."""
    return json.dumps([tenant_id, kind, name], separators=(",", ":")).encode()


class Keyring:
    """The keys of `TETHER_SECRETS_KEY`; empty when the setting is not given, and then every
    seal and open is refused (FAILED_PRECONDITION naming the setting) while the rest of the
    service (questions, approvals) keeps serving."""

    def __init__(self, keys: dict[str, bytes], sealing_key_id: str | None) -> None:
        self._keys = keys
        self._sealing_key_id = sealing_key_id

    @property
    def sealing_key_id(self) -> str | None:
        """The key that seals (the setting's first), None when there is none."""
        return self._sealing_key_id

    @property
    def key_ids(self) -> frozenset[str]:
        """Every key that opens."""
        return frozenset(self._keys)

    @classmethod
    def parse(cls, setting: str) -> Keyring:
        """Read `KEYID:base64key[,...]`; a malformed setting is a ValueError (startup fails)."""
        keys: dict[str, bytes] = {}
        first: str | None = None
        for entry in filter(None, (part.strip() for part in setting.split(","))):
            key_id, sep, encoded = entry.partition(":")
            if not sep or _KEY_ID.fullmatch(key_id) is None:
                raise ValueError(f"{SETTING}: each entry is KEYID:base64key (KEYID [A-Za-z0-9_-])")
            try:
                key = base64.b64decode(encoded, validate=True)
            except binascii.Error:
                raise ValueError(f"{SETTING}: key {key_id!r} is not base64") from None
            if len(key) != KEY_BYTES:
                raise ValueError(f"{SETTING}: key {key_id!r} must be {KEY_BYTES} bytes")
            if key_id in keys:
                raise ValueError(f"{SETTING}: key id {key_id!r} is listed twice")
            keys[key_id] = key
            first = first or key_id
        return cls(keys, first)

    @staticmethod
    def generate_setting(key_id: str = "dev1") -> str:
        """A new setting holding one fresh key (what `tether up` keeps in its data dir)."""
        return new_secrets_key(key_id)

    def _refuse(self) -> FailedPrecondition:
        return FailedPrecondition(
            f"the secret store is not configured: set {SETTING} on the interactions service",
            code="secrets_key_missing",
        )

    def seal(self, value: bytes, aad: bytes) -> Sealed:
        """Encrypt under the first key, with a fresh random nonce."""
        if self._sealing_key_id is None:
            raise self._refuse()
        nonce = os.urandom(NONCE_BYTES)
        key = self._keys[self._sealing_key_id]
        return Sealed(AESGCM(key).encrypt(nonce, value, aad), nonce, self._sealing_key_id)

    def open(self, sealed: Sealed, aad: bytes) -> bytes:
        """Decrypt; a key no longer listed, or a value moved to another tenant or name, is
        FAILED_PRECONDITION (the stored row is unusable, not the caller's input)."""
        if self._sealing_key_id is None:
            raise self._refuse()
        key = self._keys.get(sealed.key_id)
        if key is None:
            raise FailedPrecondition(
                f"sealed under key {sealed.key_id!r}, which {SETTING} no longer lists",
                code="secrets_key_retired",
            )
        try:
            return AESGCM(key).decrypt(sealed.nonce, sealed.ciphertext, aad)
        except InvalidTag:
            raise FailedPrecondition(
                "a stored secret does not open under its key and name", code="secret_corrupt"
            ) from None
