"""Prometheus metrics of the cluster caches (registered once, at import, in the default registry).

The webhook runs under gunicorn with several worker processes in prometheus multiprocess mode
(``PROMETHEUS_MULTIPROC_DIR``); every worker runs its own caches. Gauges therefore name how the workers' values
combine: ``livemin`` for "synced" (the worst live worker), ``livemax`` for the others (the worst live worker);
counters and histograms add up. No metric has a per-node label: nodes come and go and would explode cardinality.

``kind`` is one of ``nodes``, ``csidrivers``, ``volumeattachments``, ``pods``, and ``guardpolicies`` (the
gunicorn master's watch of the GuardPolicy it serves: webhook/serving/cluster_policy.py).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

from prometheus_client import Counter, Gauge, Histogram

_fork_guard = threading.Lock()


def _reinit_fork_guard() -> None:
    global _fork_guard  # noqa: PLW0603 - the child's one and only copy, made anew
    _fork_guard = threading.Lock()


# prometheus_client's multiprocess values share one module lock and presume no threads ("we presume this means
# there is no threading going on"); the gunicorn master has threads that update metrics (its GuardPolicy watch,
# the caBundle keeper) while it forks workers. A fork while one of them holds that lock leaves the worker with a
# lock no thread will release: its first metric update hangs for good. The master's updates go through
# fork_safe(), and a fork waits until none is under way.
def _hold_fork_guard() -> None:
    _fork_guard.acquire()  # the current global: a child has its own, made anew


def _release_fork_guard() -> None:
    _fork_guard.release()


os.register_at_fork(before=_hold_fork_guard, after_in_parent=_release_fork_guard, after_in_child=_reinit_fork_guard)


@contextlib.contextmanager
def fork_safe() -> Iterator[None]:
    """Hold off :func:`os.fork` while the block updates a metric (see above); cheap and uncontended otherwise."""
    with _fork_guard:
        yield

CACHE_SYNCED = Gauge(
    "csinode_guard_cache_synced",
    "1 when the watch cache of this kind has completed its initial list, else 0.",
    ["kind"],
    multiprocess_mode="livemin",
)

CACHE_OBJECTS = Gauge(
    "csinode_guard_cache_objects",
    "Objects held in the watch cache of this kind (pods: DaemonSet-controlled driver pods only).",
    ["kind"],
    multiprocess_mode="livemax",
)

CACHE_STALENESS = Gauge(
    "csinode_guard_cache_staleness_seconds",
    "Seconds since the watch of this kind was lost (0 while it is up); above --max-staleness its answers are unknown.",
    ["kind"],
    multiprocess_mode="livemax",
)

CACHE_DEGRADED = Gauge(
    "csinode_guard_cache_degraded",
    "1 when the guard became ready after --cache-sync-timeout without all caches synced (degraded mode).",
    multiprocess_mode="livemax",
)

WATCH_RESTARTS = Counter(
    "csinode_guard_watch_restarts",
    "Restarts of a list/watch loop by kind and reason: gone (410, re-list), dropped (connection lost),"
    " error (HTTP error status), closed (server ended the watch), decode (unreadable event).",
    ["kind", "reason"],
)

CACHE_LOOKUP_TIMEOUTS = Counter(
    "csinode_guard_cache_lookup_timeouts",
    "Cache lookups on the admission path that gave up (answered unknown) because the cache lock was not"
    " available within the lookup budget.",
    ["kind"],
)

ATTACH_ERRORS = Gauge(
    "csinode_guard_attach_errors",
    "VolumeAttachments currently carrying status.attachError, by attacher (driver) and error class"
    " (capacity = gRPC ResourceExhausted, KEP-4876).",
    ["driver", "class"],
    multiprocess_mode="livemax",
)

HEADROOM = Histogram(
    "csinode_guard_attach_headroom_volumes",
    "Headroom of a node for a driver when a count is judged: CSINode allocatable count minus attached"
    " VolumeAttachments (negative: more attached than allowed).",
    ["driver"],
    buckets=(-8, -4, -2, -1, 0, 1, 2, 4, 8, 16, 32, 64, 128),
)

VOLUME_LIMIT_PENDING = Gauge(
    "csinode_guard_volume_limit_pending_pods",
    "Pods Pending unscheduled because of volume limits (the scheduler's NodeVolumeLimits reason: node(s) exceed max"
    " volume count), cluster-wide.",
    multiprocess_mode="livemax",
)

HELD_BELOW_REPORTED = Gauge(
    "csinode_guard_held_below_reported_nodes",
    "Nodes whose stored count of this driver the guard holds below what the driver reports (its last clamp stored"
    " less than the node's kubelet asked for; other: drivers without a CSIDriver object).",
    ["driver"],
    multiprocess_mode="livemax",
)
