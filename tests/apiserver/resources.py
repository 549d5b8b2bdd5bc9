"""The API resources the fake server knows, and how their paths look on the wire."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Resource:
    """One API resource: ``group`` ("" for core), ``version``, ``plural``, ``kind``, ``namespaced``.

    ``delete_returns_object``: a DELETE answers with the deleted object (pods, most namespaced kinds in the real
    apiserver) instead of a ``Status``; match what the client's typed ``delete_*`` method expects.
    """

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    delete_returns_object: bool = False
    short_names: tuple[str, ...] = ()

    @property
    def api_version(self) -> str:
        """``v1`` or ``group/version``."""
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def prefix(self) -> str:
        """``/api/v1`` or ``/apis/group/version``."""
        return f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"

    @property
    def key(self) -> str:
        """``plural`` for core resources, ``plural.group`` otherwise (the name ``kubectl`` accepts)."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    def collection_path(self, namespace: str | None = None) -> str:
        """``/api/v1/namespaces/ns/pods``, ``/api/v1/nodes``, ``/apis/storage.k8s.io/v1/csidrivers``."""
        if self.namespaced and namespace:
            return f"{self.prefix}/namespaces/{namespace}/{self.plural}"
        return f"{self.prefix}/{self.plural}"

    def object_path(self, name: str, namespace: str | None = None) -> str:
        """The path of one object."""
        return f"{self.collection_path(namespace)}/{name}"


BUILTIN_RESOURCES: tuple[Resource, ...] = (
    Resource("", "v1", "nodes", "Node", namespaced=False),
    Resource("", "v1", "pods", "Pod", namespaced=True, delete_returns_object=True),
    Resource("", "v1", "namespaces", "Namespace", namespaced=False, delete_returns_object=True),
    Resource("", "v1", "secrets", "Secret", namespaced=True),
    Resource("", "v1", "configmaps", "ConfigMap", namespaced=True),
    Resource("", "v1", "services", "Service", namespaced=True, delete_returns_object=True),
    Resource("", "v1", "serviceaccounts", "ServiceAccount", namespaced=True, delete_returns_object=True),
    Resource("", "v1", "events", "Event", namespaced=True),
    Resource("apps", "v1", "daemonsets", "DaemonSet", namespaced=True),
    Resource("apps", "v1", "deployments", "Deployment", namespaced=True),
    Resource("storage.k8s.io", "v1", "csidrivers", "CSIDriver", namespaced=False, delete_returns_object=True),
    Resource("storage.k8s.io", "v1", "csinodes", "CSINode", namespaced=False, delete_returns_object=True),
    Resource(
        "storage.k8s.io", "v1", "volumeattachments", "VolumeAttachment", namespaced=False, delete_returns_object=True
    ),
    Resource("storage.k8s.io", "v1", "storageclasses", "StorageClass", namespaced=False, delete_returns_object=True),
    Resource("coordination.k8s.io", "v1", "leases", "Lease", namespaced=True),
    Resource(
        "admissionregistration.k8s.io",
        "v1",
        "validatingwebhookconfigurations",
        "ValidatingWebhookConfiguration",
        namespaced=False,
    ),
    Resource(
        "admissionregistration.k8s.io",
        "v1",
        "mutatingwebhookconfigurations",
        "MutatingWebhookConfiguration",
        namespaced=False,
    ),
    Resource(
        "rbac.authorization.k8s.io", "v1", "clusterroles", "ClusterRole", namespaced=False, delete_returns_object=False
    ),
    Resource("rbac.authorization.k8s.io", "v1", "clusterrolebindings", "ClusterRoleBinding", namespaced=False),
    Resource("rbac.authorization.k8s.io", "v1", "roles", "Role", namespaced=True),
    Resource("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding", namespaced=True),
)
"""Resources registered by default; add more with ``FakeApiServer.register``."""
