"""The cluster-wide increase budget of ``change-rate``: a token bucket per replica, with fair shares per node
(thread-safe, no I/O).

One replica runs several gunicorn worker processes; :class:`webhook.serving.shared_budget.SharedIncreaseBudget` keeps
this bucket's two numbers in a file the workers share, so the budget is the replica's, not each worker's;
:class:`webhook.serving.cluster_budget.WatchedIncreaseBudget` counts every replica's increases from the CSINode
watch.

Fair shares (issue 32, attack 8): one node must not spend the budget every other node needs. Within any budget
window (``burst / rate`` seconds) a node is granted at most :func:`node_share` increases (a tenth of the burst, at
least one); the rest of the burst stays for the other nodes. :meth:`IncreaseBudget.admit` judges the increases of
one write one by one: it grants what fits (the node's share and the bucket) and refuses the rest, which the
evaluation clamps, so a write is no longer all-or-nothing.
"""

from __future__ import annotations

import threading
from collections import deque

NODE_SHARE_DIVISOR = 10
"""A node's share of the burst: ``burst // NODE_SHARE_DIVISOR`` increases per window, at least one."""


def node_share(burst: int) -> int:
    """The increases one node may be granted within a budget window: a tenth of ``burst`` (at least 1). The
    default ``burst: 50`` gives 5 per 10 s window -- more than a node's drivers need (each entry is also held to
    ``minInterval``), and ten such nodes before the budget runs dry for the others."""
    return max(1, burst // NODE_SHARE_DIVISOR)


class IncreaseBudget:
    """Token bucket: ``rate`` tokens (increases) per second, at most ``burst`` stored. Time is in seconds.

    ``available(now)`` peeks; ``take(n, now)`` consumes up to ``n`` tokens; ``admit(node, n, now)`` grants a
    node's increases one by one within its fair share. ``now`` is a monotonic or epoch time in seconds; it must
    not go backwards by more than the caller can tolerate (it is clamped). Raises ValueError for a rate <= 0 or a
    burst < 1.
    """

    def __init__(self, rate: float, burst: int) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("rate must be > 0 and burst >= 1")
        self.rate = rate
        self.burst = burst
        self.window = burst / rate
        """Seconds over which a node's share is counted (the bucket's burst at its rate)."""
        self.share = node_share(burst)
        self._tokens = float(burst)
        self._last: float | None = None
        self._lock = threading.Lock()
        self._granted: dict[str, deque[float]] = {}  # node -> times of the increases granted to it (this process)
        self._granted_lock = threading.Lock()

    def _refill(self, now: float) -> None:
        if self._last is None:
            self._last = now
            return
        elapsed = max(0.0, now - self._last)
        self._tokens = min(float(self.burst), self._tokens + elapsed * self.rate)
        self._last = max(self._last, now)

    def _available(self, now: float) -> float:
        """:meth:`available` for a caller that holds the lock."""
        self._refill(now)
        return self._tokens

    def _take(self, n: int, now: float) -> bool:
        """:meth:`take` for a caller that holds the lock."""
        self._refill(now)
        if self._tokens + 1e-9 < n:
            return False
        self._tokens -= n
        return True

    def available(self, now: float) -> float:
        """Tokens available at ``now`` (seconds)."""
        with self._lock:
            return self._available(now)

    def take(self, n: int, now: float) -> bool:
        """Consume ``n`` tokens at ``now`` if available; returns False (consuming nothing) otherwise."""
        with self._lock:
            return self._take(n, now)

    def node_used(self, node: str, now: float) -> int:
        """Increases granted to ``node`` within the window ending at ``now`` (this process's grants; the watched
        budget counts every replica's)."""
        with self._granted_lock:
            times = self._granted.get(node)
            if not times:
                return 0
            while times and now - times[0] >= self.window:
                times.popleft()
            return len(times)

    def _record(self, node: str, n: int, now: float) -> None:
        with self._granted_lock:
            times = self._granted.setdefault(node, deque())
            times.extend([now] * n)
            if len(self._granted) > 10_000:  # forget nodes with nothing left in their window
                for key in [k for k, v in self._granted.items() if not v or now - v[-1] >= self.window]:
                    del self._granted[key]

    def admit(self, node: str, n: int, now: float, *, dry_run: bool = False) -> int:
        """Of ``n`` increases node ``node`` asks for at ``now``, how many are granted, in order: at most what is
        left of the node's share (:func:`node_share`) in the window, and one by one while the bucket has a
        token. A dry run takes nothing and records nothing."""
        if n <= 0:
            return 0
        fits = min(n, max(0, self.share - self.node_used(node, now)))
        if dry_run:
            return min(fits, int(self.available(now) + 1e-9))
        granted = 0
        while granted < fits and self.take(1, now):
            granted += 1
        if granted:
            self._record(node, granted, now)
        return granted
