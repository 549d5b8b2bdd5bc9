"""A CSINode DELETE reaches the guard (issue 32, attack 1), on the real apiserver with the real kube-scheduler.

A node without a CSINode has no volume limit for the scheduler's NodeVolumeLimits plugin: deleting the object
removes every driver's ``allocatable.count`` at once. The webhook configurations list DELETE of csinodes; a
DELETE by anyone but the node's own kubelet (or a listed writer) reaches the ``Fail`` entries and writer-identity
refuses it. The node's own DELETE (kubelet deletes its CSINode when its Node's UID changed, kubernetes#137199) is
on the never-refused entries and goes through, also with the guard down.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.k8s.controlplane import ControlPlane, Guard, counts, unique
from tests.k8s.scheduling import create, settle, volume_pods

EBS = "ebs.csi.aws.com"
LIMIT = 5
MORE = 4


def csinode_deleter(cp: ControlPlane, name: str) -> Path:
    """A user who may get and delete csinodes (a ClusterRole bound by the admin): RBAC lets the DELETE through."""
    role = f"{name}-csinodes"
    cp.kubectl("create", "clusterrole", role, "--verb=get,list,delete", "--resource=csinodes.storage.k8s.io")
    cp.kubectl("create", "clusterrolebinding", role, f"--clusterrole={role}", f"--user={name}")
    return cp.user_kubeconfig(name, "storage-team")


def test_attack_1_a_strangers_delete_is_refused_and_the_scheduler_does_not_over_bind(
    control_plane: ControlPlane, guard: Guard
) -> None:
    cp = control_plane
    node = unique("node-a")
    cp.create_node(node)
    cp.kubelet(node, "install", "--driver", EBS, "--node-id", "i-a", "--max-volumes", str(LIMIT))
    assert counts(cp.get_csinode(node)) == {EBS: LIMIT}
    namespace = unique("volumes")
    objects = volume_pods(namespace, node, EBS, LIMIT + MORE)
    create(cp, namespace, objects[: 3 * LIMIT])  # PV, PVC and Pod per volume: the node is full
    assert settle(cp, namespace, node, LIMIT)[:2] == (LIMIT, 0)

    mallory_name = unique("mallory")
    mallory = csinode_deleter(cp, mallory_name)
    refused = cp.kubectl("delete", "csinode", node, kubeconfig=mallory, check=False)
    assert refused.returncode != 0
    assert "[writer-identity]" in refused.stderr and "(deletion)" in refused.stderr, refused.stderr
    assert counts(cp.get_csinode(node)) == {EBS: LIMIT}
    deletes = [r for r in guard.decisions() if r.get("node") == node and r.get("operation") == "DELETE"]
    assert [(r["endpoint"], r["decision"], r["user"]) for r in deletes][:1] == [("mutate", "deny", mallory_name)]

    cp.kubectl("create", "-f", "-", input=_list(objects[3 * LIMIT:]))
    bound, unschedulable, messages = settle(cp, namespace, node, LIMIT + MORE)
    print(f"\n[attack 1] after the refused DELETE: {bound} bound, {unschedulable} unschedulable")
    assert (bound, unschedulable) == (LIMIT, MORE)
    assert all("exceed max volume count" in m for m in messages)


def test_the_nodes_own_delete_goes_through_with_the_guard_up_and_down(
    control_plane: ControlPlane, guard: Guard
) -> None:
    cp = control_plane
    as_node: dict[str, Path] = {}
    for phase in ("up", "down"):
        node = unique(f"recreated-{phase}")
        cp.create_node(node)
        as_node[phase] = cp.node_kubeconfig(node)
        cp.kubelet(node, "install", "--driver", EBS, "--node-id", "i-r", "--max-volumes", str(LIMIT))
        if phase == "down":
            guard.pause()  # the never-refused entries: failurePolicy Ignore
        try:
            cp.kubectl("delete", "csinode", node, kubeconfig=as_node[phase])
        finally:
            if phase == "down":
                guard.resume()
        assert cp.kubectl("get", "csinode", node, check=False).returncode != 0
        cp.kubelet(node, "install", "--driver", EBS, "--node-id", "i-r", "--max-volumes", str(LIMIT))
        assert counts(cp.get_csinode(node)) == {EBS: LIMIT}


def _list(objects: list[dict[str, object]]) -> str:
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": objects})
