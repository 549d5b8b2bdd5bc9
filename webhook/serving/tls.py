"""The certificate directory the TLS modules share: its layout, its errors, and reading the PEM files in it.

Certificate directory layout (``CertPaths``)::

    ca.crt         the current CA certificate (PEM)
    ca.key         the current CA private key (PEM, PKCS#8, mode 0600)
    tls.crt        the serving certificate, signed by the current CA (PEM)
    tls.key        the serving certificate's private key (PEM, PKCS#8, mode 0600)
    ca-bundle.crt  the CA bundle for the webhook configurations' ``caBundle``: the current CA, and during a
                   CA rotation also the previous one (PEM, several certificates)

Every file is replaced atomically (:mod:`webhook.admission.atomic_files`), so a reader sees either the old or the new
content of a file, never a mix. The files are written one after another, though: a reader may briefly see a
new ``tls.key`` next to the old ``tls.crt``. ``webhook.serving.ssl_context.ReloadingSSLContext`` rejects such a pair
and keeps serving the last good one until both match.

Who writes the directory: :mod:`webhook.serving.dev_certs` (``certs generate``, and ``serve`` in development) and
:mod:`webhook.serving.cert_rotation` (``certs rotate``); :mod:`webhook.serving.ssl_context` serves from it. This module
reads and checks the files (``certificate_problems`` for /readyz) and writes nothing.

This module imports nothing from Flask, kubernetes or prometheus_client.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import ipaddress
import os
from pathlib import Path
from typing import Final

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import dsa, ec, ed448, ed25519, rsa
from cryptography.hazmat.primitives.asymmetric.types import (
    CertificateIssuerPrivateKeyTypes,
    CertificatePublicKeyTypes,
)

__all__ = [
    "ALWAYS_DNS_NAMES",
    "ALWAYS_IP_ADDRESSES",
    "DEFAULT_DNS_NAMES",
    "DEFAULT_NAMESPACE",
    "DEFAULT_SERVICE",
    "CertPaths",
    "CertificateError",
    "IPAddress",
    "as_utc",
    "certificate_not_after",
    "certificate_problems",
    "certificate_sans",
    "issued_by",
    "load_ca",
    "load_certs",
    "load_private_key",
    "public_der",
    "service_dns_names",
]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

DEFAULT_SERVICE: Final = "csinode-guard"
DEFAULT_NAMESPACE: Final = "csinode-guard"

ALWAYS_DNS_NAMES: Final = ("localhost",)
"""DNS names every serving certificate carries besides the requested ones."""
ALWAYS_IP_ADDRESSES: Final = (ipaddress.ip_address("127.0.0.1"),)
"""IP addresses every serving certificate carries besides the requested ones."""

_ISSUER_KEY_CLASSES: Final = (
    ec.EllipticCurvePrivateKey,
    rsa.RSAPrivateKey,
    dsa.DSAPrivateKey,
    ed25519.Ed25519PrivateKey,
    ed448.Ed448PrivateKey,
)


class CertificateError(Exception):
    """A certificate directory or certificate file cannot be used as it is (missing, mismatched, expired)."""


def service_dns_names(service: str, namespace: str) -> list[str]:
    """The DNS names a Kubernetes Service answers to inside the cluster.

    Returns ``[<service>, <service>.<namespace>, <service>.<namespace>.svc,
    <service>.<namespace>.svc.cluster.local]``; the apiserver calls a webhook service at
    ``<service>.<namespace>.svc``.
    """
    return [
        service,
        f"{service}.{namespace}",
        f"{service}.{namespace}.svc",
        f"{service}.{namespace}.svc.cluster.local",
    ]


DEFAULT_DNS_NAMES: Final = tuple(service_dns_names(DEFAULT_SERVICE, DEFAULT_NAMESPACE))


@dataclasses.dataclass(frozen=True)
class CertPaths:
    """The files of one certificate directory (layout in the module docstring).

    ``written`` lists the files the call that returned this value created or replaced, in write order
    (empty when nothing changed, and for a value built with ``CertPaths(cert_dir)``).
    """

    cert_dir: Path
    written: tuple[Path, ...] = ()

    @property
    def ca_cert(self) -> Path:
        """``<cert_dir>/ca.crt``: the current CA certificate."""
        return self.cert_dir / "ca.crt"

    @property
    def ca_key(self) -> Path:
        """``<cert_dir>/ca.key``: the current CA private key (0600)."""
        return self.cert_dir / "ca.key"

    @property
    def tls_cert(self) -> Path:
        """``<cert_dir>/tls.crt``: the serving certificate."""
        return self.cert_dir / "tls.crt"

    @property
    def tls_key(self) -> Path:
        """``<cert_dir>/tls.key``: the serving private key (0600)."""
        return self.cert_dir / "tls.key"

    @property
    def ca_bundle(self) -> Path:
        """``<cert_dir>/ca-bundle.crt``: the CA bundle for the webhook configurations' ``caBundle``."""
        return self.cert_dir / "ca-bundle.crt"


