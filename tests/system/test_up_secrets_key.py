"""`tether up` generates the secret store's key once, keeps it owner-only in its data dir and
hands it to interactions alone: read off every live service's /proc environment."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from tests.system.test_up_supervision import environ_of, running_up
from tether.credentials import SECRETS_KEY_ENV
from tether.stack.processes import SERVICES

# `make slow`: a whole `tether up`.
pytestmark = pytest.mark.slow


async def test_only_interactions_holds_the_secrets_key(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    async with running_up(data_dir, TETHER_WORKERS="1") as up:
        key_file = data_dir / "secrets_key"
        key = key_file.read_text().strip()
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        pids = up.info()["pids"]
        assert environ_of(pids["interactions"])[SECRETS_KEY_ENV] == key
        for name in SERVICES:
            if name == "interactions":
                continue
            env = environ_of(pids[name])
            assert SECRETS_KEY_ENV not in env, f"{name} holds the secrets key"
            assert key.split(":", 1)[1] not in "\n".join(env.values()), (
                f"{name} holds the secrets key under another name"
            )
