"""``webhook.admission.capacity``: the status table from plain listed objects (no cluster; tests/k8s/test_status.py runs
the command against the real apiserver)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from webhook.admission.capacity import build_report, format_table, report_json
from webhook.admission.policy import load_policy
from webhook.admission.state import Correction, EntryState, GuardState, StateKeys, encode_state

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
EBS = "ebs.csi.aws.com"
KEYS = StateKeys([b"s" * 32])
OTHER_KEYS = StateKeys([b"o" * 32])


def csinode(name: str, *drivers: tuple[str, int | None], state: GuardState | None = None,
            keys: StateKeys = KEYS) -> dict[str, Any]:
    listed = []
    for driver, count in drivers:
        entry: dict[str, Any] = {"name": driver, "nodeID": f"i-{name}"}
        if count is not None:
            entry["allocatable"] = {"count": count}
        listed.append(entry)
    meta: dict[str, Any] = {"name": name, "uid": f"uid-{name}"}
    if state is not None:
        meta["annotations"] = {"csinode-guard.io/state": encode_state(state, keys)}
    return {"metadata": meta, "spec": {"drivers": listed or None}}


def node(name: str, instance_type: str | None = None) -> dict[str, Any]:
    labels = {"node.kubernetes.io/instance-type": instance_type} if instance_type else {}
    return {"metadata": {"name": name, "labels": labels}}


def va(node_name: str, *, attached: bool = True, code: int | None = None, age: timedelta = timedelta(minutes=1),
       attacher: str = EBS) -> dict[str, Any]:
    status: dict[str, Any] = {"attached": attached}
    if code is not None:
        status["attachError"] = {"time": (NOW - age).isoformat().replace("+00:00", "Z"), "errorCode": code,
                                 "message": "rpc error"}
    return {"spec": {"attacher": attacher, "nodeName": node_name}, "status": status}


def pending_pod(nominated: str | None, message: str) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}]}
    if nominated:
        status["nominatedNodeName"] = nominated
    return {"metadata": {"name": "p"}, "status": status}


@pytest.fixture(scope="module")
def policy() -> Any:
    return load_policy()


def test_rows_carry_count_ceiling_usage_and_sort_by_least_headroom(policy: Any) -> None:
    state = GuardState(uid="uid-a", entries={EBS: EntryState(count=20, changed_at=NOW - timedelta(minutes=5),
                                                             writer_version="v1.37.0")})
    report = build_report(
        [csinode("a", (EBS, 20), state=state), csinode("b", (EBS, 30)), csinode("c", (EBS, None)),
         csinode("empty")],
        [node("a", "m7i.48xlarge"), node("b", "m5.large")],
        [va("a"), va("a"), va("a", attached=False), va("b"), va("a", attacher="other.csi.io")],
        [],
        policy=policy, now=NOW, keys=KEYS,
    )
    # Headroom from the effective allowed count: b's 30 counts as its ceiling 27, c's unbounded as its ceiling.
    assert [(r.node, r.headroom) for r in report.rows] == [("a", 18), ("b", 26), ("c", 27)]
    a, b, c = report.rows
    assert (a.count, a.attached, a.accepted, a.state, a.writer_version) == (20, 2, 20, "verified", "v1.37.0")
    assert a.ceiling == 128
    assert a.ceiling_why == "node.kubernetes.io/instance-type=m7i.48xlarge (profile ebs.csi.aws.com)"
    assert b.ceiling == 27 and b.over_ceiling and b.state == "none"
    assert c.count is None and not c.bounded and c.over_ceiling and c.ceiling_why.endswith("(Node not found)")
    assert report.summary.line() == ("3 nodes, 1 drivers, 3 entries: 0 frozen, 2 over ceiling, headroom 71 "
                                     "(1 unbounded), 3 attached, 0 pods pending on volume limits")


def test_state_is_verified_with_the_key_and_unverified_without(policy: Any) -> None:
    state = GuardState(uid="uid-a", entries={EBS: EntryState(count=20, changed_at=NOW)})
    forged = [csinode("a", (EBS, 20), state=state, keys=OTHER_KEYS)]
    assert build_report(forged, [], [], [], policy=policy, now=NOW, keys=KEYS).rows[0].state == "bad-signature"
    unverified = build_report(forged, [], [], [], policy=policy, now=NOW).rows[0]
    assert (unverified.state, unverified.accepted) == ("unverified", 20)
    copied = csinode("b", (EBS, 20))
    copied["metadata"]["annotations"] = forged[0]["metadata"]["annotations"]  # another object's state
    assert build_report([copied], [], [], [], policy=policy, now=NOW).rows[0].state == "other-object"


def test_frozen_and_corrected_entries_show_until_when(policy: Any) -> None:
    correction = Correction(at=NOW - timedelta(minutes=10), before=25, after=23, basis="resource-exhausted")
    state = GuardState(uid="uid-a", entries={
        EBS: EntryState(count=23, changed_at=NOW - timedelta(minutes=10), frozen_until=NOW + timedelta(hours=2),
                        correction=correction)})
    row = build_report([csinode("a", (EBS, 23), state=state)], [node("a", "m5.large")], [], [],
                       policy=policy, now=NOW, keys=KEYS).rows[0]
    assert row.frozen_until == NOW + timedelta(hours=2)
    assert row.corrected_until == NOW + timedelta(minutes=50) and row.correction == "25->23 (resource-exhausted)"
    text = format_table(build_report([csinode("a", (EBS, 23), state=state)], [], [], [], policy=policy, now=NOW,
                                     keys=KEYS), NOW)
    assert "frozen until 2026-12-01T14:00:00.000Z" in text and "corrected 25->23" in text
    expired = GuardState(uid="uid-a", entries={EBS: EntryState(
        count=23, changed_at=NOW - timedelta(hours=3), frozen_until=NOW - timedelta(seconds=1),
        correction=Correction(at=NOW - timedelta(hours=2), before=25, after=23, basis="justification"))})
    old = build_report([csinode("a", (EBS, 23), state=expired)], [], [], [], policy=policy, now=NOW, keys=KEYS)
    assert old.rows[0].frozen_until is None and old.rows[0].corrected_until is None
    assert old.summary.frozen == 0


def test_attach_errors_by_class_within_the_window_and_pending_pods(policy: Any) -> None:
    attachments = [va("a", attached=False, code=8), va("a", attached=False, code=8), va("a", attached=False, code=7),
                   va("a", attached=False, code=9), va("a", attached=False, code=14),
                   va("a", attached=False, code=2), va("a", attached=False, code=8, age=timedelta(hours=2))]
    pods = [pending_pod("a", "0/3 nodes are available: 3 node(s) exceed max volume count."),
            pending_pod(None, "0/3 nodes are available: 3 node(s) exceed max volume count."),
            pending_pod("a", "0/3 nodes are available: 3 Insufficient cpu.")]
    report = build_report([csinode("a", (EBS, 5))], [], attachments, pods, policy=policy, now=NOW)
    row = report.rows[0]
    assert dict(row.attach_errors) == {"ResourceExhausted": 2, "permission": 1, "topology": 1, "transient": 1,
                                       "other": 1}
    assert row.pending == 1 and report.summary.pending_on_limits == 2
    wide = format_table(report, NOW, wide=True)
    assert "ResourceExhausted=2,permission=1,topology=1,transient=1,other=1" in wide


def test_filters_and_json(policy: Any) -> None:
    objs = [csinode("a", (EBS, 5), ("disk.csi.azure.com", 8)), csinode("b", (EBS, 7))]
    only_b = build_report(objs, [], [], [], policy=policy, now=NOW, node_names={"b"})
    assert [(r.node, r.driver) for r in only_b.rows] == [("b", EBS)]
    azure = build_report(objs, [], [], [], policy=policy, now=NOW, driver_names=["disk.csi.azure.com"])
    assert [(r.node, r.driver) for r in azure.rows] == [("a", "disk.csi.azure.com")]
    doc = report_json(azure)
    assert doc["summary"]["entries"] == 1
    assert doc["entries"][0] == {
        "node": "a", "driver": "disk.csi.azure.com", "allocatableCount": 8, "acceptedCount": None,
        "acceptedAt": None, "writerVersion": None, "state": "none", "ceiling": 16,
        "ceilingReason": "ceiling for unknown node (Node not found)",
        "overCeiling": False, "attachedVolumes": 0, "headroom": 8, "pendingOnVolumeLimits": 0,
        "attachErrors": {}, "frozenUntil": None, "correctedUntil": None, "correction": None,
    }
    assert format_table(build_report([], [], [], [], policy=policy, now=NOW), NOW).endswith(
        "No CSINode driver entries matched.\n")
