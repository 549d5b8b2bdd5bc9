""":class:`KubernetesClusterView`: the :class:`~webhook.admission.cluster.ClusterView` answered from watch caches.

Four kinds of cache, each filled by its own :class:`~webhook.kube.watch.reflector.Reflector` thread:

==================  =============================================  ===========================================
kind                collection                                     kept per object
==================  =============================================  ===========================================
nodes               ``/api/v1/nodes``                              labels, ``status.nodeInfo.kubeletVersion``
csidrivers          ``/apis/storage.k8s.io/v1/csidrivers``         ``spec.nodeAllocatableUpdatePeriodSeconds``
volumeattachments   ``/apis/storage.k8s.io/v1/volumeattachments``  attacher, nodeName, attached, attachError
pods                ``/api/v1/namespaces/<ns>/pods?labelSelector``  DaemonSet pods only: node, labels, images
pendingpods         ``/api/v1/pods?fieldSelector=spec.nodeName=,``   unscheduled Pods Pending on volume limits
                    ``status.phase=Pending``                        only: their namespace
csinodes            ``/apis/storage.k8s.io/v1/csinodes``           drivers and counts, verified state (with keys)
histories           the guard namespace's ConfigMaps (label)       a node's verified history record
brakes              the guard namespace's ConfigMaps (label)       the verified brakes, a release request
==================  =============================================  ===========================================

The pendingpods watch (``serve`` runs it) feeds a metric only (``csinode_guard_volume_limit_pending_pods``, next
to ``csinode_guard_held_below_reported_nodes`` from the CSINode watch: :mod:`webhook.admission.held_below`); no
decision reads it, so the guard's readiness does not wait for it.

The CSINode watch runs when the view is given the state keys (:mod:`webhook.kube.watch.csinodes`): the audit
loop, the cluster-wide increase budget and the newest state sequence per object read it.

There is one pod watch per distinct (namespace, label selector) of the policy's ``pod`` version sources.

The admission path only reads: each lookup checks the cache's freshness (two attribute reads), then takes the
store's lock with the lookup budget; it never calls the API and never waits longer than the budget.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any, TypeVar

from webhook.admission.brake import BRAKES_LABEL, BRAKES_OBJECT
from webhook.admission.cluster import AttachError, Brake, PodVersionSource, RetainedState
from webhook.admission.held_below import held_below_reported
from webhook.admission.label_provenance import vouched_labels
from webhook.admission.node_history import HISTORY_LABEL, history_object_name
from webhook.admission.state import StateKeys
from webhook.kube.watch import metrics
from webhook.kube.watch.brakes import BrakeBook, make_brakes_parser
from webhook.kube.watch.csinodes import CSINodeRecord, CSINodeStore, IncreaseLedger, make_parser
from webhook.kube.watch.histories import HistoryStore, make_history_parser
from webhook.kube.watch.pod_store import PodStore
from webhook.kube.watch.records import (
    CSIDriverRecord,
    NodeRecord,
    PendingPodRecord,
    PodRecord,
    VolumeAttachmentRecord,
    lowest_version,
    make_node_parser,
    parse_csidriver,
    parse_node,
    parse_pod,
    parse_volume_attachment,
    parse_volume_limit_pending,
)
from webhook.kube.watch.reflector import Reflector
from webhook.kube.watch.settings import CacheSettings
from webhook.kube.watch.store import Store
from webhook.kube.watch.transport import CollectionClient

log = logging.getLogger("webhook.providers.view")

R = TypeVar("R")

KINDS = ("nodes", "csidrivers", "volumeattachments", "pods", "csinodes", "histories", "pendingpods", "brakes")
"""Cache kinds, as used in the ``kind`` label of the cache metrics."""

PENDING_POD_SELECTOR = "spec.nodeName=,status.phase=Pending"
"""The pendingpods watch's field selector: Pods no node is bound to, Pending."""
HELD_INTERVAL = 5.0
"""Seconds between two counts of the nodes held below their driver's report (a pass over the CSINode cache)."""
MAX_HELD_DRIVER_LABELS = 64
"""Driver names that label ``csinode_guard_held_below_reported_nodes`` at most (then ``other``)."""

