"""Volume-using pods for the real kube-scheduler: PVs pre-bound to PVCs with CSI volumes of a driver, one pod
per PVC pinned to a node (no kubelet runs them; the scheduler's NodeVolumeLimits plugin counts them against the
node's CSINode ``allocatable.count``).

Pre-binding as ../shared/k8s/README.md describes (no controller manager binds anything): the PV's ``claimRef``,
the PVC's ``volumeName`` and its ``pv.kubernetes.io/bind-completed: "yes"`` annotation, which the scheduler's
VolumeBinding plugin reads as bound.
"""

from __future__ import annotations

import json
import time
from typing import Any

from tests.k8s.controlplane import ControlPlane


def volume_pods(namespace: str, node: str, driver: str, n: int) -> list[dict[str, Any]]:
    """``n`` PV + PVC + Pod triples in ``namespace`` for ``node``, each pod with one CSI volume of ``driver``."""
    objects: list[dict[str, Any]] = []
    for i in range(n):
        name = f"{node}-{i:02d}"
        objects.append({
            "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": name},
            "spec": {
                "capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"],
                "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
                "csi": {"driver": driver, "volumeHandle": f"vol-{name}"},
                "claimRef": {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "namespace": namespace,
                             "name": name},
            },
        })
        objects.append({
            "apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": name, "namespace": namespace,
                         "annotations": {"pv.kubernetes.io/bind-completed": "yes"}},
            "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "", "volumeName": name,
                     "resources": {"requests": {"storage": "1Gi"}}},
        })
        objects.append({
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": node},
                "containers": [{"name": "app", "image": "registry.k8s.io/pause:3.10"}],
                "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": name}}],
            },
        })
    return objects


def create(cp: ControlPlane, namespace: str, objects: list[dict[str, Any]]) -> None:
    """Create the namespace and ``objects`` with one kubectl call each."""
    cp.kubectl("create", "namespace", namespace)
    cp.kubectl("create", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}))


def placement(cp: ControlPlane, namespace: str, node: str) -> tuple[int, int, list[str]]:
    """``(bound to node, unschedulable, unschedulable messages)`` of the pods of ``node`` in ``namespace``."""
    pods = cp.kubectl_json("get", "pods", "-n", namespace)["items"]
    mine = [p for p in pods if p["spec"].get("nodeSelector", {}).get("kubernetes.io/hostname") == node]
    bound = sum(1 for p in mine if p["spec"].get("nodeName") == node)
    messages = [
        c.get("message", "")
        for p in mine
        for c in (p.get("status") or {}).get("conditions") or []
        if c["type"] == "PodScheduled" and c["status"] == "False" and c.get("reason") == "Unschedulable"
    ]
    return bound, len(messages), messages


def settle(
    cp: ControlPlane, namespace: str, node: str, total: int, timeout: float = 60.0
) -> tuple[int, int, list[str]]:
    """Wait until every pod of ``node`` is either bound or marked unschedulable, and the numbers hold still
    for a second (the scheduler retries unschedulable pods)."""
    deadline = time.monotonic() + timeout
    last: tuple[int, int, list[str]] | None = None
    while True:
        now = placement(cp, namespace, node)
        if now[0] + now[1] == total and last is not None and last[:2] == now[:2]:
            return now
        if time.monotonic() > deadline:
            raise AssertionError(f"pods of {node} not settled within {timeout}s: {now[:2]} of {total}")
        last = now
        time.sleep(1.0)
