"""Replay equals live: the apiserver's own audit log, fed to ``csinode-guard replay`` with the same policy, gives
every decision the live guard took, and the counts replay ends with are the counts stored in etcd.

This is what lets an operator trust ``replay`` on their own cluster's audit log before enforcing a policy.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from tests.k8s.controlplane import ControlPlane, Guard, counts, csinode_writes, fast_policy, unique, wait_until

EBS = "ebs.csi.aws.com"
JUSTIFICATION = "csinode-guard.io/justification"


def writes_through(cp: ControlPlane, node: str) -> None:
    """The story's writes: decrease, too-fast increase (the node's kubelet's: held at the stored count), a
    stranger's increase (denied), clamp, unbounded, justified drop."""
    cp.kubelet(node, "install", "--driver", EBS, "--node-id", "i-replay", "--max-volumes", "25")
    cp.kubelet(node, "update", "--driver", EBS, "--max-volumes", "23")
    cp.kubelet(node, "update", "--driver", EBS, "--max-volumes", "24")  # too fast: held at 23
    refused = cp.replace_count(node, EBS, 26, kubeconfig=cp.kubeconfig, check=False)  # the admin: writer-identity
    assert refused.returncode != 0 and "writer-identity" in refused.stderr, refused.stderr
    time.sleep(2.5)
    cp.kubelet(node, "update", "--driver", EBS, "--max-volumes", "39")  # clamped to 27
    time.sleep(2.5)
    cp.kubelet(node, "update", "--driver", EBS, "--max-volumes", "0")  # unbounded: clamped back
    expires = (datetime.now(UTC) + timedelta(hours=2)).strftime("%Y-%m-%dT%H:%M:%SZ")
    justification = [{"driver": EBS, "reason": "retirement", "minCount": 0, "maxCount": 0, "expires": expires}]
    cp.kubectl("annotate", "csinode", node, f"{JUSTIFICATION}={json.dumps(justification)}",
               kubeconfig=cp.approver_kubeconfig())
    cp.replace_count(node, EBS, 0)


def test_replay_of_the_apiservers_audit_log_equals_the_live_decisions_and_etcd(
    control_plane: ControlPlane, guard_factory: Any, tmp_path: Path
) -> None:
    cp = control_plane
    policy = fast_policy(tmp_path / "policy.yaml")
    guard: Guard = guard_factory(policy)
    node = unique("replay")
    cp.create_node(node)
    writes_through(cp, node)
    live = [r for r in guard.decisions() if r.get("node") == node and r["endpoint"] == "mutate"]
    assert len(live) >= 8, live
    # every write of the node is in the apiserver's log before it is read (kubelet's CREATE and the
    # registration reach the guard too: one mutate record per write)
    wait_until(lambda: len(cp.audit_events(csinode_writes(node))) >= len(live), what="all writes audited")

    out = guard.csinode_guard("replay", "--audit-log", str(cp.audit_log), "--policy", str(policy),
                              "-o", "json", "--no-progress")
    replayed = [r for r in json.loads(out.stdout)["events"] if r["node"] == node]

    def decision(record: dict[str, Any]) -> tuple[Any, ...]:
        return tuple(record.get(k) for k in ("driver", "old", "new", "final", "decision", "user"))

    def live_decision(record: dict[str, Any]) -> tuple[Any, ...]:
        # replay's rows show a new entry's registration as "registered" where the audit record has no old count
        if record.get("registration") and record.get("old") is None:
            record = dict(record, old="registered")
        return decision(record)

    assert live[0]["operation"] == "CREATE" and live[1]["registration"] is True
    assert [decision(r) for r in replayed] == [live_decision(r) for r in live], (
        json.dumps([decision(r) for r in replayed]) + "\n" + json.dumps([live_decision(r) for r in live]))
    assert {r["decision"] for r in live} >= {"allow", "deny", "clamp"}
    finals = {r["driver"]: r["final"] for r in replayed if r["driver"] and r["decision"] != "deny"}
    assert finals == counts(cp.get_csinode(node)) == {EBS: 0}
