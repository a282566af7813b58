"""Worker process entry point: `python -m services.worker`.

The worker holds no database credentials; it talks to the orchestrator over gRPC. Its attempt
loop arrives with the durable-execution issue; until then it serves health checks so the
stack and Kubernetes can supervise it.
"""

from __future__ import annotations

import asyncio

from pydantic_settings import SettingsConfigDict
from tether.grpcutil import start_server
from tether.runner import configure_logging, serve, write_ready_file
from tether.settings import PlatformSettings


class WorkerSettings(PlatformSettings):
    """Worker settings (env prefix TETHER_WORKER_)."""

    model_config = SettingsConfigDict(env_prefix="TETHER_WORKER_", frozen=True, extra="ignore")
    grace_s: float = 10.0


async def amain(settings: WorkerSettings) -> None:
    """Serve health until signalled."""
    server, port, _ = await start_server(
        host=settings.host,
        port=settings.port,
        register=[],
        service_names=[],
        service_token=settings.service_token or None,
    )
    write_ready_file(settings.ready_file, port)
    await serve(server, grace=settings.grace_s, cleanups=[])


def main() -> None:
    """Read settings from the environment and serve."""
    settings = WorkerSettings()
    configure_logging("worker", settings.log_level)
    asyncio.run(amain(settings))


if __name__ == "__main__":
    main()
