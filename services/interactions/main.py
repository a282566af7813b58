"""Interactions process entry point: `python -m services.interactions`.

The questions/approvals/connections servicer arrives with its issue; until then the service
answers health checks and reports UNIMPLEMENTED for its RPCs.
"""

from __future__ import annotations

import asyncio

from pydantic_settings import SettingsConfigDict

from tether.grpcutil import start_server
from tether.runner import configure_logging, serve, write_ready_file
from tether.settings import PlatformSettings
from tether.v1 import interactions_pb2, interactions_pb2_grpc


class InteractionsSettings(PlatformSettings):
    """Interactions' settings (env prefix TETHER_INTERACTIONS_)."""

    model_config = SettingsConfigDict(
        env_prefix="TETHER_INTERACTIONS_", frozen=True, extra="ignore"
    )
    grace_s: float = 5.0


async def amain(settings: InteractionsSettings) -> None:
    """Run the interactions service until signalled."""
    servicer = interactions_pb2_grpc.InteractionsServiceServicer()  # type: ignore[abstract]
    server, port, _ = await start_server(
        host=settings.host,
        port=settings.port,
        register=[
            lambda s: interactions_pb2_grpc.add_InteractionsServiceServicer_to_server(servicer, s)
        ],
        service_names=[
            interactions_pb2.DESCRIPTOR.services_by_name["InteractionsService"].full_name
        ],
        service_token=settings.service_token or None,
    )
    write_ready_file(settings.ready_file, port)
    await serve(server, grace=settings.grace_s, cleanups=[])


def main() -> None:
    """Read settings from the environment and serve."""
    settings = InteractionsSettings()
    configure_logging("interactions", settings.log_level)
    asyncio.run(amain(settings))


if __name__ == "__main__":
    main()
