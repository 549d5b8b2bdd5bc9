"""The CSINode watch cache: what every CSINode stores now, its verified state, and the increases it shows.

One :class:`~webhook.kube.watch.reflector.Reflector` lists and watches ``/apis/storage.k8s.io/v1/csinodes`` with
the same paging, bookmarks, 410 re-list, backoff and freshness as the other caches. Each object is kept as a
:class:`CSINodeRecord`: the parsed CSINode (drivers and counts, without annotations), its ``resourceVersion``, and
its ``csinode-guard.io/state`` verified with the state keys (:func:`webhook.admission.state.decode_state`).

Three readers:

- the audit loop (:mod:`webhook.serving.audit_loop`) judges every record (:meth:`CSINodeStore.snapshot`);
- every replica's cluster-wide increase budget counts the accepted increases the watch has shown inside the
  budget's window (:meth:`IncreaseLedger.since`): an entry of a verified state whose ``changedAt`` moved
  and whose count rose is one increase at that ``changedAt`` (registrations and decreases are not increases, as
  for ``change-rate``'s budget). Every replica watching the same objects counts the same increases;
- replay detection: the highest verified state ``sequence`` seen per object UID (:meth:`CSINodeStore.newest_sequence`).

Transitions are seen from one version of an object to the next, so a replica counts the increases it watched;
after a re-list it compares the new list with what it held. Increases made before its first list are not known
to a replica that just started (at most one budget window of them).
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from webhook.admission.csinode import CSINode, CSINodeError, parse_csinode
from webhook.admission.state import STATE_ANNOTATION, DecodedState, StateKeys, decode_state
from webhook.kube.watch.records import resource_version
from webhook.kube.watch.store import Store

LEDGER_HORIZON = 3600.0
"""Seconds of watched increases kept (longer than any sensible budget window: burst / rate)."""


@dataclass(frozen=True, slots=True)
class CSINodeRecord:
    """One stored CSINode: ``csinode`` (drivers and counts; its ``annotations`` are left out), the object's
    ``resource_version``, and ``decoded``, its state annotation verified for its UID (``decoded.state`` None with
    the :class:`~webhook.admission.state.StateProblem` when missing or unusable)."""

    csinode: CSINode
    resource_version: str
    decoded: DecodedState

    @property
    def sequence(self) -> int | None:
        """The verified state's ``sequence`` (an integer the guard raises with every state it writes), or None
        when the state is unusable or carries none."""
        state = self.decoded.state
        value = getattr(state, "sequence", None) if state is not None else None
        return value if isinstance(value, int) and not isinstance(value, bool) else None


def make_parser(keys: StateKeys) -> Any:
    """``parse(obj) -> CSINodeRecord | None`` for the reflector: None for an object that is not a usable CSINode
    (the admission path refuses those too)."""

    def parse(obj: Mapping[str, Any]) -> CSINodeRecord | None:
        try:
            parsed = parse_csinode(obj)
        except (CSINodeError, RecursionError):
            return None
        decoded = decode_state(parsed.annotations.get(STATE_ANNOTATION), parsed.uid, keys)
        slim = parsed._replace(annotations={}, has_annotations=parsed.has_annotations)
        return CSINodeRecord(slim, resource_version(obj) or "", decoded)

    return parse


def watched_increases(old: CSINodeRecord | None, new: CSINodeRecord) -> list[float]:
    """Wall-clock times (Unix seconds) of the accepted increases ``new`` shows over ``old`` (same UID, both states
    verified): each driver entry whose ``changedAt`` moved and whose count rose (None = unbounded is higher)."""
    return [t for t, _ in watched_increases_by_driver(old, new)]


def watched_increases_by_driver(old: CSINodeRecord | None, new: CSINodeRecord) -> list[tuple[float, str]]:
    """:func:`watched_increases` with each increase's driver: ``(Unix seconds, driver name)``."""
    if old is None or old.csinode.uid != new.csinode.uid:
        return []
    before, after = old.decoded.state, new.decoded.state
    if before is None or after is None:
        return []
    found: list[tuple[float, str]] = []
    for driver, entry in after.entries.items():
        previous = before.entries.get(driver)
        if previous is None or previous.changed_at == entry.changed_at:
            continue
        if previous.count is not None and (entry.count is None or entry.count > previous.count):
            found.append((entry.changed_at.timestamp(), driver))
    return found


