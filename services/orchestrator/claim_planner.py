"""How the claim's own pool plans (`tether.db.engine.create_engine(planner=...)`): the
orchestrator's claims pool, and every test and bench that claims as it does."""

from __future__ import annotations

# The claim is one large statement whose every step is an index probe or an ordered index walk;
# what the statistics say of the queue at a moment (none on a fresh table, few queued runs
# before a burst) must not change that:
# - one generic plan, made once per connection: left to choose, PostgreSQL planned the
#   statement afresh at each claim (several ms) whenever its generic estimate came out above
#   the custom ones;
# - no bitmap scans: with the queued runs underestimated, the slots' walk of ix_runs_fair in
#   start-tag order became a bitmap read of every claimable run and a sort of them all (issue
#   32: a quiet tenant's claim 25-54 ms instead of 5 beside a hot tenant's 10,000 queued runs);
# - no sequential scans where an index reaches the rows: a connection keeps the plan it made
#   first, often on a table of a few runs (a fresh deployment, a replica started early), and
#   there a scan of `runs` looked cheaper than a primary-key probe for each run leased, so
#   every claim after read the whole table (issue 34: a third of a scan of `runs` per run at
#   saturation in the bench). Tables with no index for the read (a handful of rows: tenants
#   by their cap) are still scanned.
CLAIM_PLANNER = {
    "plan_cache_mode": "force_generic_plan",
    "enable_bitmapscan": "off",
    "enable_seqscan": "off",
}
