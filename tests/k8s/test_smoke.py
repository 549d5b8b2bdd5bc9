"""The fixture works end to end: kubelet's own code registers a driver through the real apiserver while the
real guard is registered, and a GET reads the count back from etcd."""

from __future__ import annotations

from tests.k8s.controlplane import ControlPlane, Guard, counts, unique

EBS = "ebs.csi.aws.com"


def test_kubelet_installs_a_driver_through_the_real_apiserver_with_the_guard_registered(
    control_plane: ControlPlane, guard: Guard
) -> None:
    node = unique("smoke")
    control_plane.create_node(node)
    assert control_plane.kubectl("get", "mutatingwebhookconfiguration", guard.name).returncode == 0
    assert control_plane.kubectl("get", "validatingwebhookconfiguration", guard.name).returncode == 0

    out = control_plane.kubelet(node, "install", "--driver", EBS, "--node-id", "i-smoke", "--max-volumes", "25")

    assert f"OK install driver={EBS}" in out.stdout
    stored = control_plane.get_csinode(node)
    assert counts(stored) == {EBS: 25}
    assert stored["metadata"]["ownerReferences"][0]["name"] == node

    # The Python client's models accept what the fixture created (full status.nodeInfo) and kubelet wrote.
    from kubernetes import client  # noqa: PLC0415

    read_node = client.CoreV1Api(control_plane.api_client()).read_node(node)
    assert read_node.status.node_info.kubelet_version == "v1.36.2"
    assert read_node.spec.taints is None
    csinode = client.StorageV1Api(control_plane.api_client()).read_csi_node(node)
    assert [(d.name, d.allocatable.count) for d in csinode.spec.drivers] == [(EBS, 25)]