class IncreaseLedger:
    """Watched increases by time, with the node and driver of each (thread-safe): :meth:`add` from the watch
    thread, :meth:`since` from requests."""

    def __init__(self, horizon: float = LEDGER_HORIZON) -> None:
        self._lock = threading.Lock()
        self._times: list[float] = []
        self._who: list[tuple[str, str]] = []  # (node, driver), parallel to _times
        self._horizon = horizon
        self.total = 0
        """Increases added so far (monotone): lets a replica match its own takes to what the watch shows."""

    def add(self, times: list[float], node: str = "", drivers: Sequence[str] = ()) -> None:
        """Record increases at ``times`` (Unix seconds) of CSINode ``node``, ``drivers`` the driver of each (by
        position; "" when not given); forgets those older than the horizon."""
        if not times:
            return
        with self._lock:
            for i, t in enumerate(times):
                at = bisect.bisect_right(self._times, t)
                self._times.insert(at, t)
                self._who.insert(at, (node, drivers[i] if i < len(drivers) else ""))
            self.total += len(times)
            cut = bisect.bisect_left(self._times, time.time() - self._horizon)
            if cut:
                del self._times[:cut]
                del self._who[:cut]

    def since(self, start: float, node: str | None = None,
              uncounted: Callable[[str], bool] | None = None) -> int:
        """Increases at or after ``start`` (Unix seconds); of CSINode ``node`` only when given; without those
        whose driver ``uncounted`` says draws nothing from the budget (a driver the cluster has no CSIDriver
        object for)."""
        with self._lock:
            first = bisect.bisect_left(self._times, start)
            if node is None and uncounted is None:
                return len(self._times) - first
            return sum(1 for n, d in self._who[first:]
                       if (node is None or n == node) and not (uncounted is not None and uncounted(d)))


class CSINodeStore(Store[CSINodeRecord]):
    """The CSINode :class:`Store`, which also feeds the :class:`IncreaseLedger` and the newest sequence per UID
    from every version it is given (one writer: the watch thread)."""

    def __init__(self, ledger: IncreaseLedger) -> None:
        super().__init__("csinodes")
        self.ledger = ledger
        self._sequences: dict[str, int] = {}
        self.relists = 0
        """Completed lists (the first, and every re-list after 410 Gone): the audit loop passes after each."""

    def _observe(self, old: CSINodeRecord | None, new: CSINodeRecord) -> None:
        found = watched_increases_by_driver(old, new)
        if found:
            self.ledger.add([t for t, _ in found], new.csinode.name, [d for _, d in found])
        sequence = new.sequence
        if sequence is not None and sequence > self._sequences.get(new.csinode.uid, -1):
            self._sequences[new.csinode.uid] = sequence

    def upsert(self, key: str, record: CSINodeRecord) -> None:
        """Store ``record``; the increases and sequence it shows over the version held before are recorded."""
        _, old = self.get(key, 60.0)
        super().upsert(key, record)
        self._observe(old, record)

    def replace(self, items: Mapping[str, CSINodeRecord]) -> None:
        """A (re-)list: compared with what was held, then swapped in."""
        for key, record in items.items():
            _, old = self.get(key, 60.0)
            self._observe(old, record)
        super().replace(items)
        self.relists += 1

    def delete(self, key: str) -> None:
        """Forget the object (and the newest sequence of its UID: a re-created CSINode has a new UID)."""
        _, old = self.get(key, 60.0)
        super().delete(key)
        if old is not None:
            self._sequences.pop(old.csinode.uid, None)

    def newest_sequence(self, uid: str) -> int | None:
        """The highest verified state sequence seen for ``uid`` (None when none was seen)."""
        return self._sequences.get(uid)

    def snapshot(self) -> list[CSINodeRecord]:
        """Every record now (a copy; waits for the lock)."""
        with self.lock:
            return list(self._items.values())
