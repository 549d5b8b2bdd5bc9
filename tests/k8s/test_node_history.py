"""What the guard trusted about a node outlives its CSINode (issue 32, item 2), on the real apiserver: the audit
leader copies each CSINode's newest verified state into the node's history record (a ConfigMap in the guard's
namespace, webhook/kube/node_history.py); a node that deletes its own CSINode -- with the guard restarted in
between -- and registers again is judged from that history. Writes by ``kubelet-csinode`` as
``system:node:<node>``; the deletion with the node's own kubeconfig."""

from __future__ import annotations

import json
from typing import Any

from tests.k8s.controlplane import ControlPlane, Guard, counts, unique, wait_until
from webhook.admission.node_history import history_object_name

EBS = "ebs.csi.aws.com"
NAMESPACE = "csinode-guard"  # serve's default --lease-namespace: the guard's own
STATE = "csinode-guard.io/state"


def stored(cp: ControlPlane, node: str) -> int | None:
    return counts(cp.get_csinode(node)).get(EBS)


def install(cp: ControlPlane, node: str, count: int) -> str:
    """kubelet-csinode's install; returns its standard error (the apiserver's warnings, as kubelet logs them)."""
    out = cp.kubelet(node, "install", "--driver", EBS, "--node-id", "i-1", "--max-volumes", str(count))
    assert f"OK install driver={EBS}" in out.stdout, out.stdout + out.stderr
    return out.stderr


def assert_own_state(cp: ControlPlane, node: str, count: int, warnings: str) -> None:
    """The re-created CSINode carries a state of its own with ``count``, and /validate found nothing wrong with
    it (no state-integrity warning reached the kubelet)."""
    annotations = cp.get_csinode(node)["metadata"].get("annotations") or {}
    assert STATE in annotations, annotations
    assert json.loads(annotations[STATE])["drivers"][EBS]["count"] == count
    assert "state-integrity" not in warnings, warnings


def history(cp: ControlPlane, node: str) -> dict[str, Any] | None:
    """The node's history record (its JSON), None while there is none."""
    found = cp.kubectl("get", "configmap", "-n", NAMESPACE, history_object_name(node), "-o", "json", check=False)
    if found.returncode != 0:
        return None
    record: dict[str, Any] = json.loads(json.loads(found.stdout)["data"]["record"])
    return record


def retained_count(cp: ControlPlane, node: str) -> int | None:
    record = history(cp, node)
    if record is None:
        return None
    count: int | None = json.loads(record["state"])["drivers"][EBS]["count"]
    return count


def ensure_namespace(cp: ControlPlane) -> None:
    if cp.kubectl("get", "namespace", NAMESPACE, check=False).returncode != 0:
        cp.kubectl("create", "namespace", NAMESPACE)


def test_a_held_increase_is_not_lifted_by_deleting_the_csinode_across_a_guard_restart(
    control_plane: ControlPlane, guard: Guard
) -> None:
    cp = control_plane
    ensure_namespace(cp)
    node = unique("history")
    cp.create_node(node, {})
    install(cp, node, 10)
    held = cp.kubelet(node, "update", "--driver", EBS, "--max-volumes", "20", check=False)
    assert held.returncode == 0 and stored(cp, node) == 10  # paced: clamped to the last accepted count
    wait_until(lambda: retained_count(cp, node) == 10, what=f"the history record of {node}")
    record = history(cp, node)
    assert record is not None and record["node"] == node and record["uid"] == cp.get_csinode(node)["metadata"]["uid"]

    guard.stop()
    cp.kubectl("delete", "csinode", node, kubeconfig=cp.node_kubeconfig(node))  # a new UID comes next
    guard.start()
    warnings = install(cp, node, 26)
    assert stored(cp, node) == 10  # judged from the node's history: the last accepted count, paced
    assert_own_state(cp, node, 10, warnings)
    assert cp.get_csinode(node)["metadata"]["uid"] != record["uid"]


def test_kubelets_own_recreation_with_the_same_count_passes(control_plane: ControlPlane, guard: Guard) -> None:
    cp = control_plane
    ensure_namespace(cp)
    node = unique("samecount")
    cp.create_node(node, {})
    install(cp, node, 12)
    wait_until(lambda: retained_count(cp, node) == 12, what=f"the history record of {node}")
    cp.kubectl("delete", "csinode", node, kubeconfig=cp.node_kubeconfig(node))
    warnings = install(cp, node, 12)
    assert stored(cp, node) == 12
    assert_own_state(cp, node, 12, warnings)
    cp.kubelet(node, "update", "--driver", EBS, "--max-volumes", "8")  # a decrease: the safe direction
    assert stored(cp, node) == 8
