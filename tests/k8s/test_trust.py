"""The node must not raise its own limit, nor a stranger remove it: the attacks of issue 19 replayed on the real
apiserver, with kubelet's own code (``kubelet-csinode``) writing as ``system:node:<node>``, a node kubeconfig for
the node's own Node labels, a user with RBAC on csinodes, and the real kube-scheduler.

Each test ends by reading etcd: the count stays within the pinned ceiling / the last accepted count, the driver
entry and the guard's state stay, and the scheduler does not over-bind.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from tests.k8s.controlplane import ControlPlane, Guard, counts, fast_policy, policy_file, unique
from tests.k8s.scheduling import create, settle, volume_pods

EBS = "ebs.csi.aws.com"
TYPE = "node.kubernetes.io/instance-type"
STATE = "csinode-guard.io/state"


def new_node(cp: ControlPlane, prefix: str, labels: dict[str, str] | None = None) -> str:
    node = unique(prefix)
    cp.create_node(node, {TYPE: "m6i.large"} if labels is None else labels)
    time.sleep(1.0)  # the guard's Node informer: one event away
    return node


def install(cp: ControlPlane, node: str, count: int) -> None:
    out = cp.kubelet(node, "install", "--driver", EBS, "--node-id", "i-1", "--max-volumes", str(count))
    assert f"OK install driver={EBS}" in out.stdout, out.stdout + out.stderr


def stored(cp: ControlPlane, node: str) -> int | None:
    return counts(cp.get_csinode(node)).get(EBS)


def label_as_node(cp: ControlPlane, node: str, *labels: str) -> None:
    """The node labels its own Node (NodeRestriction allows instance-type and labels outside kubernetes.io)."""
    cp.kubectl("label", "node", node, "--overwrite", *labels, kubeconfig=cp.node_kubeconfig(node))
    time.sleep(1.0)  # the guard's Node informer


def csinode_editor(cp: ControlPlane, name: str) -> Path:
    """A user with get/update/patch/delete/create on csinodes (a ClusterRole bound by the admin)."""
    role = f"{name}-csinodes"
    cp.kubectl("create", "clusterrole", role, "--verb=get,list,update,patch,delete,create",
               "--resource=csinodes.storage.k8s.io")
    cp.kubectl("create", "clusterrolebinding", role, f"--clusterrole={role}", f"--user={name}")
    return cp.user_kubeconfig(name, "storage-team")


def test_attack_1_the_node_labels_itself_a_bigger_instance_type_and_cycles_its_plugin(
    control_plane: ControlPlane, guard_factory: Any, tmp_path: Path
) -> None:
    cp = control_plane
    guard_factory(fast_policy(tmp_path / "fast.yaml", "2s"))
    node = new_node(cp, "relabel")
    install(cp, node, 25)
    assert stored(cp, node) == 25

    label_as_node(cp, node, f"{TYPE}=c7i.48xlarge")  # 128 in the shipped EBS profile
    for _ in range(4):
        time.sleep(2.2)  # past minInterval each time: only the pinned ceiling holds it
        cp.kubelet(node, "uninstall", "--driver", EBS)
        install(cp, node, 128)
        assert (stored(cp, node) or 0) <= 27
    cp.kubelet(node, "update", "--driver", EBS, "--max-volumes", "128", check=False)
    assert stored(cp, node) == 27  # the pinned m6i.large ceiling, not 128


def test_attack_2_a_held_increase_is_not_lifted_by_uninstall_install(control_plane: ControlPlane, guard: Guard) -> None:
    cp = control_plane
    node = new_node(cp, "cycle")
    install(cp, node, 10)
    held = cp.kubelet(node, "update", "--driver", EBS, "--max-volumes", "20", check=False)
    assert held.returncode == 0  # clamped for the node's kubelet, not refused
    assert stored(cp, node) == 10

    for _ in range(5):
        cp.kubelet(node, "uninstall", "--driver", EBS)
        install(cp, node, 26)
    assert stored(cp, node) == 10  # the last accepted count: registrations are paced (minInterval 60s)


def test_attack_4_a_stranger_removing_the_entry_is_refused_and_the_scheduler_does_not_over_bind(
    control_plane: ControlPlane, guard: Guard
) -> None:
    cp = control_plane
    node = new_node(cp, "strip")
    install(cp, node, 2)
    user = csinode_editor(cp, unique("mallory"))

    obj = cp.kubectl_json("get", "csinode", node, kubeconfig=user)
    obj["spec"]["drivers"] = [d for d in obj["spec"]["drivers"] if d["name"] != EBS]
    refused = cp.kubectl("replace", "-f", "-", kubeconfig=user, check=False, input=json.dumps(obj))
    assert refused.returncode != 0
    assert "[writer-identity]" in refused.stderr and "(removal)" in refused.stderr
    assert stored(cp, node) == 2

    namespace = unique("strip")
    create(cp, namespace, volume_pods(namespace, node, EBS, 3))
    bound, unschedulable, _ = settle(cp, namespace, node, 3)
    assert (bound, unschedulable) == (2, 1)


def test_attack_4_with_the_guard_down_a_strangers_removal_is_refused_too(
    control_plane: ControlPlane, guard: Guard
) -> None:
    cp = control_plane
    node = new_node(cp, "stripdown")
    install(cp, node, 2)
    user = csinode_editor(cp, unique("eve"))
    guard.pause()
    try:
        obj = cp.kubectl_json("get", "csinode", node, kubeconfig=user)
        obj["spec"]["drivers"] = []
        refused = cp.kubectl("replace", "-f", "-", kubeconfig=user, check=False, input=json.dumps(obj))
    finally:
        guard.resume()
    assert refused.returncode != 0  # the Fail entry: nothing the guard did not judge
    assert stored(cp, node) == 2


def test_attack_5_a_stranger_cannot_delete_and_create_with_a_higher_count(
    control_plane: ControlPlane, guard: Guard
) -> None:
    cp = control_plane
    node = new_node(cp, "recreate")
    install(cp, node, 5)
    user = csinode_editor(cp, unique("trudy"))
    obj = cp.kubectl_json("get", "csinode", node, kubeconfig=user)
    refused_delete = cp.kubectl("delete", "csinode", node, kubeconfig=user, check=False)
    assert refused_delete.returncode != 0 and "[writer-identity]" in refused_delete.stderr  # issue 32, attack 1
    cp.kubectl("delete", "csinode", node, kubeconfig=cp.node_kubeconfig(node))  # the node's own DELETE passes

    for key in ("uid", "resourceVersion", "creationTimestamp", "managedFields", "annotations"):
        obj["metadata"].pop(key, None)
    for d in obj["spec"]["drivers"]:
        d["allocatable"] = {"count": 27}
    refused = cp.kubectl("create", "-f", "-", kubeconfig=user, check=False, input=json.dumps(obj))
    assert refused.returncode != 0
    assert "[writer-identity]" in refused.stderr
    assert cp.kubectl("get", "csinode", node, check=False).returncode != 0  # nothing stored
    install(cp, node, 5)  # the node's own kubelet re-creates it
    assert stored(cp, node) == 5


def test_attack_6_a_node_that_removes_the_scope_label_stays_enforced(
    control_plane: ControlPlane, guard_factory: Any, tmp_path: Path
) -> None:
    cp = control_plane

    def canary(doc: dict[str, Any]) -> None:
        doc["spec"]["enforcementScope"] = {"nodeSelector": {"matchLabels": {"csinode-guard.io/enforce": "true"}}}
        doc["spec"]["rules"]["change-rate"]["minInterval"] = "1s"

    guard_factory(policy_file(tmp_path / "canary.yaml", canary))
    node = new_node(cp, "scope", {TYPE: "m6i.large", "csinode-guard.io/enforce": "true"})
    install(cp, node, 27)
    label_as_node(cp, node, "csinode-guard.io/enforce-")
    time.sleep(1.1)
    cp.kubelet(node, "update", "--driver", EBS, "--max-volumes", "60", check=False)
    assert stored(cp, node) == 27


def test_attacks_7_and_8_with_the_guard_down_the_node_can_neither_strip_nor_replay_its_state(
    control_plane: ControlPlane, guard: Guard
) -> None:
    cp = control_plane
    node = new_node(cp, "state")
    install(cp, node, 5)
    older = cp.get_csinode(node)["metadata"]["annotations"][STATE]
    cp.kubelet(node, "update", "--driver", EBS, "--max-volumes", "4")
    assert stored(cp, node) == 4
    current = cp.get_csinode(node)["metadata"]["annotations"][STATE]
    assert current != older

    guard.pause()
    try:
        for value in (None, older):  # strip it (7), put back an older signed state of its own (8)
            obj = cp.kubectl_json("get", "csinode", node, kubeconfig=cp.node_kubeconfig(node))
            obj["spec"]["drivers"] = [d for d in obj["spec"]["drivers"] if d["name"] != EBS]
            if value is None:
                obj["metadata"]["annotations"].pop(STATE)
            else:
                obj["metadata"]["annotations"][STATE] = value
            put = cp.kubectl("replace", "-f", "-", kubeconfig=cp.node_kubeconfig(node), check=False,
                             input=json.dumps(obj))
            assert put.returncode != 0, put.stdout
    finally:
        guard.resume()
    after = cp.get_csinode(node)
    assert after["metadata"]["annotations"][STATE] == current
    assert counts(after) == {EBS: 4}


def test_the_nodes_own_decrease_still_passes(control_plane: ControlPlane, guard: Guard) -> None:
    cp = control_plane
    node = new_node(cp, "legit")
    install(cp, node, 20)
    cp.kubelet(node, "update", "--driver", EBS, "--max-volumes", "18")
    assert stored(cp, node) == 18
