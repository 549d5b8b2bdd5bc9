"""The audit's pure parts: the judgement of a stored CSINode (webhook.admission.standing), the increases a CSINode
watch sees (webhook.kube.watch.csinodes) and the one cluster budget counted from them
(webhook.serving.cluster_budget). The bundled policy from policies/ is the policy judged."""

from __future__ import annotations

import copy
import time
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest

from webhook.admission.cluster import StaticClusterView
from webhook.admission.csinode import INT32_MAX, parse_csinode
from webhook.admission.policy import PolicyError, load_policy, parse_policy
from webhook.admission.standing import (
    ReconcileMode,
    audit_record,
    judge_standing,
    lowered_object,
    reconcile_mode,
)
from webhook.admission.state import (
    STATE_ANNOTATION,
    Correction,
    EntryState,
    GuardState,
    PinnedLabel,
    StateKeys,
    decode_state,
    encode_state,
)
from webhook.kube.repair import RepairResult, repair_csinode
from webhook.kube.watch.csinodes import CSINodeStore, IncreaseLedger, make_parser, watched_increases
from webhook.serving.cluster_budget import WatchedIncreaseBudget

EBS = "ebs.csi.aws.com"
UID = "6a0c3f0e-1b2d-4c5e-8f9a-0b1c2d3e4f5a"
NOW = datetime(2026, 12, 2, 10, 0, tzinfo=UTC)
KEYS = StateKeys([b"standing-test-key-0123456789abcd"])
M6I = {"node.kubernetes.io/instance-type": "m6i.large"}  # the profile's unlisted-Nitro ceiling: 27
POLICY = load_policy()


def csinode(count: int | None, state: GuardState | None = None, *, raw_state: str | None = None,
            uid: str = UID) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": EBS, "nodeID": "i-1"}
    if count is not None:
        entry["allocatable"] = {"count": count}
    annotations = {}
    if state is not None:
        annotations[STATE_ANNOTATION] = encode_state(state, KEYS)
    if raw_state is not None:
        annotations[STATE_ANNOTATION] = raw_state
    return {"metadata": {"name": "node-a", "uid": uid, "resourceVersion": "7", "annotations": annotations},
            "spec": {"drivers": [entry]}}


def judge(obj: dict[str, Any], labels: dict[str, str] | None = M6I, policy: Any = POLICY,
          newest_sequence: int | None = None) -> Any:
    node = parse_csinode(obj)
    decoded = decode_state(node.annotations.get(STATE_ANNOTATION), node.uid, KEYS)
    cluster = StaticClusterView(
        nodes={} if labels is None else {"node-a": {"labels": labels}},
        state_sequences={} if newest_sequence is None else {UID: newest_sequence},
    )
    return judge_standing(node, decoded, policy, cluster, NOW, KEYS)


def accepted(count: int | None, **fields: Any) -> GuardState:
    return GuardState(uid=UID, entries={EBS: EntryState(count=count, changed_at=NOW - timedelta(hours=2), **fields)})


@pytest.mark.parametrize(
    ("count", "state", "allowed", "why"),
    [
        pytest.param(39, None, 27, "above the ceiling 27",
                     id="a count above the ceiling with no state is lowered to it"),
        pytest.param(39, accepted(25), 27, "above the ceiling 27",
                     id="a count above the ceiling and above the accepted count is lowered to the ceiling"),
        pytest.param(None, accepted(25), 25, "removed (unbounded) after being bounded",
                     id="unbounded after an accepted bounded count goes back to the accepted count"),
        pytest.param(None, None, 27, "registered without a count",
                     id="unbounded with no history goes to the finite ceiling"),
        pytest.param(INT32_MAX, accepted(20), 20, "2147483647",
                     id="int32 max goes back to the accepted count"),
        pytest.param(26, accepted(5), 21, "larger than maxStepUp 16",
                     id="a rise over the accepted count beyond maxStepUp goes to the step"),
    ],
)
def test_standing_counts_the_rules_no_longer_allow_are_found_with_the_count_they_allow(
    count: int | None, state: GuardState | None, allowed: int, why: str
) -> None:
    judgement = judge(csinode(count, state))
    assert judgement.targets == {EBS: allowed}
    assert any(why in f.why and f.repairable for f in judgement.findings), judgement.findings


def test_a_frozen_entry_above_its_accepted_count_is_lowered_to_it() -> None:
    state = accepted(20, frozen_until=NOW + timedelta(hours=1))
    judgement = judge(csinode(24, state))
    assert judgement.targets == {EBS: 20}
    assert [f.rule for f in judgement.findings] == ["count-rollback"]


