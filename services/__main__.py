"""`python -m services [NAME]`: run one service, NAME or else $TETHER_SERVICE (the image's
entry point: `docker run IMAGE worker`, or the image built with `--build-arg SERVICE=worker`)."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

SERVICE_ENV = "TETHER_SERVICE"


def available() -> list[str]:
    """Every service this package holds (each a folder with its own `__main__`)."""
    here = Path(__file__).parent
    return sorted(p.parent.name for p in here.glob("*/__main__.py"))


def main() -> None:
    """Run the service named on the command line or in TETHER_SERVICE."""
    args = sys.argv[1:]
    name = args[0] if args else os.environ.get(SERVICE_ENV, "")
    services = available()
    if name not in services:
        raise SystemExit(
            f"which service? {name!r} is none of {', '.join(services)}: name one as the "
            f"first argument or in {SERVICE_ENV}"
        )
    if args[1:]:
        raise SystemExit(
            f"{name} takes no arguments ({' '.join(args[1:])!r}): every setting comes from "
            "its environment (TETHER_*)"
        )
    importlib.import_module(f"services.{name}.main").main()


if __name__ == "__main__":
    main()
