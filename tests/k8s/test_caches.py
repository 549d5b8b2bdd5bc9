"""The guard's watch caches against the real apiserver: what admins change in Nodes, CSIDrivers and
VolumeAttachments reaches the guard's decisions without a call per request.

Each fact is changed by an admin (kubectl), then a server-side dry run by the node polls until the guard's
decision shows it; the real write by kubelet's code follows and is read back from etcd.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tests.k8s.controlplane import ControlPlane, Guard, counts, fast_policy, judged_dry_run, unique, wait_until

EBS = "ebs.csi.aws.com"
PD = "pd.csi.storage.gke.io"
INSTANCE_TYPE = "node.kubernetes.io/instance-type"


def test_a_node_label_sets_the_ceiling_and_a_relabel_lowers_it(
    control_plane: ControlPlane, guard_factory: Any, tmp_path: Path
) -> None:
    cp = control_plane
    guard: Guard = guard_factory(fast_policy(tmp_path / "policy.yaml"))
    node = unique("label")
    cp.create_node(node, labels={INSTANCE_TYPE: "a1.metal"})  # the EBS profile: 31
    cp.kubelet(node, "install", "--driver", EBS, "--node-id", "i-1", "--max-volumes", "20")
    # The registration is judged (never refused) and its accepted count starts change-rate's interval.
    time.sleep(2.1)

    cp.kubelet(node, "update", "--driver", EBS, "--max-volumes", "39")
    assert counts(cp.get_csinode(node)) == {EBS: 31}

    # A relabel may lower the pinned ceiling (raising it needs an approver: tests/k8s/test_trust.py).
    cp.kubectl("label", "node", node, f"{INSTANCE_TYPE}=c5d.24xlarge", "--overwrite")  # the EBS profile: 23
    wait_until(lambda: judged_dry_run(cp, guard, node, EBS, 39)["final"] == 23, what="the new label's ceiling")
    cp.kubelet(node, "update", "--driver", EBS, "--max-volumes", "39")
    assert counts(cp.get_csinode(node)) == {EBS: 23}


def test_a_csidriver_update_period_lengthens_the_change_rate_interval(
    control_plane: ControlPlane, guard_factory: Any, tmp_path: Path
) -> None:
    cp = control_plane
    guard: Guard = guard_factory(fast_policy(tmp_path / "policy.yaml"))
    node = unique("period")
    cp.create_node(node)
    cp.kubelet(node, "install", "--driver", PD, "--node-id", "pd-1", "--max-volumes", "20")
    cp.kubelet(node, "update", "--driver", PD, "--max-volumes", "18")  # judged: the state has a changedAt now
    csidriver = {
        "apiVersion": "storage.k8s.io/v1", "kind": "CSIDriver", "metadata": {"name": PD},
        "spec": {"attachRequired": True, "nodeAllocatableUpdatePeriodSeconds": 3600},
    }
    cp.kubectl("apply", "-f", "-", input=json.dumps(csidriver))
    try:
        stored = cp.kubectl_json("get", "csidriver", PD)
        assert stored["spec"]["nodeAllocatableUpdatePeriodSeconds"] == 3600, "the apiserver kept the KEP-4876 field"

        last: list[dict[str, Any]] = []

        def held_for_the_period() -> bool:
            # the node's kubelet's too-fast increase: change-rate's deny acts as a clamp to the stored count
            last[:] = [judged_dry_run(cp, guard, node, PD, 19)]
            return last[0]["decision"] == "clamp" and last[0]["final"] == 18 and any(
                r["rule"] == "change-rate" and r["effective"] == "clamp" and "the minimum is 1h" in r["message"]
                for r in last[0]["rules"]
            )

        try:
            wait_until(held_for_the_period, what="the CSIDriver's period in change-rate")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; last decision: {last}") from None
        held = cp.kubelet(node, "update", "--driver", PD, "--max-volumes", "19")
        assert "[change-rate]" in held.stderr, "the clamp's warning reaches kubelet"
        assert counts(cp.get_csinode(node)) == {PD: 18}
    finally:
        cp.kubectl("delete", "csidriver", PD, "--ignore-not-found")
    # Without the CSIDriver, the policy's 2s applies again.
    wait_until(lambda: judged_dry_run(cp, guard, node, PD, 19)["decision"] == "allow", what="period gone")
    cp.kubelet(node, "update", "--driver", PD, "--max-volumes", "19")
    assert counts(cp.get_csinode(node)) == {PD: 19}


def test_an_attach_error_with_code_8_makes_a_decrease_a_correction(
    control_plane: ControlPlane, guard_factory: Any, tmp_path: Path
) -> None:
    cp = control_plane
    guard: Guard = guard_factory(fast_policy(tmp_path / "policy.yaml"))
    node = unique("exhausted")
    cp.create_node(node)
    cp.kubelet(node, "install", "--driver", EBS, "--node-id", "i-1", "--max-volumes", "27")
    cp.kubelet(node, "update", "--driver", EBS, "--max-volumes", "26")  # a plain decrease: no correction
    state = json.loads(cp.get_csinode(node)["metadata"]["annotations"]["csinode-guard.io/state"])
    assert state["drivers"][EBS]["correction"] is None

    va_name = unique("va")
    va = {
        "apiVersion": "storage.k8s.io/v1", "kind": "VolumeAttachment", "metadata": {"name": va_name},
        "spec": {"attacher": EBS, "nodeName": node, "source": {"persistentVolumeName": unique("pv")}},
    }
    cp.kubectl("create", "-f", "-", input=json.dumps(va))
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    status = {"status": {"attached": False, "attachError": {
        "time": now, "message": "rpc error: code = ResourceExhausted desc = attachment limit reached",
        "errorCode": 8}}}
    cp.kubectl("patch", "volumeattachment", va_name, "--subresource=status", "--type=merge",
               "-p", json.dumps(status))
    try:
        stored_va = cp.kubectl_json("get", "volumeattachment", va_name)
        assert stored_va["status"]["attachError"]["errorCode"] == 8, "the apiserver kept the KEP-4876 field"

        wait_until(lambda: judged_dry_run(cp, guard, node, EBS, 20).get("correction") == "resource-exhausted",
                   what="the attach error in the guard's cache")
        cp.kubelet(node, "update", "--driver", EBS, "--max-volumes", "20")
        stored = cp.get_csinode(node)
        assert counts(stored) == {EBS: 20}
        correction = json.loads(stored["metadata"]["annotations"]["csinode-guard.io/state"])["drivers"][EBS][
            "correction"]
        assert (correction["from"], correction["to"], correction["basis"]) == (26, 20, "resource-exhausted")
    finally:
        cp.kubectl("delete", "volumeattachment", va_name, "--ignore-not-found")
