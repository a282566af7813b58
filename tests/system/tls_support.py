"""Certificates for the mutual-TLS tests, made with the `cryptography` package: a CA of the
test's own and a certificate per service it signs, valid for loopback (localhost, 127.0.0.1) as
server and as client, written where a service's TETHER_TLS_* settings point."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# Long enough for any test run, short enough that a leaked file is worthless.
VALIDITY = datetime.timedelta(hours=1)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


@dataclass(frozen=True)
class Issued:
    """A certificate and its key, as PEM files."""

    cert: Path
    key: Path


class TestCa:
    """A certificate authority that lives for one test module."""

    __test__ = False  # a helper, not a test class

    def __init__(self, folder: Path, name: str = "tether-test-ca") -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(_name(name))
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self._key, hashes.SHA256())
        )
        self.cert = folder / f"{name}.crt"
        self.cert.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, service: str) -> Issued:
        """A certificate for `service` (its common name), good as server and as client on
        loopback."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(service))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + VALIDITY)
            .add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            )
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .sign(self._key, hashes.SHA256())
        )
        issued = Issued(self.folder / f"{service}.crt", self.folder / f"{service}.key")
        issued.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        issued.key.write_bytes(_pem(key))
        issued.key.chmod(0o600)
        return issued

    def env(self, service: str, *, serves: bool, calls: bool) -> dict[str, str]:
        """The TETHER_TLS_* settings of `service`, with a certificate of its own."""
        issued = self.issue(service)
        env = {"TETHER_TLS_CA_FILE": str(self.cert)}
        if serves:
            env["TETHER_TLS_SERVER_CERT_FILE"] = str(issued.cert)
            env["TETHER_TLS_SERVER_KEY_FILE"] = str(issued.key)
        if calls:
            env["TETHER_TLS_CLIENT_CERT_FILE"] = str(issued.cert)
            env["TETHER_TLS_CLIENT_KEY_FILE"] = str(issued.key)
        return env
