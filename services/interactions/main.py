"""Interactions process entry point: `python -m services.interactions`."""

from __future__ import annotations

from services.interactions.approvals import Approvals
from services.interactions.channel_store import ChannelStore
from services.interactions.channels_edge import ChannelRpcs
from services.interactions.clients import GrpcOrchestrator, HttpTokenExchange
from services.interactions.connections import Connections
from services.interactions.domain import OAuthProvider, Policy
from services.interactions.lifecycle import Lifecycle
from services.interactions.mcp_oauth import McpOAuth
from services.interactions.questions import Questions
from services.interactions.resealing import Resealer
from services.interactions.sealing import Keyring
from services.interactions.secret_store import ConnectionTokens, SecretStore
from services.interactions.servicer import InteractionsServicer
from services.interactions.settings import InteractionsSettings
from services.interactions.upkeep import Upkeep
from services.interactions.webhook_secrets import WebhookSecrets
from services.interactions.webhook_secrets_edge import WebhookSecretRpcs
from tether.credentials import CredentialMissing, require_credential, require_verifiers
from tether.db.engine import create_engine
from tether.runtime.process import announce, run, serve
from tether.runtime.readiness import await_schema
from tether.runtime.rpc import internal_channel, start_server
from tether.runtime.tasks import Supervisor, rounds
from tether.runtime.tls import MutualTls, mutual_tls
from tether.telemetry.setup import configure
from tether.v1 import interactions_pb2, interactions_pb2_grpc, orchestrator_pb2_grpc

DEMO_PROVIDER = "democal"


# How often a replica looks for values sealed under an older key (a key rotation is rare).
RESEAL_S = 600.0


async def amain(
    settings: InteractionsSettings,
    credential: str,
    verifiers: dict[str, str],
    tls: MutualTls | None,
    keyring: Keyring,
) -> None:
    """Run the interactions service until signalled."""
    engine = create_engine(
        settings.database_url, pool_size=settings.pool_size, application="interactions"
    )
    channel = internal_channel(
        settings.orchestrator_addr, credential, service="orchestrator", tls=tls
    )
    providers = {}
    token_urls = {}
    if settings.oauth_base_url:
        providers[DEMO_PROVIDER] = OAuthProvider(
            DEMO_PROVIDER,
            f"{settings.oauth_base_url}/authorize",
            settings.oauth_client_id,
            settings.oauth_redirect_uri,
        )
        token_urls[DEMO_PROVIDER] = f"{settings.oauth_base_url}/token"
    orchestrator = GrpcOrchestrator(orchestrator_pb2_grpc.OrchestratorServiceStub(channel))
    policy = Policy(
        settings.approval_ttl_s, settings.consent_ttl_s, providers, settings.orphan_grace_s
    )
    lifecycle = Lifecycle(engine, orchestrator)
    tokens = ConnectionTokens(keyring)
    upkeep = Upkeep(engine, orchestrator, lifecycle, policy)
    servicer = InteractionsServicer(
        Questions(engine, orchestrator, lifecycle),
        Approvals(engine, orchestrator, lifecycle, policy),
        Connections(
            engine,
            orchestrator,
            lifecycle,
            policy,
            tokens,
            HttpTokenExchange(token_urls, settings.oauth_client_id),
            McpOAuth(
                settings.mcp_oauth_client_id,
                settings.oauth_redirect_uri,
                settings.target_policy,
            )
            if settings.mcp_oauth_client_id and settings.oauth_redirect_uri
            else None,
        ),
        upkeep,
        SecretStore(engine, keyring),
        ChannelRpcs(ChannelStore(engine, keyring, settings.target_policy), orchestrator),
        WebhookSecretRpcs(WebhookSecrets(engine, keyring)),
    )
    served = await start_server(
        host=settings.host,
        port=settings.port,
        register=[
            lambda s: interactions_pb2_grpc.add_InteractionsServiceServicer_to_server(servicer, s)
        ],
        service_names=[
            interactions_pb2.DESCRIPTOR.services_by_name["InteractionsService"].full_name
        ],
        verifiers=verifiers,
        tls=tls,
        health_port=settings.health_port,
        ready=False,
    )
    announce(settings.ready_file, served)
    await await_schema(engine, poll_s=settings.schema_poll_s)
    if settings.secrets_key.get_secret_value():
        # Tokens stored in plaintext before 0023 leave the table before this replica serves.
        await tokens.seal_plaintext(engine)
    supervisor = Supervisor()
    # Anything made after a round (here or on another replica) is due no sooner than the
    # shortest TTL or the orphan grace from then: no round need wait longer to see it.
    most_s = min(settings.approval_ttl_s, settings.consent_ttl_s, settings.orphan_grace_s)
    for name, work, nudge in (
        ("expiry sweep", upkeep.expiry_round, None),
        ("orphan sweep", upkeep.orphan_round, None),
        ("redelivery sweep", upkeep.redelivery_round, lifecycle.undelivered),
    ):
        supervisor.start(
            name,
            rounds(work, name, least_s=settings.sweep_interval_s, most_s=most_s, nudge=nudge),
        )
    if keyring.sealing_key_id is not None:
        # Values an older key sealed move under the current one, so the old can be dropped.
        reseal = Resealer(engine, keyring).round
        supervisor.start(
            "reseal sweep",
            rounds(reseal, "reseal sweep", least_s=settings.sweep_interval_s, most_s=RESEAL_S),
        )
    await served.ready()

    async def close() -> None:
        await channel.close()

    await serve(
        served,
        grace=settings.grace_s,
        cleanups=[engine.dispose, close, supervisor.stop],
        failed=supervisor.failed,
    )


def main() -> None:
    """Read settings from the environment and serve."""
    settings = InteractionsSettings()
    configure("interactions", settings)
    credential = require_credential("interactions", settings.service_credential)
    verifiers = require_verifiers("interactions", settings.service_verifiers)
    tls = mutual_tls("interactions", settings, serves=True, calls=True)
    try:
        keyring = Keyring.parse(settings.secrets_key.get_secret_value())
    except ValueError as exc:
        raise CredentialMissing(f"interactions: {exc}") from None
    run(amain(settings, credential, verifiers, tls, keyring))


if __name__ == "__main__":
    main()
