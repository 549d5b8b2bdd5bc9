"""The GuardPolicy status the leader writes from the replicas' report Leases (webhook/kube/guardpolicy_status.py),
and the policy document a GuardPolicy object is judged as (webhook/kube/guardpolicy.py), with a fixed clock.

The apiserver round trip (two guards, kubectl get) is tests/k8s/test_guardpolicy.py.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import yaml

from webhook.admission.policy import PolicyError, bundled_policy_path, load_policy
from webhook.kube.guardpolicy import parse_guardpolicy, policy_document
from webhook.kube.guardpolicy_status import (
    REPORT_EXPIRY,
    ReplicaReport,
    enforcement_summary,
    guardpolicy_status,
    live_reports,
    report_lease,
    report_lease_name,
)

NOW = datetime(2026, 12, 4, 12, 0, 0, tzinfo=UTC)


def _object(generation: int, status: dict[str, Any] | None = None) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(bundled_policy_path().read_text("utf-8"))
    doc["metadata"] = {"name": "default", "generation": generation, "resourceVersion": "42", "uid": "u",
                       "managedFields": [{"manager": "kubectl"}]}
    if status is not None:
        doc["status"] = status
    return doc


def _conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status["conditions"]}


def test_a_guardpolicy_object_hashes_as_the_file_it_was_applied_from() -> None:
    obj = _object(3, status={"observedGeneration": 2})
    assert parse_guardpolicy(obj).hash == load_policy(None).hash
    assert set(policy_document(obj)) == {"apiVersion", "kind", "metadata", "spec"}
    assert parse_guardpolicy(obj).source == "guardpolicy/default generation 3"


def test_every_replica_on_the_generation_is_enforced() -> None:
    policy = load_policy(None)
    reports = [ReplicaReport(r, 3, policy.hash, "guardpolicy/default generation 3") for r in ("a", "b")]
    status = guardpolicy_status(_object(3), policy, reports, NOW)
    conditions = _conditions(status)
    assert conditions["Accepted"]["status"] == "True" and conditions["Enforced"]["status"] == "True"
    assert status["replicas"] == "2/2" and status["policyHash"] == policy.hash and status["observedGeneration"] == 3
    assert status["enforcement"] == "deny 5, clamp 1"
    assert [p["id"] for p in status["byPod"]] == ["a", "b"]


def test_a_replica_behind_is_pending_and_named() -> None:
    policy = load_policy(None)
    reports = [ReplicaReport("a", 3, policy.hash, "x"), ReplicaReport("b", 2, "old", "x")]
    status = guardpolicy_status(_object(3), policy, reports, NOW)
    enforced = _conditions(status)["Enforced"]
    assert enforced["status"] == "False" and enforced["reason"] == "Pending"
    assert "b serves 2" in enforced["message"] and status["replicas"] == "1/2"


def test_a_refused_generation_says_where_and_keeps_the_transition_time_while_it_stays() -> None:
    error = PolicyError("guardpolicy/default generation 4", "$.spec.defaults.ceiling.profile", "not found")
    reports = [ReplicaReport("a", 3, "h3", "x", error="generation 4 refused")]
    first = guardpolicy_status(_object(4), error, reports, NOW)
    accepted = _conditions(first)["Accepted"]
    assert accepted["status"] == "False" and accepted["reason"] == "Invalid"
    assert accepted["message"] == "at $.spec.defaults.ceiling.profile: not found"
    assert _conditions(first)["Enforced"]["reason"] == "Refused" and first["replicas"] == "0/1"
    later = guardpolicy_status(_object(4, first), error, reports, NOW + timedelta(minutes=5))
    assert _conditions(later)["Accepted"]["lastTransitionTime"] == accepted["lastTransitionTime"]


def test_no_reports_is_unknown() -> None:
    status = guardpolicy_status(_object(1), load_policy(None), [], NOW)
    assert _conditions(status)["Enforced"]["status"] == "Unknown" and status["replicas"] == "0/0"


def test_a_report_not_renewed_within_its_duration_is_left_out() -> None:
    fresh = report_lease("ns", "default", ReplicaReport("pod-a", 2, "h", "s"), NOW - timedelta(seconds=10))
    stale = report_lease("ns", "default", ReplicaReport("pod-b", 2, "h", "s"),
                         NOW - timedelta(seconds=REPORT_EXPIRY + 1))
    assert [r.replica for r in live_reports([fresh, stale], NOW)] == ["pod-a"]
    assert live_reports([fresh], NOW)[0] == ReplicaReport("pod-a", 2, "h", "s")


def test_report_lease_names_are_dns_subdomains() -> None:
    assert report_lease_name("vm_1234") == "csinode-guard-policy-vm-1234"
    assert report_lease_name("csinode-guard-7d9f-abcde") == "csinode-guard-policy-csinode-guard-7d9f-abcde"


def test_the_summary_says_scoped() -> None:
    doc = yaml.safe_load(bundled_policy_path().read_text("utf-8"))
    doc["spec"]["enforcementScope"] = {"nodeSelector": {"matchLabels": {"x": "y"}}}
    doc["spec"]["rules"]["change-rate"]["enforcementAction"] = "dryrun"
    policy = parse_guardpolicy(doc)
    assert enforcement_summary(policy) == "deny 4, clamp 1, dryrun 1 (scoped)"
