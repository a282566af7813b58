"""Mutual TLS for internal gRPC: off by default (the loopback stack speaks plaintext), on when a
CA is configured (TETHER_TLS_*). Then a server serves only over TLS and requires a client
certificate signed by that CA, and a channel verifies the server against the CA and presents
its own certificate. The service credentials (`tether.credentials`) still say which caller may
call what; mTLS keeps the wire private and refuses anyone without a certificate before a byte
of a call is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from tether.settings import PlatformSettings

CA_ENV = "TETHER_TLS_CA_FILE"
SERVER_CERT_ENV = "TETHER_TLS_SERVER_CERT_FILE"
SERVER_KEY_ENV = "TETHER_TLS_SERVER_KEY_FILE"
CLIENT_CERT_ENV = "TETHER_TLS_CLIENT_CERT_FILE"
CLIENT_KEY_ENV = "TETHER_TLS_CLIENT_KEY_FILE"


class TlsMisconfigured(SystemExit):
    """A service was given part of its TLS settings, or files it cannot read; it exits with
    this message rather than fall back to plaintext."""


@dataclass(frozen=True)
class MutualTls:
    """What one service needs for mutual TLS, read from its files once at start.

    `server` is this server's (private key, certificate chain), None for a service that serves
    no internal calls over TLS; `client` is what its channels present, None for a service that
    calls no one."""

    ca: bytes
    server: tuple[bytes, bytes] | None = None
    client: tuple[bytes, bytes] | None = None

    def server_credentials(self) -> grpc.ServerCredentials:
        """TLS for a server: only clients presenting a certificate the CA signed get in."""
        if self.server is None:
            raise ValueError("no server certificate configured")
        return grpc.ssl_server_credentials(
            [self.server], root_certificates=self.ca, require_client_auth=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """TLS for a channel: the server is verified against the CA (and its name), and this
        service's certificate is presented."""
        if self.client is None:
            raise ValueError("no client certificate configured")
        key, chain = self.client
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=key, certificate_chain=chain
        )


def _read(service: str, env: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise TlsMisconfigured(f"{service}: cannot read {env}={path}: {exc.strerror}") from None


def _pair(service: str, settings: PlatformSettings, role: str) -> tuple[bytes, bytes]:
    cert_env, key_env = (
        (SERVER_CERT_ENV, SERVER_KEY_ENV) if role == "server" else (CLIENT_CERT_ENV, CLIENT_KEY_ENV)
    )
    cert, key = (
        (settings.tls_server_cert_file, settings.tls_server_key_file)
        if role == "server"
        else (settings.tls_client_cert_file, settings.tls_client_key_file)
    )
    if not cert or not key:
        raise TlsMisconfigured(
            f"{service}: {CA_ENV} is set, so internal gRPC uses mutual TLS and this service "
            f"needs its {role} certificate: set {cert_env} and {key_env} (PEM files)"
        )
    return _read(service, key_env, key), _read(service, cert_env, cert)


def mutual_tls(
    service: str, settings: PlatformSettings, *, serves: bool, calls: bool
) -> MutualTls | None:
    """`service`'s mutual TLS from its settings, None when no CA is set (plaintext). A service
    that `serves` internal calls needs a server certificate, one that `calls` others a client
    certificate; anything missing or unreadable exits with a message naming the setting."""
    stray = [
        env
        for env, value in (
            (SERVER_CERT_ENV, settings.tls_server_cert_file),
            (SERVER_KEY_ENV, settings.tls_server_key_file),
            (CLIENT_CERT_ENV, settings.tls_client_cert_file),
            (CLIENT_KEY_ENV, settings.tls_client_key_file),
        )
        if value
    ]
    if not settings.tls_ca_file:
        if stray:
            # Certificates without a CA would silently mean plaintext: say so instead.
            raise TlsMisconfigured(
                f"{service}: {', '.join(stray)} set but {CA_ENV} is not; set the CA that "
                "signs every internal certificate to turn on mutual TLS"
            )
        return None
    return MutualTls(
        ca=_read(service, CA_ENV, settings.tls_ca_file),
        server=_pair(service, settings, "server") if serves else None,
        client=_pair(service, settings, "client") if calls else None,
    )
