"""Wide CSINodes on the real apiserver, through the registered guard (issue 32, attacks 5 and 6).

Attack 6: between 1,500 and 2,000 drivers the guard's own state patch pushed the object's annotations past the
apiserver's 256 KiB ("metadata.annotations: Too long") and the apiserver refused the kubelet's registration. Now a
registration of 2,000 drivers is stored, its annotations stay under 256 KiB (apimachinery
``ValidateAnnotationsSize``: the sum of every key's and value's length), and kubelet's own writes keep working on
the wide object. Attack 5: ebs at 128 registered together with thousands of other drivers took longer than
``timeoutSeconds`` and the apiserver failed open; now the count does not end stored at 128 unless the answer was
counted late.

The thousands of drivers are written in one PUT as ``system:node:<node>`` with the node's kubeconfig (``kubectl
replace``, the node's own identity, NodeRestriction applies): ``kubelet-csinode`` registers one driver per
write (InstallCSIDriver), so 2,000 drivers would be 2,000 writes, each judged on an object growing to 2,000 —
not the single registration the attacks make (many node plugins starting at once, or a buggy plugin). kubelet's
own code path is used for everything it can do here: creating the CSINode (``init``), the first driver
(``install``), and a registration and a periodic update on the wide object.
"""

from __future__ import annotations

import json
import time
from typing import Any

from tests.k8s.controlplane import ControlPlane, Guard, counts, unique
from tests.test_late_answers import late_answers

EBS = "ebs.csi.aws.com"
M6I_LARGE = {"node.kubernetes.io/instance-type": "m6i.large"}
CEILING = 27  # the shipped profile's ceiling for an m6i.large
STATE = "csinode-guard.io/state"
LIMIT = 256 * 1024


def annotation_bytes(obj: dict[str, Any]) -> int:
    annotations = obj["metadata"].get("annotations") or {}
    return sum(len(k.encode()) + len(v.encode()) for k, v in annotations.items())


def wide_node(control_plane: ControlPlane, prefix: str) -> str:
    """A Node (m6i.large) whose CSINode kubelet created, with ebs registered at 20 by kubelet's own code."""
    node = unique(prefix)
    control_plane.create_node(node, M6I_LARGE)
    time.sleep(1.0)  # the guard's Node informer: one event away
    control_plane.kubelet(node, "init")
    out = control_plane.kubelet(node, "install", "--driver", EBS, "--node-id", "i-1", "--max-volumes", "20")
    assert f"OK install driver={EBS}" in out.stdout, out.stdout + out.stderr
    return node


def register_many(control_plane: ControlPlane, node: str, drivers: int, ebs: int | None = None) -> Any:
    """One PUT as ``system:node:<node>``: the stored CSINode with ``drivers`` invented drivers registered (count
    10), and ebs re-registered at ``ebs`` (removed and appended again, as kubelet does) when given."""
    kubeconfig = control_plane.node_kubeconfig(node)
    stored = control_plane.kubectl_json("get", "csinode", node, kubeconfig=kubeconfig)
    entries = [d for d in stored["spec"]["drivers"] if ebs is None or d["name"] != EBS]
    entries += [{"name": f"plugin-{i:05d}.csi.example.com", "nodeID": node, "topologyKeys": None,
                 "allocatable": {"count": 10}} for i in range(drivers)]
    if ebs is not None:
        entries.append({"name": EBS, "nodeID": "i-1", "topologyKeys": None, "allocatable": {"count": ebs}})
    stored["spec"]["drivers"] = entries
    return control_plane.kubectl("replace", "-f", "-", kubeconfig=kubeconfig, check=False,
                                 input=json.dumps(stored))


def test_a_registration_of_2000_drivers_goes_through_and_stays_under_256_kib(
        control_plane: ControlPlane, guard: Guard) -> None:
    node = wide_node(control_plane, "wide")
    put = register_many(control_plane, node, 2000)
    assert put.returncode == 0, put.stderr  # was: metadata.annotations: Too long
    stored = control_plane.get_csinode(node)
    assert len(stored["spec"]["drivers"]) == 2001
    assert STATE in stored["metadata"]["annotations"]
    assert annotation_bytes(stored) <= LIMIT, annotation_bytes(stored)
    # kubelet's own writes on the wide object: a periodic update and one more registration.
    update = control_plane.kubelet(node, "update", "--driver", EBS, "--max-volumes", "19")
    assert update.returncode == 0, update.stderr
    install = control_plane.kubelet(node, "install", "--driver", "late.csi.example.com", "--node-id", "n-1",
                                    "--max-volumes", "5")
    assert "OK install" in install.stdout, install.stdout + install.stderr
    stored = control_plane.get_csinode(node)
    assert counts(stored)[EBS] == 19 and counts(stored)["late.csi.example.com"] == 5
    assert annotation_bytes(stored) <= LIMIT, annotation_bytes(stored)


def test_ebs_at_128_among_thousands_of_drivers_does_not_stay_at_128_unnoticed(
        control_plane: ControlPlane, guard_factory: Any) -> None:
    """Attack 5, as a single PUT on one worker: the answer comes within the budget (judged in full, or past the
    budget with the ceilings), or it is counted late. Either way not a silent 128."""
    guard = guard_factory(workers=1)
    node = wide_node(control_plane, "attack5")
    before = sum(late_answers(guard).values())
    put = register_many(control_plane, node, 4000, ebs=128)
    assert put.returncode == 0, put.stderr  # a registration is never refused
    stored = control_plane.get_csinode(node)
    ebs = counts(stored)[EBS]
    assert annotation_bytes(stored) <= LIMIT
    if ebs == 128:  # the apiserver failed open: the guard must have counted its late answer
        time.sleep(2.0)
        assert sum(late_answers(guard).values()) > before, "failed open and not counted late"
    else:
        assert ebs is not None and ebs <= CEILING, ebs
