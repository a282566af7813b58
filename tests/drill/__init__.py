"""`make drill`: the chaos soak. A bounded, seeded run of steady load against the stack as real
processes while faults land at seeded moments, then an invariant checker over PostgreSQL, the
ledger and every client's transcript; `python -m tests.drill --help` for the knobs.

It lives under `tests/` rather than `bench/` because it is a test: it passes or fails on
invariants (non-zero exit), and the 60-second version runs in `make test`
(tests/system/test_chaos_soak.py). `bench/` prints figures and never fails.
"""