def test_undoing_a_recent_correction_is_held_to_the_recovery_step() -> None:
    corr = Correction(at=NOW - timedelta(minutes=10), before=25, after=10, basis="resource-exhausted")
    state = GuardState(uid=UID, entries={EBS: EntryState(count=10, changed_at=NOW - timedelta(minutes=10),
                                                          correction=corr)})
    judgement = judge(csinode(25, state))
    assert judgement.targets == {EBS: 12}, judgement.findings  # accepted 10 + recoveryStep 2


@pytest.mark.parametrize(
    ("count", "state"),
    [
        pytest.param(27, None, id="at the ceiling"),
        pytest.param(20, accepted(25), id="below the accepted count: the safe direction"),
        pytest.param(0, accepted(25), id="a drop to 0 is never raised by the audit"),
        pytest.param(22, accepted(20), id="a small rise over the accepted count within every rule"),
    ],
)
def test_what_the_rules_allow_is_left_alone(count: int, state: GuardState | None) -> None:
    judgement = judge(csinode(count, state))
    assert judgement.findings == () and judgement.targets == {}


@pytest.mark.parametrize("reported", [40, 128])
def test_a_label_the_node_set_while_the_guard_was_down_raises_no_ceiling_of_the_audit(reported: int) -> None:
    """Attack 4: the ceiling pinned at m6i.large (27); the node relabels itself c7i.48xlarge (the profile's 128)
    and registers ``reported`` unjudged. The audit judges with the pin, as admission does: 27, never the new
    label's 128 nor the step over the accepted count (27 + maxStepUp 16 = 43)."""
    state = accepted(27, pinned=PinnedLabel("node.kubernetes.io/instance-type", "m6i.large"))
    judgement = judge(csinode(reported, state), labels={"node.kubernetes.io/instance-type": "c7i.48xlarge"})
    assert judgement.targets == {EBS: 27}
    assert any("pinned" in f.why and f.allowed == 27 and f.repairable for f in judgement.findings), judgement


def test_a_ceiling_tightened_under_an_accepted_count_is_found() -> None:
    doc = dict(POLICY.document)
    drivers = {**doc["spec"]["drivers"], EBS: {**doc["spec"]["drivers"][EBS], "ceiling": {"max": 20, "unknown": 20}}}
    policy = parse_policy({**doc, "spec": {**doc["spec"], "drivers": drivers}})
    judgement = judge(csinode(25, accepted(25)), labels=None, policy=policy)
    assert judgement.targets == {EBS: 20}
    assert [f.rule for f in judgement.findings] == ["count-ceiling"]


def test_an_unknown_node_gets_the_unknown_nodes_ceiling() -> None:
    assert judge(csinode(39), labels=None).targets == {EBS: 27}


def test_a_warn_or_dryrun_ceiling_is_reported_and_never_repaired() -> None:
    doc = dict(POLICY.document)
    doc["spec"] = {**doc["spec"], "rules": {**doc["spec"]["rules"], "count-ceiling": {"enforcementAction": "warn"}}}
    policy = parse_policy(doc)
    judgement = judge(csinode(39), policy=policy)
    assert judgement.targets == {}
    assert [(f.rule, f.repairable) for f in judgement.findings] == [("count-ceiling", False)]


def test_a_node_outside_the_enforcement_scope_is_reported_only() -> None:
    doc = dict(POLICY.document)
    doc["spec"] = {**doc["spec"], "enforcementScope": {"nodeSelector": {"matchLabels": {"canary": "true"}}}}
    judgement = judge(csinode(39), policy=parse_policy(doc))
    assert judgement.targets == {} and judgement.findings[0].repairable is False


@pytest.mark.parametrize(
    ("raw", "newest", "why"),
    [
        pytest.param(None, 3, "is gone", id="a state seen before and now gone"),
        pytest.param('{"v":1}', None, "not usable (malformed", id="an edited state"),
    ],
)
def test_state_problems_are_reported_on_the_object(raw: str | None, newest: int | None, why: str) -> None:
    judgement = judge(csinode(20, raw_state=raw), newest_sequence=newest)
    [finding] = judgement.findings
    assert finding.rule == "state-integrity" and finding.driver is None and why in finding.why
    assert not finding.repairable


def test_no_state_on_an_object_never_judged_is_normal() -> None:
    assert judge(csinode(20)).findings == ()


