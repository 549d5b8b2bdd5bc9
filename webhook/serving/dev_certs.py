"""Issuing development certificates: a CA, serving and client certificates, and a directory that holds them.

``ensure_dev_certs`` (``csinode-guard certs generate``, and ``serve`` when it generates certificates) makes a
certificate directory (layout: :mod:`webhook.serving.tls`) hold a usable CA and serving certificate, writing only what
is missing or unusable. The ``generate_*`` functions issue ECDSA P-256 certificates with ``cryptography``; the
``write_*`` functions put them into the directory (each file replaced atomically), for
:mod:`webhook.serving.cert_rotation` too.

This module imports nothing from Flask, kubernetes or prometheus_client.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import ipaddress
import logging
import os
import secrets
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Final

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519
from cryptography.hazmat.primitives.asymmetric.types import CertificateIssuerPrivateKeyTypes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from webhook.admission.atomic_files import write_atomic
from webhook.serving.tls import (
    ALWAYS_DNS_NAMES,
    ALWAYS_IP_ADDRESSES,
    DEFAULT_DNS_NAMES,
    DEFAULT_SERVICE,
    CertificateError,
    CertPaths,
    IPAddress,
    as_utc,
    certificate_sans,
    issued_by,
    load_ca,
    load_certs,
    load_private_key,
    public_der,
)

__all__ = [
    "CLOCK_SKEW",
    "ca_common_name",
    "ensure_dev_certs",
    "generate_ca",
    "generate_client_cert",
    "generate_serving_cert",
    "write_bundle",
    "write_ca",
    "write_serving",
]

logger = logging.getLogger("webhook.tls")  # the certificate modules log under one name, as before they split

CLOCK_SKEW: Final = dt.timedelta(minutes=5)
"""Certificates are valid from this long before their issue time, for clocks slightly behind ours."""

_KEY_MODE: Final = 0o600
_CERT_MODE: Final = 0o644


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
    now = as_utc(now)
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
    now = as_utc(now)
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
    now = as_utc(now)
    paths.cert_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    written: list[Path] = []

    new_ca = force or not (paths.ca_cert.exists() and paths.ca_key.exists())
    ca_key: CertificateIssuerPrivateKeyTypes
    if new_ca:
        ca_key, ca_cert = generate_ca(ca_common_name(now), now=now)
        written += write_ca(paths, ca_key, ca_cert)
        written += write_bundle(paths, [ca_cert])
    else:
        ca_key, ca_cert = load_ca(paths)
        if not ca_cert.not_valid_before_utc <= now < ca_cert.not_valid_after_utc:
            raise CertificateError(
                f"{paths.ca_cert}: CA not valid now (valid until {ca_cert.not_valid_after_utc:%Y-%m-%d}); "
                "rotate it (certs rotate --new-ca) or regenerate everything (certs generate --force)"
            )
        if not paths.ca_bundle.exists():
            written += write_bundle(paths, [ca_cert])

    if new_ca:
        reason: str | None = ("a new CA was made, as --force asks" if force
                              else "first run: no CA in the directory yet, so a new one was made")
    else:
        reason = _serving_cert_problem(paths, ca_cert, dns_names, ip_addresses, now)
    if reason is not None:
        logger.info("issuing serving certificate in %s: %s", paths.cert_dir, reason)
        key, cert = generate_serving_cert(ca_key, ca_cert, dns_names, ip_addresses, valid_days, now=now)
        written += write_serving(paths, key, cert)
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
        cert = load_certs(paths.tls_cert)[0]
        key = load_private_key(paths.tls_key)
    except (CertificateError, ValueError) as exc:
        return f"unreadable: {exc}"
    if public_der(key.public_key()) != public_der(cert.public_key()):
        return "tls.key does not match tls.crt"
    if not issued_by(cert, ca_cert):
        return "not signed by the current CA"
    if not cert.not_valid_before_utc <= now < cert.not_valid_after_utc:
        return f"not valid now ({cert.not_valid_before_utc:%Y-%m-%d} to {cert.not_valid_after_utc:%Y-%m-%d})"
    have_dns, have_ips = certificate_sans(cert)
    missing = [n for n in _serving_dns_names(dns_names) if n not in have_dns]
    missing += [str(ip) for ip in _serving_ip_addresses(ip_addresses) if ip not in have_ips]
    if missing:
        return f"lacks subject alternative names {', '.join(missing)}"
    return None


def ca_common_name(now: dt.datetime) -> str:
    """The subject CN of a new CA issued at ``now``: ``csinode-guard CA <date> <6 random hex digits>``."""
    # Distinct per CA, so the two CAs in a rotation bundle are told apart by name, by people and by OpenSSL.
    return f"{DEFAULT_SERVICE} CA {now:%Y-%m-%d} {secrets.token_hex(3)}"


def write_ca(paths: CertPaths, key: CertificateIssuerPrivateKeyTypes, cert: x509.Certificate) -> list[Path]:
    """Replace ``ca.key`` (PKCS#8 PEM, 0600) then ``ca.crt`` (PEM, 0644); returns them in write order."""
    write_atomic(paths.ca_key, _key_pem(key), _KEY_MODE)
    write_atomic(paths.ca_cert, cert.public_bytes(serialization.Encoding.PEM), _CERT_MODE)
    return [paths.ca_key, paths.ca_cert]


def write_serving(paths: CertPaths, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> list[Path]:
    """Replace ``tls.key`` (PKCS#8 PEM, 0600) then ``tls.crt`` (PEM, 0644); returns them in write order."""
    write_atomic(paths.tls_key, _key_pem(key), _KEY_MODE)
    write_atomic(paths.tls_cert, cert.public_bytes(serialization.Encoding.PEM), _CERT_MODE)
    return [paths.tls_key, paths.tls_cert]


def write_bundle(paths: CertPaths, certs: Sequence[x509.Certificate]) -> list[Path]:
    """Replace ``ca-bundle.crt`` with ``certs`` in order (PEM, 0644); returns ``[ca-bundle.crt]``."""
    pem = b"".join(c.public_bytes(serialization.Encoding.PEM) for c in certs)
    write_atomic(paths.ca_bundle, pem, _CERT_MODE)
    return [paths.ca_bundle]


def _key_pem(key: CertificateIssuerPrivateKeyTypes) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
