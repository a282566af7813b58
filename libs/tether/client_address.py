"""Where a client finds the gateway and its credential: a stack.json that `tether up` wrote, or
the environment (`TETHER_GATEWAY`, `TETHER_OPERATOR_CREDENTIAL`)."""

from __future__ import annotations

import json
import os
from pathlib import Path


def load_stack(path: str | Path) -> tuple[str, str]:
    """(gateway address, API key) from a stack.json."""
    info = json.loads(Path(path).read_text())
    return str(info["gateway"]), str(info["api_key"])


def operator_from_env(stack: str | None) -> tuple[str, str]:
    """(gateway address, operator credential) from a stack.json or the environment."""
    gateway = os.environ.get("TETHER_GATEWAY", "")
    secret = os.environ.get("TETHER_OPERATOR_CREDENTIAL", "")
    if stack:
        info = json.loads(Path(stack).read_text())
        gateway, secret = str(info["gateway"]), str(info.get("operator_credential", ""))
    if not gateway or not secret:
        raise ValueError(
            "no operator credential: pass --stack <data-dir>/stack.json or set "
            "TETHER_GATEWAY and TETHER_OPERATOR_CREDENTIAL"
        )
    return gateway, secret