def test_lowering_never_raises_and_keeps_every_other_field() -> None:
    obj = csinode(39)
    obj["spec"]["drivers"].append({"name": "other.csi.io", "nodeID": "x", "allocatable": {"count": 3}})
    lowered, changed = lowered_object(obj, {EBS: 27, "other.csi.io": 10, "gone.csi.io": 1})
    assert changed == {EBS: 27}
    assert lowered["spec"]["drivers"][0] == {"name": EBS, "nodeID": "i-1", "allocatable": {"count": 27}}
    assert lowered["spec"]["drivers"][1]["allocatable"] == {"count": 3}
    assert lowered["metadata"] == obj["metadata"], "resourceVersion kept: the write is conditional"
    assert obj["spec"]["drivers"][0]["allocatable"] == {"count": 39}, "the input is not modified"
    unbounded, changed = lowered_object(csinode(None), {EBS: 27})
    assert changed == {EBS: 27} and unbounded["spec"]["drivers"][0]["allocatable"] == {"count": 27}


class _AdmittingApiserver:
    """The apiserver as a repair sees it, for one CSINode: GET returns the stored object; PUT stores the object
    after a mutating webhook that holds ``driver`` at ``held`` at most (as the guard's own admission may hold a
    repair below its target), and answers with what it stored."""

    def __init__(self, obj: dict[str, Any], held: int) -> None:
        self.obj = obj
        self.held = held

    def get(self, resource: Any, name: str) -> dict[str, Any]:
        return copy.deepcopy(self.obj)

    def replace(self, resource: Any, obj: dict[str, Any], *, dry_run: bool = False,
                field_manager: str | None = None) -> dict[str, Any]:
        stored = copy.deepcopy(obj)
        for entry in stored["spec"]["drivers"]:
            count = (entry.get("allocatable") or {}).get("count")
            if entry["name"] == EBS and (count is None or count > self.held):
                entry["allocatable"] = {"count": self.held}
        if not dry_run:
            self.obj = stored
        return stored


def test_a_repair_reports_the_count_the_update_stored_not_the_target_it_sent() -> None:
    apiserver = _AdmittingApiserver(csinode(128), held=27)
    outcome = repair_csinode(cast(Any, apiserver), "node-a", lambda obj: {EBS: 43})
    assert outcome.result is RepairResult.REPAIRED
    assert outcome.lowered == {EBS: 43}, "the target sent"
    assert outcome.stored == {EBS: 27}, "what etcd holds: the audit's record and Event say this"
    assert apiserver.obj["spec"]["drivers"][0]["allocatable"] == {"count": 27}


def test_reconcile_is_a_policy_field_with_clamp_as_the_bundled_default_and_report_the_opt_out() -> None:
    # What fails open must not stay: writes under failurePolicy Ignore pair with an audit that lowers.
    assert reconcile_mode(POLICY) is ReconcileMode.CLAMP
    doc = dict(POLICY.document)
    unsaid = {k: v for k, v in doc["spec"].items() if k != "reconcile"}
    assert reconcile_mode(parse_policy({**doc, "spec": unsaid})) is ReconcileMode.CLAMP, "absent: clamp"
    assert reconcile_mode(parse_policy({**doc, "spec": {**doc["spec"], "reconcile": "report"}})) is \
        ReconcileMode.REPORT
    with pytest.raises(PolicyError, match=r"\$\.spec\.reconcile"):
        parse_policy({**doc, "spec": {**doc["spec"], "reconcile": "repair"}})


def test_an_audit_record_says_it_comes_from_the_audit_not_a_request() -> None:
    [finding] = judge(csinode(39)).findings
    record = audit_record(finding, now=NOW, trigger="interval", policy_hash="h", policy_generation=2,
                          decision="repaired", final=27)
    assert {k: record[k] for k in ("source", "endpoint", "uid", "user", "node", "driver", "old", "new", "final",
                                   "trigger", "decision")} == {
        "source": "audit", "endpoint": "audit", "uid": None, "user": None, "node": "node-a", "driver": EBS,
        "old": 39, "new": 27, "final": 27, "trigger": "interval", "decision": "repaired"}
    assert record["rules"][0]["rule"] == "count-ceiling" and record["rules"][0]["effective"] == "clamp"


# --- the CSINode watch's increases and the one cluster budget ------------------------------------------------


def record(count: int, changed: datetime, *, uid: str = UID, key: StateKeys = KEYS) -> Any:
    state = GuardState(uid=uid, entries={EBS: EntryState(count=count, changed_at=changed)})
    obj = csinode(count, uid=uid)
    obj["metadata"]["annotations"][STATE_ANNOTATION] = encode_state(state, key)
    return make_parser(KEYS)(obj)


