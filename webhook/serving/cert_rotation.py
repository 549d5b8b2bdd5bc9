"""Rotating the certificates of an existing certificate directory (layout: :mod:`webhook.serving.tls`).

A new serving certificate from the current CA, or a CA rotation in two steps that bracket an overlap period:

1. ``rotate(cert_dir, new_ca=True)`` (``csinode-guard certs rotate --new-ca``): a new CA, a new serving
   certificate signed by it, and ``ca-bundle.crt`` holding the new and the old CA. Put the bundle into the
   webhook configurations' ``caBundle`` *before* the replicas serve the new certificate (the apiserver must
   trust it first), then roll out the new ``tls.crt``/``tls.key``. Until then the replicas still serve the
   old-CA certificate, which the bundle also trusts.
2. ``rotate(cert_dir, finish=True)`` (``certs rotate --finish``), once every replica serves the new
   certificate: ``ca-bundle.crt`` holds the new CA only. Put it into ``caBundle`` again.

The servers pick the new files up without a restart (:class:`webhook.serving.ssl_context.ReloadingSSLContext`).
This module imports nothing from Flask, kubernetes or prometheus_client.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes

from webhook.serving import tls
from webhook.serving.dev_certs import (
    ca_common_name,
    generate_ca,
    generate_serving_cert,
    write_bundle,
    write_ca,
    write_serving,
)

__all__ = ["rotate"]


def rotate(
    cert_dir: str | os.PathLike[str],
    dns_names: Sequence[str] | None = None,
    *,
    ip_addresses: Sequence[str | tls.IPAddress] | None = None,
    new_ca: bool = False,
    finish: bool = False,
    valid_days: int = 365,
    ca_valid_days: int = 3650,
    now: dt.datetime | None = None,
) -> tls.CertPaths:
    """Rotate the certificates in an existing ``cert_dir`` (two-step CA rotation: see the module docstring).

    - default: a new serving key and certificate (``valid_days`` days) from the current CA; bundle unchanged.
    - ``new_ca``: a new CA (``ca_valid_days`` days) replaces ``ca.crt``/``ca.key``; ``ca-bundle.crt`` holds
      the new CA then the old one; a new serving certificate signed by the new CA. Writes the bundle first.
    - ``finish``: ``ca-bundle.crt`` holds ``ca.crt`` only (the old CA is dropped); nothing else changes,
      and nothing is written when the bundle already is just ``ca.crt``.

    ``dns_names``/``ip_addresses`` of None keep the current serving certificate's SANs (the defaults when
    there is no ``tls.crt``; when it is unreadable, ``dns_names`` must be given and IPs default to none).
    Returns the layout with ``written`` listing the replaced files in write order.
    Raises ``ValueError`` for ``new_ca`` with ``finish``; ``tls.CertificateError`` when the CA files are missing
    or do not match, for ``new_ca`` while a CA rotation is still unfinished (the bundle holds another CA), and
    for ``finish`` while ``tls.crt`` is not signed by the current CA; ``OSError`` for I/O failures.
    """
    if new_ca and finish:
        raise ValueError("new_ca and finish are two separate steps of a CA rotation; pass one of them")
    paths = tls.CertPaths(Path(cert_dir))
    now = tls.as_utc(now)
    ca_key, ca_cert = tls.load_ca(paths)
    bundle = _read_bundle(paths, ca_cert)
    others = [c for c in bundle if _fingerprint(c) != _fingerprint(ca_cert)]

    if finish:
        serving = tls.load_certs(paths.tls_cert)[0] if paths.tls_cert.exists() else None
        if serving is not None and not tls.issued_by(serving, ca_cert):
            raise tls.CertificateError(
                f"{paths.tls_cert} is not signed by {paths.ca_cert}; dropping the old CA now would break it: "
                "run rotate first"
            )
        if [_fingerprint(c) for c in bundle] != [_fingerprint(ca_cert)]:
            return dataclasses.replace(paths, written=tuple(write_bundle(paths, [ca_cert])))
        return paths

    if dns_names is None or ip_addresses is None:
        current = _current_sans(paths)
        if current is None and dns_names is None:
            raise tls.CertificateError(
                f"{paths.tls_cert} is unreadable: pass the DNS names for the new certificate"
            )
        current_dns, current_ips = current or ([], [])
        dns_names = current_dns if dns_names is None else dns_names
        ip_addresses = current_ips if ip_addresses is None else ip_addresses

    written: list[Path] = []
    if new_ca:
        if others:
            raise tls.CertificateError(
                f"{paths.ca_bundle} still holds the previous CA ({others[0].subject.rfc4514_string()}): "
                "finish the running CA rotation first (certs rotate --finish)"
            )
        old_ca = ca_cert
        ca_key, ca_cert = generate_ca(ca_common_name(now), ca_valid_days, now=now)
        # Bundle first: whoever reads the directory must trust the new CA before anything is signed by it.
        written += write_bundle(paths, [ca_cert, old_ca])
        written += write_ca(paths, ca_key, ca_cert)
    key, cert = generate_serving_cert(ca_key, ca_cert, dns_names, ip_addresses, valid_days, now=now)
    written += write_serving(paths, key, cert)
    return dataclasses.replace(paths, written=tuple(written))


def _current_sans(paths: tls.CertPaths) -> tuple[list[str], list[tls.IPAddress]] | None:
    """The requested SANs of the current serving certificate; the defaults without one; None if unreadable."""
    if not paths.tls_cert.exists():
        return list(tls.DEFAULT_DNS_NAMES), []
    try:
        dns, ips = tls.certificate_sans(tls.load_certs(paths.tls_cert)[0])
    except tls.CertificateError:
        return None
    return [n for n in dns if n not in tls.ALWAYS_DNS_NAMES], [ip for ip in ips if ip not in tls.ALWAYS_IP_ADDRESSES]


def _fingerprint(cert: x509.Certificate) -> bytes:
    return cert.fingerprint(hashes.SHA256())


def _read_bundle(paths: tls.CertPaths, ca_cert: x509.Certificate) -> list[x509.Certificate]:
    return tls.load_certs(paths.ca_bundle) if paths.ca_bundle.exists() else [ca_cert]
