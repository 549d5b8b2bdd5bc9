"""A label the node set never raises its ceiling, and its history outlives its CSINode: attacks 2 and 3 of the
third attack (issue 32) replayed on the real apiserver, with the node's own credentials -- kubelet's code
(``kubelet-csinode``) for the CSINode, the node's kubeconfig for its Node and for deleting its CSINode -- and the
guard up with its Node entry registered (``register`` applies ``csinode-guard-nodes``).

The bundled policy: EBS ceilings by ``node.kubernetes.io/instance-type`` (the shipped profile: c7i.48xlarge 128),
27 for an unknown type. Each test ends by reading etcd.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

from tests.k8s.controlplane import KUBELET_VERSION, ControlPlane, counts, fast_policy, unique, wait_until
from tests.k8s.test_node_history import ensure_namespace, retained_count
from webhook.admission.label_provenance import PROVENANCE_ANNOTATION

EBS = "ebs.csi.aws.com"
TYPE = "node.kubernetes.io/instance-type"
HOSTNAME = "kubernetes.io/hostname"


def stored(cp: ControlPlane, node: str) -> int | None:
    return counts(cp.get_csinode(node)).get(EBS)


def install(cp: ControlPlane, node: str, count: int) -> None:
    out = cp.kubelet(node, "install", "--driver", EBS, "--node-id", "i-1", "--max-volumes", str(count))
    assert f"OK install driver={EBS}" in out.stdout, out.stdout + out.stderr


def record(cp: ControlPlane, node: str) -> dict[str, Any] | None:
    """The guard's label provenance record on the Node (its JSON, not verified here), None when absent."""
    annotations = cp.kubectl_json("get", "node", node)["metadata"].get("annotations") or {}
    value = annotations.get(PROVENANCE_ANNOTATION)
    return json.loads(value) if value else None


def recorded(cp: ControlPlane, node: str, labels: dict[str, str]) -> None:
    """Wait until the Node carries a record vouching for exactly ``labels``, then for the guard's Node watch."""
    wait_until(lambda: (record(cp, node) or {}).get("labels") == labels, what=f"record {labels} on {node}")
    time.sleep(1.0)  # the guard's Node informer: one event away


def create_own_node(cp: ControlPlane, node: str, labels: dict[str, str]) -> None:
    """The kubelet registers its own Node (as ``system:node:<node>``, NodeRestriction lets it set these labels)."""
    body = {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": node, "labels": {"kubernetes.io/hostname": node, **labels}},
        "status": {"nodeInfo": {
            "architecture": "amd64", "bootID": str(uuid.uuid4()), "containerRuntimeVersion": "containerd://2.1.0",
            "kernelVersion": "6.8.0", "kubeProxyVersion": "", "kubeletVersion": KUBELET_VERSION,
            "machineID": uuid.uuid4().hex, "operatingSystem": "linux", "osImage": "test",
            "systemUUID": str(uuid.uuid4()),
        }},
    }
    cp.kubectl("create", "-f", "-", input=json.dumps(body), kubeconfig=cp.node_kubeconfig(node))


def cloud_controller(cp: ControlPlane) -> Path:
    """A stand-in for the cloud-controller-manager: an identity other than the node, allowed to label Nodes."""
    name = "cloud-controller-manager"
    if cp.kubectl("get", "clusterrole", name, check=False).returncode != 0:
        cp.kubectl("create", "clusterrole", name, "--verb=get,list,patch,update", "--resource=nodes")
        cp.kubectl("create", "clusterrolebinding", name, f"--clusterrole={name}", f"--user={name}")
    return cp.user_kubeconfig(name)


def test_attack_3_a_node_that_creates_its_own_node_with_a_big_instance_type_stays_at_the_unknown_ceiling(
    control_plane: ControlPlane, guard_factory: Any, tmp_path: Path
) -> None:
    cp = control_plane
    guard_factory(fast_policy(tmp_path / "fast.yaml", "2s"))
    node = unique("selfmade")
    create_own_node(cp, node, {TYPE: "c7i.48xlarge"})  # 128 in the shipped EBS profile
    recorded(cp, node, {})  # the guard saw the CREATE: nothing vouched for
    install(cp, node, 128)
    assert stored(cp, node) == 27  # the unknown-type ceiling, not c7i.48xlarge's 128
    time.sleep(2.2)  # past minInterval: only the ceiling holds it
    cp.kubelet(node, "update", "--driver", EBS, "--max-volumes", "128", check=False)
    assert stored(cp, node) == 27


