"""Orchestrator process entry point: `python -m services.orchestrator`."""

from __future__ import annotations

from services.orchestrator import observed
from services.orchestrator.execution import Execution
from services.orchestrator.maintenance import listen_for_hints
from services.orchestrator.retention import Retention
from services.orchestrator.service import Runs
from services.orchestrator.servicer import OrchestratorServicer
from services.orchestrator.settings import OrchestratorSettings
from services.orchestrator.work import WorkSettings
from tether import telemetry
from tether.bus import Bus
from tether.credentials import require_verifiers
from tether.db.engine import create_engine
from tether.runtime.process import announce, run, serve
from tether.runtime.readiness import await_schema
from tether.runtime.rpc import start_server
from tether.runtime.tasks import Supervisor, rounds
from tether.runtime.tls import MutualTls, mutual_tls
from tether.telemetry.setup import configure, metric_export_interval_s
from tether.v1 import orchestrator_pb2, orchestrator_pb2_grpc

# A due retry another replica holds locked is looked at again this soon, not spun on.
RETRY_ROUND_LEAST_S = 0.05


async def amain(
    settings: OrchestratorSettings, verifiers: dict[str, str], tls: MutualTls | None
) -> None:
    """Run the orchestrator until signalled."""
    engine = create_engine(settings.database_url, pool_size=settings.pool_size)
    bus = Bus(settings.redis_url)
    execution = Execution.build(
        engine,
        bus,
        lease_ttl_s=settings.lease_ttl_s,
        claim_poll_s=settings.claim_poll_s,
        claim_poll_hinted_s=settings.claim_poll_hinted_s,
    )
    work = WorkSettings(
        lease_ttl_s=settings.lease_ttl_s,
        keepalive_interval_s=settings.keepalive_interval_s or settings.lease_ttl_s / 4,
        progress_deadline_s=settings.progress_deadline_s,
        render_timeout_s=settings.render_timeout_s,
    )
    retention = Retention(engine, settings)
    servicer = OrchestratorServicer(
        Runs(engine, execution.publisher, bus),
        execution,
        work,
        retention,
        target_policy=settings.target_policy,
    )
    served = await start_server(
        host=settings.host,
        port=settings.port,
        register=[
            lambda s: orchestrator_pb2_grpc.add_OrchestratorServiceServicer_to_server(servicer, s)
        ],
        service_names=[
            orchestrator_pb2.DESCRIPTOR.services_by_name["OrchestratorService"].full_name
        ],
        verifiers=verifiers,
        # Work streams are long-lived: asked to go away now and then, workers rebalance across
        # replicas (they reconnect and carry on with the leases they hold).
        max_connection_age_s=settings.max_connection_age_s,
        max_connection_age_grace_s=settings.max_connection_age_grace_s,
        tls=tls,
        health_port=settings.health_port,
        ready=False,
    )
    announce(settings.ready_file, served)
    # Nothing runs against a schema older than this release's: no round, no dispatch.
    await await_schema(engine, poll_s=settings.schema_poll_s)
    supervisor = Supervisor()
    recovery = execution.recovery
    supervisor.start(
        "reaper",
        rounds(
            recovery.reap_round,
            "reaper",
            least_s=settings.reap_interval_s,
            most_s=settings.lease_ttl_s,
        ),
    )
    supervisor.start(
        "retry-scheduler",
        rounds(
            recovery.retry_round,
            "retry scheduler",
            least_s=RETRY_ROUND_LEAST_S,
            most_s=settings.retry_poll_s,
            nudge=recovery.retry_scheduled,
        ),
    )
    supervisor.start("retention", retention.sweeps.run())
    supervisor.start("hint-listener", listen_for_hints(bus, execution.publisher, servicer.work))
    supervisor.start("claim-poll", execution.claims.poll_claimable())
    supervisor.start("cap-watch", execution.claims.caps.watch())
    supervisor.start("lease-dispatcher", servicer.work.dispatch(settings.claim_poll_s))
    if telemetry.on:
        # Read once per metric export: what the queue gauges report.
        every_s = metric_export_interval_s()
        supervisor.start(
            "queue-gauges",
            rounds(observed.watch_queue(engine), "queue gauges", least_s=every_s, most_s=every_s),
        )
    await served.ready()
    await serve(
        served,
        grace=settings.grace_s,
        cleanups=[engine.dispose, bus.close, supervisor.stop],
        failed=supervisor.failed,
    )


def main() -> None:
    """Read settings from the environment and serve."""
    settings = OrchestratorSettings()
    configure("orchestrator", settings)
    verifiers = require_verifiers("orchestrator", settings.service_verifiers)
    tls = mutual_tls("orchestrator", settings, serves=True, calls=False)
    run(amain(settings, verifiers, tls))


if __name__ == "__main__":
    main()
