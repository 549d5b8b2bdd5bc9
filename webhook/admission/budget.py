"""The cluster-wide increase budget of ``change-rate``: a token bucket per replica (thread-safe, no I/O).

One replica runs several gunicorn worker processes; :class:`webhook.serving.shared_budget.SharedIncreaseBudget` keeps
this bucket's two numbers in a file the workers share, so the budget is the replica's, not each worker's.
"""

from __future__ import annotations

import threading


class IncreaseBudget:
    """Token bucket: ``rate`` tokens (increases) per second, at most ``burst`` stored. Time is in seconds.

    ``available(now)`` peeks; ``take(n, now)`` consumes up to ``n`` tokens. ``now`` is a monotonic or
    epoch time in seconds; it must not go backwards by more than the caller can tolerate (it is clamped).
    """

    def __init__(self, rate: float, burst: int) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("rate must be > 0 and burst >= 1")
        self.rate = rate
        self.burst = burst
        self._tokens = float(burst)
        self._last: float | None = None
        self._lock = threading.Lock()

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
