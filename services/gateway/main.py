"""Gateway process entry point: `python -m services.gateway`."""

from __future__ import annotations

import asyncio

from services.gateway import browser_credentials
from services.gateway.auth import Authenticator
from services.gateway.grpc.admissions import Admissions
from services.gateway.grpc.agents import AgentRpcs
from services.gateway.grpc.callers import Callers
from services.gateway.grpc.channels import ChannelRpcs
from services.gateway.grpc.documents import DocumentRpcs
from services.gateway.grpc.interactions import InteractionRpcs
from services.gateway.grpc.keys import KeyRpcs
from services.gateway.grpc.runs import RunRpcs
from services.gateway.grpc.schedules import ScheduleRpcs
from services.gateway.grpc.secrets import SecretRpcs
from services.gateway.grpc.servicer import GatewayServicer
from services.gateway.grpc.streaming import StreamRpcs
from services.gateway.grpc.tenants import TenantRpcs
from services.gateway.grpc.webhooks import WebhookRpcs
from services.gateway.http.app import http_app, start_http
from services.gateway.http.bridge_v1 import BridgeV1
from services.gateway.http.bridge_v2 import BridgeV2
from services.gateway.http.console import Console
from services.gateway.http.edge import Edge
from services.gateway.http.signin import SignIn, SignInPolicy
from services.gateway.http.webhook_lookup import Verifications
from services.gateway.http.webhooks_in import Webhooks
from services.gateway.live.run_list import LiveListTiming, LiveRuns
from services.gateway.live.streams import build_streams
from services.gateway.settings import GatewaySettings
from tether import telemetry
from tether.credentials import require_credential
from tether.db.engine import create_engine
from tether.runtime.process import announce, run, serve
from tether.runtime.readiness import await_schema
from tether.runtime.rpc import internal_channel, start_server
from tether.runtime.tasks import Supervisor, rounds
from tether.runtime.tls import MutualTls, mutual_tls
from tether.telemetry import metrics
from tether.telemetry.setup import configure
from tether.v1 import (
    admission_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    interactions_pb2_grpc,
    orchestrator_pb2_grpc,
)


