"""Serving: gunicorn with threaded workers over TLS, the metrics port in the master, clean shutdown.

Why this shape: the apiserver calls webhooks over HTTP/1.1 with keep-alive; gunicorn's sync workers close the
connection after every response (a TLS handshake per request), so the workers are ``gthread``. gunicorn 27
opens a control socket under the home directory unless disabled (a read-only root filesystem), so it is
disabled. The TLS context is ``webhook.serving.ssl_context.ReloadingSSLContext``: rotated certificates are picked up
without a restart. Each worker builds its own runtime (policy store, cluster view, audit writer) after the fork; the
Prometheus multiprocess directory is created in the master before it (the audit writers share no lock a dead
worker could keep: :mod:`webhook.serving.audit_writer`). SIGTERM: gunicorn stops
accepting, lets in-flight requests finish (``graceful_timeout``) and exits 0; audit records are written
unbuffered, so there is nothing left to flush.

Slow clients: gunicorn 27's gthread worker waits up to 5 s for a new connection's first bytes in a pool thread
(shortened to ``FIRST_BYTES_WAIT``, after which a silent connection waits in the poller and holds no thread),
then reads the TLS handshake, the headers and the body in that thread with blocking reads and no timeout, so a
client that stalls half way would hold the thread forever. Every TLS socket is therefore a
:class:`DeadlineSSLSocket`: the handshake and each request (headers and body) must arrive within the client
read timeout (5 s; ``CSINODE_GUARD_CLIENT_READ_TIMEOUT``) of their start, else the connection is closed and the
thread is free again. Writes get the same timeout.

Closing a keep-alive connection: gunicorn drops the ``Connection`` header an application sets, so
:func:`honour_connection_close` turns the app's ``Connection: close`` into gunicorn's own close (used for
``--connection-max-age`` and for 413 answers, whose body the app has drained up to a bound).

Logs: :class:`JsonGunicornLogger` gives gunicorn's own lines the guard's JSON formatter. Why gunicorn and not a
front in native code (granian, measured through the real apiserver): ``docs/serving-front.md``.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import glob
import logging
import os
import shutil
import ssl
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, ClassVar

from gunicorn.app.base import BaseApplication
from gunicorn.glogging import Logger as GunicornLogger

from webhook.serving.flushlock import flush_lock
from webhook.serving.gctuning import settle_for_requests
from webhook.serving.logs import json_formatter
from webhook.serving.settings import Settings

log = logging.getLogger("csinode_guard.serving")

CLIENT_READ_TIMEOUT_ENV = "CSINODE_GUARD_CLIENT_READ_TIMEOUT"
DEFAULT_CLIENT_READ_TIMEOUT = 5.0
"""Seconds a client has for the TLS handshake, and for each request's headers and body (the apiserver sends a
whole AdmissionReview at once and gives up after the webhook's timeoutSeconds, 5 s in deploy/)."""


WORKER_CONNECTIONS = 512
"""Connections per worker process (kept-alive, in flight and not yet readable); well below a 1024-fd limit."""
FIRST_BYTES_WAIT = 0.25
"""Seconds a pool thread waits for a new connection's first bytes before parking it in the poller."""


def limit_first_bytes_wait() -> None:
    """Make gthread workers park silent new connections after ``FIRST_BYTES_WAIT`` instead of 5 s.

    gunicorn 27 waits for a new connection's first bytes in a pool thread (``DEFAULT_WORKER_DATA_TIMEOUT``,
    5 s) before it hands the connection to its poller; a burst of connections that send nothing would hold
    every thread that long. The same bound caps the drain of an unread body before a keep-alive reuse.
    """
    from gunicorn.workers import gthread  # noqa: PLC0415 - only where gunicorn serves

    if hasattr(gthread, "DEFAULT_WORKER_DATA_TIMEOUT"):
        gthread.DEFAULT_WORKER_DATA_TIMEOUT = FIRST_BYTES_WAIT


def client_read_timeout() -> float:
    """``CSINODE_GUARD_CLIENT_READ_TIMEOUT`` (seconds, > 0) or the default."""
    raw = os.environ.get(CLIENT_READ_TIMEOUT_ENV, "")
    try:
        value = float(raw)
    except ValueError:
        return DEFAULT_CLIENT_READ_TIMEOUT
    return value if value > 0 else DEFAULT_CLIENT_READ_TIMEOUT


class ClientTooSlowError(ConnectionResetError):
    """A client did not complete its TLS handshake or request in time; gunicorn drops it like a reset."""

    def __init__(self, what: str, seconds: float) -> None:
        super().__init__(errno.ECONNRESET, f"client sent no complete {what} within {seconds:g}s")


