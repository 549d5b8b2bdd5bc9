"""One node cannot spend everyone's increase budget (issue 32, attack 8), on the real apiserver.

node-a's own kubelet identity registers 50 invented drivers at 1 and raises all 50 by 1 in one PUT; node-b's
kubelet (``kubelet-csinode``) then raises a driver the cluster has a CSIDriver object for from 10 to 12. Drivers
without a CSIDriver object ask nothing of the cluster budget (the guard's CSIDriver watch says so), and a node's
increases are granted one by one within its fair share, so node-b's increase is admitted.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from tests.k8s.controlplane import ControlPlane, counts, policy_file, unique, wait_until

INVENTED = 50


def fairness_policy(path: Path) -> Path:
    """The bundled policy with a 1 s minInterval (so that a raise can follow a registration at once) and its
    default cluster budget (5/s, burst 50)."""

    def edit(doc: dict[str, Any]) -> None:
        doc["spec"]["rules"]["change-rate"]["minInterval"] = "1s"

    return policy_file(path, edit)


def put_as_node(cp: ControlPlane, node: str, obj: dict[str, Any]) -> None:
    """One PUT of the whole CSINode with the node's own kubelet identity (what kubelet's GET-then-PUT does)."""
    cp.kubectl("replace", "-f", "-", kubeconfig=cp.node_kubeconfig(node), input=json.dumps(obj))


def test_attack_8_a_flood_of_invented_drivers_leaves_another_nodes_increase_its_budget(
    control_plane: ControlPlane, guard_factory: Any, tmp_path: Path
) -> None:
    cp = control_plane
    real = f"{unique('real')}.csi.example.com"
    cp.kubectl("create", "-f", "-", input=json.dumps({
        "apiVersion": "storage.k8s.io/v1", "kind": "CSIDriver", "metadata": {"name": real},
        "spec": {"attachRequired": True}}))
    guard_factory(fairness_policy(tmp_path / "policy.yaml"))
    node_a, node_b = unique("node-a"), unique("node-b")
    cp.create_node(node_a)
    cp.create_node(node_b)
    try:
        cp.kubelet(node_a, "install", "--driver", "seed.csi.example.com", "--node-id", "i-a", "--max-volumes", "1")
        obj = cp.get_csinode(node_a)
        invented = [f"d{i:02d}.{unique('fake')}.example.com" for i in range(INVENTED)]
        obj["spec"]["drivers"] += [{"name": d, "nodeID": "i-a", "allocatable": {"count": 1}} for d in invented]
        put_as_node(cp, node_a, obj)  # 50 registrations at 1
        cp.kubelet(node_b, "install", "--driver", real, "--node-id", "i-b", "--max-volumes", "10")
        time.sleep(1.5)  # minInterval 1 s since the registrations

        obj = cp.get_csinode(node_a)
        for entry in obj["spec"]["drivers"]:
            if entry["name"] in invented:
                entry["allocatable"]["count"] = 2
        put_as_node(cp, node_a, obj)  # all 50 raised by 1 in one PUT
        stored_a = counts(cp.get_csinode(node_a))
        raised_a = sum(1 for d in invented if stored_a[d] == 2)
        time.sleep(1.0)  # the guards' CSINode watch shows node-a's increases

        out = cp.kubelet(node_b, "update", "--driver", real, "--max-volumes", "12", check=False)
        stored_b = wait_until(lambda: counts(cp.get_csinode(node_b)).get(real), timeout=10, what="node-b's count")
        print(f"\n[attack 8] node-a raised {raised_a} of {INVENTED} invented drivers; node-b's 10 -> 12 stored as "
              f"{stored_b}: {out.stdout.strip()[:120]}")
        assert raised_a == INVENTED, "no CSIDriver object: judged by their ceilings only"
        assert stored_b == 12
    finally:
        cp.kubectl("delete", "csidriver", real, check=False)
