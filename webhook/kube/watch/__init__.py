"""Cluster facts from the Kubernetes API: watch caches behind the :class:`~webhook.admission.cluster.ClusterView`
protocol.

This package is the only code that reads the Kubernetes API for the admission path. It keeps five kinds of watch
cache -- Nodes, CSIDrivers, VolumeAttachments, the CSI drivers' node pods and (given the state keys) CSINodes --
filled by one list+watch thread per collection (see :mod:`webhook.kube.watch.reflector`), and answers the rules'
lookups from memory only.

Use::

    view, caches = build_cluster_view(kubeconfig, pod_sources, max_staleness=120, cache_sync_timeout=30)
    ...                                  # /readyz: caches.readiness(); policy reload: caches.set_pod_sources(...)
    caches.stop()                        # at shutdown

RBAC -- exactly what the guard's ServiceAccount needs, and nothing more (every request is a GET: list or watch)::

    # ClusterRole csinode-guard-cluster-facts, bound with a ClusterRoleBinding
    - apiGroups: [""]
      resources: ["nodes"]
      verbs: ["get", "list", "watch"]
    - apiGroups: ["storage.k8s.io"]
      resources: ["csidrivers", "volumeattachments"]
      verbs: ["get", "list", "watch"]
    - apiGroups: ["storage.k8s.io"]        # the CSINode watch (with the state keys), and the audit's repair
      resources: ["csinodes"]
      verbs: ["get", "list", "watch", "update"]

    # Role csinode-guard-driver-pods + RoleBinding, in each namespace named by a policy `pod` versionSource
    # (e.g. kube-system for the aws-ebs-csi-driver node DaemonSet)
    - apiGroups: [""]
      resources: ["pods"]
      verbs: ["get", "list", "watch"]

Pods are listed per namespace with the version source's label selector on the request, so a namespaced Role
suffices and the apiserver sends only the driver's pods. The caches send only list and watch requests; ``get``
completes the read-only set. ``deploy/base/rbac.yaml`` carries these rules.

Without ``--kubeconfig``, ``KUBECONFIG`` or an in-cluster service account the guard runs offline: one log line at
start, :class:`~webhook.admission.cluster.UnknownClusterView`, and the rules follow the design's asymmetry for unknown
facts.
"""

from webhook.kube.watch.config import ClusterCaches, OfflineCaches, build_cluster_view, load_api_client
from webhook.kube.watch.settings import CacheSettings
from webhook.kube.watch.view import KubernetesClusterView

__all__ = [
    "CacheSettings",
    "ClusterCaches",
    "KubernetesClusterView",
    "OfflineCaches",
    "build_cluster_view",
    "load_api_client",
]
