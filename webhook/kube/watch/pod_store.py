"""The pod cache of a ``pod`` version source, which remembers the last driver pod of a node after it is gone.

A node may delete the pods bound to it (NodeRestriction ``admitPod``: a kubelet finishes every pod deletion). A
node that deletes its own driver pod would otherwise make its driver version unknown until the DaemonSet
controller creates the replacement, and ``writer-version`` would judge its increases on ``onUnknown`` meanwhile.
So when the last pod of a node leaves the cache (a DELETE event, or absent from a re-list), its record stays as
that node's *departed* pod until a pod for the node appears again -- in a rolling update, the new version's pod.
At most one departed record per node; it lives as long as the process (a restarted replica knows none).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping

from webhook.kube.watch.records import PodRecord
from webhook.kube.watch.store import Store


def pod_node(record: PodRecord) -> str:
    """The ``node`` index key of a pod record: ``spec.nodeName``."""
    return record.node


class PodStore(Store[PodRecord]):
    """A :class:`Store` of driver pods indexed by node (index ``node``), with :meth:`departed`."""

    def __init__(self, kind: str = "pods") -> None:
        """``kind`` names the cache in metrics and logs."""
        super().__init__(kind, {"node": pod_node})
        self._departed: dict[str, PodRecord] = {}

    # Each write updates the departed records on the side that keeps a reader's view whole: a reader between the
    # two steps sees a live pod and a departed one (and uses the live one), never neither.

    def replace(self, items: Mapping[str, PodRecord]) -> None:
        """Replace the contents (after a list); a node whose pods all vanished keeps one of them as departed."""
        present = {record.node for record in items.values()}
        with self.lock:
            for key, record in sorted(self._items.items()):
                if key not in items and record.node not in present:
                    self._departed[record.node] = record
        super().replace(items)
        with self.lock:
            for node in present:
                self._departed.pop(node, None)

    def upsert(self, key: str, record: PodRecord) -> None:
        """Add or replace a pod; its node has a live pod again, so its departed record is dropped."""
        super().upsert(key, record)
        with self.lock:
            self._departed.pop(record.node, None)

    def delete(self, key: str) -> None:
        """Remove a pod; when it was its node's last, it becomes the node's departed record."""
        with self.lock:
            old = self._items.get(key)
            if old is not None and set(self._indexes["node"].get(old.node) or ()) == {key}:
                self._departed[old.node] = old
        super().delete(key)

    def departed(self, node: Hashable, budget: float) -> tuple[bool, PodRecord | None]:
        """``(available, record)``: the last pod of ``node`` that left the cache while no other pod of the node
        is in it (None when there is none); ``available`` is False when the lock was not free within ``budget``."""
        if not self.lock.acquire(timeout=budget):
            return False, None
        try:
            return True, self._departed.get(str(node))
        finally:
            self.lock.release()
