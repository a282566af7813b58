"""The secrets key: given to interactions alone, and `tether up`'s dev key made once,
owner-only."""

from __future__ import annotations

import stat
from pathlib import Path

from services.interactions.sealing import Keyring
from tether.credentials import SECRETS_KEY_ENV
from tether.stack.processes import SERVICES, meant_for
from tether.stack.up import _secrets_key


def test_only_interactions_is_meant_the_secrets_key() -> None:
    holders = [service for service in SERVICES if meant_for(service, SECRETS_KEY_ENV)]
    assert holders == ["interactions"]


def test_tether_up_makes_one_key_owner_only_and_keeps_it(tmp_path: Path) -> None:
    path = tmp_path / "secrets_key"
    first = _secrets_key(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert _secrets_key(path) == first
    sealed = Keyring.parse(first).seal(b"value", b"aad")
    assert Keyring.parse(_secrets_key(path)).open(sealed, b"aad") == b"value"
