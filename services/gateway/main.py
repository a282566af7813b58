"""Gateway process entry point: `python -m services.gateway`."""

from __future__ import annotations

import asyncio

from services.gateway.auth import Authenticator
from services.gateway.servicer import GatewayServicer
from services.gateway.settings import GatewaySettings
from tether.db.engine import create_engine
from tether.grpcutil import internal_channel, start_server
from tether.runner import configure_logging, serve, write_ready_file
from tether.v1 import admission_pb2_grpc, gateway_pb2, gateway_pb2_grpc, orchestrator_pb2_grpc


async def amain(settings: GatewaySettings) -> None:
    """Run the gateway until signalled."""
    engine = create_engine(settings.database_url, pool_size=settings.pool_size)
    token = settings.service_token or None
    admission = internal_channel(settings.admission_addr, token)
    orchestrator = internal_channel(settings.orchestrator_addr, token)
    # Streaming and interaction RPCs answer UNIMPLEMENTED until their issues land.
    servicer = GatewayServicer(  # type: ignore[abstract]
        auth=Authenticator(engine, cache_ttl_s=settings.key_cache_ttl_s),
        engine=engine,
        admission=admission_pb2_grpc.AdmissionServiceStub(admission),
        orchestrator=orchestrator_pb2_grpc.OrchestratorServiceStub(orchestrator),
    )
    server, port, _ = await start_server(
        host=settings.host,
        port=settings.port,
        register=[lambda s: gateway_pb2_grpc.add_GatewayServiceServicer_to_server(servicer, s)],
        service_names=[gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name],
        # The gateway is the public edge: callers authenticate with API keys instead.
        service_token=None,
    )
    write_ready_file(settings.ready_file, port)

    async def close_channels() -> None:
        await admission.close()
        await orchestrator.close()

    await serve(server, grace=settings.grace_s, cleanups=[engine.dispose, close_channels])


def main() -> None:
    """Read settings from the environment and serve."""
    settings = GatewaySettings()
    configure_logging("gateway", settings.log_level)
    asyncio.run(amain(settings))


if __name__ == "__main__":
    main()
