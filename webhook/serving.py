"""Serving: gunicorn with threaded workers over TLS, the metrics port in the master, clean shutdown.

Why this shape: the apiserver calls webhooks over HTTP/1.1 with keep-alive; gunicorn's sync workers close the
connection after every response (a TLS handshake per request), so the workers are ``gthread``. gunicorn 27
opens a control socket under the home directory unless disabled (a read-only root filesystem), so it is
disabled. The TLS context is ``webhook.tls.ReloadingSSLContext``: rotated certificates are picked up without a
restart. Each worker builds its own runtime (policy store, cluster view, audit writer) after the fork; the audit
lock and the Prometheus multiprocess directory are created in the master before it. SIGTERM: gunicorn stops
accepting, lets in-flight requests finish (``graceful_timeout``) and exits 0; audit records are written
unbuffered, so there is nothing left to flush.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gunicorn.app.base import BaseApplication

from webhook.settings import Settings

log = logging.getLogger("csinode_guard.serving")


def prepare_metrics_dir() -> str:
    """Create a fresh Prometheus multiprocess directory and export PROMETHEUS_MULTIPROC_DIR.

    Must run before ``prometheus_client`` is imported anywhere in the process.
    """
    existing = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if existing:
        shutil.rmtree(existing, ignore_errors=True)
        os.makedirs(existing, exist_ok=True)
        return existing
    path = tempfile.mkdtemp(prefix="csinode-guard-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    return path


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
        """Build the WSGI app (called in each worker after the fork)."""
        return self.app_factory()


def gunicorn_options(settings: Settings, cert_file: Path, key_file: Path, ssl_hook: Callable[..., Any],
                     metrics_hook: Callable[[Any], None]) -> dict[str, Any]:
    """gunicorn settings for the webhook (see the module docstring for why each is set)."""
    from prometheus_client import multiprocess  # noqa: PLC0415 - after PROMETHEUS_MULTIPROC_DIR is set

    def child_exit(_server: Any, worker: Any) -> None:
        multiprocess.mark_process_dead(worker.pid)  # type: ignore[no-untyped-call]

    return {
        "bind": [f"[{settings.host}]:{settings.port}" if ":" in settings.host else f"{settings.host}:{settings.port}"],
        "workers": settings.workers,
        "worker_class": "gthread",
        "threads": settings.threads,
        "worker_connections": max(64, settings.threads * 8),
        "keepalive": max(1, round(settings.keepalive)),
        "timeout": max(1, round(settings.request_timeout)),
        "graceful_timeout": 20,
        "certfile": str(cert_file),
        "keyfile": str(key_file),
        "ssl_context": ssl_hook,
        "limit_request_line": 8190,
        "limit_request_fields": 100,
        "limit_request_field_size": 8190,
        "control_socket_disable": True,
        "worker_tmp_dir": tempfile.gettempdir(),
        "accesslog": None,
        "errorlog": "-",
        "loglevel": settings.log_level,
        "proc_name": "csinode-guard",
        "when_ready": metrics_hook,
        "child_exit": child_exit,
        "preload_app": False,
    }


def start_metrics_server(port: int) -> None:
    """Serve the merged multiprocess metrics on plain HTTP ``port`` from a daemon thread (0 disables)."""
    if port <= 0:
        return
    from prometheus_client import start_http_server  # noqa: PLC0415

    from webhook.metrics import registry_for_exposition  # noqa: PLC0415

    registry = registry_for_exposition()
    if registry is None:
        start_http_server(port)
    else:
        start_http_server(port, registry=registry)
    log.info("metrics on http://0.0.0.0:%d/metrics", port)


def new_audit_lock() -> Any:
    """A lock shared by the worker processes forked after this call (audit lines stay whole)."""
    return multiprocessing.get_context("fork").Lock()