# --------------------------------------------------------------------------------------------------
# Reading the files


def load_certs(path: Path) -> list[x509.Certificate]:
    """All certificates of a PEM file, in file order; ``CertificateError`` when there is none."""
    try:
        certs = x509.load_pem_x509_certificates(path.read_bytes())
    except ValueError as exc:
        raise CertificateError(f"{path}: no readable PEM certificate ({exc})") from exc
    return certs


def load_private_key(path: Path) -> CertificateIssuerPrivateKeyTypes:
    """The unencrypted PEM private key in ``path``, of a type that can sign certificates.

    Raises ``CertificateError`` when the file holds no such key (encrypted, unreadable PEM, an X25519 key),
    ``OSError`` when it cannot be read.
    """
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (ValueError, TypeError) as exc:
        raise CertificateError(f"{path}: no readable unencrypted PEM private key ({exc})") from exc
    if not isinstance(key, _ISSUER_KEY_CLASSES):
        raise CertificateError(f"{path}: a {type(key).__name__} cannot sign certificates")
    return key


def load_ca(paths: CertPaths) -> tuple[CertificateIssuerPrivateKeyTypes, x509.Certificate]:
    """The current CA of a certificate directory: (``ca.key``, first certificate of ``ca.crt``).

    Raises ``CertificateError`` when either file is missing or unreadable, or the key does not match the
    certificate; ``OSError`` when a file cannot be read.
    """
    for path in (paths.ca_cert, paths.ca_key):
        if not path.exists():
            raise CertificateError(f"{path} is missing: generate the certificates first (certs generate)")
    cert = load_certs(paths.ca_cert)[0]
    key = load_private_key(paths.ca_key)
    if public_der(key.public_key()) != public_der(cert.public_key()):
        raise CertificateError(f"{paths.ca_key} does not match {paths.ca_cert}")
    return key, cert


def public_der(key: CertificatePublicKeyTypes) -> bytes:
    """A public key as DER SubjectPublicKeyInfo: equal bytes mean the same key (to match a key to a cert)."""
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def issued_by(cert: x509.Certificate, issuer: x509.Certificate) -> bool:
    """True when ``issuer`` signed ``cert`` directly (names and signature checked; validity dates are not)."""
    try:
        cert.verify_directly_issued_by(issuer)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def certificate_sans(cert: x509.Certificate) -> tuple[list[str], list[IPAddress]]:
    """The SubjectAltName DNS names and IP addresses of ``cert`` in certificate order (empty without one)."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return [], []
    networks = (ipaddress.IPv4Network, ipaddress.IPv6Network)
    ips = [ip for ip in san.get_values_for_type(x509.IPAddress) if not isinstance(ip, networks)]
    return list(san.get_values_for_type(x509.DNSName)), ips


# --------------------------------------------------------------------------------------------------
# Inspecting certificates


def certificate_not_after(path: str | os.PathLike[str]) -> dt.datetime:
    """The expiry (``notAfter``, aware UTC datetime) of the first certificate in the PEM file ``path``.

    Raises ``CertificateError`` when the file holds no readable certificate, ``OSError`` when unreadable.
    """
    return load_certs(Path(path))[0].not_valid_after_utc


def certificate_problems(path: str | os.PathLike[str], *, now: dt.datetime | None = None) -> list[str]:
    """Why the certificates in the PEM file ``path`` are unusable at ``now`` (default: current UTC time).

    One message per certificate that is expired or not yet valid, and one when the file is missing or holds
    no readable certificate. An empty list means every certificate in the file is within its validity.
    Never raises for file problems (they are reported in the list); meant for /readyz.
    """
    now = as_utc(now)
    try:
        certs = load_certs(Path(path))
    except (OSError, CertificateError) as exc:
        return [f"{path}: cannot read certificate: {exc}"]
    problems = []
    for cert in certs:
        subject = cert.subject.rfc4514_string()
        if now >= cert.not_valid_after_utc:
            problems.append(f"{path}: certificate {subject} expired {cert.not_valid_after_utc.isoformat()}")
        elif now < cert.not_valid_before_utc:
            problems.append(
                f"{path}: certificate {subject} not valid before {cert.not_valid_before_utc.isoformat()}"
            )
    return problems


def as_utc(now: dt.datetime | None) -> dt.datetime:
    """``now`` in UTC, the current UTC time for None; raises ``ValueError`` for a naive datetime."""
    if now is None:
        return dt.datetime.now(dt.UTC)
    if now.tzinfo is None:
        raise ValueError("now must be timezone-aware")
    return now.astimezone(dt.UTC)
