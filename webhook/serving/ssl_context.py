"""The server's ``SSLContext``: TLS 1.2+ with AEAD ciphers, reloaded from disk when the certificate rotates.

``build_server_context`` builds one context from the serving certificate and key (and a client CA);
``ReloadingSSLContext`` follows the files of a certificate directory (layout: :mod:`webhook.serving.tls`) and is what
gunicorn's ``ssl_context`` hook returns for every connection (:mod:`webhook.serving.workers`).

This module imports nothing from Flask, kubernetes or prometheus_client.
"""

from __future__ import annotations

import hashlib
import logging
import os
import ssl
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

from webhook.serving.tls import CertificateError

__all__ = ["SERVER_CIPHERS", "ReloadingSSLContext", "build_server_context"]

logger = logging.getLogger("webhook.tls")  # the certificate modules log under one name, as before they split

SERVER_CIPHERS: Final = "ECDHE+AESGCM:ECDHE+CHACHA20"
"""OpenSSL cipher string for TLS 1.2: ECDHE key exchange, AEAD ciphers only (TLS 1.3 suites are all AEAD)."""


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
