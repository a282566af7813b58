"""`python -m tests.drill [--minutes M] [--seed S]`: the chaos soak. Progress on stderr; the
report as ONE JSON object on the last line of stdout; exit 1 when an invariant fails."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from tests.drill.soak import SoakConfig, soak

# Whatever happens the soak ends: starting the world and checking are bounded too.
STARTUP_BOUND_S = 300.0
CHECK_BOUND_S = 120.0


def main(argv: list[str] | None = None) -> int:
    """Parse, soak, print the report; the exit code."""
    parser = argparse.ArgumentParser(prog="python -m tests.drill", description=__doc__)
    parser.add_argument("--minutes", type=float, default=float(os.environ.get("MINUTES") or 5))
    parser.add_argument("--seed", type=int, default=int(os.environ.get("SEED") or 0) or None)
    parser.add_argument("--settle-s", type=float, default=45.0, help="bound on settling")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (logs, data)")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 2**31)
    if not 0 < args.minutes <= 120:
        parser.error("--minutes must be in (0, 120]")
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s"
    )
    print(
        f"drill: SEED={seed} MINUTES={args.minutes:g} "
        f"(make drill SEED={seed} MINUTES={args.minutes:g} replays this schedule)",
        file=sys.stderr,
        flush=True,
    )
    work_dir = Path(tempfile.mkdtemp(prefix="tether-drill-"))
    config = SoakConfig(seed=seed, minutes=args.minutes, settle_s=args.settle_s)
    # SIGTERM unwinds like Ctrl-C, so the services (own sessions) are stopped on the way out.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    bound = STARTUP_BOUND_S + args.minutes * 60 + args.settle_s + CHECK_BOUND_S
    report = {
        "seed": seed,
        "minutes": args.minutes,
        **asyncio.run(asyncio.wait_for(soak(config, work_dir), bound)),
    }
    failed = bool(report["failed_invariants"] or report["faults_failed"])
    report["ok"] = not failed
    if failed or args.keep:
        print(f"drill: work dir kept at {work_dir}", file=sys.stderr)
    else:
        shutil.rmtree(work_dir, ignore_errors=True)
    print(json.dumps(report, sort_keys=True, default=str), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
