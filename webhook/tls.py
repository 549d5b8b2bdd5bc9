"""TLS for the webhook server: dev certificates, rotation, and a server ``SSLContext`` that follows the disk.

Certificate directory layout (``CertPaths``)::

    ca.crt         the current CA certificate (PEM)
    ca.key         the current CA private key (PEM, PKCS#8, mode 0600)
    tls.crt        the serving certificate, signed by the current CA (PEM)
    tls.key        the serving certificate's private key (PEM, PKCS#8, mode 0600)
    ca-bundle.crt  the CA bundle for the webhook configurations' ``caBundle``: the current CA, and during a
                   CA rotation also the previous one (PEM, several certificates)

Every file is replaced atomically (a temporary file in the same directory, then ``os.replace``), so a reader
sees either the old or the new content of a file, never a mix. The files are written one after another,
though: a reader may briefly see a new ``tls.key`` next to the old ``tls.crt``. ``ReloadingSSLContext``
rejects such a pair and keeps serving the last good one until both match.

CA rotation, in two steps that bracket an overlap period:

1. ``rotate(cert_dir, new_ca=True)`` (``csinode-guard certs rotate --new-ca``): a new CA, a new serving
   certificate signed by it, and ``ca-bundle.crt`` holding the new and the old CA. Put the bundle into the
   webhook configurations' ``caBundle`` *before* the replicas serve the new certificate (the apiserver must
   trust it first), then roll out the new ``tls.crt``/``tls.key``. Until then the replicas still serve the
   old-CA certificate, which the bundle also trusts.
2. ``rotate(cert_dir, finish=True)`` (``certs rotate --finish``), once every replica serves the new
   certificate: ``ca-bundle.crt`` holds the new CA only. Put it into ``caBundle`` again.

This module imports nothing from Flask, kubernetes or prometheus_client.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import dataclasses
import datetime as dt
import hashlib
import ipaddress
import logging
import os
import secrets
import ssl
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Final

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import dsa, ec, ed448, ed25519, rsa
from cryptography.hazmat.primitives.asymmetric.types import (
    CertificateIssuerPrivateKeyTypes,
    CertificatePublicKeyTypes,
)
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = [
    "DEFAULT_DNS_NAMES",
    "DEFAULT_NAMESPACE",
    "DEFAULT_SERVICE",
    "SERVER_CIPHERS",
    "CertPaths",
    "CertificateError",
    "ReloadingSSLContext",
    "StateKeyError",
    "build_server_context",
    "certificate_not_after",
    "certificate_problems",
    "ensure_dev_certs",
    "ensure_state_key",
    "generate_ca",
    "generate_client_cert",
    "generate_serving_cert",
    "rotate",
    "service_dns_names",
]

logger = logging.getLogger(__name__)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

DEFAULT_SERVICE: Final = "csinode-guard"
DEFAULT_NAMESPACE: Final = "csinode-guard"

SERVER_CIPHERS: Final = "ECDHE+AESGCM:ECDHE+CHACHA20"
"""OpenSSL cipher string for TLS 1.2: ECDHE key exchange, AEAD ciphers only (TLS 1.3 suites are all AEAD)."""

ALWAYS_DNS_NAMES: Final = ("localhost",)
ALWAYS_IP_ADDRESSES: Final = (ipaddress.ip_address("127.0.0.1"),)

CLOCK_SKEW: Final = dt.timedelta(minutes=5)
"""Certificates are valid from this long before their issue time, for clocks slightly behind ours."""

STATE_KEY_BYTES: Final = 32
STATE_KEY_MIN_BYTES: Final = 16

_ISSUER_KEY_CLASSES: Final = (
    ec.EllipticCurvePrivateKey,
    rsa.RSAPrivateKey,
    dsa.DSAPrivateKey,
    ed25519.Ed25519PrivateKey,
    ed448.Ed448PrivateKey,
)
_KEY_MODE: Final = 0o600
_CERT_MODE: Final = 0o644


class CertificateError(Exception):
    """A certificate directory or certificate file cannot be used as it is (missing, mismatched, expired)."""


class StateKeyError(ValueError):
    """The state HMAC key file holds no key, or a line that is not hex/base64 of a long-enough key."""


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
# Generating certificates


def generate_ca(
    common_name: str, valid_days: int = 3650, *, now: dt.datetime | None = None
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """Create a self-signed CA: an ECDSA P-256 key and its certificate, valid ``valid_days`` days.

    Extensions: BasicConstraints CA:true pathlen:0 and KeyUsage keyCertSign+cRLSign (both critical),
    SubjectKeyIdentifier, AuthorityKeyIdentifier (itself). ``now`` (aware datetime, default the current UTC
    time) is the issue time; the certificate is valid from ``now`` minus five minutes.
    Raises ``ValueError`` for an empty or over-long (> 64 characters) common name or ``valid_days < 1``.
    """
    if valid_days < 1:
        raise ValueError(f"valid_days must be at least 1, got {valid_days}")
    now = _utc(now)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + dt.timedelta(days=valid_days))
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
        .add_extension(ski, critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def generate_serving_cert(
    ca_key: CertificateIssuerPrivateKeyTypes,
    ca_cert: x509.Certificate,
    dns_names: Sequence[str],
    ip_addresses: Sequence[str | IPAddress] = (),
    valid_days: int = 365,
    *,
    now: dt.datetime | None = None,
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """Issue a TLS server certificate with a new ECDSA P-256 key, signed by ``ca_key``/``ca_cert``.

    SubjectAltName: ``dns_names`` then ``localhost``; ``ip_addresses`` then ``127.0.0.1`` (duplicates
    dropped, order kept). Extensions: BasicConstraints CA:false and KeyUsage digitalSignature (critical),
    ExtendedKeyUsage serverAuth, SubjectKeyIdentifier, AuthorityKeyIdentifier (the CA's key id). Subject
    CN is the first DNS name. Valid ``valid_days`` days from ``now`` (default: current UTC time), but never
    past the CA's own expiry. Raises ``ValueError`` for an empty DNS name, an unparsable IP address,
    ``valid_days < 1``, or a CA that is not valid at ``now``.
    """
    names = _serving_dns_names(dns_names)
    san: list[x509.GeneralName] = [x509.DNSName(n) for n in names]
    san += [x509.IPAddress(ip) for ip in _serving_ip_addresses(ip_addresses)]
    common_name = next((n for n in names if len(n) <= 64), "localhost")
    return _issue_leaf(
        ca_key,
        ca_cert,
        common_name=common_name,
        san=x509.SubjectAlternativeName(san),
        usage=ExtendedKeyUsageOID.SERVER_AUTH,
        valid_days=valid_days,
        now=now,
    )


def generate_client_cert(
    ca_key: CertificateIssuerPrivateKeyTypes,
    ca_cert: x509.Certificate,
    common_name: str,
    valid_days: int = 365,
    *,
    now: dt.datetime | None = None,
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """Issue a TLS client certificate (ExtendedKeyUsage clientAuth) with subject CN ``common_name``.

    For the apiserver's client certificate when the server runs with a client CA (dev and tests).
    Same key type, extensions and errors as ``generate_serving_cert``, without SubjectAltName.
    """
    return _issue_leaf(
        ca_key,
        ca_cert,
        common_name=common_name,
        san=None,
        usage=ExtendedKeyUsageOID.CLIENT_AUTH,
        valid_days=valid_days,
        now=now,
    )


def _issue_leaf(
    ca_key: CertificateIssuerPrivateKeyTypes,
    ca_cert: x509.Certificate,
    *,
    common_name: str,
    san: x509.SubjectAlternativeName | None,
    usage: x509.ObjectIdentifier,
    valid_days: int,
    now: dt.datetime | None,
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    if valid_days < 1:
        raise ValueError(f"valid_days must be at least 1, got {valid_days}")
    now = _utc(now)
    if not ca_cert.not_valid_before_utc <= now < ca_cert.not_valid_after_utc:
        raise ValueError(
            f"CA certificate {ca_cert.subject.rfc4514_string()} is not valid at {now:%Y-%m-%dT%H:%M:%SZ} "
            f"(valid {ca_cert.not_valid_before_utc:%Y-%m-%d} to {ca_cert.not_valid_after_utc:%Y-%m-%d})"
        )
    key = ec.generate_private_key(ec.SECP256R1())
    builder = x509.CertificateBuilder()
    if san is not None:
        builder = builder.add_extension(san, critical=False)
    try:
        ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
        aki = x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski)
    except x509.ExtensionNotFound:
        aki = x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key())
    cert = (
        builder.subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(min(now + dt.timedelta(days=valid_days), ca_cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(aki, critical=False)
        .sign(ca_key, _signature_hash(ca_key))
    )
    return key, cert


def _serving_dns_names(dns_names: Iterable[str]) -> list[str]:
    names: list[str] = []
    for name in [*dns_names, *ALWAYS_DNS_NAMES]:
        if not name or name != name.strip():
            raise ValueError(f"invalid DNS name {name!r}")
        if name not in names:
            names.append(name)
    return names


def _serving_ip_addresses(ip_addresses: Iterable[str | IPAddress]) -> list[IPAddress]:
    ips: list[IPAddress] = []
    for raw in [*ip_addresses, *ALWAYS_IP_ADDRESSES]:
        ip = ipaddress.ip_address(raw)  # ValueError when unparsable
        if ip not in ips:
            ips.append(ip)
    return ips


def _signature_hash(key: CertificateIssuerPrivateKeyTypes) -> hashes.SHA256 | None:
    # Ed25519/Ed448 sign without a separate digest; every other issuer key type takes SHA-256.
    return None if isinstance(key, ed25519.Ed25519PrivateKey | ed448.Ed448PrivateKey) else hashes.SHA256()


# --------------------------------------------------------------------------------------------------
# The certificate directory


def ensure_dev_certs(
    cert_dir: str | os.PathLike[str],
    dns_names: Sequence[str] = DEFAULT_DNS_NAMES,
    *,
    ip_addresses: Sequence[str | IPAddress] = (),
    valid_days: int = 365,
    force: bool = False,
    now: dt.datetime | None = None,
) -> CertPaths:
    """Make ``cert_dir`` hold a usable CA and serving certificate, writing only what is missing or unusable.

    - No ``ca.crt``/``ca.key`` (or ``force``): a new CA (10 years) and a new ``ca-bundle.crt``.
    - No ``ca-bundle.crt``: written from ``ca.crt``.
    - No ``tls.crt``/``tls.key``, a key that does not match the certificate, a certificate not issued by the
      current CA, expired or not yet valid at ``now``, or lacking one of ``dns_names``/``ip_addresses``
      (or ``localhost``/``127.0.0.1``): a new serving certificate (``valid_days`` days) from the existing CA.

    Creates ``cert_dir`` (mode 0700) when missing. Returns the layout with ``written`` listing what changed.
    Raises ``CertificateError`` when the existing CA key does not match ``ca.crt`` or the CA is not valid at
    ``now`` (fix by hand, ``rotate(new_ca=True)`` or ``force``), ``ValueError`` for invalid names, and
    ``OSError`` when files cannot be read or written.
    """
    paths = CertPaths(Path(cert_dir))
    now = _utc(now)
    paths.cert_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    written: list[Path] = []

    new_ca = force or not (paths.ca_cert.exists() and paths.ca_key.exists())
    ca_key: CertificateIssuerPrivateKeyTypes
    if new_ca:
        ca_key, ca_cert = generate_ca(_ca_common_name(now), now=now)
        written += _write_ca(paths, ca_key, ca_cert)
        written += _write_bundle(paths, [ca_cert])
    else:
        ca_key, ca_cert = _load_ca(paths)
        if not ca_cert.not_valid_before_utc <= now < ca_cert.not_valid_after_utc:
            raise CertificateError(
                f"{paths.ca_cert}: CA not valid now (valid until {ca_cert.not_valid_after_utc:%Y-%m-%d}); "
                "rotate it (certs rotate --new-ca) or regenerate everything (certs generate --force)"
            )
        if not paths.ca_bundle.exists():
            written += _write_bundle(paths, [ca_cert])

    if new_ca:
        reason: str | None = ("a new CA was made, as --force asks" if force
                              else "first run: no CA in the directory yet, so a new one was made")
    else:
        reason = _serving_cert_problem(paths, ca_cert, dns_names, ip_addresses, now)
    if reason is not None:
        logger.info("issuing serving certificate in %s: %s", paths.cert_dir, reason)
        key, cert = generate_serving_cert(ca_key, ca_cert, dns_names, ip_addresses, valid_days, now=now)
        written += _write_serving(paths, key, cert)
    return dataclasses.replace(paths, written=tuple(written))


def rotate(
    cert_dir: str | os.PathLike[str],
    dns_names: Sequence[str] | None = None,
    *,
    ip_addresses: Sequence[str | IPAddress] | None = None,
    new_ca: bool = False,
    finish: bool = False,
    valid_days: int = 365,
    ca_valid_days: int = 3650,
    now: dt.datetime | None = None,
) -> CertPaths:
    """Rotate the certificates in an existing ``cert_dir`` (two-step CA rotation: see the module docstring).

    - default: a new serving key and certificate (``valid_days`` days) from the current CA; bundle unchanged.
    - ``new_ca``: a new CA (``ca_valid_days`` days) replaces ``ca.crt``/``ca.key``; ``ca-bundle.crt`` holds
      the new CA then the old one; a new serving certificate signed by the new CA. Writes the bundle first.
    - ``finish``: ``ca-bundle.crt`` holds ``ca.crt`` only (the old CA is dropped); nothing else changes,
      and nothing is written when the bundle already is just ``ca.crt``.

    ``dns_names``/``ip_addresses`` of None keep the current serving certificate's SANs (the defaults when
    there is no ``tls.crt``; when it is unreadable, ``dns_names`` must be given and IPs default to none).
    Returns the layout with ``written`` listing the replaced files in write order.
    Raises ``ValueError`` for ``new_ca`` with ``finish``; ``CertificateError`` when the CA files are missing
    or do not match, for ``new_ca`` while a CA rotation is still unfinished (the bundle holds another CA), and
    for ``finish`` while ``tls.crt`` is not signed by the current CA; ``OSError`` for I/O failures.
    """
    if new_ca and finish:
        raise ValueError("new_ca and finish are two separate steps of a CA rotation; pass one of them")
    paths = CertPaths(Path(cert_dir))
    now = _utc(now)
    ca_key, ca_cert = _load_ca(paths)
    bundle = _read_bundle(paths, ca_cert)
    others = [c for c in bundle if _fingerprint(c) != _fingerprint(ca_cert)]

    if finish:
        serving = _load_certs(paths.tls_cert)[0] if paths.tls_cert.exists() else None
        if serving is not None and not _issued_by(serving, ca_cert):
            raise CertificateError(
                f"{paths.tls_cert} is not signed by {paths.ca_cert}; dropping the old CA now would break it: "
                "run rotate first"
            )
        if [_fingerprint(c) for c in bundle] != [_fingerprint(ca_cert)]:
            return dataclasses.replace(paths, written=tuple(_write_bundle(paths, [ca_cert])))
        return paths

    if dns_names is None or ip_addresses is None:
        current = _current_sans(paths)
        if current is None and dns_names is None:
            raise CertificateError(
                f"{paths.tls_cert} is unreadable: pass the DNS names for the new certificate"
            )
        current_dns, current_ips = current or ([], [])
        dns_names = current_dns if dns_names is None else dns_names
        ip_addresses = current_ips if ip_addresses is None else ip_addresses

    written: list[Path] = []
    if new_ca:
        if others:
            raise CertificateError(
                f"{paths.ca_bundle} still holds the previous CA ({others[0].subject.rfc4514_string()}): "
                "finish the running CA rotation first (certs rotate --finish)"
            )
        old_ca = ca_cert
        ca_key, ca_cert = generate_ca(_ca_common_name(now), ca_valid_days, now=now)
        # Bundle first: whoever reads the directory must trust the new CA before anything is signed by it.
        written += _write_bundle(paths, [ca_cert, old_ca])
        written += _write_ca(paths, ca_key, ca_cert)
    key, cert = generate_serving_cert(ca_key, ca_cert, dns_names, ip_addresses, valid_days, now=now)
    written += _write_serving(paths, key, cert)
    return dataclasses.replace(paths, written=tuple(written))


def _serving_cert_problem(
    paths: CertPaths,
    ca_cert: x509.Certificate,
    dns_names: Sequence[str],
    ip_addresses: Sequence[str | IPAddress],
    now: dt.datetime,
) -> str | None:
    """Why the serving certificate must be reissued, or None when it is fine."""
    if not (paths.tls_cert.exists() and paths.tls_key.exists()):
        return "missing"
    try:
        cert = _load_certs(paths.tls_cert)[0]
        key = _load_private_key(paths.tls_key)
    except (CertificateError, ValueError) as exc:
        return f"unreadable: {exc}"
    if _public_der(key.public_key()) != _public_der(cert.public_key()):
        return "tls.key does not match tls.crt"
    if not _issued_by(cert, ca_cert):
        return "not signed by the current CA"
    if not cert.not_valid_before_utc <= now < cert.not_valid_after_utc:
        return f"not valid now ({cert.not_valid_before_utc:%Y-%m-%d} to {cert.not_valid_after_utc:%Y-%m-%d})"
    have_dns, have_ips = _sans(cert)
    missing = [n for n in _serving_dns_names(dns_names) if n not in have_dns]
    missing += [str(ip) for ip in _serving_ip_addresses(ip_addresses) if ip not in have_ips]
    if missing:
        return f"lacks subject alternative names {', '.join(missing)}"
    return None


def _current_sans(paths: CertPaths) -> tuple[list[str], list[IPAddress]] | None:
    """The requested SANs of the current serving certificate; the defaults without one; None if unreadable."""
    if not paths.tls_cert.exists():
        return list(DEFAULT_DNS_NAMES), []
    try:
        dns, ips = _sans(_load_certs(paths.tls_cert)[0])
    except CertificateError:
        return None
    return [n for n in dns if n not in ALWAYS_DNS_NAMES], [ip for ip in ips if ip not in ALWAYS_IP_ADDRESSES]


def _sans(cert: x509.Certificate) -> tuple[list[str], list[IPAddress]]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return [], []
    networks = (ipaddress.IPv4Network, ipaddress.IPv6Network)
    ips = [ip for ip in san.get_values_for_type(x509.IPAddress) if not isinstance(ip, networks)]
    return list(san.get_values_for_type(x509.DNSName)), ips


def _issued_by(cert: x509.Certificate, issuer: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(issuer)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def _ca_common_name(now: dt.datetime) -> str:
    # Distinct per CA, so the two CAs in a rotation bundle are told apart by name, by people and by OpenSSL.
    return f"{DEFAULT_SERVICE} CA {now:%Y-%m-%d} {secrets.token_hex(3)}"


def _fingerprint(cert: x509.Certificate) -> bytes:
    return cert.fingerprint(hashes.SHA256())


def _public_der(key: CertificatePublicKeyTypes) -> bytes:
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def _load_ca(paths: CertPaths) -> tuple[CertificateIssuerPrivateKeyTypes, x509.Certificate]:
    for path in (paths.ca_cert, paths.ca_key):
        if not path.exists():
            raise CertificateError(f"{path} is missing: generate the certificates first (certs generate)")
    cert = _load_certs(paths.ca_cert)[0]
    key = _load_private_key(paths.ca_key)
    if _public_der(key.public_key()) != _public_der(cert.public_key()):
        raise CertificateError(f"{paths.ca_key} does not match {paths.ca_cert}")
    return key, cert


def _read_bundle(paths: CertPaths, ca_cert: x509.Certificate) -> list[x509.Certificate]:
    return _load_certs(paths.ca_bundle) if paths.ca_bundle.exists() else [ca_cert]


def _load_certs(path: Path) -> list[x509.Certificate]:
    """All certificates of a PEM file, in file order; ``CertificateError`` when there is none."""
    try:
        certs = x509.load_pem_x509_certificates(path.read_bytes())
    except ValueError as exc:
        raise CertificateError(f"{path}: no readable PEM certificate ({exc})") from exc
    return certs


def _load_private_key(path: Path) -> CertificateIssuerPrivateKeyTypes:
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (ValueError, TypeError) as exc:
        raise CertificateError(f"{path}: no readable unencrypted PEM private key ({exc})") from exc
    if not isinstance(key, _ISSUER_KEY_CLASSES):
        raise CertificateError(f"{path}: a {type(key).__name__} cannot sign certificates")
    return key


def _write_ca(paths: CertPaths, key: CertificateIssuerPrivateKeyTypes, cert: x509.Certificate) -> list[Path]:
    _write_atomic(paths.ca_key, _key_pem(key), _KEY_MODE)
    _write_atomic(paths.ca_cert, cert.public_bytes(serialization.Encoding.PEM), _CERT_MODE)
    return [paths.ca_key, paths.ca_cert]


def _write_serving(paths: CertPaths, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> list[Path]:
    _write_atomic(paths.tls_key, _key_pem(key), _KEY_MODE)
    _write_atomic(paths.tls_cert, cert.public_bytes(serialization.Encoding.PEM), _CERT_MODE)
    return [paths.tls_key, paths.tls_cert]


def _write_bundle(paths: CertPaths, certs: Sequence[x509.Certificate]) -> list[Path]:
    pem = b"".join(c.public_bytes(serialization.Encoding.PEM) for c in certs)
    _write_atomic(paths.ca_bundle, pem, _CERT_MODE)
    return [paths.ca_bundle]


def _key_pem(key: CertificateIssuerPrivateKeyTypes) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _write_atomic(path: Path, data: bytes, mode: int) -> None:
    """Replace ``path`` with ``data`` (mode ``mode``, umask ignored): temp file in the dir, fsync, rename."""
    tmp = _write_temp(path, data, mode)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def _write_temp(path: Path, data: bytes, mode: int) -> str:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            os.fchmod(file.fileno(), mode)
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return tmp


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):  # not every file system lets a directory be opened or synced
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# --------------------------------------------------------------------------------------------------
# The state HMAC key


def ensure_state_key(path: str | os.PathLike[str]) -> list[bytes]:
    """Read the HMAC keys that sign the guard's state annotation; create a one-key file when it is missing.

    File format (UTF-8 text): one key per line, hex (``[0-9a-fA-F]``, even length) or base64 (standard or
    URL-safe alphabet, padding optional); a line that is valid hex is read as hex. Blank lines and lines
    starting with ``#`` are ignored; surrounding whitespace is stripped. Each key is at least 16 bytes
    (32 recommended). The first key signs new state; every key verifies it, so a key is rotated by putting
    the new key on the first line and keeping the old one below it until all state was re-signed.

    A missing file (dev) is created with one random 32-byte key as hex, mode 0600; when another process
    creates it at the same moment, its key wins. Returns the keys in file order (at least one).
    Raises ``StateKeyError`` for a file with no key or an undecodable/short line, ``OSError`` for I/O errors
    (e.g. a missing file in a read-only Secret volume).
    """
    key_path = Path(path)
    if not key_path.exists():
        _create_exclusive(key_path, secrets.token_bytes(STATE_KEY_BYTES).hex().encode() + b"\n", _KEY_MODE)
        logger.warning("generated a new state key in %s (for development; use a Secret)", key_path)
    keys = []
    for number, raw in enumerate(key_path.read_text(encoding="utf-8").splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key = _decode_key_line(line)
        if key is None or len(key) < STATE_KEY_MIN_BYTES:
            raise StateKeyError(
                f"{key_path}:{number}: not a hex or base64 key of at least {STATE_KEY_MIN_BYTES} bytes"
            )
        keys.append(key)
    if not keys:
        raise StateKeyError(f"{key_path}: holds no key")
    return keys


def _decode_key_line(line: str) -> bytes | None:
    with contextlib.suppress(ValueError):
        return bytes.fromhex(line)
    padded = line + "=" * (-len(line) % 4)
    altchars = b"-_" if "-" in line or "_" in line else b"+/"
    with contextlib.suppress(binascii.Error, ValueError):
        return base64.b64decode(padded, altchars=altchars, validate=True)
    return None


def _create_exclusive(path: Path, data: bytes, mode: int) -> None:
    """Create ``path`` with ``data`` complete or not at all; an existing file (a racing writer's) wins."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _write_temp(path, data, mode)
    try:
        os.link(tmp, path)  # atomic, and fails when the file exists
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
    _fsync_dir(path.parent)


# --------------------------------------------------------------------------------------------------
# Inspecting certificates


def certificate_not_after(path: str | os.PathLike[str]) -> dt.datetime:
    """The expiry (``notAfter``, aware UTC datetime) of the first certificate in the PEM file ``path``.

    Raises ``CertificateError`` when the file holds no readable certificate, ``OSError`` when unreadable.
    """
    return _load_certs(Path(path))[0].not_valid_after_utc


def certificate_problems(path: str | os.PathLike[str], *, now: dt.datetime | None = None) -> list[str]:
    """Why the certificates in the PEM file ``path`` are unusable at ``now`` (default: current UTC time).

    One message per certificate that is expired or not yet valid, and one when the file is missing or holds
    no readable certificate. An empty list means every certificate in the file is within its validity.
    Never raises for file problems (they are reported in the list); meant for /readyz.
    """
    now = _utc(now)
    try:
        certs = _load_certs(Path(path))
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


# --------------------------------------------------------------------------------------------------
# The server SSLContext


def build_server_context(
    cert_file: str | os.PathLike[str],
    key_file: str | os.PathLike[str],
    client_ca: str | os.PathLike[str] | None = None,
    *,
    client_cert_optional: bool = False,
) -> ssl.SSLContext:
    """A server ``SSLContext``: TLS 1.2 minimum, ECDHE+AEAD ciphers for TLS 1.2, no compression.

    With ``client_ca`` (PEM file of CA certificates) clients must present a certificate signed by one of
    them (``CERT_REQUIRED``); without it no client certificate is asked for. With ``client_cert_optional``
    a client may also connect without a certificate (``CERT_OPTIONAL``: a certificate it presents must still
    verify); the server then requires one per endpoint (kubelet's HTTPS probes present none).
    Raises ``ssl.SSLError`` for unreadable PEM or a key that does not match the certificate, ``OSError``
    when a file cannot be read.
    """
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_ciphers(SERVER_CIPHERS)
    context.options |= ssl.OP_NO_COMPRESSION | ssl.OP_CIPHER_SERVER_PREFERENCE | ssl.OP_NO_RENEGOTIATION
    context.load_cert_chain(certfile=cert_file, keyfile=key_file)
    if client_ca is not None:
        context.load_verify_locations(cafile=client_ca)
        context.verify_mode = ssl.CERT_OPTIONAL if client_cert_optional else ssl.CERT_REQUIRED
    return context


_FileSignature = tuple[bytes | None, ...]


class ReloadingSSLContext:
    """A server ``SSLContext`` that follows certificate rotation on disk, without a restart.

    ``context()`` returns the current context. At most every ``check_interval`` seconds (default 10) it reads
    ``cert_file``, ``key_file`` and ``client_ca`` (following symlinks, so a Secret volume's ``..data`` swap
    counts) and compares their SHA-256 digests with those of the loaded files; content is compared rather
    than inode/mtime, which can stay the same across two quick rotations. When anything changed it builds a
    new context with ``build_server_context``. When that fails (a half-written file, a key that does not
    match the certificate) it keeps the last good context, logs one warning per distinct set of file
    contents, and tries again when the files change again. Between checks ``context()`` costs a clock read
    and two attribute reads; a check reads three small files.

    Thread-safe: one thread reloads at a time while the others keep getting the current context without
    waiting; also safe to use in processes forked after construction (gunicorn workers).

    For gunicorn, pass the bound method ``ssl_context`` as the ``ssl_context`` server hook (gunicorn calls it
    for every accepted connection); gunicorn still needs ``certfile``/``keyfile`` set to enable TLS at all.

    Raises ``CertificateError`` from the constructor when the files cannot be loaded at all.
    """

    def __init__(
        self,
        cert_file: str | os.PathLike[str],
        key_file: str | os.PathLike[str],
        *,
        client_ca: str | os.PathLike[str] | None = None,
        client_cert_optional: bool = False,
        check_interval: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Load the files now. ``check_interval`` in seconds; ``clock`` returns seconds (monotonic)."""
        self.cert_file = Path(cert_file)
        self.key_file = Path(key_file)
        self.client_ca = Path(client_ca) if client_ca is not None else None
        self.client_cert_optional = client_cert_optional
        self.check_interval = check_interval
        self._clock = clock
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._failed_signature: _FileSignature | None = None
        self.last_error: str | None = None
        """Why the last reload failed (the context in use is then older than the files), or None."""
        self._signature = self._read_signature()
        try:
            self._context = self._build()
        except (OSError, ssl.SSLError) as exc:
            raise CertificateError(f"cannot load {self.cert_file} / {self.key_file}: {exc}") from exc
        self._next_check = self._clock() + self.check_interval

    def context(self) -> ssl.SSLContext:
        """The context for the next TLS handshake; reloaded first if the interval passed and files changed."""
        if self._clock() >= self._next_check and self._acquire(blocking=False):
            try:
                self._check()
            finally:
                self._lock.release()
        return self._context

    def reload(self) -> bool:
        """Check the files now, ignoring the interval; True when a new context was installed."""
        self._acquire(blocking=True)
        try:
            return self._check()
        finally:
            self._lock.release()

    def ssl_context(
        self, conf: object, default_ssl_context_factory: Callable[[], ssl.SSLContext]
    ) -> ssl.SSLContext:
        """gunicorn's ``ssl_context(conf, default_ssl_context_factory)`` hook: returns ``context()``."""
        return self.context()

    def _acquire(self, *, blocking: bool) -> bool:
        if os.getpid() != self._pid:  # forked: the parent's lock may have been held by a thread that is gone
            self._lock = threading.Lock()
            self._pid = os.getpid()
        return self._lock.acquire(blocking=blocking)

    def _check(self) -> bool:
        self._next_check = self._clock() + self.check_interval
        signature = self._read_signature()
        if signature == self._signature:  # unchanged, or back to the loaded files after a broken version
            self._failed_signature = self.last_error = None
            return False
        if signature == self._failed_signature:
            return False
        try:
            context = self._build()
        except (OSError, ssl.SSLError) as exc:
            self._failed_signature = signature
            self.last_error = f"{type(exc).__name__}: {exc}"
            logger.warning(
                "TLS files %s / %s changed but cannot be loaded; still serving the previous certificate: %s",
                self.cert_file,
                self.key_file,
                self.last_error,
            )
            return False
        self._context = context
        self._signature = signature
        self._failed_signature = None
        self.last_error = None
        logger.info("reloaded TLS certificate from %s", self.cert_file)
        return True

    def _build(self) -> ssl.SSLContext:
        return build_server_context(
            self.cert_file, self.key_file, self.client_ca, client_cert_optional=self.client_cert_optional
        )

    def _read_signature(self) -> _FileSignature:
        # File contents, not stat data: inode numbers are reused and mtimes move in coarse ticks, so two
        # rotations in quick succession can leave (inode, mtime, size) unchanged. The files are a few KiB.
        signature: list[bytes | None] = []
        for path in (self.cert_file, self.key_file, self.client_ca):
            if path is None:
                continue
            try:
                signature.append(hashlib.sha256(path.read_bytes()).digest())
            except OSError:
                signature.append(None)
        return tuple(signature)


def _utc(now: dt.datetime | None) -> dt.datetime:
    if now is None:
        return dt.datetime.now(dt.UTC)
    if now.tzinfo is None:
        raise ValueError("now must be timezone-aware")
    return now.astimezone(dt.UTC)