class DeadlineSSLSocket(ssl.SSLSocket):
    """A server TLS socket whose blocking reads share one deadline per TLS handshake and per request.

    gunicorn's gthread worker calls ``setblocking(True)`` before it serves each request of a connection and
    ``setblocking(False)`` when it parks the connection in its poller; the first request's deadline starts
    with the handshake. Each read waits at most until the deadline (or less, when the caller set a shorter
    timeout); past it, :class:`ClientTooSlowError` is raised. Sends wait at most ``read_timeout`` each.
    """

    read_timeout: ClassVar[float] = DEFAULT_CLIENT_READ_TIMEOUT
    _deadline: float | None = None
    _requested: float | None = None
    _abandoned = False

    @property
    def timed_out(self) -> bool:
        """True once a read passed the deadline (the connection is being closed)."""
        return self._abandoned

    def setblocking(self, flag: bool) -> None:
        """Blocking mode starts a new request deadline; non-blocking mode (idle in the poller) clears it."""
        if not flag:
            self._deadline = None
            self._requested = 0.0
            super().setblocking(False)
            return
        if not self._abandoned:  # an abandoned connection is being closed; its reads return end-of-file
            self._deadline = time.monotonic() + self.read_timeout
        self._requested = None
        super().settimeout(self.read_timeout)

    def settimeout(self, value: float | None) -> None:
        """Remember the caller's timeout; reads still end at the request deadline."""
        self._requested = value
        super().settimeout(value)

    def _arm(self, what: str) -> None:
        if self._deadline is None:
            return
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise self._too_slow(what)
        super().settimeout(remaining if self._requested is None else min(self._requested, remaining))

    def give_up(self, what: str) -> ClientTooSlowError:
        """Abandon this connection because ``what`` (``request``, ``TLS handshake``) did not arrive in time: logs
        it, makes later reads return end-of-file (nothing to drain on close) and returns the error."""
        return self._too_slow(what)

    def _too_slow(self, what: str) -> ClientTooSlowError:
        error = ClientTooSlowError(what, self.read_timeout)
        # The connection is closed next. gunicorn's graceful close (in the worker's main thread) drains the
        # socket for up to 2 s first: a stalled client gets end-of-file at once instead.
        self._abandoned = True
        self._deadline = None
        try:
            peer = self.getpeername()
        except OSError:
            peer = "?"
        log.warning("closing a connection from %s: %s", peer, error.strerror)
        return error

    def do_handshake(self, block: bool = False) -> None:
        """The TLS handshake, within the deadline that starts with it."""
        if self._deadline is None:
            self._deadline = time.monotonic() + self.read_timeout
        self._arm("TLS handshake")
        try:
            super().do_handshake(block)
        except TimeoutError:
            raise self._too_slow("TLS handshake") from None

    def recv(self, buflen: int = 1024, flags: int = 0) -> bytes:
        """``recv`` bounded by the request deadline."""
        if self._abandoned:
            return b""
        self._arm("request")
        try:
            return super().recv(buflen, flags)
        except TimeoutError:
            raise self._too_slow("request") from None

    def recv_into(self, buffer: Any, nbytes: int | None = None, flags: int = 0) -> int:
        """``recv_into`` bounded by the request deadline."""
        if self._abandoned:
            return 0
        self._arm("request")
        try:
            return super().recv_into(buffer, nbytes, flags)
        except TimeoutError:
            raise self._too_slow("request") from None

    def sendall(self, data: Any, flags: int = 0) -> None:
        """``sendall`` that gives up after ``read_timeout`` (a client that does not read its answer)."""
        if self._deadline is not None:
            super().settimeout(self.read_timeout)
        super().sendall(data, flags)


def deadline_ssl_hook(ssl_hook: Callable[..., ssl.SSLContext]) -> Callable[..., ssl.SSLContext]:
    """Wrap gunicorn's ``ssl_context`` hook so that every connection gets a :class:`DeadlineSSLSocket`."""
    DeadlineSSLSocket.read_timeout = client_read_timeout()

    def hook(conf: Any, default_ssl_context_factory: Callable[[], ssl.SSLContext]) -> ssl.SSLContext:
        context = ssl_hook(conf, default_ssl_context_factory)
        context.sslsocket_class = DeadlineSSLSocket
        return context

    return hook


