"""Replay equals live: the apiserver's own audit log, fed to ``csinode-guard replay`` with the same policy, gives
every decision the live guard took, and the counts replay ends with are the counts stored in etcd.

This is what lets an operator trust ``replay`` on their own cluster's audit log before enforcing a policy.
"""

from __future__ import annotations

import contextlib
import json
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from tests.k8s.attachments import attach_error
from tests.k8s.controlplane import (
    ADMIN_USER,
    ControlPlane,
    Guard,
    counts,
    csinode_writes,
    fast_policy,
    running_guard,
    unique,
    wait_until,
)
from tests.k8s.test_brake import (
    NAMESPACE,
    brake_policy,
    brakes,
    engaged,
    ensure_namespace,
    rollout,
    start_guard,
    stored,
    update,
)
from webhook.admission.brake import BRAKES_OBJECT
from webhook.admission.state import format_time, parse_time

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



def test_replay_of_the_apiservers_audit_log_engages_the_brake_and_holds_as_the_live_leader_did(
    full_facts_cluster: ControlPlane, tmp_path: Path
) -> None:
    """The brake (issue 35) on the real apiserver, then replayed from its own audit log: a rollout raises the
    driver's count 20 -> 30 on six nodes (admitted), errorCode 8 on three of them (the external-attacher's status
    writes), the live leader engages the brake and restores 20 (``reconcile: clamp``), and every node's kubelet then
    reports 34, held at 20. The apiserver logs with docs/apiserver-audit-policy.yaml (``full_facts_cluster``: the
    VolumeAttachments with their objects; the session's cluster logs them at Metadata level, where no brake engages
    in a replay). Replay with the same policy engages the brake on the same evidence and takes every decision the
    live guard took, the held increases included.

    Where replay and the live guard legitimately differ, and what is asserted instead:

    - **When the brake engages.** The leader decides at each audit pass; replay decides before every CSINode write
      it judges and after every VolumeAttachment event (docs/guardpolicy.md, "Replay and the audit log"). No
      CSINode write comes between the last failure and the leader's pass, so no decision differs, but replay's
      summary reports the engagement at the attach error that completed the evidence (the third): at or before
      the live ``engagedAt``.
    - **The restore.** Replay does not repair; the leader's repairs are the guard's own writes (``test-admin``,
      a listed writer) in the log, and replay judges them as the live guard's webhook did: under the brake the
      entry is judged from the count trusted before the increase (20), which the repair writes, so the write
      changes no trusted count: a row without a driver, ``allow``. The counts follow the log, so each node's next
      row (the held 34) starts from the restored 20, and its final count is the one etcd stores.
    """
    cp = full_facts_cluster
    ensure_namespace(cp)
    driver = f"{unique('replaybrake')}.csi.example.com"
    policy = brake_policy(tmp_path / "policy.yaml")
    with contextlib.ExitStack() as stack:
        guard = start_guard(
            lambda path, **kw: stack.enter_context(running_guard(cp, tmp_path / "guard", path, **kw)), policy
        )
        # After the guard stopped (callbacks run last first): the brakes' record, then the VolumeAttachments.
        stack.callback(cp.kubectl, "delete", "configmap", "-n", NAMESPACE, BRAKES_OBJECT, "--ignore-not-found")
        vas: list[str] = []
        stack.callback(lambda: [cp.kubectl("delete", "volumeattachment", va, "--ignore-not-found") for va in vas])
        nodes = rollout(cp, driver)
        vas += [attach_error(cp, node, driver, 8) for node in nodes[:3]]
        wait_until(lambda: engaged(guard, driver), timeout=60, interval=1, what="the brake to engage")
        wait_until(lambda: all(stored(cp, n, driver) == 20 for n in nodes), timeout=60, interval=0.5, what="restored")
        for node in nodes:  # each node's kubelet reports 34 once: held at the restored count
            update(cp, node, driver, 34)
        live_brake = brakes(guard)[driver]
        etcd = {node: stored(cp, node, driver) for node in nodes}
        assert etcd == dict.fromkeys(nodes, 20)
        live = {n: [r for r in guard.decisions() if r.get("node") == n and r["endpoint"] == "mutate"] for n in nodes}
        wait_until(
            lambda: all(len(cp.audit_events(csinode_writes(n))) >= len(live[n]) for n in nodes),
            what="every write of the nodes audited",
        )

        out = guard.csinode_guard(
            "replay", "--audit-log", str(cp.audit_log), "--policy", str(policy), "-o", "json", "--no-progress"
        )
    doc = json.loads(out.stdout)
    assert doc["summary"]["missingFacts"] == [], out.stderr
    replayed = {n: [r for r in doc["events"] if r["node"] == n] for n in nodes}

    def decision(record: dict[str, Any]) -> tuple[Any, ...]:
        if record.get("registration") and record.get("old") is None:  # replay's rows say "registered"
            record = dict(record, old="registered")
        return tuple(record.get(k) for k in ("driver", "old", "new", "final", "decision", "user"))

    # Every decision of the live guard, in order, on every node: the rollout, the restore, the held increase.
    for node in nodes:
        assert [decision(r) for r in replayed[node]] == [decision(r) for r in live[node]], node
    for node in nodes:
        *_, restore, held = replayed[node]
        assert (restore["user"], restore["driver"], restore["decision"]) == (ADMIN_USER, None, "allow"), restore
        assert (held["old"], held["new"], held["final"], held["decision"]) == (20, 34, 20, "clamp"), held
        assert held["rules"] == ["count-rollback"] and held["user"] == f"system:node:{node}"
    # The restore in the log is the guard's write of 20: the count replay goes on from, and etcd's.
    events = {e["auditID"]: e for e in cp.audit_events(lambda e: e.get("stage") == "ResponseComplete")}
    for node in nodes:
        restore = replayed[node][-2]
        assert counts(events[restore["auditID"]]["responseObject"])[driver] == 20
    finals = {n: next(r["final"] for r in reversed(replayed[n]) if r["driver"] == driver) for n in nodes}
    assert finals == etcd

    # The brake: engaged once for the driver, on the live evidence.
    [engagement] = [b for b in doc["summary"]["brakes"] if b["driver"] == driver]
    assert engagement["engaged"] is True
    assert "on 3 of 6 nodes" in engagement["message"]
    assert {e["volumeAttachment"] for e in live_brake["evidence"]} == set(vas)
    assert all(va in engagement["message"] for va in vas), engagement["message"]
    # When: at the attach error that completed the evidence (the last of the three), before the live leader's pass.
    attach_writes = [
        e
        for e in events.values()
        if (e.get("objectRef") or {}).get("resource") == "volumeattachments"
        and (e["objectRef"].get("name") in vas and e["objectRef"].get("subresource") == "status")
    ]
    assert len(attach_writes) == 3
    last_failure = max(parse_time(e["requestReceivedTimestamp"]) for e in attach_writes)
    assert engagement["time"] == format_time(last_failure)
    assert last_failure <= parse_time(live_brake["engagedAt"])
