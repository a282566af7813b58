"""Orchestrator process entry point: `python -m services.orchestrator`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import timedelta

from services.orchestrator import observed
from services.orchestrator.children import SCAN_EVERY_S
from services.orchestrator.claim_planner import CLAIM_PLANNER
from services.orchestrator.execution import Execution
from services.orchestrator.limit_store import LimitStore
from services.orchestrator.maintenance import listen_for_hints
from services.orchestrator.rate_limits import ModelLimits
from services.orchestrator.retention import Retention
from services.orchestrator.service import Runs
from services.orchestrator.servicer import OrchestratorServicer
from services.orchestrator.settings import OrchestratorSettings
from services.orchestrator.webhook_dispatch import Dispatcher, DispatchSettings
from services.orchestrator.webhooks import Subscriptions
from services.orchestrator.webhooks_edge import InteractionsSecrets
from services.orchestrator.work import WorkSettings
from tether import telemetry
from tether.bus import Bus
from tether.credentials import require_verifiers
from tether.db.engine import create_engine
from tether.runtime.process import announce, run, serve
from tether.runtime.readiness import await_schema
from tether.runtime.rpc import internal_channel, start_server
from tether.runtime.tasks import Supervisor, rounds
from tether.runtime.tls import MutualTls, mutual_tls
from tether.telemetry.setup import configure, metric_export_interval_s
from tether.v1 import interactions_pb2_grpc, orchestrator_pb2, orchestrator_pb2_grpc

# A due retry another replica holds locked is looked at again this soon, not spun on.
RETRY_ROUND_LEAST_S = 0.05
# A round that sent something looks again this soon: a run's next event waits on the previous.
WEBHOOK_ROUND_LEAST_S = 0.05
# Subscriptions scanned, and deliveries sent at once, per round.
WEBHOOK_BATCH = 50


def _dispatch_settings(settings: OrchestratorSettings) -> DispatchSettings:
    return DispatchSettings(
        disable_after=settings.webhook_disable_window,
        backoff_base_s=settings.webhook_backoff_base_s,
        backoff_max_s=settings.webhook_backoff_max_s,
        send_timeout_s=settings.webhook_send_timeout_s,
        scan_lookback=timedelta(seconds=settings.webhook_scan_lookback_s),
        batch=WEBHOOK_BATCH,
        secret_ttl_s=settings.webhook_secret_ttl_s,
        log_keep=timedelta(seconds=settings.webhook_log_keep_s),
        scan_every_s=settings.webhook_poll_s,
        waiting_scan_every_s=settings.webhook_waiting_poll_s,
    )


async def amain(
    settings: OrchestratorSettings,
    verifiers: dict[str, str],
    tls: MutualTls | None,
    credential: str = "",
) -> None:
    """Run the orchestrator until signalled."""
    engine = create_engine(
        settings.database_url, pool_size=settings.pool_size, application="orchestrator"
    )
    claim_engine = create_engine(
        settings.database_url,
        pool_size=settings.claim_pool_size,
        planner=CLAIM_PLANNER,
        application="orchestrator-claims",
    )
    bus = Bus(settings.redis_url)
    execution = Execution.build(
        engine,
        bus,
        lease_ttl_s=settings.lease_ttl_s,
        claim_poll_s=settings.claim_poll_s,
        claim_poll_hinted_s=settings.claim_poll_hinted_s,
        claim_engine=claim_engine,
        stored_format=settings.stored_format,
    )
    work = WorkSettings(
        lease_ttl_s=settings.lease_ttl_s,
        keepalive_interval_s=settings.keepalive_interval_s or settings.lease_ttl_s / 4,
        progress_deadline_s=settings.progress_deadline_s,
        render_timeout_s=settings.render_timeout_s,
    )
    retention = Retention(engine, settings)
    # Run-event webhooks need interactions (the subscriptions' secrets are sealed there).
    interactions = (
        internal_channel(settings.interactions_addr, credential, service="interactions", tls=tls)
        if settings.interactions_addr and credential
        else None
    )
    secrets = (
        None
        if interactions is None
        else InteractionsSecrets(interactions_pb2_grpc.InteractionsServiceStub(interactions))
    )
    policy = settings.target_policy
    servicer = OrchestratorServicer(
        Runs(engine, execution.publisher, bus),
        execution,
        work,
        retention,
        Subscriptions(engine, secrets, policy),
        target_policy=settings.target_policy,
        model_limits=ModelLimits.from_text(
            settings.model_limits, recheck_s=settings.model_limit_recheck_s
        )
        if settings.model_limits.strip()
        else None,
    )
    limit_store = (
        None
        if servicer.model_limits is None
        else LimitStore(
            engine,
            servicer.model_limits,
            execution.publisher.wake_marker,
            lambda: servicer.work.connected,
            replica_timeout_s=settings.model_limit_replica_timeout_s,
            share_override=settings.model_limit_share,
        )
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
    supervisor.start(
        "timer-waker",
        rounds(
            execution.timers.round,
            "timer waker",
            least_s=RETRY_ROUND_LEAST_S,
            most_s=settings.retry_poll_s,
            nudge=execution.timers.timer_set,
        ),
    )
    supervisor.start(
        "children-waker",
        rounds(
            execution.children.round,
            "children waker",
            least_s=RETRY_ROUND_LEAST_S,
            # Nudged when a child ends or a parent parks here (a look at that parent): the
            # look for those another replica saw need not be as eager as the retries' (a
            # fast test setting).
            most_s=max(settings.retry_poll_s, SCAN_EVERY_S),
            nudge=execution.children.nudge,
        ),
    )
    supervisor.start("retention", retention.sweeps.run())
    supervisor.start("hint-listener", listen_for_hints(bus, execution.publisher, servicer.work))
    supervisor.start("claim-poll", execution.claims.poll_claimable())
    supervisor.start("cap-watch", execution.claims.caps.watch())
    supervisor.start("lease-dispatcher", servicer.work.dispatch(settings.claim_poll_s))
    cleanups: list[Callable[[], Awaitable[None]]] = [
        engine.dispose,
        claim_engine.dispose,
        bus.close,
        supervisor.stop,
    ]
    if limit_store is not None:
        servicer.work.sessions_changed = limit_store.workers_changed
        # Before a grant: the buckets resume from the stored levels (ModelLimits.ready).
        await limit_store.resume()
        supervisor.start(
            "model-limit-store",
            rounds(
                limit_store.round,
                "model limit store",
                least_s=settings.model_limit_sync_s,
                most_s=settings.model_limit_sync_s,
            ),
        )
        # After the supervisor stops, before the engine is disposed: the last levels.
        cleanups.insert(1, limit_store.leave)
    if secrets is not None and interactions is not None:
        dispatcher = Dispatcher(engine, secrets, policy, _dispatch_settings(settings))
        supervisor.start(
            "webhook-dispatcher",
            rounds(
                dispatcher.round,
                "webhook dispatcher",
                least_s=WEBHOOK_ROUND_LEAST_S,
                most_s=settings.webhook_poll_s,
            ),
        )
        # After the supervisor: no round is using them when they close.
        cleanups += [dispatcher.close, interactions.close]
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
        cleanups=cleanups,
        failed=supervisor.failed,
    )


def main() -> None:
    """Read settings from the environment and serve."""
    settings = OrchestratorSettings()
    configure("orchestrator", settings)
    verifiers = require_verifiers("orchestrator", settings.service_verifiers)
    # Its own credential: it calls interactions for run-event webhooks' secrets (without one,
    # webhooks are refused and nothing is dispatched; everything else serves).
    credential = settings.service_credential
    tls = mutual_tls("orchestrator", settings, serves=True, calls=True)
    run(amain(settings, verifiers, tls, credential))


if __name__ == "__main__":
    main()
