"""Settings of the watch caches: one frozen dataclass, every duration in seconds."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CacheSettings:
    """How the watch caches list, watch, retry and answer. All durations are in seconds."""

    max_staleness: float = 120.0
    """``--max-staleness``: a cache whose watch has been down longer than this answers unknown (None)."""

    cache_sync_timeout: float = 30.0
    """``--cache-sync-timeout``: after this long without every cache synced the guard turns ready anyway, in a
    degraded mode (log line, ``csinode_guard_cache_degraded`` = 1); unsynced caches answer unknown."""

    lookup_budget: float = 0.005
    """Longest an admission-path lookup waits for a cache's lock before it answers unknown (None)."""

    page_size: int = 100
    """``limit`` of each list page. Smaller than client-go's 500 on purpose: :func:`json.loads` holds the GIL for
    a whole page (~9 ms for 100 driver pods of ~13 KB, ~80 ms for 500), and admission threads wait for it; pages
    also bound the memory a list needs."""

    watch_timeout: float = 300.0
    """Base of the watch's ``timeoutSeconds``; each watch asks for a random value in [1x, 2x) of it, like client-go,
    so that replicas do not reconnect in step."""

    watch_read_timeout: float = 180.0
    """A watch that delivers nothing (no event, no BOOKMARK) for this long counts as dropped and is resumed from
    its last resourceVersion. The apiserver's watch cache sends a BOOKMARK about every minute."""

    connect_timeout: float = 10.0
    """TCP/TLS connect timeout of every request."""

    request_timeout: float = 60.0
    """Read timeout of a list page."""

    backoff_initial: float = 0.8
    """First retry delay after an error (client-go: 800 ms); doubles per consecutive error."""

    backoff_max: float = 30.0
    """Cap of the retry delay (client-go: 30 s). Each delay is jittered to 50-100 % of its value."""

    monitor_interval: float = 1.0
    """Period of the thread that publishes cache metrics and notices the end of the sync timeout."""
