"""``versionSource: pod`` on the real apiserver: the node cannot forge its driver's version.

Under NodeRestriction a node may update the status of the pods bound to it, delete them, and create mirror pods
bound to itself whose only owner is its Node; it may not change a pod's spec or labels. The guard reads the
version from the spec of pods a DaemonSet controls (the image the DaemonSet controller set), in any phase, and
never from a mirror pod; a pod the node deletes keeps counting for that node until a replacement appears. No
kube-controller-manager runs here, so the DaemonSet's pod is created as admin with the controller reference the
DaemonSet controller would set.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.k8s.controlplane import ControlPlane, Guard, counts, policy_file, unique

EBS = "ebs.csi.aws.com"
NAMESPACE = "kube-system"
IMAGE = "public.ecr.aws/ebs-csi-driver/aws-ebs-csi-driver"
STATE = "csinode-guard.io/state"


def _policy(path: Path) -> Path:
    def edit(doc: dict[str, Any]) -> None:
        doc["spec"]["rules"]["change-rate"]["minInterval"] = "1s"
        doc["spec"]["drivers"][EBS]["minVersion"] = "v1.40.0"
        assert doc["spec"]["drivers"][EBS]["versionSource"]["type"] == "pod"  # the bundled default

    return policy_file(path, edit)


def _daemonset_pod(cp: ControlPlane, node: str, tag: str) -> dict[str, Any]:
    """A DaemonSet ``ebs-csi-node-<unique>`` and its pod on ``node`` (as the DaemonSet controller makes it)."""
    name = unique("ebs-csi-node")
    labels = {"app": "ebs-csi-node", "instance": name}
    template = {"metadata": {"labels": labels},
                "spec": {"containers": [{"name": "ebs-plugin", "image": f"{IMAGE}:{tag}"}]}}
    daemonset = {"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": name, "namespace": NAMESPACE},
                 "spec": {"selector": {"matchLabels": labels}, "template": template}}
    cp.kubectl("create", "-f", "-", input=json.dumps(daemonset))
    uid = cp.kubectl_json("get", "daemonset", "-n", NAMESPACE, name)["metadata"]["uid"]
    pod = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": f"{name}-x1", "namespace": NAMESPACE, "labels": labels,
                     "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": name, "uid": uid,
                                          "controller": True, "blockOwnerDeletion": True}]},
        "spec": {**template["spec"], "nodeName": node},
    }
    cp.kubectl("create", "-f", "-", input=json.dumps(pod))
    cp.kubectl("patch", "pod", "-n", NAMESPACE, pod["metadata"]["name"], "--subresource=status", "--type=merge",
               "-p", json.dumps({"status": {"phase": "Running"}}))
    stored: dict[str, Any] = cp.kubectl_json("get", "pod", "-n", NAMESPACE, pod["metadata"]["name"])
    return stored


def _patch_status(kubeconfig: Path, pod: str, status: dict[str, Any]) -> None:
    """PATCH ``pods/<pod>/status`` as kubelet's status manager does (no GET first: a node may not read
    ``pods/status``, only update and patch it)."""
    from kubernetes import client, config  # noqa: PLC0415

    with config.new_client_from_config(config_file=str(kubeconfig)) as api:
        client.CoreV1Api(api).patch_namespaced_pod_status(pod, NAMESPACE, {"status": status})


def _mirror_pod(node: dict[str, Any], owner: dict[str, Any]) -> dict[str, Any]:
    name = node["metadata"]["name"]
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": f"ebs-csi-node-{name}", "namespace": NAMESPACE, "labels": {"app": "ebs-csi-node"},
                     "annotations": {"kubernetes.io/config.mirror": "f00d", "kubernetes.io/config.source": "file"},
                     "ownerReferences": [owner]},
        "spec": {"nodeName": name, "containers": [{"name": "ebs-plugin", "image": f"{IMAGE}:v9.9.9"}]},
    }


def test_a_node_cannot_forge_its_driver_version_with_pod_status_or_a_mirror_pod(
    control_plane: ControlPlane, guard_factory: Any, tmp_path: Path
) -> None:
    cp = control_plane
    node_name = unique("podver")
    node = cp.create_node(node_name)
    real = _daemonset_pod(cp, node_name, "v1.30.0")
    pod_name = real["metadata"]["name"]
    guard: Guard = guard_factory(_policy(tmp_path / "policy.yaml"))
    as_node = cp.node_kubeconfig(node_name)
    cp.kubelet(node_name, "init")
    cp.kubelet(node_name, "install", "--driver", EBS, "--node-id", "i-podver", "--max-volumes", "20")
    assert counts(cp.get_csinode(node_name)) == {EBS: 20}

    # What NodeRestriction lets the node do: mark its real driver pod Failed, and create a mirror pod (owned by
    # its Node) that looks like a driver pod at v9.9.9 and says it runs.
    _patch_status(as_node, pod_name, {"phase": "Failed", "containerStatuses": [
        {"name": "ebs-plugin", "image": f"{IMAGE}:v9.9.9", "imageID": "", "ready": True, "restartCount": 0,
         "started": True, "state": {"running": {}}}]})
    node_owner = {"apiVersion": "v1", "kind": "Node", "name": node_name, "uid": node["metadata"]["uid"],
                  "controller": True}
    mirror = _mirror_pod(node, node_owner)
    cp.kubectl("create", "-f", "-", input=json.dumps(mirror), kubeconfig=as_node)
    _patch_status(as_node, mirror["metadata"]["name"], {"phase": "Running"})

    # What it may not do: change its pod's image (spec), or create a pod claiming a DaemonSet as controller.
    spec_change = cp.kubectl("set", "image", "-n", NAMESPACE, f"pod/{pod_name}", f"ebs-plugin={IMAGE}:v9.9.9",
                             kubeconfig=as_node, check=False)
    assert spec_change.returncode != 0 and "forbidden" in spec_change.stderr.lower(), spec_change.stderr
    forged = _mirror_pod(node, dict(real["metadata"]["ownerReferences"][0]))
    forged["metadata"]["name"] += "-ds"
    forged["metadata"]["ownerReferences"][0].pop("blockOwnerDeletion")
    refused = cp.kubectl("create", "-f", "-", input=json.dumps(forged), kubeconfig=as_node, check=False)
    assert refused.returncode != 0 and "owner reference set to itself" in refused.stderr, refused.stderr
    assert cp.kubectl_json("get", "pod", "-n", NAMESPACE, pod_name)["spec"]["containers"][0]["image"].endswith(
        ":v1.30.0")

    # The node's kubelet raises its count: the version is still the DaemonSet pod's v1.30.0, below minVersion, so
    # the increase is held at the stored count (for the node's kubelet a denial acts as a clamp).
    cp.kubelet(node_name, "update", "--driver", EBS, "--max-volumes", "22")
    stored = cp.get_csinode(node_name)
    assert counts(stored) == {EBS: 20}
    state = json.loads(stored["metadata"]["annotations"][STATE])
    assert "v9.9.9" not in json.dumps(state), state
    [held] = [r for r in guard.decisions()
              if r.get("node") == node_name and r.get("endpoint") == "mutate" and r.get("new") == 22]
    assert (held["decision"], held["final"], held["writerVersion"]) == ("clamp", 20, "v1.30.0"), held
    assert any(o["rule"] == "writer-version" and o["result"] == "violation" and "below minVersion" in o["message"]
               for o in held["rules"]), held

    # The node deletes its driver pod (NodeRestriction lets it delete pods bound to it; no DaemonSet controller
    # runs here to re-create it): the guard keeps the last pod's version for the node, so the increase is held.
    cp.kubectl("delete", "pod", "-n", NAMESPACE, pod_name, "--grace-period=0", "--force", "--wait=false",
               kubeconfig=as_node)
    assert cp.kubectl("get", "pod", "-n", NAMESPACE, pod_name, check=False).returncode != 0
    cp.kubelet(node_name, "update", "--driver", EBS, "--max-volumes", "23")
    assert counts(cp.get_csinode(node_name)) == {EBS: 20}
    [after] = [r for r in guard.decisions()
               if r.get("node") == node_name and r.get("endpoint") == "mutate" and r.get("new") == 23]
    assert (after["decision"], after["final"], after["writerVersion"]) == ("clamp", 20, "v1.30.0"), after


def test_the_kubelet_source_is_the_nodes_own_report(control_plane: ControlPlane) -> None:
    """What threat-model.md says of ``versionSource: kubelet``: the node writes its own Node status, so it can
    report any kubeletVersion (NodeRestriction does not look at ``status.nodeInfo``), while a label under
    node-restriction.kubernetes.io/ stays out of its reach."""
    from kubernetes import client, config  # noqa: PLC0415

    cp = control_plane
    node = unique("kubeletver")
    cp.create_node(node)
    with config.new_client_from_config(config_file=str(cp.node_kubeconfig(node))) as api:
        client.CoreV1Api(api).patch_node_status(node, {"status": {"nodeInfo": {"kubeletVersion": "v9.9.9"}}})
    assert cp.kubectl_json("get", "node", node)["status"]["nodeInfo"]["kubeletVersion"] == "v9.9.9"
    safe = cp.kubectl("label", "node", node, "node-restriction.kubernetes.io/instance-type=c7i.48xlarge",
                      kubeconfig=cp.node_kubeconfig(node), check=False)
    assert safe.returncode != 0 and "is not allowed to modify labels" in safe.stderr, safe.stderr
    assert cp.kubectl("label", "node", node, "node.kubernetes.io/instance-type=c7i.48xlarge",
                      kubeconfig=cp.node_kubeconfig(node), check=False).returncode == 0
