"""Admission process entry point: `python -m services.admission`."""

from __future__ import annotations

from services.admission.domain import FreshnessPolicy
from services.admission.retention import Retention
from services.admission.schedules import Schedules, Ticker, TickerTiming, file_clock, system_clock
from services.admission.service import Admitter
from services.admission.servicer import AdmissionServicer
from services.admission.settings import AdmissionSettings
from services.admission.stream import StreamTiming
from tether.bus import Bus
from tether.credentials import require_verifiers
from tether.db.engine import create_engine
from tether.runtime.process import announce, run, serve
from tether.runtime.readiness import await_schema
from tether.runtime.rpc import start_server
from tether.runtime.tasks import Supervisor
from tether.runtime.tls import MutualTls, mutual_tls
from tether.telemetry.setup import configure
from tether.v1 import admission_pb2, admission_pb2_grpc


async def amain(
    settings: AdmissionSettings, verifiers: dict[str, str], tls: MutualTls | None
) -> None:
    """Run the admission service until signalled."""
    engine = create_engine(
        settings.database_url, pool_size=settings.pool_size, application="admission"
    )
    bus = Bus(settings.redis_url)
    admitter = Admitter(
        engine,
        max_attempts=settings.max_attempts,
        freshness=FreshnessPolicy(settings.replay_window_s, settings.stale_replay),
        bus=bus,
    )
    retention = Retention(engine, settings)
    clock = (
        file_clock(settings.schedule_clock_file) if settings.schedule_clock_file else system_clock
    )
    ticker = Ticker(
        engine,
        max_attempts=settings.max_attempts,
        timing=TickerTiming(
            settings.schedule_poll_s, settings.schedule_batch, settings.schedule_grace_s
        ),
        clock=clock,
        bus=bus,
    )
    servicer = AdmissionServicer(
        admitter,
        retention,
        StreamTiming(settings.max_stream_age_s, settings.stream_drain_grace_s),
        Schedules(engine, clock),
    )
    served = await start_server(
        host=settings.host,
        port=settings.port,
        register=[lambda s: admission_pb2_grpc.add_AdmissionServiceServicer_to_server(servicer, s)],
        service_names=[admission_pb2.DESCRIPTOR.services_by_name["AdmissionService"].full_name],
        verifiers=verifiers,
        tls=tls,
        health_port=settings.health_port,
        ready=False,
    )
    served.on_stop.append(servicer.streams.drain_all)
    announce(settings.ready_file, served)
    await await_schema(engine, poll_s=settings.schema_poll_s)
    supervisor = Supervisor()
    # Nothing is swept under a schema older than this release's.
    supervisor.start("retention", retention.sweeps.run())
    supervisor.start("schedules", ticker.run())
    await served.ready()
    await serve(
        served,
        grace=settings.grace_s,
        cleanups=[engine.dispose, bus.close, supervisor.stop],
        failed=supervisor.failed,
    )


def main() -> None:
    """Read settings from the environment and serve."""
    settings = AdmissionSettings()
    configure("admission", settings)
    verifiers = require_verifiers("admission", settings.service_verifiers)
    tls = mutual_tls("admission", settings, serves=True, calls=False)
    run(amain(settings, verifiers, tls))


if __name__ == "__main__":
    main()
