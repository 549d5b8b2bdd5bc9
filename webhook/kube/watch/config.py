"""Choosing the cluster: kubeconfig, in-cluster service account, or offline; and the caches' control surface."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Protocol

from webhook import __version__
from webhook.admission.cluster import ClusterView, PodVersionSource, UnknownClusterView
from webhook.admission.state import StateKeys
from webhook.kube.kubeapi import load_configuration
from webhook.kube.watch.settings import CacheSettings
from webhook.kube.watch.view import KubernetesClusterView

log = logging.getLogger("webhook.providers.config")


class ClusterCaches(Protocol):
    """Lifecycle, readiness and metrics of the cluster view; the server holds it next to the view."""

    def start(self) -> None:
        """Start the watch threads (idempotent)."""
        ...

    def stop(self, timeout: float = 5.0) -> None:
        """End the watch threads, waiting up to ``timeout`` seconds."""
        ...

    def synced(self) -> bool:
        """True when every cache has completed its initial list."""
        ...

    def ready(self) -> bool:
        """True when ``/readyz`` should pass: synced, or ``cache_sync_timeout`` passed (degraded)."""
        ...

    def degraded(self) -> bool:
        """True when ready by timeout while some cache has not synced."""
        ...

    def readiness(self) -> tuple[bool, str]:
        """``(ready(), reason)`` for ``/readyz``."""
        ...

    def set_pod_sources(self, sources: Sequence[PodVersionSource]) -> None:
        """Replace the policy's ``pod`` version sources (policy hot reload)."""
        ...

    def observe_headroom(self, driver: str, allocatable: int | None, node: str, label: str | None = None) -> int | None:
        """Record allocatable minus attached volumes for (node, driver) in the headroom histogram (``label``)."""
        ...

    def status(self) -> dict[str, dict[str, Any]]:
        """Per cache kind: synced, fresh, staleness_seconds, objects."""
        ...


class OfflineCaches:
    """:class:`ClusterCaches` of the offline mode: nothing to sync, always ready, nothing known."""

    def start(self) -> None:
        """Nothing to start."""

    def stop(self, timeout: float = 5.0) -> None:
        """Nothing to stop."""

    def synced(self) -> bool:
        """False: there are no caches."""
        return False

    def ready(self) -> bool:
        """True: an offline guard serves at once (rules treat every cluster fact as unknown)."""
        return True

    def degraded(self) -> bool:
        """False: offline is a configuration, not a degradation."""
        return False

    def readiness(self) -> tuple[bool, str]:
        """Always ready: ``(True, "offline")``."""
        return True, "offline"

    def set_pod_sources(self, sources: Sequence[PodVersionSource]) -> None:
        """Ignored."""

    def observe_headroom(self, driver: str, allocatable: int | None, node: str, label: str | None = None) -> int | None:
        """Unknown: nothing recorded."""
        return None

    def status(self) -> dict[str, dict[str, Any]]:
        """No caches."""
        return {}


def load_api_client(kubeconfig: str | None = None, *, environment: bool = True) -> Any | None:
    """A ``kubernetes.client.ApiClient`` for the watch caches, or None when no cluster is configured.

    The sources of :func:`webhook.kube.kubeapi.load_configuration` without its ``~/.kube/config`` fallback: a
    developer's default context must never be watched by accident; without ``environment``, not ``$KUBECONFIG``
    either (``serve``: only ``kubeconfig`` or the pod's service account). A configured but broken source raises
    ``kubernetes.config.ConfigException``.
    """
    from kubernetes.client.api_client import ApiClient  # noqa: PLC0415 - heavy; only when a cluster is used
    from urllib3.util import Retry  # noqa: PLC0415

    configuration = load_configuration(kubeconfig, home_fallback=False, environment=environment)
    if configuration is None:
        return None
    # One connection per open watch (3 + one per pod watch) plus lists: keep them all pooled.
    configuration.connection_pool_maxsize = max(configuration.connection_pool_maxsize or 0, 16)
    # One quick retry for a pooled keep-alive connection the server closed; everything else is the reflectors'
    # own backoff with jitter (urllib3's default would retry 3 times at once).
    configuration.retries = Retry(total=1, redirect=0, status=0, backoff_factor=0)
    api_client = ApiClient(configuration)
    api_client.user_agent = f"csinode-guard/{__version__}"
    return api_client


def build_cluster_view(
    kubeconfig: str | None,
    sources: Sequence[PodVersionSource],
    max_staleness: float,
    cache_sync_timeout: float,
    *,
    settings: CacheSettings | None = None,
    start: bool = True,
    state_keys: StateKeys | None = None,
    history_namespace: str | None = None,
    pending_pods: bool = False,
    environment: bool = True,
) -> tuple[ClusterView, ClusterCaches]:
    """The cluster view and its control surface.

    With a cluster (see :func:`load_api_client`): a :class:`KubernetesClusterView` (both values are that object),
    started unless ``start`` is False. Without one: :class:`~webhook.admission.cluster.UnknownClusterView` and
    :class:`OfflineCaches`, and one log line. ``max_staleness`` and ``cache_sync_timeout`` are seconds and
    override ``settings``; ``state_keys`` adds the CSINode watch (:mod:`webhook.kube.watch.csinodes`), and with
    ``history_namespace`` the watch of the nodes' history records there (:mod:`webhook.kube.node_history`);
    ``pending_pods`` the watch of Pods Pending on volume limits (a metric only); ``environment`` False ignores
    ``$KUBECONFIG`` (:func:`load_api_client`).
    """
    api_client = load_api_client(kubeconfig, environment=environment)
    if api_client is None:
        log.warning(
            "no --kubeconfig, no KUBECONFIG and not running in a cluster: offline, every cluster fact is unknown"
        )
        return UnknownClusterView(), OfflineCaches()
    effective = replace(settings or CacheSettings(), max_staleness=max_staleness, cache_sync_timeout=cache_sync_timeout)
    view = KubernetesClusterView(api_client, sources, effective, state_keys=state_keys,
                                 history_namespace=history_namespace, pending_pods=pending_pods)
    if start:
        view.start()
    return view, view
