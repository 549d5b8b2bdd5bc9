"""``csinode-guard status`` as a subprocess against the real kube-apiserver: counts written by kubelet's own code
through the real guard (which signs its state onto the CSINode), VolumeAttachments created as the
attach-detach controller and external-attacher would leave them (status through the status subresource)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tests.k8s.controlplane import ControlPlane, Guard, unique, wait_until

EBS = "ebs.csi.aws.com"


def status(cp: ControlPlane, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "webhook", "status", *args],
        env={**os.environ, "KUBECONFIG": str(cp.kubeconfig)},
        capture_output=True, text=True, timeout=120, check=False,
    )


def entries(result: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    assert result.returncode == 0, result.stderr
    found: list[dict[str, Any]] = json.loads(result.stdout)["entries"]
    return found


def volume_attachment(cp: ControlPlane, node: str, status: dict[str, Any]) -> None:
    name = unique("va")
    obj = {
        "apiVersion": "storage.k8s.io/v1",
        "kind": "VolumeAttachment",
        "metadata": {"name": name},
        "spec": {"attacher": EBS, "nodeName": node, "source": {"persistentVolumeName": unique("pv")}},
    }
    cp.kubectl("create", "-f", "-", input=json.dumps(obj))
    cp.kubectl("patch", "volumeattachment", name, "--subresource=status", "--type=merge",
               "-p", json.dumps({"status": status}))


def test_status_shows_counts_state_ceilings_and_usage(
    control_plane: ControlPlane, guard: Guard, tmp_path: Path
) -> None:
    busy, idle = unique("busy"), unique("idle")
    pool = unique("pool")
    control_plane.create_node(busy, {"node.kubernetes.io/instance-type": "m7i.48xlarge", "pool": pool})
    control_plane.create_node(idle, {"node.kubernetes.io/instance-type": "m5.large", "pool": pool})
    for node in (busy, idle):
        control_plane.kubelet(node, "install", "--driver", EBS, "--node-id", f"i-{node}", "--max-volumes", "25")
    control_plane.kubelet(busy, "update", "--driver", EBS, "--max-volumes", "20")  # judged: the guard signs it
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    for _ in range(3):
        volume_attachment(control_plane, busy, {"attached": True})
    volume_attachment(control_plane, busy, {"attached": False, "attachError": {
        "time": now, "message": "rpc error: code = ResourceExhausted", "errorCode": 8}})
    volume_attachment(control_plane, busy, {"attached": False, "attachError": {
        "time": now, "message": "rpc error: code = Unavailable", "errorCode": 14}})

    key = str(guard.cert_dir / "state.key")
    result = status(control_plane, "-o", "json", "--selector", f"pool={pool}", "--state-key-file", key)
    rows = entries(result)
    assert [(r["node"], r["driver"]) for r in rows] == [(busy, EBS), (idle, EBS)]  # least headroom first
    first, second = rows
    assert first["allocatableCount"] == 20 and first["attachedVolumes"] == 3 and first["headroom"] == 17
    assert first["acceptedCount"] == 20 and first["state"] == "verified" and first["acceptedAt"]
    assert first["ceiling"] == 128 and "m7i.48xlarge" in first["ceilingReason"]
    assert first["attachErrors"] == {"ResourceExhausted": 1, "transient": 1}
    # A registration is judged too: the guard signed the count it registered with.
    assert second["allocatableCount"] == 25 and second["headroom"] == 25 and second["state"] == "verified"
    assert second["acceptedCount"] == 25
    assert second["ceiling"] == 27 and second["overCeiling"] is False
    summary = json.loads(result.stdout)["summary"]
    assert summary["nodes"] == 2 and summary["entries"] == 2 and summary["headroom"] == 42
    assert summary["attachedVolumes"] == 3

    unverified = entries(status(control_plane, "-o", "json", "--node", busy))
    assert unverified[0]["state"] == "unverified" and unverified[0]["acceptedCount"] == 20
    wrong_key = tmp_path / "wrong.key"
    wrong_key.write_text("00" * 32 + "\n", "utf-8")
    forged = entries(status(control_plane, "-o", "json", "--node", busy, "--state-key-file", str(wrong_key)))
    assert forged[0]["state"] == "bad-signature" and forged[0]["acceptedCount"] is None
    assert entries(status(control_plane, "-o", "json", "--node", busy, "--driver", "other.csi.io")) == []

    table = status(control_plane, "--selector", f"pool={pool}")
    lines = table.stdout.splitlines()
    assert lines[0].startswith("2 nodes, 1 drivers, 2 entries: 0 frozen, 0 over ceiling, headroom 42")
    assert lines[1].split()[:6] == ["NODE", "DRIVER", "COUNT", "CEILING", "ATTACHED", "HEADROOM"]
    assert lines[2].split()[:6] == [busy, EBS, "20", "128", "3", "17"]
    wide = status(control_plane, "-o", "wide", "--node", busy)
    assert "ResourceExhausted=1,transient=1" in wide.stdout and "CEILING-REASON" in wide.stdout


def _pending_on_limits(cp: ControlPlane) -> int:
    summary: dict[str, int] = json.loads(status(cp, "-o", "json", "--driver", "none").stdout)["summary"]
    return summary["pendingOnVolumeLimits"]


def test_pods_the_real_scheduler_leaves_pending_on_volume_limits_are_counted(control_plane: ControlPlane) -> None:
    node = unique("limits")
    namespace = unique("limits")
    control_plane.create_node(node)
    control_plane.kubelet(node, "install", "--driver", EBS, "--node-id", f"i-{node}", "--max-volumes", "1")
    control_plane.kubectl("create", "namespace", namespace)
    before = _pending_on_limits(control_plane)
    try:
        for i in range(2):  # two pods with one pre-bound CSI volume each, pinned to a node that can attach one
            pv, pvc = f"{namespace}-pv-{i}", f"pvc-{i}"
            objects = [
                {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv},
                 "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"],
                          "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
                          "claimRef": {"namespace": namespace, "name": pvc},
                          "csi": {"driver": EBS, "volumeHandle": f"vol-{namespace}-{i}"}}},
                {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                 "metadata": {"name": pvc, "namespace": namespace,
                              "annotations": {"pv.kubernetes.io/bind-completed": "yes"}},
                 "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "", "volumeName": pv,
                          "resources": {"requests": {"storage": "1Gi"}}}},
            ]
            for obj in objects:
                control_plane.kubectl("create", "-f", "-", input=json.dumps(obj))
            control_plane.kubectl("patch", "pv", pv, "--subresource=status", "--type=merge",
                                  "-p", '{"status":{"phase":"Bound"}}')
            control_plane.kubectl("patch", "pvc", pvc, "-n", namespace, "--subresource=status", "--type=merge",
                                  "-p", '{"status":{"phase":"Bound","accessModes":["ReadWriteOnce"],'
                                        '"capacity":{"storage":"1Gi"}}}')
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"pod-{i}", "namespace": namespace},
                   "spec": {"nodeSelector": {"kubernetes.io/hostname": node},
                            "containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10"}],
                            "volumes": [{"name": "v", "persistentVolumeClaim": {"claimName": pvc}}]}}
            control_plane.kubectl("create", "-f", "-", input=json.dumps(pod))
        wait_until(lambda: _pending_on_limits(control_plane) == before + 1, timeout=60,
                   what="one pod Unschedulable on volume limits")
    finally:
        control_plane.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
        control_plane.kubectl("delete", "pv", f"{namespace}-pv-0", f"{namespace}-pv-1", "--wait=false", check=False)


def test_headroom_is_never_above_the_ceiling(control_plane: ControlPlane) -> None:
    """A count stored above its ceiling (written while no guard was registered) gives headroom from the ceiling."""
    node = unique("over")
    pool = unique("pool")
    control_plane.create_node(node, {"node.kubernetes.io/instance-type": "m5.large", "pool": pool})
    control_plane.kubelet(node, "install", "--driver", EBS, "--node-id", f"i-{node}", "--max-volumes", "39")
    volume_attachment(control_plane, node, {"attached": True})
    [row] = entries(status(control_plane, "-o", "json", "--node", node))
    assert (row["allocatableCount"], row["ceiling"], row["overCeiling"]) == (39, 27, True)
    assert row["headroom"] == 26, "27 allowed minus 1 attached, not 39 - 1"
    table = status(control_plane, "--selector", f"pool={pool}").stdout.splitlines()
    assert "headroom 26 " in table[0]
    assert table[2].split()[:6] == [node, EBS, "39", "27", "1", "26"]
