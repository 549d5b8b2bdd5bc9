"""The brakes' record through the apiserver: written by the audit leader only.

One ConfigMap, :data:`~webhook.admission.brake.BRAKES_OBJECT` in the guard's namespace (label
``csinode-guard.io/brakes=true``), ``data.record`` signed with the state key (:mod:`webhook.admission.brake`). The
leader writes it when a brake engages, its last failure moves, or it releases, with the ``resourceVersion`` it read
(a 409 Conflict is tried again at the next pass); when it honours or drops an approver's release request it removes
the :data:`~webhook.admission.brake.RELEASE_ANNOTATION` in the same write. RBAC: the guard's Role
``csinode-guard-node-history`` (ConfigMaps in its namespace); approvers may only ``patch`` this one object (Role
``csinode-guard-brake-approver``), so a record they edit no longer verifies and a request is all they can add.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from webhook.admission.brake import BRAKES_LABEL, BRAKES_OBJECT, RECORD_KEY, RELEASE_ANNOTATION, encode_brakes
from webhook.admission.cluster import Brake
from webhook.admission.state import StateKeys
from webhook.kube.kubeapi import ApiRequest, KubeApiError, KubeClient
from webhook.kube.node_history import CONFIGMAPS, FIELD_MANAGER

log = logging.getLogger("csinode_guard.brakes")


class BrakeWriter:
    """Writes the brakes' ConfigMap (``client`` the guard's, ``namespace`` the guard's, ``keys`` the state keys)."""

    def __init__(self, client: KubeClient, namespace: str, keys: StateKeys) -> None:
        self.client = client
        self.namespace = namespace
        self.keys = keys

    def write(self, brakes: Mapping[str, Brake], *, clear_release: bool = False) -> None:
        """Create or update the record with ``brakes`` (GET, then PUT with the resourceVersion read; POST when
        absent); ``clear_release`` also removes an approver's release request. Raises
        :class:`~webhook.kube.kubeapi.KubeApiError` (a 409 Conflict when the object changed since it was read)."""
        value = encode_brakes(brakes, self.keys)
        query = (("fieldManager", FIELD_MANAGER),)
        try:
            existing: Mapping[str, Any] | None = self.client.get(CONFIGMAPS, BRAKES_OBJECT, self.namespace)
        except KubeApiError as exc:
            if not exc.not_found:
                raise
            existing = None
        meta = dict((existing or {}).get("metadata") or {})
        annotations = dict(meta.get("annotations") or {})
        if clear_release:
            annotations.pop(RELEASE_ANNOTATION, None)
        body: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": BRAKES_OBJECT,
                "namespace": self.namespace,
                "labels": {BRAKES_LABEL: "true"},
                "annotations": annotations,
            },
            "data": {RECORD_KEY: value},
        }
        if existing is None:
            self.client.send(ApiRequest("POST", CONFIGMAPS.collection_path(self.namespace), query, body))
            return
        body["metadata"]["resourceVersion"] = meta.get("resourceVersion")
        self.client.send(ApiRequest("PUT", CONFIGMAPS.object_path(BRAKES_OBJECT, self.namespace), query, body))


SELF_SUBJECT_REVIEWS = "/apis/authentication.k8s.io/v1/selfsubjectreviews"


def read_brakes_object(client: KubeClient, namespace: str) -> Mapping[str, Any] | None:
    """The brakes' ConfigMap in ``namespace`` (None when there is none: no brake ever engaged). Raises
    :class:`~webhook.kube.kubeapi.KubeApiError` for any other refusal."""
    try:
        found: Mapping[str, Any] = client.get(CONFIGMAPS, BRAKES_OBJECT, namespace)
    except KubeApiError as exc:
        if exc.not_found:
            return None
        raise
    return found


def who_am_i(client: KubeClient) -> str:
    """The requester's username as the apiserver authenticates it (``authentication.k8s.io/v1``
    SelfSubjectReview, allowed to every authenticated user); "" when the answer carries none."""
    answer = client.send(ApiRequest("POST", SELF_SUBJECT_REVIEWS, body={
        "apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}))
    user = ((answer or {}).get("status") or {}).get("userInfo") or {}
    return str(user.get("username") or "")


def request_release(client: KubeClient, namespace: str, obj: Mapping[str, Any], value: str) -> None:
    """Set the release request annotation ``value`` on the brakes' ConfigMap ``obj`` as read (PUT with its
    resourceVersion: a concurrent write makes it fail with 409 Conflict). Raises
    :class:`~webhook.kube.kubeapi.KubeApiError` (403 for a requester the approver Role is not bound to)."""
    body = {key: value_ for key, value_ in obj.items() if key != "status"}
    meta = dict(body.get("metadata") or {})
    meta["annotations"] = {**(meta.get("annotations") or {}), RELEASE_ANNOTATION: value}
    body["metadata"] = meta
    client.send(ApiRequest("PUT", CONFIGMAPS.object_path(BRAKES_OBJECT, namespace),
                           (("fieldManager", "csinode-guard-brake-release"),), body))