def honour_connection_close(app: Callable[..., Iterable[bytes]]) -> Callable[..., Iterable[bytes]]:
    """WSGI middleware: an app response with ``Connection: close`` makes gunicorn close the connection.

    gunicorn removes hop-by-hop headers from an application's response and keeps the connection alive; its
    own ``Response.force_close()`` (the object behind ``start_response``) closes it after this response and
    announces ``Connection: close``.
    """

    def wsgi(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        def start(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            if any(name.lower() == "connection" and value.lower() == "close" for name, value in headers):
                force_close = getattr(getattr(start_response, "__self__", None), "force_close", None)
                if callable(force_close):
                    force_close()
            return start_response(status, headers, exc_info)

        return app(environ, start)

    return wsgi


def prepare_metrics_dir() -> str:
    """Create a fresh Prometheus multiprocess directory and export PROMETHEUS_MULTIPROC_DIR.

    Must run before ``prometheus_client`` is imported anywhere in the process. A directory it creates (none was
    given) is removed when this process exits; the worker processes, forked from it, leave it alone.
    """
    existing = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if existing:
        # Only the sample files of an earlier run go (a restarted container keeps its emptyDir); nothing else in
        # the directory is touched.
        os.makedirs(existing, exist_ok=True)
        for name in os.listdir(existing):
            if name.endswith(".db"):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(existing, name))
        return existing
    path = tempfile.mkdtemp(prefix="csinode-guard-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    owner = os.getpid()

    def remove() -> None:
        if os.getpid() == owner:  # not in a worker, which inherits this handler when gunicorn forks it
            shutil.rmtree(path, ignore_errors=True)

    atexit.register(remove)
    return path


class JsonGunicornLogger(GunicornLogger):  # type: ignore[misc]
    """gunicorn's logger with the guard's JSON line formatter on its error (and access) log handlers.

    gunicorn writes its own lines (``Starting gunicorn``, ``Booting worker``, ``Worker exiting``, a worker
    timeout or a signal) through ``gunicorn.error``, which does not propagate to the root logger; with this
    class they are JSON objects like every other line of ``serve`` (``"logger": "gunicorn.error"``).
    """

    def _set_handler(self, log: logging.Logger, output: str | None, fmt: logging.Formatter,
                     stream: Any = None) -> None:
        super()._set_handler(log, output, json_formatter(), stream)


class GuardApplication(BaseApplication):  # type: ignore[misc]
    """A gunicorn application whose configuration comes from :class:`Settings`, not from gunicorn's CLI."""

    def __init__(self, settings: Settings, app_factory: Callable[[], Any], options: dict[str, Any]) -> None:
        self.settings = settings
        self.app_factory = app_factory
        self.options = options
        super().__init__()

    def load_config(self) -> None:
        """Apply ``options`` to gunicorn's config."""
        for key, value in self.options.items():
            self.cfg.set(key, value)

    def load(self) -> Any:
        """Build the WSGI app (called in each worker after the fork).

        Everything built so far lives as long as the worker: ``gc.freeze()`` takes it out of the garbage
        collector's full collections, which otherwise scan it every few hundred requests (a p99 spike), and
        the youngest generation collects less often (:mod:`webhook.serving.gctuning`).
        """
        app = honour_connection_close(self.app_factory())
        settle_for_requests()
        return app


def whole_request_worker(settings: Settings) -> str:
    """The worker class (:class:`webhook.serving.wholerequest.WholeRequestWorker`, gunicorn's gthread worker reading
    each request whole before a thread serves it), with this server's limits; called in the master before the fork."""
    from webhook.serving.wholerequest import WholeRequestWorker  # noqa: PLC0415 - only where gunicorn serves

    WholeRequestWorker.read_timeout = client_read_timeout()
    WholeRequestWorker.max_request_bytes = settings.max_body_bytes
    return "webhook.serving.wholerequest.WholeRequestWorker"


def gunicorn_options(settings: Settings, cert_file: Path, key_file: Path, ssl_hook: Callable[..., Any],
                     metrics_hook: Callable[[Any], None]) -> dict[str, Any]:
    """gunicorn settings for the webhook (see the module docstring for why each is set)."""
    from prometheus_client import multiprocess  # noqa: PLC0415 - after PROMETHEUS_MULTIPROC_DIR is set

    limit_first_bytes_wait()

    def child_exit(_server: Any, worker: Any) -> None:
        multiprocess.mark_process_dead(worker.pid)  # type: ignore[no-untyped-call]

    return {
        "bind": [f"[{settings.host}]:{settings.port}" if ":" in settings.host else f"{settings.host}:{settings.port}"],
        "reuse_port": settings.reuse_port,
        "workers": settings.workers,
        "worker_class": whole_request_worker(settings),
        "threads": settings.threads,
        # Connections that have sent nothing yet wait in the worker's poller and only hold a slot here (until
        # the keep-alive timeout): many of them must not stop a worker from accepting the apiserver's.
        "worker_connections": max(WORKER_CONNECTIONS, settings.threads * 8),
        "keepalive": max(1, round(settings.keepalive)),
        "timeout": max(1, round(settings.request_timeout)),
        "graceful_timeout": 20,
        "certfile": str(cert_file),
        "keyfile": str(key_file),
        "ssl_context": deadline_ssl_hook(ssl_hook),
        "limit_request_line": 8190,
        "limit_request_fields": 100,
        "limit_request_field_size": 8190,
        "control_socket_disable": True,
        "worker_tmp_dir": tempfile.gettempdir(),
        "accesslog": None,
        "errorlog": "-",
        "logger_class": "webhook.serving.workers.JsonGunicornLogger",
        "loglevel": settings.log_level,
        "proc_name": "csinode-guard",
        "when_ready": metrics_hook,
        "child_exit": child_exit,
        "preload_app": False,
    }


class CertificateExpiryCollector:
    """``csinode_guard_serving_certificate_expiry_timestamp_seconds``: notAfter of the serving certificate on
    disk, read at every scrape in the process that serves /metrics.

    A worker-side gauge would read 0 from a worker that has imported the metrics but not set them yet (a
    booting or replaced worker); the file is what every worker reloads within seconds anyway.
    """

    def __init__(self, cert_file: Path) -> None:
        self.cert_file = cert_file

    def collect(self) -> Iterator[Any]:
        """One gauge sample, or none while the file cannot be read (the /readyz problem says why)."""
        from prometheus_client.core import GaugeMetricFamily  # noqa: PLC0415

        from webhook.serving.tls import certificate_not_after  # noqa: PLC0415

        family = GaugeMetricFamily(
            "csinode_guard_serving_certificate_expiry_timestamp_seconds",
            "notAfter of the serving certificate, as a Unix timestamp.",
        )
        with contextlib.suppress(Exception):
            family.add_metric([], certificate_not_after(self.cert_file).timestamp())
        yield family


SAMPLE_FILE_HEADER_BYTES = 8
"""A sample file's header (prometheus_client's ``MmapedDict``: 4 bytes of used length, 4 of padding)."""


class LockedMultiProcessCollector:
    """prometheus_client's multiprocess merge of the workers' sample files, read under the shared flush lock of
    their directory.

    The workers write each batch of samples under the exclusive lock (:mod:`webhook.serving.flushlock`), so a scrape
    sees every sample of a batch or none (never a request counted without its latency).

    A sample file shorter than its header is skipped: prometheus_client creates each file empty and sizes it a
    moment later, so a scrape in that moment (a worker booting, or touching its first metric of a kind) would
    otherwise fail whole with HTTP 500, and a worker killed in that moment would leave the empty file, and the
    500s, for good (prometheus/client_python#1199, open in 0.26.0). Such a file holds no sample yet.
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def sample_files(self) -> list[str]:
        """The ``*.db`` files of the directory that hold at least a header, as paths."""
        files = []
        for path in glob.glob(os.path.join(self.directory, "*.db")):
            try:
                size = os.stat(path).st_size
            except FileNotFoundError:  # a live gauge's file removed as its worker died (mark_process_dead)
                continue
            if size >= SAMPLE_FILE_HEADER_BYTES:
                files.append(path)
        return files

    def collect(self) -> Any:
        """The merged metric families of all workers' sample files, read while no batch is half written."""
        from prometheus_client.multiprocess import MultiProcessCollector  # noqa: PLC0415

        with flush_lock(self.directory, shared=True):
            return list(MultiProcessCollector.merge(self.sample_files(), accumulate=True))  # type: ignore[no-untyped-call]


def start_metrics_server(port: int, cert_file: Path | None = None, collectors: Iterable[Any] = ()) -> None:
    """Serve the merged multiprocess metrics on plain HTTP ``port`` from a daemon thread (0 disables).

    With ``cert_file``, the serving certificate's expiry is collected at scrape time
    (:class:`CertificateExpiryCollector`); ``collectors`` (the master's own, such as the policy metrics) are
    registered next to the merged view.
    """
    if port <= 0:
        return
    from prometheus_client import REGISTRY, CollectorRegistry, start_http_server  # noqa: PLC0415

    # The master defines no metrics of its own (webhook.serving.metrics is imported only by the workers), so a gauge
    # merged with "min" or "max" never sees a master's zero.
    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if directory:
        registry = CollectorRegistry()
        registry.register(LockedMultiProcessCollector(directory))
    else:
        registry = REGISTRY
    if cert_file is not None:
        registry.register(CertificateExpiryCollector(cert_file))
    for collector in collectors:
        registry.register(collector)
    start_http_server(port, registry=registry)
    log.info("metrics on http://0.0.0.0:%d/metrics", port)

