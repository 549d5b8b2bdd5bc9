"""The cluster-wide increase budget shared by the worker processes of one replica.

``clusterBudget`` is per replica (README, ``policies/default.yaml``), but every gunicorn worker judges requests
on its own: with a bucket per worker, ``--workers 2`` admitted twice the burst, and whether a retry was admitted
depended on the worker its connection landed on. :class:`SharedIncreaseBudget` keeps the bucket's state (tokens,
last refill time) in a 17-byte file per policy version, read and written under ``flock`` (the kernel releases
it when its holder dies, so a killed worker never wedges the others). The master creates the directory before it
forks (:func:`prepare_budget_dir`); a worker started later (a replaced one) shares the same file. The clock is
``time.monotonic()``, which is one clock for all processes of a host (CLOCK_MONOTONIC).
"""

from __future__ import annotations

import atexit
import fcntl
import logging
import math
import os
import shutil
import struct
import tempfile
from pathlib import Path

from webhook.admission.budget import IncreaseBudget

log = logging.getLogger("csinode_guard.budget")

BUDGET_DIR_ENV = "CSINODE_GUARD_BUDGET_DIR"
_STATE = struct.Struct("<?dd")  # initialised, tokens, last refill (NaN: never)


def prepare_budget_dir() -> Path | None:
    """The directory of the replica's shared budgets, created (and exported in ``CSINODE_GUARD_BUDGET_DIR``) by
    the master before it forks, removed when the master exits. None when none can be created (then each
    worker keeps its own bucket, and says so)."""
    existing = os.environ.get(BUDGET_DIR_ENV)
    if existing and os.path.isdir(existing):
        return Path(existing)
    try:
        path = tempfile.mkdtemp(prefix="csinode-guard-budget-")
    except OSError as exc:
        log.warning("the cluster increase budget is kept per worker process (no shared directory: %s)", exc)
        return None
    os.environ[BUDGET_DIR_ENV] = path
    owner = os.getpid()

    def remove() -> None:
        if os.getpid() == owner:
            shutil.rmtree(path, ignore_errors=True)

    atexit.register(remove)
    return Path(path)


class SharedIncreaseBudget(IncreaseBudget):
    """:class:`IncreaseBudget` whose state lives in ``path``, shared by every process that opens the same file.

    Each ``available``/``take`` locks the file (``flock``, exclusive), loads the state, runs the bucket and
    stores it back: a few microseconds, only for writes that raise a count in /mutate. When the file cannot be
    used, the bucket falls back to this process's memory (logged once).
    """

    def __init__(self, rate: float, burst: int, path: Path) -> None:
        super().__init__(rate, burst)
        self.path = path
        self._fd: int | None = None
        self._failed = False

    def _open(self) -> int | None:
        if self._fd is None and not self._failed:
            try:
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            except OSError as exc:
                self._failed = True
                log.warning("cluster increase budget %s unusable (%s); counting in this worker", self.path, exc)
        return self._fd

    def _shared(self, operation: str, n: int, now: float) -> float | bool:
        with self._lock:
            fd = self._open()
            if fd is None:
                return self._available(now) if operation == "available" else self._take(n, now)
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                raw = os.pread(fd, _STATE.size, 0)
                if len(raw) == _STATE.size and _STATE.unpack(raw)[0]:
                    _, self._tokens, last = _STATE.unpack(raw)
                    self._last = None if math.isnan(last) else last
                else:
                    self._tokens, self._last = float(self.burst), None
                result = self._available(now) if operation == "available" else self._take(n, now)
                last = math.nan if self._last is None else self._last
                os.pwrite(fd, _STATE.pack(True, self._tokens, last), 0)
                return result
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)

    def available(self, now: float) -> float:
        """Tokens available to the replica at ``now`` (seconds, ``time.monotonic()``)."""
        return float(self._shared("available", 0, now))

    def take(self, n: int, now: float) -> bool:
        """Consume ``n`` of the replica's tokens at ``now`` if available; False (consuming nothing) otherwise."""
        return bool(self._shared("take", n, now))