def test_attack_2_a_node_that_relabels_itself_and_recreates_its_csinode_stays_at_27(
    control_plane: ControlPlane, guard_factory: Any, tmp_path: Path
) -> None:
    """The re-registration is judged from the node's history (written by the audit leader, whose Lease and records
    live in the guard's namespace): from 20, past minInterval (a re-registration within it is paced at 20 by
    change-rate), at most the unknown-type ceiling 27 whatever label the node set itself."""
    cp = control_plane
    ensure_namespace(cp)
    guard_factory(fast_policy(tmp_path / "fast.yaml", "2s"))
    node = unique("recreated")
    cp.create_node(node, {})
    install(cp, node, 20)
    assert stored(cp, node) == 20
    wait_until(lambda: retained_count(cp, node) == 20, what=f"the history record of {node}")
    time.sleep(2.2)  # past minInterval since the registration at 20
    node_kubeconfig = cp.node_kubeconfig(node)
    cp.kubectl("label", "node", node, "--overwrite", f"{TYPE}=c7i.48xlarge", kubeconfig=node_kubeconfig)
    recorded(cp, node, {HOSTNAME: node})  # the admin's hostname label, not the node's instance type
    cp.kubectl("delete", "csinode", node, kubeconfig=node_kubeconfig)  # a new UID: no state on it
    install(cp, node, 128)
    assert stored(cp, node) == 27
    time.sleep(2.2)
    cp.kubelet(node, "update", "--driver", EBS, "--max-volumes", "128", check=False)
    assert stored(cp, node) == 27


def test_a_cloud_controller_labelling_a_node_after_its_plugin_registered_lifts_the_unknown_ceiling(
    control_plane: ControlPlane, guard_factory: Any, tmp_path: Path
) -> None:
    """The legitimate flow: a new Node (the kubelet's own, no instance type yet), the plugin registers, then the
    cloud-controller-manager sets the instance type; the next increase is judged by that type's ceiling."""
    cp = control_plane
    guard_factory(fast_policy(tmp_path / "fast.yaml", "2s"))
    node = unique("ccm")
    create_own_node(cp, node, {})
    install(cp, node, 40)
    assert stored(cp, node) == 27  # unknown type
    cp.kubectl("label", "node", node, f"{TYPE}=c7i.48xlarge", kubeconfig=cloud_controller(cp))
    recorded(cp, node, {TYPE: "c7i.48xlarge"})
    time.sleep(2.2)  # past minInterval
    cp.kubelet(node, "update", "--driver", EBS, "--max-volumes", "40")
    assert stored(cp, node) == 40  # within c7i.48xlarge's 128 and maxStepUp 16 of 27


def test_a_node_that_strips_or_forges_the_record_while_the_guard_is_up_gets_the_old_one_back(
    control_plane: ControlPlane, guard_factory: Any, tmp_path: Path
) -> None:
    cp = control_plane
    guard_factory(fast_policy(tmp_path / "fast.yaml", "2s"))
    node = unique("forge")
    cp.create_node(node, {TYPE: "m6i.large"})
    recorded(cp, node, {HOSTNAME: node, TYPE: "m6i.large"})  # the admin (not the node) set them
    node_kubeconfig = cp.node_kubeconfig(node)
    forged = json.dumps({"v": 1, "node": node, "uid": "", "labels": {TYPE: "c7i.48xlarge"}, "sig": "AAAA"})
    cp.kubectl("annotate", "node", node, "--overwrite", f"{PROVENANCE_ANNOTATION}={forged}",
               kubeconfig=node_kubeconfig)
    kept = record(cp, node)
    assert kept is not None and kept["labels"] == {HOSTNAME: node, TYPE: "m6i.large"} and kept["sig"] != "AAAA"
    cp.kubectl("annotate", "node", node, f"{PROVENANCE_ANNOTATION}-", kubeconfig=node_kubeconfig)
    kept = record(cp, node)
    assert kept is not None and kept["labels"] == {HOSTNAME: node, TYPE: "m6i.large"}
