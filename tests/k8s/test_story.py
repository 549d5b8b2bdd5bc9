"""The story of tests/test_e2e.py, through the real apiserver: kubelet's own code writes as system:node:<name>,
an approver writes with kubectl, and every step ends in the count stored in etcd, read back with a GET.

Also here: the guard's JSON Patch is applied by the apiserver (the stored object carries the signed state and
the clamped count), the validating webhook sees that final object, a later mutating webhook makes the apiserver
reinvoke the guard once (``reinvocationPolicy: IfNeeded``) without a loop, and a denial reaches kubelet's code as
the error kubelet logs.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from tests.k8s.controlplane import (
    ADMIN_USER,
    ControlPlane,
    Guard,
    counts,
    csinode_writes,
    fast_policy,
    unique,
    wait_until,
)

EBS = "ebs.csi.aws.com"
STATE = "csinode-guard.io/state"
JUSTIFICATION = "csinode-guard.io/justification"
VERSIONS = "csinode-guard.io/driver-versions"
MUTATE = "increases-and-other-writers.mutate.csinode-guard.io"


def state_of(csinode: dict[str, Any]) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(csinode["metadata"]["annotations"][STATE])
    return loaded


def writes(cp: ControlPlane, node: str) -> list[dict[str, Any]]:
    return cp.audit_events(csinode_writes(node))


def test_the_kubelet_story_ends_in_the_counts_stored_in_etcd(
    control_plane: ControlPlane, guard_factory: Any, tmp_path: Path
) -> None:
    cp = control_plane
    # minInterval 10 s: long enough that the increase right after the decrease is inside it on a loaded machine
    # (with 2 s, the steps between them took 2.2 s once under a full suite), short enough to wait out twice.
    guard: Guard = guard_factory(fast_policy(tmp_path / "policy.yaml", "10s", reporter=ADMIN_USER))
    node = unique("story")
    cp.create_node(node)
    cp.kubelet(node, "init")
    cp.kubectl("annotate", "csinode", node, f"{VERSIONS}={json.dumps({EBS: 'v1.37.0'})}")

    # The node registers ebs.csi.aws.com at 25.
    cp.kubelet(node, "install", "--driver", EBS, "--node-id", "i-story", "--max-volumes", "25")
    assert counts(cp.get_csinode(node)) == {EBS: 25}

    # Network interfaces take two slots: 25 -> 23 from the node's own kubelet passes, recorded in the signed state.
    cp.kubelet(node, "update", "--driver", EBS, "--max-volumes", "23")
    stored = cp.get_csinode(node)
    assert counts(stored) == {EBS: 23}
    state = state_of(stored)
    assert state["drivers"][EBS]["count"] == 23
    assert state["drivers"][EBS]["writerVersion"] == "v1.37.0"
    assert state["uid"] == stored["metadata"]["uid"]

    # An increase right after it comes faster than the period: change-rate's deny acts as a clamp to the stored
    # count for the node's own kubelet (a denial would fail a re-registration after a kubelet restart, the same
    # PUT). kubelet's update succeeds in one request, no retries; the clamp's result is the stored object, so the
    # PUT is a no-op and etcd keeps its resourceVersion.
    before = len(writes(cp, node))
    version = cp.get_csinode(node)["metadata"]["resourceVersion"]
    fast = cp.kubelet(node, "update", "--driver", EBS, "--max-volumes", "24", check=False)
    assert fast.returncode == 0, fast.stderr
    assert f"[change-rate] {node}/{EBS}: 23 -> 24 (clamped to 23): " in fast.stderr + fast.stdout
    wait_until(lambda: writes(cp, node)[before:], what="kubelet's write audited")
    time.sleep(0.5)
    attempts = writes(cp, node)[before:]
    assert len(attempts) == 1, "one request, not kubelet's retries of a denial"
    assert {e["responseStatus"]["code"] for e in attempts} == {200}
    held = [r for r in guard.decisions() if r["node"] == node and r["endpoint"] == "mutate" and r.get("new") == 24]
    assert [(r["old"], r["final"], r["decision"]) for r in held] == [(23, 23, "clamp")]
    stored = cp.get_csinode(node)
    assert counts(stored) == {EBS: 23}
    assert stored["metadata"]["resourceVersion"] == version

    # After the period, a report of 39 (no such EBS limit on an unlabelled node: 27) is clamped to 27 by the
    # guard's patch, which the apiserver applies; the validating webhook sees the final 27.
    time.sleep(10.1)  # past minInterval
    clamped = cp.kubelet(node, "update", "--driver", EBS, "--max-volumes", "39")
    assert "OK update" in clamped.stdout
    stored = cp.get_csinode(node)
    assert counts(stored) == {EBS: 27}
    assert state_of(stored)["drivers"][EBS]["count"] == 27
    last = [r for r in guard.decisions() if r["node"] == node][-2:]
    assert [(r["endpoint"], r["new"], r["final"], r["decision"]) for r in last] == [
        ("mutate", 39, 27, "clamp"), ("validate", 27, 27, "allow")
    ]

    # An unbounded report (kubelet drops allocatable for max_volumes_per_node 0) is clamped back to the stored
    # count, with the guard's warning in kubelet's log: spec and annotations stay as they were, state included.
    # The PUT is a no-op for the apiserver: the guard also puts back kubelet's managed fields (which the
    # apiserver took from kubelet's request, without allocatable), so nothing is written and the
    # resourceVersion stays.
    time.sleep(10.1)  # past minInterval
    unbounded = cp.kubelet(node, "update", "--driver", EBS, "--max-volumes", "0")
    assert f"Warning: [count-ceiling] {node}/{EBS}: 27 -> unbounded (clamped to 27)" in unbounded.stderr
    after = cp.get_csinode(node)
    assert counts(after) == {EBS: 27}
    assert after["metadata"]["resourceVersion"] == stored["metadata"]["resourceVersion"]
    assert after["spec"] == stored["spec"]
    assert after["metadata"]["annotations"] == stored["metadata"]["annotations"]
    assert [r for r in guard.decisions() if r["node"] == node and r["endpoint"] == "mutate"][-1]["final"] == 27

    # An approver's justification for 0 is recorded in the signed state; then the node's drop to 0 passes
    # quietly as a justified correction. kubelet's own code cannot report 0 (it removes allocatable), so the
    # node's identity writes it with a GET + PUT, as kubelet does.
    expires = (datetime.now(UTC) + timedelta(hours=2)).strftime("%Y-%m-%dT%H:%M:%SZ")
    justification = [{"driver": EBS, "reason": "instance retirement", "minCount": 0, "maxCount": 0,
                      "expires": expires, "ticket": "OPS-4711"}]
    cp.kubectl("annotate", "csinode", node, f"{JUSTIFICATION}={json.dumps(justification)}",
               kubeconfig=cp.approver_kubeconfig())
    approval = state_of(cp.get_csinode(node))["approvals"][0]
    assert (approval["approvedBy"], approval["ticket"]) == ("alice@example.com", "OPS-4711")
    drop = cp.replace_count(node, EBS, 0)
    assert "Warning" not in drop.stderr
    stored = cp.get_csinode(node)
    assert counts(stored) == {EBS: 0}
    correction = state_of(stored)["drivers"][EBS]["correction"]
    assert (correction["from"], correction["to"], correction["basis"]) == (27, 0, "justification")


def test_a_later_mutating_webhook_on_the_nodes_decrease_is_checked_by_the_validating_webhook(
    control_plane: ControlPlane, guard_factory: Any, tmp_path: Path
) -> None:
    """Another mutating webhook ordered after the guard labels every CSINode update. On the node's own decrease
    (the ``Ignore`` entry) the guard's patch has changed its state, and a changed state routes to the ``Fail``
    entry, which was not called in the first round: so the apiserver does not reinvoke the guard, and the
    validating webhook checks the final object."""
    from tests.k8s.labeler import running_labeler  # noqa: PLC0415

    cp = control_plane
    guard: Guard = guard_factory(fast_policy(tmp_path / "policy.yaml"))
    node = unique("reinvoke")
    cp.create_node(node)
    cp.kubelet(node, "install", "--driver", EBS, "--node-id", "i-re", "--max-volumes", "25")
    with running_labeler(cp, tmp_path / "labeler", guard) as labeler:
        cp.kubelet(node, "update", "--driver", EBS, "--max-volumes", "23")
    stored = cp.get_csinode(node)
    assert counts(stored) == {EBS: 23}
    assert stored["metadata"]["labels"][labeler.label] == "yes"
    assert state_of(stored)["drivers"][EBS]["count"] == 23
    # The registration before it reached the guard too (judged, never refused): only the 25 -> 23 update here.
    records = [r for r in guard.decisions() if r["node"] == node and r.get("old") == 25 and r.get("new") == 23]
    assert [r["endpoint"] for r in records] == ["mutate", "validate"]
    event = wait_until(lambda: [e for e in writes(cp, node) if e["responseStatus"]["code"] == 200][-1:],
                       what="the update audited")[0]
    rounds = sorted(k for k in event["annotations"] if k.startswith("mutation.webhook.admission.k8s.io/"))
    called = [json.loads(event["annotations"][k])["configuration"] for k in rounds]
    assert called == [guard.name, labeler.name]

    # An increase reaches the Fail entry in the first round, so that entry is reinvoked (IfNeeded), once, on the
    # labelled object, and the validating webhook checks the final object.
    cp.kubectl("label", "csinode", node, f"{labeler.label}-")  # so that the labeler changes the object again
    time.sleep(2.1)  # past change-rate's interval of the fast policy
    with running_labeler(cp, tmp_path / "labeler-2", guard) as second:
        cp.kubelet(node, "update", "--driver", EBS, "--max-volumes", "24")
    assert counts(cp.get_csinode(node)) == {EBS: 24}
    records = [r for r in guard.decisions() if r["node"] == node and r.get("old") == 23 and r.get("new") == 24]
    assert [r["endpoint"] for r in records] == ["mutate", "mutate", "validate"]
    event = wait_until(lambda: [e for e in writes(cp, node) if e["responseStatus"]["code"] == 200][-1:],
                       what="the increase audited")[0]
    rounds = sorted(k for k in event["annotations"] if k.startswith("mutation.webhook.admission.k8s.io/"))
    assert [json.loads(event["annotations"][k])["configuration"] for k in rounds] == [guard.name, second.name,
                                                                                       guard.name]
