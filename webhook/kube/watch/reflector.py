"""One list+watch loop per collection, in its own daemon thread, keeping a :class:`Store` in sync.

The loop follows client-go's reflector (``k8s.io/client-go/tools/cache/reflector.go``):

1. list the collection in pages, replace the store, remember the list's ``resourceVersion``;
2. watch from that resourceVersion with ``allowWatchBookmarks=true``, applying ADDED / MODIFIED / DELETED and
   advancing the resourceVersion on every event and BOOKMARK;
3. when the watch ends (server timeout) or the connection drops, watch again from the last resourceVersion;
4. on 410 Gone -- an HTTP 410 or an ERROR event whose Status has code 410 ("too old resource version") --
   list again (step 1);
5. after an error, wait an exponential backoff with jitter before the next request.

Freshness: the reflector records when its watch went down (``down_since``, monotonic seconds) and clears it once
a list succeeds or a watch is established again; readers compare that with ``max_staleness``.
"""

from __future__ import annotations

import http.client
import json
import logging
import random
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

import urllib3.exceptions

from webhook.kube.watch import metrics
from webhook.kube.watch.records import object_key, resource_version
from webhook.kube.watch.settings import CacheSettings
from webhook.kube.watch.store import Store
from webhook.kube.watch.transport import ApiStatusError, CollectionClient, GoneError, RawResponse, iter_lines

log = logging.getLogger("webhook.providers.reflector")

R = TypeVar("R")

_CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    urllib3.exceptions.HTTPError,  # ProtocolError (dropped mid-stream), ReadTimeoutError, MaxRetryError, ...
    http.client.HTTPException,
    OSError,
)


class WatchDecodeError(Exception):
    """A watch stream line that is not a JSON watch event."""


