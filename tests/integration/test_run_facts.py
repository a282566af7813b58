"""The facts interactions may know of a run, read against the real PostgreSQL: asked with a lease
epoch, the orchestrator says whether that lease is live, by its one lease fence (interactions'
sweeps decide orphans on it)."""

from __future__ import annotations

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from services.admission.domain import FreshnessPolicy
from services.admission.service import Admitter
from services.orchestrator.execution import Execution
from services.orchestrator.service import Runs
from tests.integration.test_admission import _tenant, chat
from tether.errors import NotFound
from tether.visibility import Viewer

pytestmark = pytest.mark.asyncio(loop_scope="session")

SWEEPS = Viewer("t1", "", all_runs=True)


async def test_a_lookup_with_an_epoch_says_whether_that_lease_is_live(engine: AsyncEngine) -> None:
    await _tenant(engine, "t1", "t2")
    execution = Execution.build(engine, None, lease_ttl_s=30, claim_poll_s=60)
    runs = Runs(engine, execution.publisher, None)
    admitter = Admitter(engine, max_attempts=3, freshness=FreshnessPolicy())
    run_id = (await admitter.admit(chat("e-facts", conversation="c-facts"))).run.run_id

    _, lease_held = await runs.facts(SWEEPS, run_id, 0)
    assert not lease_held, "a queued run holds no lease"

    claimed = await execution.claims.claim("w-1", wait_s=0)
    assert claimed is not None and claimed.run.run_id == run_id
    epoch = claimed.run.lease_epoch
    assert (await runs.facts(SWEEPS, run_id, epoch))[1]
    assert not (await runs.facts(SWEEPS, run_id, epoch - 1))[1], "an earlier lease"
    assert not (await runs.facts(SWEEPS, run_id, None))[1], "no lease asked about"

    assert await execution.attempts.release(run_id, epoch)
    released, lease_held = await runs.facts(SWEEPS, run_id, epoch)
    assert (released.status, released.lease_epoch) == ("queued", epoch)
    assert not lease_held, "the same epoch, but the run is no longer running under it"

    with pytest.raises(NotFound):
        await runs.facts(Viewer("t2", "", all_runs=True), run_id, epoch)
