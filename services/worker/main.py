"""Worker process entry point: `python -m services.worker`.

A stateless process with no database credentials: it talks to the orchestrator over gRPC,
streams the provider with the runtime's own retry policy (the SDK's retries are off), and
serves gRPC health checks so the platform can supervise it.
"""

from __future__ import annotations

import os

import httpx2
from anthropic import AsyncAnthropic

from services.worker.attempt import Attempt
from services.worker.delivery import DeliverySettings
from services.worker.history_cache import HistoryCache
from services.worker.interactions import Interactions, builtin_announcements
from services.worker.mcp.client import McpClients
from services.worker.mcp.tools import McpToolbox
from services.worker.orchestrator_client import Orchestrator
from services.worker.plugins import load_plugins
from services.worker.pool import WorkerPool
from services.worker.render import render
from services.worker.settings import WorkerSettings
from services.worker.work_stream import WorkStream
from tether.bus import Bus
from tether.credentials import require_credential
from tether.domain import Assignment
from tether.runtime.process import announce, run, wait_for_signal
from tether.runtime.rpc import internal_channel, start_server
from tether.runtime.tasks import Supervisor
from tether.runtime.tls import MutualTls, mutual_tls
from tether.telemetry.setup import configure


def provider_client(settings: WorkerSettings) -> AsyncAnthropic:
    """The Messages API client: runtime-owned retries, explicit base URL and key."""
    return AsyncAnthropic(
        api_key=settings.anthropic_api_key or os.environ.get("ANTHROPIC_API_KEY", ""),
        base_url=settings.anthropic_base_url or None,
        max_retries=0,
        timeout=httpx2.Timeout(settings.provider_timeout_s, connect=5.0),
        # The worker's own `chat` span is the model call's (GenAI conventions, usage, finish
        # reason): the SDK's span of the same call, and the trace context it would send the
        # provider, are left out.
        open_telemetry={"traces": False, "propagation": False},
    )


async def amain(settings: WorkerSettings, credential: str, tls: MutualTls | None) -> None:
    """Run the pool until signalled."""
    channel = internal_channel(
        settings.orchestrator_addr, credential, service="orchestrator", tls=tls
    )
    registry, providers = load_plugins(os.environ)
    # A built-in interaction tool is run before the registry is asked (the gate), so its
    # announcement wins over a registered tool of the same name.
    announced = {t.name: t for t in [*registry.announcements(), *builtin_announcements()]}
    histories = (
        HistoryCache(settings.history_cache_bytes) if settings.history_cache_bytes > 0 else None
    )
    stream = WorkStream(
        channel, settings.worker_id, tools=list(announced.values()), histories=histories
    )
    orchestrator = Orchestrator(stream)
    bus = Bus(settings.redis_url) if settings.redis_url else None
    client = provider_client(settings)

    interactions_channel = (
        internal_channel(settings.interactions_addr, credential, service="interactions", tls=tls)
        if settings.interactions_addr
        else None
    )
    interactions = Interactions(interactions_channel) if interactions_channel else None
    # One set of MCP sessions per process; a server URL is checked against the deployment's
    # outbound-target rule before each session opens.
    mcp = McpToolbox(
        McpClients(target_policy=settings.target_policy),
        call_timeout_s=settings.mcp_call_timeout_s,
    )

    delivery = DeliverySettings(settings.target_policy, settings.delivery_reconcile_s)

    def make_attempt(assignment: Assignment) -> Attempt:
        leased = interactions.under(assignment.lease) if interactions is not None else None
        return Attempt(
            assignment,
            orchestrator=orchestrator,
            client=client,
            registry=registry,
            bus=bus,
            checkpoint_interval_s=settings.checkpoint_interval_s,
            interactions=leased,
            providers=providers,
            delivery=delivery,
            mcp=mcp,
        )

    pool = WorkerPool(
        stream=stream,
        make_attempt=make_attempt,
        concurrency=settings.concurrency,
        render=lambda job: render(job, registry=registry, providers=providers, mcp=mcp),
    )
    # It has no database: ready once it serves (what it needs of the schema, the
    # orchestrator it calls waits for).
    served = await start_server(
        host=settings.host,
        port=settings.port,
        register=[],
        service_names=[],
        # Serves only health checks; nothing else is registered, and no one calls a worker.
        verifiers={},
        health_port=settings.health_port,
    )
    announce(settings.ready_file, served)
    supervisor = Supervisor()
    supervisor.start("worker-pool", pool.run())
    try:
        await wait_for_signal(supervisor.failed)
        supervisor.stopping()  # the pool's run returns once its stop has drained it
        await pool.stop(settings.grace_s)
        await supervisor.stop()  # raises what the pool died of: the worker exits non-zero
    finally:
        await served.stop(1.0)
        await client.close()
        await mcp.clients.aclose()
        if bus is not None:
            await bus.close()
        await channel.close()
        if interactions_channel is not None:
            await interactions_channel.close()


def main() -> None:
    """Read settings from the environment and run."""
    settings = WorkerSettings()
    configure("worker", settings, instance=settings.worker_id)
    credential = require_credential("worker", settings.service_credential)
    # Its server answers only health, so it needs no server certificate; its calls are mTLS.
    tls = mutual_tls("worker", settings, serves=False, calls=True)
    run(amain(settings, credential, tls))


if __name__ == "__main__":
    main()