def test_an_accepted_increase_is_seen_from_one_version_to_the_next() -> None:
    t1, t2 = NOW - timedelta(seconds=30), NOW
    assert watched_increases(record(10, t1), record(12, t2)) == [t2.timestamp()]
    assert watched_increases(record(12, t1), record(10, t2)) == [], "a decrease is not an increase"
    assert watched_increases(record(10, t1), record(10, t1)) == [], "no new change"
    assert watched_increases(None, record(12, t2)) == [], "a first sight shows no transition"
    assert watched_increases(record(10, t1, uid="other"), record(12, t2)) == [], "another object"
    forged = record(12, t2, key=StateKeys([b"not-the-guards-key-0123456789abc"]))
    assert forged.decoded.state is None and watched_increases(record(10, t1), forged) == [], "unverified"


def test_the_store_feeds_the_ledger_on_events_and_relists() -> None:
    ledger = IncreaseLedger()
    store = CSINodeStore(ledger)
    now = datetime.now(UTC)
    store.replace({"node-a": record(10, now - timedelta(minutes=5))})
    assert ledger.total == 0
    store.upsert("node-a", record(12, now))
    store.replace({"node-a": record(14, now + timedelta(seconds=1))})  # an increase missed between relists
    assert ledger.total == 2 and ledger.since(time.time() - 60) == 2
    assert store.relists == 2


def test_one_budget_counts_every_replicas_increases_and_its_own_until_the_watch_shows_them() -> None:
    ledger = IncreaseLedger()
    budget = WatchedIncreaseBudget(rate=1.0, burst=3, ledger=ledger)  # window 3 s
    other = WatchedIncreaseBudget(rate=1.0, burst=3, ledger=ledger)  # another replica on the same watch
    clock = time.monotonic()
    assert budget.take(2, clock)
    assert budget.available(clock) == 1
    ledger.add([time.time(), time.time()])  # the watch shows those two
    assert budget.available(clock) == 1, "matched, not counted twice"
    assert other.available(clock) == 1, "the other replica counts them too"
    assert other.take(1, clock)
    ledger.add([time.time()])  # once the watch shows the other replica's increase, the window is full for both
    assert not budget.take(1, clock + 0.01) and not other.take(1, clock + 0.01)
    unseen = WatchedIncreaseBudget(rate=1.0, burst=3, ledger=IncreaseLedger(), pending_ttl=0.5)
    assert unseen.take(3, clock) and unseen.available(clock) == 0
    assert unseen.available(clock + 0.6) == 3, "an admitted increase never stored stops counting"


def test_the_watched_budget_counts_a_nodes_share_across_replicas_and_skips_drivers_without_a_csidriver() -> None:
    """Issue 32, attack 8, across replicas: the ledger keeps the node and driver of each watched increase, so every
    replica counts a node's share the same way; a driver without a CSIDriver object draws nothing."""
    ledger = IncreaseLedger()
    invented = {"fake.example.com"}
    budget = WatchedIncreaseBudget(rate=5.0, burst=50, ledger=ledger, uncounted=lambda d: d in invented)
    other = WatchedIncreaseBudget(rate=5.0, burst=50, ledger=ledger, uncounted=lambda d: d in invented)
    clock = time.monotonic()
    assert budget.admit("node-a", 8, clock) == 5  # its share: 50 // 10
    ledger.add([time.time()] * 5, "node-a", ["ebs.csi.aws.com"] * 5)  # the watch shows them
    assert other.admit("node-a", 1, clock) == 0, "the other replica sees node-a's share spent"
    assert other.admit("node-b", 1, clock) == 1
    ledger.add([time.time()] * 50, "node-c", ["fake.example.com"] * 50)
    assert budget.available(clock) == 45 - 0, "invented drivers' increases are not counted"
    assert budget.node_used("node-c", clock) == 0
    watched = IncreaseLedger()
    store = CSINodeStore(watched)
    now = datetime.now(UTC)
    before = record(10, now - timedelta(minutes=5))
    store.replace({before.csinode.name: before})
    store.upsert(before.csinode.name, record(12, now))
    assert watched.since(time.time() - 60, before.csinode.name) == 1, "the store records the CSINode's name"
    assert watched.since(time.time() - 60, "node-z") == 0
    assert watched.since(time.time() - 60, uncounted=lambda d: d == EBS) == 0