async def amain(settings: GatewaySettings, credential: str, tls: MutualTls | None) -> None:
    """Run the gateway until signalled."""
    engine = create_engine(
        settings.database_url, pool_size=settings.pool_size, application="gateway"
    )
    admission = internal_channel(settings.admission_addr, credential, service="admission", tls=tls)
    orchestrator = internal_channel(
        settings.orchestrator_addr, credential, service="orchestrator", tls=tls
    )
    interactions = internal_channel(
        settings.interactions_addr, credential, service="interactions", tls=tls
    )
    auth = Authenticator(
        engine,
        cache_ttl_s=settings.key_cache_ttl_s,
        recheck_s=settings.key_recheck_s,
        operator_sha256=settings.operator_credential_sha256,
    )
    orchestrator_stub = orchestrator_pb2_grpc.OrchestratorServiceStub(orchestrator)
    supervisor = Supervisor()
    # Set by SIGTERM/SIGINT (through `serve`) or by a supervised task (the event hub) dying.
    stopping = supervisor.failed
    streams = build_streams(settings, orchestrator_stub)
    streams.hub.start(supervisor)
    if telemetry.on:
        metrics.observe_subscribers(streams.hub.open_feeds)
    live_runs = LiveRuns(
        orchestrator_stub,
        streams.hub,
        LiveListTiming(
            reread_s=settings.live_list_reread_s,
            poll_s=max(settings.poll_interval_s, 1.0),
            keepalive_s=settings.keepalive_interval_s,
        ),
    )
    admission_stub = admission_pb2_grpc.AdmissionServiceStub(admission)
    # Each AdmitStream on a connection of its own: a drained stream's successor may reach
    # another replica.
    admissions = Admissions(
        lambda: internal_channel(
            settings.admission_addr, credential, service="admission", tls=tls, own_connection=True
        ),
        admission_stub,
        timeout_s=settings.admit_timeout_s,
    )
    interactions_stub = interactions_pb2_grpc.InteractionsServiceStub(interactions)
    callers = Callers(auth)
    channels = ChannelRpcs(callers, interactions_stub, settings.public_url)
    servicer = GatewayServicer(
        runs=RunRpcs(callers, admissions, admission_stub, orchestrator_stub),
        interactions=InteractionRpcs(callers, interactions_stub),
        keys=KeyRpcs(callers, auth, engine),
        documents=DocumentRpcs(callers, orchestrator_stub),
        agents=AgentRpcs(callers, orchestrator_stub),
        secrets=SecretRpcs(callers, interactions_stub),
        channels=channels,
        webhooks=WebhookRpcs(callers, orchestrator_stub),
        schedules=ScheduleRpcs(callers, admission_stub, orchestrator_stub),
        tenants=TenantRpcs(
            callers=callers,
            auth=auth,
            engine=engine,
            admission=admission_stub,
            orchestrator=orchestrator_stub,
            interactions=interactions_stub,
            revocation_bound_s=settings.key_cache_ttl_s + settings.key_recheck_s,
        ),
        streams=StreamRpcs(callers, streams, live_runs),
    )
    served = await start_server(
        host=settings.host,
        port=settings.port,
        register=[lambda s: gateway_pb2_grpc.add_GatewayServiceServicer_to_server(servicer, s)],
        service_names=[gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name],
        # The gateway is the public edge: callers authenticate with API keys instead.
        verifiers=None,
        reflection_on=settings.reflection,
        health_port=settings.health_port,
        ready=False,
    )
    sweep = browser_credentials.Sweep(engine)
    sign_in = SignIn(
        auth,
        engine,
        SignInPolicy(
            session_ttl_s=settings.session_ttl_s, token_max_ttl_s=settings.token_max_ttl_s
        ),
        sweep,
    )
    app = http_app(
        [
            BridgeV1(servicer, streams, auth),
            BridgeV2(servicer, streams, live_runs, auth),
            sign_in,
            Console(settings.console_path()),
            Webhooks(Verifications(interactions_stub), admissions, orchestrator_stub),
        ],
        Edge(settings.cors_origin_list()),
    )
    http, http_port = await start_http(app, settings.host, settings.http_port, settings.grace_s)
    channels.listening_at(f"http://{settings.host}:{http_port}")
    announce(settings.ready_file, served, http=http_port)
    await await_schema(engine, poll_s=settings.schema_poll_s)
    supervisor.start(
        "credential sweep",
        rounds(
            sweep.round,
            "credential sweep",
            least_s=1.0,
            most_s=float(settings.token_max_ttl_s),
            nudge=sweep.nudge,
        ),
    )
    await served.ready()

    async def end_streams_when_stopping() -> None:
        # Open streams end at once with their resume cursor instead of holding the drain.
        await stopping.wait()
        streams.hub.close_feeds()

    ender = asyncio.create_task(end_streams_when_stopping(), name="end-streams")

    async def close_channels() -> None:
        await admissions.close()
        await admission.close()
        await orchestrator.close()
        await interactions.close()

    await serve(
        served,
        grace=settings.grace_s,
        cleanups=[engine.dispose, close_channels, supervisor.stop, streams.hub.stop, http.cleanup],
        failed=stopping,
    )
    ender.cancel()


def main() -> None:
    """Read settings from the environment and serve."""
    settings = GatewaySettings()
    configure("gateway", settings)
    credential = require_credential("gateway", settings.service_credential)
    # Its own server is the public edge (TLS ends at the ingress); its calls inward are mTLS.
    tls = mutual_tls("gateway", settings, serves=False, calls=True)
    run(amain(settings, credential, tls))


if __name__ == "__main__":
    main()
