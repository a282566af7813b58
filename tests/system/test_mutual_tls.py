"""Internal gRPC over mutual TLS, with the services as real processes: the gateway's calls to
admission and the orchestrator work with the certificates the stack's CA signed, and a caller
without a client certificate (or with one another CA signed, or in plaintext) is refused at the
handshake, before any credential or method is looked at."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.conftest import drop_database
from tests.system.stack_support import seeded_database
from tests.system.tls_support import TestCa
from tether import credentials
from tether.stack.processes import ServiceSet
from tether.v1 import admission_pb2, admission_pb2_grpc, common_pb2, gateway_pb2, gateway_pb2_grpc

# What each service does over internal gRPC: admission and the orchestrator serve (the
# orchestrator calls interactions too, for run-event webhooks), the
# gateway calls (its own port is the public edge, plaintext behind an ingress).
ROLES = {
    "orchestrator": {"serves": True, "calls": True},
    "admission": {"serves": True, "calls": False},
    "gateway": {"serves": False, "calls": True},
}


@dataclass
class TlsStack:
    services: ServiceSet
    ca: TestCa
    key: str
    gateway_credential: str

    def addr(self, name: str) -> str:
        return self.services.addresses()[name]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def tls_stack(
    pg_server_url: str, template_db: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[TlsStack]:
    seeded = await seeded_database(pg_server_url, template_db)
    folder = tmp_path_factory.mktemp("mtls")
    ca = TestCa(folder / "pki")
    service_credentials = credentials.generate()
    services = ServiceSet(
        folder / "run",
        {"TETHER_DATABASE_URL": seeded.url, "TETHER_REDIS_URL": redis_url},
        service_credentials,
    )
    try:
        for name, role in ROLES.items():
            # Health on a plaintext port of its own: the TLS port answers certificates only.
            env = {**ca.env(name, **role), f"TETHER_{name.upper()}_HEALTH_PORT": "0"}
            await services.start(name, extra_env=env)
        yield TlsStack(services, ca, seeded.key_a, service_credentials["gateway"])
    finally:
        await services.stop_all()
        await drop_database(pg_server_url, seeded.name)


async def test_the_gateway_reaches_admission_and_the_orchestrator_over_mutual_tls(
    tls_stack: TlsStack,
) -> None:
    metadata = (("authorization", f"Bearer {tls_stack.key}"),)
    async with grpc.aio.insecure_channel(tls_stack.addr("gateway")) as channel:
        gateway = gateway_pb2_grpc.GatewayServiceStub(channel)
        sent = await gateway.SendMessage(
            gateway_pb2.SendMessageRequest(
                text="over mTLS", conversation_id="c-tls", event_id=f"e-{uuid.uuid4().hex}"
            ),
            metadata=metadata,
        )
        assert sent.run.status == common_pb2.RUN_STATUS_QUEUED  # admission answered
        read = await gateway.GetRun(
            gateway_pb2.GetRunRequest(run_id=sent.run.run_id), metadata=metadata
        )
        assert read.run.run_id == sent.run.run_id  # the orchestrator answered


def _tls_channel(
    stack: TlsStack, *, client: str | None, ca: TestCa | None = None
) -> grpc.aio.Channel:
    """A channel to admission that trusts the stack's CA and presents `client`'s certificate
    (issued by `ca`, the stack's by default), or none."""
    root = stack.ca.cert.read_bytes()
    if client is None:
        creds = grpc.ssl_channel_credentials(root_certificates=root)
    else:
        issued = (ca or stack.ca).issue(client)
        creds = grpc.ssl_channel_credentials(
            root_certificates=root,
            private_key=issued.key.read_bytes(),
            certificate_chain=issued.cert.read_bytes(),
        )
    return grpc.aio.secure_channel(stack.addr("admission"), creds)


async def _check(channel: grpc.aio.Channel) -> int:
    response = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(), timeout=5
    )
    return int(response.status)


async def test_a_caller_with_a_certificate_the_ca_signed_is_served(tls_stack: TlsStack) -> None:
    async with _tls_channel(tls_stack, client="tester") as channel:
        assert await _check(channel) == health_pb2.HealthCheckResponse.SERVING
        # Past TLS, the service credential still decides which methods it may call.
        admit = admission_pb2_grpc.AdmissionServiceStub(channel).Admit(
            admission_pb2.AdmitRequest(), timeout=5
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await admit
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_a_caller_without_a_client_certificate_is_refused(tls_stack: TlsStack) -> None:
    async with _tls_channel(tls_stack, client=None) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _check(channel)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_a_certificate_another_ca_signed_is_refused(
    tls_stack: TlsStack, tmp_path: Path
) -> None:
    stranger = TestCa(tmp_path / "other-pki", name="someone-else")
    async with _tls_channel(tls_stack, client="gateway", ca=stranger) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _check(channel)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_plaintext_is_refused_on_the_tls_port(tls_stack: TlsStack) -> None:
    async with grpc.aio.insecure_channel(tls_stack.addr("admission")) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _check(channel)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_probes_reach_the_plaintext_health_port_only(tls_stack: TlsStack) -> None:
    proc = tls_stack.services.procs["admission"]
    assert proc.health_port is not None and proc.health_port != proc.port
    async with grpc.aio.insecure_channel(proc.health_address) as channel:
        assert await _check(channel) == health_pb2.HealthCheckResponse.SERVING
        # Nothing but health is served there, not even to a caller with a credential.
        admit = admission_pb2_grpc.AdmissionServiceStub(channel).Admit(
            admission_pb2.AdmitRequest(),
            metadata=((credentials.CREDENTIAL_KEY, tls_stack.gateway_credential),),
            timeout=5,
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await admit
        assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_a_service_given_half_its_tls_settings_exits_naming_what_is_missing(
    tls_stack: TlsStack,
) -> None:
    env = {"TETHER_TLS_CA_FILE": str(tls_stack.ca.cert), "TETHER_GATEWAY_HEALTH_PORT": "0"}
    with pytest.raises(RuntimeError) as failed:
        await tls_stack.services.start("gateway", extra_env=env, timeout=30)
    assert "TETHER_TLS_CLIENT_CERT_FILE and TETHER_TLS_CLIENT_KEY_FILE" in str(failed.value)
