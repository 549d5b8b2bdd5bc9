"""One cluster-wide increase budget for every replica, counted from the watched CSINodes.

``clusterBudget`` (``increasesPerSecond``, ``burst``) is a token bucket. Kept per process (or per replica, in a
shared file: :mod:`webhook.serving.shared_budget`), three replicas admitted three bursts. Here every replica counts
the same increases: the accepted increases the CSINode watch shows (:class:`webhook.kube.watch.csinodes.IncreaseLedger`:
an entry of a verified state whose ``changedAt`` moved and whose count rose), as a sliding window of
``burst / increasesPerSecond`` seconds holding at most ``burst`` increases -- the token bucket's burst, and its
rate over any longer time.

The watch shows an increase some milliseconds after the replica that admitted it answered. Until then that
replica counts it itself (:meth:`WatchedIncreaseBudget.take` keeps it as pending, matched against the next
increases the watch shows, or dropped after ``pending_ttl`` seconds when it was never stored: a later webhook
refused the write, or it lost a conflict). Replicas that admit increases within the same watch delay do not see
each other's: the overshoot is bounded by what the other replicas admit within that delay (docs/budget.md:
measured).

Fair shares: a node's increases inside the window are counted from the same ledger (every replica's, by the
CSINode they were shown on) plus this replica's pending ones for that node, against
:func:`webhook.admission.budget.node_share`. Increases of a driver the cluster has no CSIDriver object for
(``uncounted``) are not counted: the evaluation does not ask the budget for them either.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from webhook.admission.budget import IncreaseBudget


@runtime_checkable
class WatchedIncreases(Protocol):
    """The increases a CSINode watch has shown (:class:`webhook.kube.watch.csinodes.IncreaseLedger`)."""

    total: int
    """Increases shown so far (monotone)."""

    def since(self, start: float, node: str | None = None,
              uncounted: Callable[[str], bool] | None = None) -> int:
        """Increases at or after ``start`` (Unix seconds), of ``node`` only when given, without the drivers
        ``uncounted`` names."""
        ...


PENDING_TTL = 5.0
"""Seconds an increase this replica admitted counts while the watch has not shown it."""


class WatchedIncreaseBudget(IncreaseBudget):
    """The cluster budget over ``ledger`` (see the module docstring). ``now`` arguments are
    ``time.monotonic()`` seconds, as the server passes them; the ledger's times are wall-clock (they come
    from the admitting replica's state timestamps), so the window is placed with ``time.time()``."""

    def __init__(self, rate: float, burst: int, ledger: WatchedIncreases, pending_ttl: float = PENDING_TTL,
                 uncounted: Callable[[str], bool] | None = None) -> None:
        super().__init__(rate, burst)
        self.ledger = ledger
        self.pending_ttl = pending_ttl
        self.uncounted = uncounted
        """True for a driver whose watched increases draw nothing (no CSIDriver object); None: all count."""
        self._pending: deque[tuple[float, int]] = deque()  # (monotonic time taken, ledger total at that time)
        self._pending_nodes: deque[tuple[float, str]] = deque()  # (monotonic time granted, node), admit() only
        self._pending_lock = threading.Lock()

    def _used(self, now: float) -> int:
        """Increases inside the window: the ledger's, plus this process's own not shown yet (lock held)."""
        while self._pending and now - self._pending[0][0] >= self.pending_ttl:
            self._pending.popleft()
        total = self.ledger.total
        matched = 0
        unmatched = 0
        for _, seen_at_take in self._pending:
            if total - seen_at_take > matched:
                matched += 1  # the watch has shown (at least) one increase since: count it there, not here
            else:
                unmatched += 1
        return self.ledger.since(time.time() - self.window, uncounted=self.uncounted) + unmatched

    def node_used(self, node: str, now: float) -> int:
        """Increases of ``node`` inside the window: every replica's that the watch showed, plus this replica's
        granted ones not older than ``pending_ttl`` that the watch may not show yet (an increase seen both ways
        within that time counts twice: the node's share errs on the small side)."""
        with self._pending_lock:
            while self._pending_nodes and now - self._pending_nodes[0][0] >= self.pending_ttl:
                self._pending_nodes.popleft()
            mine = sum(1 for _, n in self._pending_nodes if n == node)
        return self.ledger.since(time.time() - self.window, node, self.uncounted) + mine

    def _record(self, node: str, n: int, now: float) -> None:
        with self._pending_lock:
            self._pending_nodes.extend([(now, node)] * n)

    def available(self, now: float) -> float:
        """Increases the cluster may still admit now (``burst`` minus the window's)."""
        with self._pending_lock:
            return float(max(0, self.burst - self._used(now)))

    def take(self, n: int, now: float) -> bool:
        """Admit ``n`` increases when the window has room for all of them (kept as pending); else False."""
        with self._pending_lock:
            if self._used(now) + n > self.burst:
                return False
            total = self.ledger.total
            for _ in range(n):
                self._pending.append((now, total))
            return True


def watched_budget(rate: float, burst: int, cluster: object) -> WatchedIncreaseBudget | None:
    """A :class:`WatchedIncreaseBudget` over ``cluster``'s CSINode watch, or None when it has none (offline).
    Watched increases of a driver ``cluster`` knows has no CSIDriver object are not counted."""
    ledger = getattr(cluster, "increase_ledger", None)
    if not isinstance(ledger, WatchedIncreases) or getattr(cluster, "csinodes", None) is None:
        return None
    exists = getattr(cluster, "csidriver_exists", None)
    uncounted = (lambda driver: exists(driver) is False) if callable(exists) else None
    return WatchedIncreaseBudget(rate, burst, ledger, uncounted=uncounted)