PodWatchKey = tuple[str, str]
"""(namespace, label selector) of one pod watch."""


def label_selector(match_labels: Sequence[tuple[str, str]]) -> str:
    """A label selector string from ``matchLabels`` pairs: ``app=ebs-csi-node,tier=node`` (sorted, deduplicated)."""
    return ",".join(f"{key}={value}" for key, value in sorted(set(match_labels)))


def _attached_key(record: VolumeAttachmentRecord) -> tuple[str, str] | None:
    return (record.node, record.driver) if record.attached else None


def _error_key(record: VolumeAttachmentRecord) -> tuple[str, str] | None:
    return (record.node, record.driver) if record.error is not None else None


class KubernetesClusterView:
    """A :class:`~webhook.admission.cluster.ClusterView` over watch caches of the Kubernetes API, plus their lifecycle.

    Construct it in the process that serves requests (with gunicorn: in each worker, after the fork -- threads do
    not survive a fork), call :meth:`start`, poll :meth:`ready` from ``/readyz``, :meth:`stop` at shutdown.
    Every lookup returns None (unknown) when its cache has not synced, when its watch has been down longer than
    ``settings.max_staleness`` seconds, or when the cache's lock is not free within ``settings.lookup_budget``.
    """

    def __init__(
        self,
        api_client: Any,
        pod_sources: Sequence[PodVersionSource] = (),
        settings: CacheSettings | None = None,
        state_keys: StateKeys | None = None,
        history_namespace: str | None = None,
        pending_pods: bool = False,
    ) -> None:
        """``api_client`` is a configured ``kubernetes.client.ApiClient``; ``pod_sources`` are the policy's
        ``pod`` version sources (replace them later with :meth:`set_pod_sources`); with ``state_keys`` the view
        also watches CSINodes and verifies their state (:mod:`webhook.kube.watch.csinodes`), and with
        ``history_namespace`` too the nodes' history records there (:mod:`webhook.kube.node_history`); with
        ``pending_pods`` the unscheduled Pods Pending on volume limits (cluster-wide: list/watch of pods)."""
        self._api = api_client
        self._settings = settings or CacheSettings()
        self._budget = self._settings.lookup_budget
        self._max_staleness = self._settings.max_staleness
        node_parser = parse_node if state_keys is None else make_node_parser(state_keys)
        self.nodes: Reflector[NodeRecord] = self._reflector("nodes", "/api/v1/nodes", node_parser, Store("nodes"))
        self.csidrivers: Reflector[CSIDriverRecord] = self._reflector(
            "csidrivers", "/apis/storage.k8s.io/v1/csidrivers", parse_csidriver, Store("csidrivers")
        )
        self.volumeattachments: Reflector[VolumeAttachmentRecord] = self._reflector(
            "volumeattachments",
            "/apis/storage.k8s.io/v1/volumeattachments",
            parse_volume_attachment,
            Store("volumeattachments", {"attached": _attached_key, "errors": _error_key}),
        )
        self.pending_pods: Reflector[PendingPodRecord] | None = None
        if pending_pods:
            self.pending_pods = self._reflector(
                "pendingpods", "/api/v1/pods", parse_volume_limit_pending, Store("pendingpods"),
                field_selector=PENDING_POD_SELECTOR,
            )
        self._held_at: float | None = None
        self._held_labels: set[str] = set()
        self.increase_ledger = IncreaseLedger()
        self.csinode_store = CSINodeStore(self.increase_ledger)
        self.csinodes: Reflector[CSINodeRecord] | None = None
        if state_keys is not None:
            self.csinodes = self._reflector(
                "csinodes", "/apis/storage.k8s.io/v1/csinodes", make_parser(state_keys), self.csinode_store
            )
        self.history_namespace = history_namespace
        self.histories: Reflector[RetainedState] | None = None
        if state_keys is not None and history_namespace:
            self.histories = self._reflector(
                "histories", f"/api/v1/namespaces/{history_namespace}/configmaps", make_history_parser(state_keys),
                HistoryStore("histories"), selector=f"{HISTORY_LABEL}=true",
            )
        self.brakes: Reflector[BrakeBook] | None = None
        if state_keys is not None and history_namespace:
            self.brakes = self._reflector(
                "brakes", f"/api/v1/namespaces/{history_namespace}/configmaps", make_brakes_parser(state_keys),
                Store("brakes"), selector=f"{BRAKES_LABEL}=true",
            )
        self._pod_watches: dict[PodWatchKey, Reflector[PodRecord]] = {}
        self._pod_sources: Mapping[str, tuple[PodVersionSource, Reflector[PodRecord]]] = {}
        self._sources_lock = threading.Lock()
        self._started_at: float | None = None
        self._stopped = threading.Event()
        self._monitor: threading.Thread | None = None
        self._state_lock = threading.Lock()  # readiness transitions (request threads and the monitor)
        self._ready = False
        self._degraded = False
        self._published_errors: set[tuple[str, str]] = set()
        self.set_pod_sources(pod_sources)

    def _reflector(
        self,
        kind: str,
        path: str,
        parse: Callable[[Mapping[str, Any]], R | None],
        store: Store[R],
        selector: str | None = None,
        name: str | None = None,
        field_selector: str | None = None,
    ) -> Reflector[R]:
        client = CollectionClient(self._api, path, label_selector=selector, field_selector=field_selector)
        return Reflector(kind, client, parse, store, self._settings, name=name)

    # --- lifecycle --------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start every list/watch thread and the metrics monitor; returns at once (see :meth:`ready`)."""
        if self._started_at is not None:
            return
        self._started_at = time.monotonic()
        for reflector in self._reflectors():
            reflector.start()
        self._monitor = threading.Thread(target=self._run_monitor, name="csinode-guard-cache-monitor", daemon=True)
        self._monitor.start()

    def stop(self, timeout: float = 5.0) -> None:
        """End all threads: interrupt open watches, then wait up to ``timeout`` seconds in total.

        A request the server has not answered yet cannot be interrupted; it ends within ``connect_timeout`` /
        ``request_timeout`` / ``watch_read_timeout`` and its thread is a daemon, so it never blocks exit.
        """
        self._stopped.set()
        reflectors = self._reflectors()
        for reflector in reflectors:
            reflector.stop()
        deadline = time.monotonic() + timeout
        for reflector in reflectors:
            reflector.join(max(0.0, deadline - time.monotonic()))
        if self._monitor is not None:
            self._monitor.join(max(0.0, deadline - time.monotonic()))

    def set_pod_sources(self, sources: Sequence[PodVersionSource]) -> None:
        """Replace the policy's ``pod`` version sources (policy hot reload).

        Watches of (namespace, selector) pairs still in use keep running and keep their cache; new pairs get a new
        watch (unknown until it syncs); pairs no longer used are stopped. A driver named by two sources uses the
        last one.
        """
        with self._sources_lock:
            watches: dict[PodWatchKey, Reflector[PodRecord]] = {}
            by_driver: dict[str, tuple[PodVersionSource, Reflector[PodRecord]]] = {}
            for source in sources:
                key = (source.namespace, label_selector(source.match_labels))
                reflector = watches.get(key) or self._pod_watches.get(key)
                if reflector is None:
                    namespace, selector = key
                    reflector = self._reflector(
                        "pods",
                        f"/api/v1/namespaces/{namespace}/pods",
                        parse_pod,
                        PodStore("pods"),
                        selector=selector or None,
                        name=f"pods-{namespace}-{selector}" if selector else f"pods-{namespace}",
                    )
                    if self._started_at is not None and not self._stopped.is_set():
                        reflector.start()
                watches[key] = reflector
                if source.driver in by_driver:
                    log.warning("two pod version sources for driver %s; using the last", source.driver)
                by_driver[source.driver] = (source, reflector)
            removed = [r for key, r in self._pod_watches.items() if key not in watches]
            self._pod_sources = by_driver  # one reference swap: readers see the old or the new map
            self._pod_watches = watches
        for reflector in removed:
            reflector.stop()

    def _reflectors(self) -> list[Reflector[Any]]:
        pods: list[Reflector[Any]] = list(self._pod_watches.values())
        csinodes: list[Reflector[Any]] = [self.csinodes] if self.csinodes is not None else []
        histories: list[Reflector[Any]] = [self.histories] if self.histories is not None else []
        pending: list[Reflector[Any]] = [self.pending_pods] if self.pending_pods is not None else []
        brakes: list[Reflector[Any]] = [self.brakes] if self.brakes is not None else []
        return [self.nodes, self.csidrivers, self.volumeattachments, *pods, *csinodes, *histories, *brakes, *pending]

    def _decision_reflectors(self) -> list[Reflector[Any]]:
        """The caches a decision reads (readiness waits for these): all but the pendingpods watch."""
        return [r for r in self._reflectors() if r is not self.pending_pods]

    # --- readiness --------------------------------------------------------------------------------------------

    def synced(self) -> bool:
        """True when every cache (including every pod watch) has completed its initial list."""
        return all(r.synced for r in self._decision_reflectors())

    def ready(self) -> bool:
        """For ``/readyz``: True once every cache synced, or once ``cache_sync_timeout`` seconds passed since
        :meth:`start` (degraded mode: logged, ``csinode_guard_cache_degraded`` = 1; unsynced caches answer
        unknown). Once True it stays True, so a policy reload that adds a pod watch does not take every replica
        out of the Service at once."""
        if self._ready:
            return True
        if self._started_at is None:
            return False
        synced = self.synced()
        timed_out = time.monotonic() - self._started_at >= self._settings.cache_sync_timeout
        if not (synced or timed_out):
            return False
        with self._state_lock:
            if self._ready:
                return True
            self._ready = True
            if synced:
                log.info("cluster caches synced; ready")
                return True
            self._degraded = True
            metrics.CACHE_DEGRADED.set(1)
            unsynced = sorted({r.name for r in self._decision_reflectors() if not r.synced})
            log.warning(
                "cluster caches not synced after %.0f s (%s); ready in degraded mode: their facts are unknown",
                self._settings.cache_sync_timeout,
                ", ".join(unsynced),
            )
            return True

    def readiness(self) -> tuple[bool, str]:
        """:meth:`ready` with a reason for ``/readyz``: ``synced``, ``degraded: <kinds> not synced``, or
        ``waiting for caches: <kinds>``."""
        ready = self.ready()
        unsynced = ", ".join(sorted({r.name for r in self._decision_reflectors() if not r.synced}))
        if not unsynced:
            return ready, "synced"
        return ready, (f"degraded: {unsynced} not synced" if ready else f"waiting for caches: {unsynced}")

    def degraded(self) -> bool:
        """True while the view is ready by timeout but some cache has still not synced."""
        return self._degraded

    def status(self) -> dict[str, dict[str, Any]]:
        """Per kind: ``synced`` (bool), ``fresh`` (bool), ``staleness_seconds`` (float), ``objects`` (int)."""
        now = time.monotonic()
        groups: dict[str, list[Reflector[Any]]] = {kind: [] for kind in KINDS}
        for reflector in self._reflectors():
            groups[reflector.kind].append(reflector)
        return {
            kind: {
                "synced": all(r.synced for r in members),
                "fresh": all(r.fresh(now, self._max_staleness) for r in members),
                "staleness_seconds": max((r.staleness(now) for r in members), default=0.0),
                "objects": sum(len(r.store) for r in members),
            }
            for kind, members in groups.items()
        }

    # --- ClusterView ------------------------------------------------------------------------------------------

    def _get(self, reflector: Reflector[R], key: str) -> R | None:
        if not reflector.fresh(time.monotonic(), self._max_staleness):
            return None
        available, record = reflector.store.get(key, self._budget)
        if not available:
            metrics.CACHE_LOOKUP_TIMEOUTS.labels(reflector.kind).inc()
        return record

    def _bucket(self, reflector: Reflector[R], index: str, key: object) -> Mapping[str, R] | None:
        if not reflector.fresh(time.monotonic(), self._max_staleness):
            return None
        found = reflector.store.bucket(index, key, self._budget)
        if found is None:
            metrics.CACHE_LOOKUP_TIMEOUTS.labels(reflector.kind).inc()
        return found

    def node_labels(self, node: str) -> Mapping[str, str] | None:
        """Labels of Node ``node`` (read-only mapping), or None when unknown (no such Node, or cache unknown)."""
        record = self._get(self.nodes, node)
        return None if record is None else MappingProxyType(record.labels)

    def node_exists(self, node: str) -> bool | None:
        """Whether Node ``node`` exists (:meth:`ClusterView.node_exists`): None when the Node cache is not synced
        and fresh, or its lock is busy past the lookup budget."""
        if not self.nodes.fresh(time.monotonic(), self._max_staleness):
            return None
        available, record = self.nodes.store.get(node, self._budget)
        if not available:
            metrics.CACHE_LOOKUP_TIMEOUTS.labels(self.nodes.kind).inc()
            return None
        return record is not None

    def vouched_node_labels(self, node: str) -> Mapping[str, str] | None:
        """The labels of Node ``node`` a ceiling may be selected by (:meth:`ClusterView.vouched_node_labels`): those
        the node cannot set and those the guard's verified record says an identity other than the node set; None
        when unknown. Without the state keys: only the labels the node cannot set."""
        record = self._get(self.nodes, node)
        if record is None:
            return None
        if record.vouched is None:
            return MappingProxyType(vouched_labels(record.labels, {}))
        return MappingProxyType(record.vouched)

    def kubelet_version(self, node: str) -> str | None:
        """``status.nodeInfo.kubeletVersion`` of Node ``node`` (``v1.35.1``), or None when unknown."""
        record = self._get(self.nodes, node)
        return (record.kubelet_version or None) if record is not None else None

    def driver_update_period(self, driver: str) -> float | None:
        """CSIDriver ``spec.nodeAllocatableUpdatePeriodSeconds`` in seconds; None when unset, absent or unknown."""
        record = self._get(self.csidrivers, driver)
        return None if record is None else record.update_period

    def csidriver_exists(self, driver: str) -> bool | None:
        """True when the CSIDriver cache holds ``driver``, False when it does not, None while it is not fresh."""
        if not self.csidrivers.fresh(time.monotonic(), self._max_staleness):
            return None
        return self._get(self.csidrivers, driver) is not None

    def driver_version(self, node: str, driver: str) -> str | None:
        """Version of ``driver`` on ``node`` from its ``pod`` version source: the lowest SemVer among the source's
        DaemonSet-controlled pods bound to that node, in any phase (image tag of the named container in the pod
        spec, or the named label; never a mirror pod, never status). When the node has none now, the version of its
        last pod that left the cache (a node may delete its own pods: :mod:`webhook.kube.watch.pod_store`). None
        when no source is configured for the driver, no such pod reports a parsable version, or the cache is
        unknown."""
        entry = self._pod_sources.get(driver)
        if entry is None:
            return None
        source, reflector = entry
        pods = self._bucket(reflector, "node", node)
        if pods is None:
            return None
        if not pods:  # none now: the node's last pod, if it deleted it (until the DaemonSet's replacement appears)
            store = reflector.store
            available, departed = store.departed(node, self._budget) if isinstance(store, PodStore) else (True, None)
            if not available:
                metrics.CACHE_LOOKUP_TIMEOUTS.labels(reflector.kind).inc()
            return departed.version(source) if departed is not None else None
        versions = [v for v in (pod.version(source) for pod in pods.values()) if v]
        return lowest_version(versions)

    def attach_errors(self, node: str, driver: str, since: datetime) -> Sequence[AttachError] | None:
        """Attach errors on VolumeAttachments with ``spec.nodeName`` = node and ``spec.attacher`` = driver whose
        ``status.attachError.time`` >= ``since`` (a naive ``since`` is taken as UTC), oldest first; an empty list
        when there are none; None when unknown."""
        bucket = self._bucket(self.volumeattachments, "errors", (node, driver))
        if bucket is None:
            return None
        if since.tzinfo is None:
            since = since.replace(tzinfo=UTC)
        errors = [r.error for r in bucket.values() if r.error is not None and r.error.time >= since]
        errors.sort(key=lambda e: (e.time, e.volume_attachment))
        return errors

    def attached_volumes(self, node: str, driver: str) -> int | None:
        """VolumeAttachments with ``status.attached: true`` for (node, attacher = driver), or None when unknown."""
        bucket = self._bucket(self.volumeattachments, "attached", (node, driver))
        return None if bucket is None else len(bucket)

    @property
    def api_client(self) -> Any:
        """The ``kubernetes.client.ApiClient`` the caches use (the audit loop sends its writes through it too)."""
        return self._api

    def newest_state_sequence(self, uid: str) -> int | None:
        """The highest verified state ``sequence`` the CSINode watch has seen for the object ``uid``; None when it
        saw none, or when the CSINode cache is not watched or not fresh (unknown)."""
        if self.csinodes is None or not self.csinodes.fresh(time.monotonic(), self._max_staleness):
            return None
        return self.csinode_store.newest_sequence(uid)

    def retained_state(self, node: str) -> RetainedState | None:
        """The verified history record of ``node`` (:mod:`webhook.kube.node_history`), None when there is none,
        the records are not watched, or the cache is unknown."""
        if self.histories is None or not self.history_namespace:
            return None
        return self._get(self.histories, f"{self.history_namespace}/{history_object_name(node)}")

    def brake_book(self) -> BrakeBook | None:
        """The brakes' ConfigMap as the watch holds it (:mod:`webhook.kube.watch.brakes`): None when it does not
        exist, is not watched, or the cache is unknown."""
        if self.brakes is None or not self.history_namespace:
            return None
        return self._get(self.brakes, f"{self.history_namespace}/{BRAKES_OBJECT}")

    def brake(self, driver: str) -> Brake | None:
        """The driver's engaged brake (:meth:`webhook.admission.cluster.ClusterView.brake`) from the leader's
        verified record; None when none is engaged, or when the record is not watched or the cache is unknown."""
        book = self.brake_book()
        found = book.brakes.get(driver) if book is not None else None
        return found if found is not None and found.engaged else None

    def retained_records(self) -> list[RetainedState]:
        """Every verified history record now (the audit leader's retention pass); empty when not watched."""
        store = self.histories.store if self.histories is not None else None
        return store.snapshot() if isinstance(store, HistoryStore) else []

    def csinodes_fresh(self) -> bool:
        """True when the CSINode cache is watched, synced and not stale (the audit and the budget may use it)."""
        return self.csinodes is not None and self.csinodes.fresh(time.monotonic(), self._max_staleness)

    def csinode_records(self) -> list[CSINodeRecord]:
        """Every CSINode now (an empty list when the cache is not watched)."""
        return self.csinode_store.snapshot() if self.csinodes is not None else []

    def node_labels_for_audit(self, node: str) -> Mapping[str, str] | None:
        """:meth:`node_labels` for the audit loop, which waits for the lock (it is off the admission path)."""
        if not self.nodes.fresh(time.monotonic(), self._max_staleness):
            return None
        _, record = self.nodes.store.get(node, 5.0)
        return None if record is None else MappingProxyType(record.labels)

    def vouched_node_labels_for_audit(self, node: str) -> Mapping[str, str] | None:
        """:meth:`vouched_node_labels` for the audit loop, which waits for the lock (it is off the admission path)."""
        if not self.nodes.fresh(time.monotonic(), self._max_staleness):
            return None
        _, record = self.nodes.store.get(node, 5.0)
        if record is None:
            return None
        if record.vouched is None:
            return MappingProxyType(vouched_labels(record.labels, {}))
        return MappingProxyType(record.vouched)

    # --- metrics ----------------------------------------------------------------------------------------------

    def has_csidriver(self, driver: str) -> bool:
        """True when the CSIDriver cache holds an object named ``driver`` (False when unknown)."""
        return self._get(self.csidrivers, driver) is not None

    def observe_headroom(self, driver: str, allocatable: int | None, node: str, label: str | None = None) -> int | None:
        """Record ``allocatable`` (a CSINode ``allocatable.count``) minus the attached volumes of (node, driver) in
        the ``csinode_guard_attach_headroom_volumes`` histogram (labelled by driver only: ``label``, default the
        driver's name) and return it; None (nothing recorded) when the count is unbounded or the attachments are
        unknown."""
        if allocatable is None:
            return None
        attached = self.attached_volumes(node, driver)
        if attached is None:
            return None
        headroom = allocatable - attached
        metrics.HEADROOM.labels(label or driver).observe(headroom)
        return headroom

    def _run_monitor(self) -> None:
        while not self._stopped.is_set():
            try:
                self.publish_metrics()
            except Exception:
                log.exception("publishing cache metrics failed")
            self._stopped.wait(self._settings.monitor_interval)

    def publish_metrics(self) -> None:
        """Set the cache gauges from the current state (the monitor thread calls this every second)."""
        self.ready()  # notices the end of the sync timeout even when nobody polls /readyz
        if self._degraded and self.synced():
            with self._state_lock:
                self._degraded = False
                metrics.CACHE_DEGRADED.set(0)
            log.info("all cluster caches synced; leaving degraded mode")
        for kind, state in self.status().items():
            metrics.CACHE_SYNCED.labels(kind).set(1 if state["synced"] else 0)
            metrics.CACHE_OBJECTS.labels(kind).set(state["objects"])
            metrics.CACHE_STALENESS.labels(kind).set(state["staleness_seconds"])
        counts: Counter[tuple[str, str]] = Counter()
        for bucket in self.volumeattachments.store.buckets("errors"):
            for record in bucket.values():
                if record.error is not None:
                    counts[(record.driver, record.error.error_class.value)] += 1
        for key in self._published_errors - counts.keys():
            metrics.ATTACH_ERRORS.labels(*key).set(0)
        for key, value in counts.items():
            metrics.ATTACH_ERRORS.labels(*key).set(value)
        self._published_errors |= counts.keys()
        self.publish_held()

    def publish_held(self, force: bool = False) -> None:
        """Set ``csinode_guard_volume_limit_pending_pods`` and, every :data:`HELD_INTERVAL` seconds (or when
        ``force``), ``csinode_guard_held_below_reported_nodes`` per driver from the CSINode cache (a driver without
        a CSIDriver object, or past :data:`MAX_HELD_DRIVER_LABELS` names, counts under ``other``: a node may invent
        driver names). Unsynced caches publish nothing (the last values stay)."""
        if self.pending_pods is not None and self.pending_pods.synced:
            metrics.VOLUME_LIMIT_PENDING.set(len(self.pending_pods.store))
        now = time.monotonic()
        if self.csinodes is None or not self.csinodes.synced:
            return
        if not force and self._held_at is not None and now - self._held_at < HELD_INTERVAL:
            return
        self._held_at = now
        held: Counter[str] = Counter()
        for record in self.csinode_store.snapshot():
            state = record.decoded.state
            if state is None:
                continue
            for name, driver in record.csinode.drivers.items():
                if held_below_reported(driver.allocatable_count, state.entries.get(name)) is not None:
                    held[self._held_label(name)] += 1
        for label in self._held_labels - held.keys():
            metrics.HELD_BELOW_REPORTED.labels(label).set(0)
        for label, value in held.items():
            metrics.HELD_BELOW_REPORTED.labels(label).set(value)
        self._held_labels |= held.keys()

    def _held_label(self, driver: str) -> str:
        if driver in self._held_labels:
            return driver
        if len(self._held_labels) >= MAX_HELD_DRIVER_LABELS or not self.has_csidriver(driver):
            return "other"
        self._held_labels.add(driver)
        return driver
