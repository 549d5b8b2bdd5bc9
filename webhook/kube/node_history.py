"""The nodes' history records through the apiserver: parsed for the watch cache, written by the audit leader.

One ConfigMap per node in the guard's namespace (``csinode-guard-history-<node>``, label
``csinode-guard.io/node-history=true``, ``data.record`` as :mod:`webhook.admission.node_history` describes). The
audit leader (:mod:`webhook.serving.audit_loop`) calls :meth:`HistoryWriter.sync` on every poll of its loop with
the CSINode cache: a CSINode whose verified state is newer than the node's record (another UID, a higher
sequence, other content) gets its record written (create, or update with the resourceVersion read); a record of a
node without a CSINode is deleted once older than the retention. Only the guard's ServiceAccount may write these
ConfigMaps (deploy/base/rbac.yaml, Role ``csinode-guard-node-history``); a record someone else writes is not
signed by the state key and is ignored.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import TYPE_CHECKING, Any, Final

from webhook.admission.cluster import RetainedState
from webhook.admission.node_history import (
    HISTORY_LABEL,
    MAX_RECORDS,
    RECORD_KEY,
    RETENTION_SECONDS,
    encode_history,
    history_object_name,
    retained_guard_state,
)
from webhook.admission.state import StateKeys, encode_state
from webhook.kube.kubeapi import ApiRequest, ApiResource, KubeApiError, KubeClient

if TYPE_CHECKING:
    from webhook.kube.watch.csinodes import CSINodeRecord

log = logging.getLogger("csinode_guard.node_history")

CONFIGMAPS: Final = ApiResource("", "v1", "configmaps", "ConfigMap", namespaced=True)
FIELD_MANAGER: Final = "csinode-guard"


class HistoryWriter:
    """Writes the nodes' records (the audit leader's; see the module docstring). Not thread-safe: one loop calls it.

    ``client`` the guard's API client, ``namespace`` the guard's, ``keys`` the state keys; ``read`` returns the
    record the watch cache holds for a node (``KubernetesClusterView.retained_state``)."""

    def __init__(self, client: KubeClient, namespace: str, keys: StateKeys,
                 read: Callable[[str], RetainedState | None]) -> None:
        self.client = client
        self.namespace = namespace
        self.keys = keys
        self.read = read
        self._written: dict[str, tuple[str, str]] = {}  # node -> (uid, state) this process wrote last

    def sync(self, records: Iterable[CSINodeRecord], now: datetime, retained: Iterable[RetainedState] = ()) -> int:
        """Write the record of every CSINode whose verified state the node's record does not hold yet; delete the
        records of nodes without a CSINode saved more than the retention ago. Returns the writes made. API errors
        are logged and retried at the next call."""
        writes = 0
        present: set[str] = set()
        retained = list(retained)
        count = len(retained)
        for record in records:
            node, uid, state = record.csinode.name, record.csinode.uid, record.decoded.state
            present.add(node)
            if state is None or not uid:
                continue
            value = encode_state(state, self.keys)
            current = self.read(node)
            if self._written.get(node) == (uid, value) and current is not None:
                continue  # written by this process (the cache may lag its own write by an event)
            if current is not None and current.uid == uid and current.state == value:
                self._written[node] = (uid, value)
                continue
            if current is not None and current.uid == uid and state.sequence < _sequence(current, self.keys):
                continue  # the record is newer than this (replayed) state
            if current is None and count >= MAX_RECORDS:
                log.warning("node history: %d records, the cap: %s gets none", count, node)
                continue
            retained_now = RetainedState(node, uid, "", value, now)
            try:
                self._put(node, encode_history(retained_now, self.keys))
            except KubeApiError as exc:
                log.warning("node history of %s not written: %s", node, exc)
                continue
            self._written[node] = (uid, value)
            writes += 1
        for held in retained:
            if held.node not in present and (now - held.saved_at).total_seconds() > RETENTION_SECONDS:
                try:
                    self.client.send(ApiRequest("DELETE", CONFIGMAPS.object_path(history_object_name(held.node),
                                                                                 self.namespace)))
                except KubeApiError as exc:
                    if not exc.not_found:
                        log.warning("node history of %s not deleted: %s", held.node, exc)
        return writes

    def _put(self, node: str, value: str) -> None:
        name = history_object_name(node)
        body: dict[str, Any] = {
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": self.namespace, "labels": {HISTORY_LABEL: "true"}},
            "data": {RECORD_KEY: value},
        }
        query = (("fieldManager", FIELD_MANAGER),)
        try:
            existing = self.client.get(CONFIGMAPS, name, self.namespace)
        except KubeApiError as exc:
            if not exc.not_found:
                raise
            self.client.send(ApiRequest("POST", CONFIGMAPS.collection_path(self.namespace), query, body))
            return
        body["metadata"]["resourceVersion"] = existing.get("metadata", {}).get("resourceVersion")
        self.client.send(ApiRequest("PUT", CONFIGMAPS.object_path(name, self.namespace), query, body))


def _sequence(retained: RetainedState, keys: StateKeys) -> int:
    state = retained_guard_state(retained, keys)
    return state.sequence if state is not None else 0