class Reflector(Generic[R]):
    """Keeps ``store`` equal to the collection behind ``client``; ``parse`` turns an object into its record
    (None: do not keep the object, e.g. a pod no DaemonSet controls)."""

    def _count_restart(self, reason: str) -> None:
        """``csinode_guard_watch_restarts_total{kind,reason}`` + 1 (the reflector may run in gunicorn's master)."""
        with metrics.fork_safe():
            metrics.WATCH_RESTARTS.labels(self.kind, reason).inc()

    def __init__(
        self,
        kind: str,
        client: CollectionClient,
        parse: Callable[[Mapping[str, Any]], R | None],
        store: Store[R],
        settings: CacheSettings,
        name: str | None = None,
    ) -> None:
        """``kind`` labels metrics (``nodes``, ``pods``, ...); ``name`` names the thread and log lines."""
        self.kind = kind
        self.name = name or kind
        self.client = client
        self.store = store
        self._parse = parse
        self._settings = settings
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._response: RawResponse | None = None
        self._resource_version: str | None = None
        self._created = time.monotonic()
        self.synced = False
        """True once a list has completed (stays True)."""
        self.down_since: float | None = None
        """``time.monotonic()`` when the watch was lost, None while it is up."""

    # --- state read by the view -------------------------------------------------------------------------------

    def fresh(self, now: float, max_staleness: float) -> bool:
        """True when the store may be read: synced, and its watch not down for more than ``max_staleness`` s."""
        if not self.synced:
            return False
        down = self.down_since
        return down is None or now - down <= max_staleness

    def staleness(self, now: float) -> float:
        """Seconds since the watch went down (0 while up; since creation while never synced)."""
        if not self.synced:
            return now - self._created
        down = self.down_since
        return 0.0 if down is None else now - down

    @property
    def resource_version(self) -> str | None:
        """The last resourceVersion seen (list, event or BOOKMARK)."""
        return self._resource_version

    # --- lifecycle --------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the loop thread (once)."""
        if self._thread is not None:
            return
        self._created = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=f"csinode-guard-watch-{self.name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ask the loop to end and interrupt a watch that is blocked reading; does not wait (see :meth:`join`)."""
        self._stop.set()
        response = self._response
        if response is not None:
            _interrupt(response)

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the loop thread to end."""
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """True while the loop thread runs."""
        return self._thread is not None and self._thread.is_alive()

    # --- the loop ---------------------------------------------------------------------------------------------

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                if self._resource_version is None:
                    self._list()
                    failures = 0
                opened = time.monotonic()
                received = self._watch()
                if self._stop.is_set():
                    break
                self._count_restart("closed")
                self._mark_down()
                # A watch the server closes at once, again and again (a misbehaving proxy), must not spin.
                if received or time.monotonic() - opened >= 1.0:
                    failures = 0
                    continue
                failures += 1
            except GoneError as exc:
                self._count_restart("gone")
                log.info("watch %s: %s; re-listing", self.name, exc)
                self._resource_version = None
                self._mark_down()
                failures += 1
                if failures == 1:
                    continue  # re-list at once, like client-go; back off only when 410s repeat
            except ApiStatusError as exc:
                self._count_restart("error")
                log.warning("watch %s: API error %s; retrying", self.name, exc)
                self._mark_down()
                failures += 1
            except WatchDecodeError as exc:
                self._count_restart("decode")
                log.warning("watch %s: %s; restarting the watch", self.name, exc)
                self._mark_down()
                failures += 1
            except _CONNECTION_ERRORS as exc:
                if self._stop.is_set():
                    break
                self._count_restart("dropped")
                log.info("watch %s: connection lost (%s: %s); reconnecting", self.name, type(exc).__name__, exc)
                self._mark_down()
                failures += 1
            except Exception:
                self._count_restart("error")
                log.exception("watch %s: unexpected error; retrying", self.name)
                self._mark_down()
                failures += 1
            self._stop.wait(self._backoff(failures))

    def _backoff(self, failures: int) -> float:
        """Exponential backoff in seconds with jitter: initial * 2**(failures-1), capped, times U(0.5, 1)."""
        if failures <= 0:
            return 0.0
        delay = min(self._settings.backoff_max, self._settings.backoff_initial * 2.0 ** min(failures - 1, 30))
        return delay * random.uniform(0.5, 1.0)

    def _mark_down(self) -> None:
        if self.down_since is None:
            self.down_since = time.monotonic()

    def _list(self) -> None:
        """List all pages and replace the store; raises on any error (the caller retries)."""
        settings = self._settings
        timeout = (settings.connect_timeout, settings.request_timeout)
        items: dict[str, R] = {}
        continue_token: str | None = None
        list_rv: str | None = None
        while True:
            page = self.client.list_page(settings.page_size, continue_token, timeout)
            raw_items = page.get("items") or []
            for obj in raw_items:
                if not isinstance(obj, Mapping):
                    continue
                key = object_key(obj)
                record = self._parse(obj) if key else None
                if key and record is not None:
                    items[key] = record
            list_rv = resource_version(page) or list_rv
            meta = page.get("metadata")
            continue_token = meta.get("continue") if isinstance(meta, Mapping) else None
            del page, raw_items
            if not continue_token:
                break
        if list_rv is None:
            raise ApiStatusError(500, "InternalError", f"list of {self.client.path} has no resourceVersion")
        self.store.replace(items)
        self._resource_version = list_rv
        self.down_since = None
        if not self.synced:
            self.synced = True
            log.info("cache %s synced: %d objects at resourceVersion %s", self.name, len(items), list_rv)

    def _watch(self) -> int:
        """Watch from the current resourceVersion until the stream ends; returns the number of lines received."""
        settings = self._settings
        rv = self._resource_version
        assert rv is not None
        timeout_seconds = int(settings.watch_timeout * (1.0 + random.random()))
        response = self.client.watch(rv, timeout_seconds, (settings.connect_timeout, settings.watch_read_timeout))
        self._response = response
        received = 0
        try:
            if self._stop.is_set():
                return 0
            self.down_since = None
            for line in iter_lines(response):
                received += 1
                self._apply(line)
                if self._stop.is_set():
                    break
        finally:
            self._response = None
            response.close()
        return received

    def _apply(self, line: bytes) -> None:
        try:
            event = json.loads(line)
        except ValueError as exc:
            raise WatchDecodeError(f"undecodable watch event: {line[:80]!r}") from exc
        if not isinstance(event, Mapping) or not isinstance(event.get("object"), Mapping):
            raise WatchDecodeError(f"not a watch event: {line[:80]!r}")
        event_type = event.get("type")
        obj: Mapping[str, Any] = event["object"]
        if event_type == "ERROR":
            raise ApiStatusError.from_status(obj)
        new_rv = resource_version(obj)
        if event_type != "BOOKMARK":
            key = object_key(obj)
            if key is None:
                raise WatchDecodeError(f"{event_type} event without metadata.name")
            if event_type in ("ADDED", "MODIFIED"):
                record = self._parse(obj)
                if record is None:
                    self.store.delete(key)
                else:
                    self.store.upsert(key, record)
            elif event_type == "DELETED":
                self.store.delete(key)
            else:
                raise WatchDecodeError(f"unknown watch event type {event_type!r}")
        if new_rv:
            self._resource_version = new_rv


def _interrupt(response: RawResponse) -> None:
    """Unblock a thread reading ``response``: shut the socket down (urllib3 >= 2.3), else close it."""
    shutdown = getattr(response, "shutdown", None)
    try:
        if callable(shutdown):
            shutdown()
        else:
            response.close()
    except Exception:  # best effort while stopping
        log.debug("could not interrupt a watch response", exc_info=True)
