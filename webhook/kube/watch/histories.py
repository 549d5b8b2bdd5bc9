"""The watch cache's side of the nodes' history records (:mod:`webhook.kube.node_history` writes them): the
parser that keeps a ConfigMap's record only when it verifies for the node its name is derived from, and the store."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from webhook.admission.cluster import RetainedState
from webhook.admission.node_history import RECORD_KEY, decode_history, history_object_name
from webhook.admission.state import StateKeys
from webhook.kube.watch.store import Store


def make_history_parser(keys: StateKeys) -> Callable[[Mapping[str, Any]], RetainedState | None]:
    """``parse(configmap) -> RetainedState | None`` for the watch cache: None for a ConfigMap whose record is not a
    verified record of the node its name is derived from."""

    def parse(obj: Mapping[str, Any]) -> RetainedState | None:
        data = obj.get("data")
        meta = obj.get("metadata")
        value = data.get(RECORD_KEY) if isinstance(data, Mapping) else None
        name = meta.get("name") if isinstance(meta, Mapping) else None
        if not isinstance(value, str) or not isinstance(name, str):
            return None
        claimed = _claimed_node(value)
        if claimed is None or history_object_name(claimed) != name:
            return None
        return decode_history(value, claimed, keys)

    return parse


def _claimed_node(value: str) -> str | None:
    """The node name the record claims (decode_history then verifies it)."""
    try:
        doc = json.loads(value)
    except (ValueError, RecursionError):
        return None
    node = doc.get("node") if isinstance(doc, dict) else None
    return node if isinstance(node, str) else None


class HistoryStore(Store[RetainedState]):
    """The watch cache's store of history records, with a snapshot for the leader's retention pass."""

    def snapshot(self) -> list[RetainedState]:
        """Every record now (a copy; waits for the lock)."""
        with self.lock:
            return list(self._items.values())


