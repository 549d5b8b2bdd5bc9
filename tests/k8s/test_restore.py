"""``csinode-guard restore`` and ``csinode-guard unregister`` against the real apiserver.

The emergency switch first: with the guard unregistered, a bogus increase is stored unjudged. Registered again,
an approver restores the last count the guard trusted (from its signed state): one CSINode update as the
approver, judged by the guard like any other, and the count in etcd is the trusted one again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.k8s.controlplane import ControlPlane, Guard, counts, fast_policy, unique

EBS = "ebs.csi.aws.com"
STATE = "csinode-guard.io/state"
JUSTIFICATION = "csinode-guard.io/justification"


def test_restore_puts_back_the_trusted_count_after_an_unjudged_increase(
    control_plane: ControlPlane, guard_factory: Any, tmp_path: Path
) -> None:
    cp = control_plane
    # reconcile: report: the running guard's audit would otherwise lower the 39 itself before restore does
    guard: Guard = guard_factory(fast_policy(tmp_path / "policy.yaml", reconcile="report"))
    node = unique("restore")
    cp.create_node(node)
    cp.kubelet(node, "install", "--driver", EBS, "--node-id", "i-1", "--max-volumes", "25")
    cp.kubelet(node, "update", "--driver", EBS, "--max-volumes", "23")
    assert json.loads(cp.get_csinode(node)["metadata"]["annotations"][STATE])["drivers"][EBS]["count"] == 23

    # Emergency switch: unjudged, kubelet's 39 is stored as it is (no ceiling applies).
    out = guard.unregister()
    assert f"mutatingwebhookconfiguration/{guard.name} deleted" in out.stdout.lower() or "deleted" in out.stdout
    cp.kubelet(node, "update", "--driver", EBS, "--max-volumes", "39")
    assert counts(cp.get_csinode(node)) == {EBS: 39}

    guard.register()
    alice = cp.approver_kubeconfig()
    args = ("restore", node, "--driver", EBS, "--reason", "driver reported a bogus limit", "--ticket", "INC-7",
            "--state-key-file", str(guard.cert_dir / "state.key"), "--kubeconfig", str(alice))

    dry = guard.csinode_guard(*args, "--dry-run=server")
    assert "39" in dry.stdout and "23" in dry.stdout, dry.stdout
    assert counts(cp.get_csinode(node)) == {EBS: 39}

    guard.csinode_guard(*args)
    stored = cp.get_csinode(node)
    assert counts(stored) == {EBS: 23}
    annotations = stored["metadata"]["annotations"]
    justification = json.loads(annotations[JUSTIFICATION])
    assert [(j["driver"], j["minCount"], j["maxCount"], j["ticket"]) for j in justification] == [
        (EBS, 23, 23, "INC-7")
    ]
    state = json.loads(annotations[STATE])
    assert state["drivers"][EBS]["count"] == 23
    assert state["approvals"][0]["approvedBy"] == "alice@example.com"
    judged = [r for r in guard.decisions() if r.get("node") == node and r["endpoint"] == "mutate"]
    # Reconciled: the unjudged 39 counts for nothing, so the restore is judged from the trusted 23 to 23 (no
    # change to judge), and the record says why.
    last = judged[-1]
    assert (last["user"], last["dryRun"], last["allowed"], last["decision"], last["driver"]) == (
        "alice@example.com", False, True, "allow", None
    )
    assert last["notes"] == [
        f"{node}/{EBS}: the stored count 39 is above the last count csinode-guard accepted (23): judged from 23"
    ]
