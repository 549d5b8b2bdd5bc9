"""A keyed in-memory cache with secondary indexes, written by one watch thread, read by admission requests.

Concurrency model: every write takes the store's lock for O(1) work (one key and its index entries). A re-list
builds the new contents and indexes outside the lock and swaps them in under it. Index buckets are
copy-on-write (a bucket is replaced, never changed in place), so a reader may keep a bucket it got under the
lock and iterate it afterwards without holding the lock.

Readers never wait long: each read acquires the lock with a time budget (seconds) and answers "unavailable"
(None) when it cannot get it in time, e.g. because a writer was descheduled while holding it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Generic, TypeVar, cast

R = TypeVar("R")

#: An index function maps a record to its index key, or None to leave it out of that index.
IndexFunc = Callable[[R], Hashable | None]


class Store(Generic[R]):
    """Records by key (``namespace/name`` or ``name``) plus named indexes of key -> record buckets."""

    def __init__(self, kind: str, indexers: Mapping[str, IndexFunc[R]] | None = None) -> None:
        """``kind`` names the cache in metrics and logs; ``indexers`` maps an index name to its index function."""
        self.kind = kind
        self._indexers: dict[str, IndexFunc[R]] = dict(indexers or {})
        self._lock = threading.Lock()
        self._items: dict[str, R] = {}
        self._indexes: dict[str, dict[Hashable, Mapping[str, R]]] = {name: {} for name in self._indexers}

    # --- writers (one watch thread) -------------------------------------------------------------------------

    def replace(self, items: Mapping[str, R]) -> None:
        """Replace the whole contents (after a list); indexes are built before the lock is taken."""
        new_items = dict(items)
        new_indexes: dict[str, dict[Hashable, dict[str, R]]] = {name: {} for name in self._indexers}
        for name, func in self._indexers.items():
            index = new_indexes[name]
            for key, record in new_items.items():
                ikey = func(record)
                if ikey is not None:
                    index.setdefault(ikey, {})[key] = record
        with self._lock:
            self._items = new_items
            self._indexes = cast("dict[str, dict[Hashable, Mapping[str, R]]]", new_indexes)

    def upsert(self, key: str, record: R) -> None:
        """Add or replace the record under ``key``."""
        with self._lock:
            old = self._items.get(key)
            self._items[key] = record
            for name, func in self._indexers.items():
                old_ikey = func(old) if old is not None else None
                new_ikey = func(record)
                if old_ikey is not None and old_ikey != new_ikey:
                    self._bucket_remove(name, old_ikey, key)
                if new_ikey is not None:
                    self._bucket_put(name, new_ikey, key, record)

    def delete(self, key: str) -> None:
        """Remove the record under ``key`` if present."""
        with self._lock:
            old = self._items.pop(key, None)
            if old is None:
                return
            for name, func in self._indexers.items():
                ikey = func(old)
                if ikey is not None:
                    self._bucket_remove(name, ikey, key)

    def _bucket_put(self, name: str, ikey: Hashable, key: str, record: R) -> None:
        index = self._indexes[name]
        old = index.get(ikey)
        bucket = dict(old) if old else {}
        bucket[key] = record
        index[ikey] = bucket

    def _bucket_remove(self, name: str, ikey: Hashable, key: str) -> None:
        index = self._indexes[name]
        old = index.get(ikey)
        if old is None or key not in old:
            return
        if len(old) == 1:
            del index[ikey]
            return
        bucket = dict(old)
        del bucket[key]
        index[ikey] = bucket

    # --- readers (admission requests; bounded wait) -----------------------------------------------------------

    def get(self, key: str, budget: float) -> tuple[bool, R | None]:
        """``(available, record)``: the record under ``key`` (None when absent); ``available`` is False when the
        lock could not be taken within ``budget`` seconds."""
        if not self._lock.acquire(timeout=budget):
            return False, None
        try:
            return True, self._items.get(key)
        finally:
            self._lock.release()

    def bucket(self, index: str, ikey: Hashable, budget: float) -> Mapping[str, R] | None:
        """The records whose ``index`` key is ``ikey`` (an empty mapping when none), or None when the lock could not
        be taken within ``budget`` seconds. The mapping is never modified afterwards: iterate it freely."""
        if not self._lock.acquire(timeout=budget):
            return None
        try:
            found = self._indexes[index].get(ikey)
            return {} if found is None else found
        finally:
            self._lock.release()

    def count(self, index: str, ikey: Hashable, budget: float) -> int | None:
        """Number of records whose ``index`` key is ``ikey``, or None when the lock was not taken in ``budget``."""
        found = self.bucket(index, ikey, budget)
        return None if found is None else len(found)

    def buckets(self, index: str) -> Iterable[Mapping[str, R]]:
        """A snapshot of all buckets of ``index`` (for metrics; waits for the lock)."""
        with self._lock:
            return list(self._indexes[index].values())

    def __len__(self) -> int:
        """Number of records (a racy read, for metrics)."""
        return len(self._items)

    @property
    def lock(self) -> threading.Lock:
        """The store's lock (tests hold it to simulate a slow writer)."""
        return self._lock
