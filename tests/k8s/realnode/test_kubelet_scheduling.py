"""The scheduling demo (docs/scheduling-demo.md) on a real Ready node: the real kube-scheduler's NodeVolumeLimits
plugin binds as many volume-using pods as the count the guard lets the real kubelet store.

Why the real kubelet: the node is Ready because its kubelet says so (heartbeats, no hand-made Node), the count
comes from the driver's NodeGetInfo through kubelet's registration and periodic refresh, and the pods bound to the
node are the kubelet's to run (they stay ContainerCreating: no volume publishing here; the binding is what the
scheduler decided). After a policy reload raises the ceiling, it is kubelet's next refresh — not a test's write —
that raises the stored count and lets the scheduler bind more.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.k8s.controlplane import Guard, unique, wait_until
from tests.k8s.realnode.cluster import DRIVER, RealNode
from tests.k8s.realnode.policy import hostpath_policy
from tests.k8s.scheduling import create, placement, settle, volume_pods

REPORTED = 9
CEILING = 6
RAISED = 8


def real_node_pods(namespace: str, node: str, n: int) -> list[dict[str, Any]]:
    """:func:`tests.k8s.scheduling.volume_pods` for a real node: the claims left to kube-controller-manager's PV
    binder instead of pre-bound, the pods on the host network (the node has no pod network) with the node's own
    pause image (nothing is pulled)."""
    objects = volume_pods(namespace, node, DRIVER, n)
    for obj in objects:
        if obj["kind"] == "PersistentVolume":  # the PV binder binds them (any PV fits any claim here)
            del obj["spec"]["claimRef"]
        elif obj["kind"] == "PersistentVolumeClaim":
            del obj["spec"]["volumeName"], obj["metadata"]["annotations"]
        else:
            obj["spec"]["hostNetwork"] = True
            obj["spec"]["containers"][0].update(image="localhost/pause:3.10", imagePullPolicy="Never")
    return objects


def test_the_real_scheduler_binds_as_many_volume_pods_as_the_guarded_count_on_a_real_node(
    real_node: RealNode, guard_factory: Any, tmp_path: Path
) -> None:
    """The driver reports 9, the ceiling is 6: 6 of 9 volume pods bound, 3 ``exceed max volume count``; the ceiling
    raised to 8: kubelet's next refresh stores 8 and the scheduler binds 2 more. Real kubelet: see the module."""
    node = real_node
    policy = hostpath_policy(tmp_path / "policy.yaml", ceiling=CEILING)
    guard: Guard = guard_factory(policy)
    node.deploy_driver(attach_limit=REPORTED)
    node.wait_registered()
    wait_until(lambda: node.count() == CEILING, timeout=30, what="the driver's 9 stored as 6")
    assert node.ready()

    namespace = unique("volumes")
    objects = real_node_pods(namespace, node.name, REPORTED)
    # the volumes first, the pods once the PV binder has bound every claim: a pod whose claim or PV the scheduler
    # has not seen bound yet is unschedulable for another reason, and waits for a retry
    create(node.cp, namespace, [o for o in objects if o["kind"] != "Pod"])
    wait_until(lambda: all(c["status"].get("phase") == "Bound" for c in node.cp.kubectl_json(
        "get", "pvc", "-n", namespace)["items"]), timeout=60, what="the claims bound")
    node.cp.kubectl("create", "-f", "-", input=json.dumps(
        {"apiVersion": "v1", "kind": "List", "items": [o for o in objects if o["kind"] == "Pod"]}))
    bound, unschedulable, messages = settle(node.cp, namespace, node.name, REPORTED)
    print(f"\n[scheduling] ceiling {CEILING}: {bound} of {REPORTED} pods bound, {unschedulable} unschedulable: "
          f"{messages[:1]}")
    assert (bound, unschedulable) == (CEILING, REPORTED - CEILING)
    assert all("exceed max volume count" in m for m in messages), messages

    hostpath_policy(policy, ceiling=RAISED)  # the guard reloads it; kubelet's next refresh stores 8
    wait_until(lambda: node.count() == RAISED, timeout=60, what="kubelet's refresh raised to the new ceiling")
    wait_until(lambda: placement(node.cp, namespace, node.name)[0] == RAISED, timeout=60,
               what="the scheduler binds two more")
    bound, unschedulable, messages = settle(node.cp, namespace, node.name, REPORTED)
    print(f"[scheduling] ceiling {RAISED}: {bound} of {REPORTED} pods bound, {unschedulable} unschedulable")
    assert (bound, unschedulable) == (RAISED, REPORTED - RAISED)
    raised = [w for w in node.kubelet_writes() if w.stored == {DRIVER: RAISED}]
    assert raised and raised[0].sent == {DRIVER: REPORTED}, "kubelet's own write, clamped to the new ceiling"
    assert [r["final"] for r in guard.decisions() if r.get("node") == node.name and r.get("final") == RAISED]
    assert node.ready()
