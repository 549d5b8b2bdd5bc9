"""A worker told to stop ends its writes to the cluster at once, before it has drained its connections.

gunicorn sends each worker SIGTERM when the guard stops (a rolling update, ``kubectl delete pod``, an uninstall);
the worker keeps answering the AdmissionReviews already on its connections for up to ``graceful_timeout`` (20 s),
and only then exits (``atexit``). The background audit must not go on that long: a replica on its way out that
keeps the audit Lease delays the next leader, and one that still takes the Lease after the signal (its caches
had not synced yet) would repair counts with a policy and a registration that are being removed. So the worker's
SIGTERM handler (:class:`webhook.serving.wholerequest.WholeRequestWorker`) calls :func:`begin_stop`, which runs
every callback given to :func:`on_stop` in a thread of its own (the audit loop's ``stop``: end the loop, give the
Lease up), and :func:`requested` tells code that starts such a writer later not to start it.

This module imports nothing from Flask, kubernetes or prometheus_client.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("csinode_guard.serving")

_requested = threading.Event()
_lock = threading.Lock()
_callbacks: list[Callable[[], None]] = []


def requested() -> bool:
    """True once this process was told to stop (:func:`begin_stop`)."""
    return _requested.is_set()


def on_stop(callback: Callable[[], None]) -> None:
    """Run ``callback`` (no arguments; it may block, e.g. to give a Lease up) in a daemon thread when the process
    is told to stop; at once when it already was."""
    with _lock:
        if not _requested.is_set():
            _callbacks.append(callback)
            return
    _run(callback)


def begin_stop() -> None:
    """The process was told to stop: run every registered callback, each once, in a thread of its own. Safe in a
    signal handler (it only starts threads) and idempotent."""
    with _lock:
        if _requested.is_set():
            return
        _requested.set()
        callbacks = list(_callbacks)
        _callbacks.clear()
    for callback in callbacks:
        _run(callback)


def _run(callback: Callable[[], None]) -> None:
    def call() -> None:
        try:
            callback()
        except Exception:  # stopping must go on
            log.exception("stopping %r failed", callback)

    threading.Thread(target=call, name="csinode-guard-stop", daemon=True).start()
