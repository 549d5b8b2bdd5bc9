"""Registrations, plugin restarts, CSINode re-creation and reconciliation, judged under the shipped policy.

A node plugin restart (every upgrade or rollback of the driver's DaemonSet) makes kubelet remove the driver from
CSINode and register it again with whatever the new binary reports; kubelet exits when it cannot register. So a
registration is judged — ceilings, and the entry's retained history (version, freeze, correction, the count
before removal) — but only ever clamped, never refused, also by /validate and with a rule set to ``deny``.
Each write goes through /mutate, its patch, /validate and is stored, as the apiserver does it.
"""

from __future__ import annotations

import copy
import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from kube import (
    EBS,
    EBS_NODE_ID,
    KUBELET,
    NODE,
    apply_response,
    base_csinode,
    count_of,
    kubelet_update,
    review,
    with_annotation,
    without_driver,
)

from webhook.admission.cluster import AttachError, StaticClusterView
from webhook.admission.evaluation import AdmissionDecision, Decision, Mode, evaluate
from webhook.admission.policy import EnforcementAction, Policy, bundled_policy_path, load_policy, parse_policy
from webhook.admission.review import build_response, parse_review
from webhook.admission.state import (
    STATE_ANNOTATION,
    EntryState,
    GuardState,
    StateKeys,
    StateProblem,
    decode_state,
    encode_state,
)

KEYS = StateKeys([b"r" * 32])
POLICY = load_policy()
T0 = datetime(2026, 11, 30, 3, 0, tzinfo=UTC)
VERSIONS = "csinode-guard.io/driver-versions"
LABELS = {"node.kubernetes.io/instance-type": "m6i.large"}
CEILING = 27  # the shipped profile's value for this (unlisted Nitro) instance type
STRANGER = ("mallory", ["system:authenticated"])
POLICY_DIR = bundled_policy_path().parent
REPORTER = ("system:serviceaccount:kube-system:version-reporter", ["system:serviceaccounts"])


def cluster(version: str = "v1.37.0") -> StaticClusterView:
    """The node is an m6i.large and the EBS node pod on it runs ``version`` (the shipped pod version source)."""
    return StaticClusterView(nodes={NODE: {"labels": LABELS}}, driver_versions={NODE: {EBS: version}})


def judge(stored: dict[str, Any] | None, new: dict[str, Any], at: timedelta, *, mode: Mode = Mode.MUTATE,
          policy: Policy = POLICY, view: StaticClusterView | None = None, operation: str = "UPDATE",
          user: tuple[str, list[str]] | None = None) -> tuple[AdmissionDecision, dict[str, Any]]:
    username, groups = user if user is not None else (KUBELET, None)
    request = parse_review(json.dumps(review(stored, new, operation=operation, user=username, groups=groups)))
    decision = evaluate(request, policy, view or cluster(), T0 + at, KEYS, mode=mode)
    document = build_response(request.uid, decision.response, allow_patch=mode is Mode.MUTATE)
    final = apply_response(new, document) if mode is Mode.MUTATE and decision.response.allowed else new
    return decision, final


class Node:
    """One stored CSINode; :meth:`put` is the apiserver: /mutate, the patch, /validate, then stored."""

    def __init__(self, obj: dict[str, Any], policy: Policy = POLICY) -> None:
        self.obj = obj
        self.policy = policy
        self.view = cluster()

    def put(self, new: dict[str, Any], at: timedelta, **kwargs: Any) -> AdmissionDecision:
        mutated, final = judge(self.obj, new, at, policy=self.policy, view=self.view, **kwargs)
        if mutated.response.allowed:
            validated, _ = judge(self.obj, final, at, mode=Mode.VALIDATE, policy=self.policy, view=self.view,
                                 **kwargs)
            assert validated.response.allowed, validated.response.message
            self.obj = final
        return mutated

    def restart_plugin(self, count: int | None, at: timedelta, version: str | None = None) -> AdmissionDecision:
        """kubelet's UninstallCSIDriver then InstallCSIDriver: the driver removed, then registered again."""
        removed = self.put(without_driver(self.obj, EBS), at)
        assert removed.response.allowed and removed.decision in (Decision.ALLOW, Decision.SKIP)
        if version is not None:
            self.view = cluster(version)
        return self.put(kubelet_update(self.obj, EBS, count), at)

    @property
    def state(self) -> GuardState:
        found = decode_state(self.obj["metadata"]["annotations"].get(STATE_ANNOTATION), self.obj["metadata"]["uid"],
                             KEYS).state
        assert found is not None
        return found

    @property
    def count(self) -> int | None:
        return count_of(self.obj, EBS)


def registered(count: int = 25) -> Node:
    """A node whose EBS driver (v1.37.0) registered at ``count``, then was lowered to 24 an hour later."""
    node = Node(base_csinode())
    assert node.put(kubelet_update(node.obj, EBS, count), timedelta(0)).response.allowed
    assert node.put(kubelet_update(node.obj, EBS, count - 1), timedelta(hours=1)).decision is Decision.ALLOW
    return node


def test_an_old_driver_that_reports_39_after_a_plugin_restart_keeps_the_last_accepted_count_and_freezes() -> None:
    node = registered(25)

    decision = node.restart_plugin(39, timedelta(hours=2), version="v1.30.0")  # aws-ebs-csi-driver#1139's table

    assert decision.response.allowed is True
    assert decision.decision is Decision.CLAMP
    assert node.count == 24  # the last accepted count, not the ceiling 27
    assert set(decision.fired_rules) == {"writer-version", "count-ceiling"}
    assert any("driver version rolled back v1.37.0 -> v1.30.0" in w for w in decision.response.warnings)
    assert node.state.entries[EBS].frozen_until == T0 + timedelta(hours=8)
    # Frozen: the next increase from the rolled-back driver (an UPDATE, not a registration) is held at the stored
    # count; for the node's own kubelet the freeze's deny acts as a clamp to it.
    frozen = node.put(kubelet_update(node.obj, EBS, 25), timedelta(hours=3))
    assert frozen.decision is Decision.CLAMP
    assert node.count == 24
    assert "count-rollback" in frozen.fired_rules
    assert any("increases are frozen until" in w for w in frozen.response.warnings)


@pytest.mark.parametrize(
    ("count", "final"),
    [
        pytest.param(None, 24, id="without allocatable (max_volumes_per_node 0): the count before removal"),
        pytest.param(2147483647, 24, id="int32 max: the count before removal"),
        pytest.param(128, CEILING, id="above the ceiling"),
        pytest.param(26, 26, id="within the ceiling and maxStepUp"),
    ],
)
def test_a_reregistration_is_judged_from_the_count_before_removal(count: int | None, final: int) -> None:
    node = registered(25)

    decision = node.restart_plugin(count, timedelta(hours=2))

    assert decision.response.allowed is True
    assert node.count == final
    assert node.state.entries[EBS].count == final


@pytest.mark.parametrize(
    ("count", "final"),
    [
        pytest.param(None, CEILING, id="without allocatable: the driver's ceiling"),
        pytest.param(2147483647, CEILING, id="int32 max"),
        pytest.param(128, CEILING, id="above the ceiling"),
        pytest.param(20, 20, id="within the ceiling"),
    ],
)
def test_a_first_registration_is_clamped_to_the_ceiling(count: int | None, final: int) -> None:
    node = Node(base_csinode())

    decision = node.put(kubelet_update(node.obj, EBS, count), timedelta(0))

    assert decision.response.allowed is True
    assert node.count == final
    assert node.state.entries[EBS].count == final
    assert node.state.entries[EBS].writer_version == "v1.37.0"


def test_max_step_up_counts_from_the_count_before_removal() -> None:
    node = Node(base_csinode())
    assert node.put(kubelet_update(node.obj, EBS, 4), timedelta(0)).response.allowed

    decision = node.restart_plugin(26, timedelta(hours=1))

    assert node.count == 4 + 16  # maxStepUp 16 of the shipped policy
    assert decision.fired_rules == ["count-ceiling"]


def test_recovery_after_a_correction_survives_the_removal() -> None:
    node = registered(25)
    node.view.attach_error_list[(NODE, EBS)] = [
        AttachError(code=8, time=T0 + timedelta(hours=2), volume_attachment="csi-0", message="ResourceExhausted")
    ]
    assert node.put(kubelet_update(node.obj, EBS, 20), timedelta(hours=2, minutes=1)).response.allowed
    assert node.state.entries[EBS].correction is not None

    decision = node.restart_plugin(24, timedelta(hours=2, minutes=30))

    assert node.count == 22  # recoveryStep 2 within the window after the correction 24 -> 20
    assert decision.fired_rules == ["count-rollback"]


def test_a_rule_set_to_deny_acts_as_clamp_on_a_registration() -> None:
    doc = copy.deepcopy(POLICY.document)
    doc["spec"]["rules"]["count-ceiling"]["enforcementAction"] = "deny"
    node = Node(base_csinode(), parse_policy(doc, "deny-ceiling.yaml", POLICY_DIR))

    decision = node.put(kubelet_update(node.obj, EBS, 128), timedelta(0))

    assert decision.response.allowed is True
    assert decision.decision is Decision.CLAMP
    assert node.count == CEILING
    # The same policy still holds an increase of an entry that stays at the stored count (its deny acts as a
    # clamp to the stored count for the node's own kubelet, not to the ceiling).
    rising = node.put(kubelet_update(node.obj, EBS, 28), timedelta(hours=1))
    assert rising.decision is Decision.CLAMP
    assert node.count == CEILING
    assert any("count-ceiling deny acts as clamp for the node's kubelet" in n for n in rising.notes)


@pytest.mark.parametrize(
    "stored",
    [
        pytest.param(base_csinode, id="first registration, no state"),
        pytest.param(lambda: without_driver(registered(25).obj, EBS), id="re-registration with history"),
    ],
)
def test_validate_never_refuses_a_registration_that_mutate_did_not_clamp(stored: Any) -> None:
    old = stored()

    decision, _ = judge(old, kubelet_update(old, EBS, 128), timedelta(hours=2), mode=Mode.VALIDATE)

    assert decision.response.allowed is True
    assert decision.decision is Decision.WARN


def test_a_new_node_id_with_a_higher_count_is_a_registration_paced_by_change_rate() -> None:
    # A registration is paced from the entry's last accepted count and time: inside minInterval it keeps the
    # last accepted count (clamped, never refused); the first write after the interval gets the new count.
    node = Node(base_csinode())
    assert node.put(kubelet_update(node.obj, EBS, 24), timedelta(0)).response.allowed
    moved = kubelet_update(node.obj, EBS, 27)
    moved["spec"]["drivers"][-1]["nodeID"] = "i-0fedcba9876543210"  # InstallCSIDriver on a replaced instance

    decision = node.put(moved, timedelta(seconds=5))  # change-rate's minInterval is 60s

    assert decision.response.allowed is True
    assert decision.decision is Decision.CLAMP
    assert node.count == 24
    assert "change-rate" in decision.fired_rules
    assert node.obj["spec"]["drivers"][-1]["nodeID"] == "i-0fedcba9876543210"

    later = node.put(kubelet_update(node.obj, EBS, 27), timedelta(seconds=65))
    assert later.response.allowed is True
    assert node.count == 27


def test_an_increase_with_the_same_node_id_is_still_judged_as_an_increase() -> None:
    node = Node(base_csinode())
    assert node.put(kubelet_update(node.obj, EBS, 24), timedelta(0)).response.allowed
    assert node.obj["spec"]["drivers"][-1]["nodeID"] == EBS_NODE_ID

    decision = node.put(kubelet_update(node.obj, EBS, 27), timedelta(seconds=5))

    # Judged as an increase (change-rate fires; a registration would be exempt), and for the node's own kubelet
    # the deny acts as a clamp to the stored count: kubelet's write (also a re-registration after a kubelet
    # restart, the same PUT) succeeds and the count stays.
    assert decision.decision is Decision.CLAMP
    assert decision.response.allowed is True
    assert decision.fired_rules == ["change-rate"]
    assert [(o.enforcement, o.effective) for o in decision.outcomes if o.result == "violation"] == [
        (EnforcementAction.DENY, EnforcementAction.CLAMP)
    ]
    assert [c.final for c in decision.changes] == [24]
    assert any("change-rate deny acts as clamp for the node's kubelet" in n for n in decision.notes)


def test_a_removal_by_the_nodes_kubelet_is_never_judged() -> None:
    node = registered(25)

    decision = node.put(without_driver(node.obj, EBS), timedelta(hours=2))

    assert decision.response.allowed is True
    assert decision.outcomes == ()
    assert EBS in node.state.entries  # the removed driver keeps its state entry


def test_a_removal_by_a_stranger_is_refused() -> None:
    node = registered(25)

    decision = node.put(without_driver(node.obj, EBS), timedelta(hours=2), user=STRANGER)

    assert decision.response.allowed is False
    assert node.count == 24


# -- reconciliation: what went through while the guard was down ------------------------------------------------


def unjudged(node: Node, new: dict[str, Any]) -> None:
    """A write the apiserver let through without the guard (failurePolicy Ignore, guard down)."""
    node.obj = new


def test_an_unjudged_reregistration_is_judged_from_the_last_accepted_count_at_the_next_write() -> None:
    node = registered(25)
    unjudged(node, without_driver(node.obj, EBS))
    unjudged(node, kubelet_update(node.obj, EBS, 39))

    decision = node.put(kubelet_update(node.obj, EBS, 40), timedelta(hours=2))

    assert decision.response.allowed is True
    assert node.count == CEILING  # judged as 24 -> 40: clamped to the ceiling
    assert any("above the last count csinode-guard accepted (24)" in n for n in decision.notes)


def test_an_unjudged_decrease_counts_as_accepted() -> None:
    node = registered(25)
    unjudged(node, kubelet_update(node.obj, EBS, 10))

    decision = node.put(kubelet_update(node.obj, EBS, 12), timedelta(hours=2))

    assert decision.decision is Decision.ALLOW  # judged 10 -> 12
    assert node.count == 12


def test_a_lower_report_after_an_unjudged_registration_is_never_refused() -> None:
    node = registered(25)
    unjudged(node, kubelet_update(node.obj, EBS, 39))

    decision = node.put(kubelet_update(node.obj, EBS, 38), timedelta(hours=1, seconds=10))  # 24 -> 38 from trust

    assert decision.response.allowed is True  # refusing it would keep 39
    assert node.count == 24


def test_an_entry_the_write_does_not_touch_is_reconciled_too() -> None:
    gce = "pd.csi.storage.gke.io"
    node = registered(25)
    assert node.put(kubelet_update(node.obj, gce, 100), timedelta(hours=1, minutes=1)).response.allowed
    unjudged(node, kubelet_update(node.obj, EBS, 39))

    decision = node.put(kubelet_update(node.obj, gce, 90), timedelta(hours=2))

    assert decision.response.allowed is True
    assert node.count == CEILING
    assert count_of(node.obj, gce) == 90


# -- re-creation -------------------------------------------------------------------------------------------------


def test_a_recreated_csinode_with_128_and_the_old_state_copied_in_is_clamped() -> None:
    old = registered(25).obj
    recreated = kubelet_update(copy.deepcopy(old), EBS, 128)
    recreated["metadata"].pop("uid")  # mutating admission of a CREATE runs before the apiserver sets the UID
    recreated["metadata"].pop("resourceVersion", None)

    decision, final = judge(None, recreated, timedelta(hours=2), operation="CREATE")

    assert decision.response.allowed is True
    assert count_of(final, EBS) == CEILING
    assert STATE_ANNOTATION not in final["metadata"]["annotations"]  # recorded for another UID: removed


def test_a_state_copied_from_another_object_is_ignored_on_update() -> None:
    donor = GuardState(uid="another-uid", entries={EBS: EntryState(128, T0)})
    stored = with_annotation(kubelet_update(base_csinode(), EBS, 128), STATE_ANNOTATION, encode_state(donor, KEYS))
    node = Node(stored)

    node.put(kubelet_update(node.obj, EBS, 120), timedelta(hours=1))

    assert node.count == CEILING


# -- trusted driver versions ------------------------------------------------------------------------------------

ANNOTATION_POLICY_DOC = copy.deepcopy(POLICY.document)
ANNOTATION_POLICY_DOC["spec"]["drivers"][EBS]["versionSource"] = {"type": "annotation"}
ANNOTATION_POLICY_DOC["spec"]["versionReporters"] = {"serviceAccounts": ["kube-system/version-reporter"]}
ANNOTATION_POLICY = parse_policy(ANNOTATION_POLICY_DOC, "annotation-source.yaml", POLICY_DIR)


def declared(node: Node, version: str, at: timedelta) -> AdmissionDecision:
    return node.put(with_annotation(node.obj, VERSIONS, json.dumps({EBS: version})), at, user=REPORTER)


def test_a_version_reporter_declares_versions_and_the_state_records_who() -> None:
    node = Node(kubelet_update(base_csinode(), EBS, 25), ANNOTATION_POLICY)

    assert declared(node, "v1.37.0", timedelta(0)).decision is Decision.ALLOW

    recorded = node.state.declared[EBS]
    assert (recorded.version, recorded.set_by, recorded.set_at) == ("v1.37.0", REPORTER[0], T0)


@pytest.mark.parametrize("forged", ["v9.9.9", None], ids=["a higher version", "the annotation removed"])
def test_the_kubelet_cannot_declare_its_own_version(forged: str | None) -> None:
    node = Node(kubelet_update(base_csinode(), EBS, 25), ANNOTATION_POLICY)
    declared(node, "v1.37.0", timedelta(0))
    assert node.put(kubelet_update(node.obj, EBS, 24), timedelta(minutes=5)).response.allowed

    value = json.dumps({EBS: forged}) if forged else None
    decision = node.put(with_annotation(kubelet_update(node.obj, EBS, 25), VERSIONS, value), timedelta(hours=1))

    assert decision.decision is Decision.DENY
    assert "is not a version reporter the policy lists" in decision.response.message
    assert node.state.declared[EBS].version == "v1.37.0"


def test_a_forged_version_on_a_registration_is_put_back_not_refused() -> None:
    node = Node(kubelet_update(base_csinode(), EBS, 25), ANNOTATION_POLICY)
    declared(node, "v1.37.0", timedelta(0))
    original = node.obj["metadata"]["annotations"][VERSIONS]
    node.put(without_driver(node.obj, EBS), timedelta(hours=1))

    forged = with_annotation(kubelet_update(node.obj, EBS, 39), VERSIONS, json.dumps({EBS: "v9.9.9"}))
    decision = node.put(forged, timedelta(hours=1))

    assert decision.response.allowed is True
    assert node.obj["metadata"]["annotations"][VERSIONS] == original
    assert node.state.declared[EBS].version == "v1.37.0"
    assert node.count == CEILING  # the ceiling still applies
    assert any("not a version reporter" in w for w in decision.response.warnings)


def test_a_declared_rollback_freezes_like_a_pod_version_rollback() -> None:
    node = Node(kubelet_update(base_csinode(), EBS, 25), ANNOTATION_POLICY)
    declared(node, "v1.37.0", timedelta(0))
    assert node.put(kubelet_update(node.obj, EBS, 24), timedelta(minutes=5)).response.allowed
    assert node.state.entries[EBS].writer_version == "v1.37.0"
    declared(node, "v1.30.0", timedelta(hours=1))
    node.put(without_driver(node.obj, EBS), timedelta(hours=1, minutes=1))

    decision = node.put(kubelet_update(node.obj, EBS, 27), timedelta(hours=1, minutes=1))

    assert node.count == 24
    assert "writer-version" in decision.fired_rules
    assert node.state.entries[EBS].frozen_until is not None


# -- registrations are paced (change-rate, maxStepUp and recoveryStep from the last accepted count and time) ------

BIG = {"node.kubernetes.io/instance-type": "c7i.48xlarge"}  # the shipped EBS profile: 128


def test_uninstall_install_cycles_inside_min_interval_gain_nothing() -> None:
    node = Node(base_csinode())
    node.view = StaticClusterView(nodes={NODE: {"labels": BIG}}, driver_versions={NODE: {EBS: "v1.37.0"}})
    assert node.put(kubelet_update(node.obj, EBS, 25), timedelta(0)).response.allowed

    for i in range(9):  # 9 x uninstall + install --max-volumes 128 in about 2 s
        decision = node.restart_plugin(128, timedelta(seconds=1 + i * 0.2))
        assert decision.response.allowed is True
        assert "change-rate" in decision.fired_rules
        assert node.count == 25
    assert node.state.entries[EBS].count == 25
    assert node.state.entries[EBS].changed_at == T0  # a held registration does not restart the interval

    after = node.restart_plugin(128, timedelta(seconds=61))  # a plugin upgrade after the interval
    assert after.response.allowed is True
    assert node.count == 25 + 16  # one maxStepUp
    again = node.restart_plugin(128, timedelta(seconds=62))
    assert node.count == 41
    assert "change-rate" in again.fired_rules


def test_a_registration_does_not_get_around_a_held_increase() -> None:
    node = Node(base_csinode())
    assert node.put(kubelet_update(node.obj, EBS, 10), timedelta(0)).response.allowed
    held = node.put(kubelet_update(node.obj, EBS, 20), timedelta(seconds=5))
    assert held.decision is Decision.CLAMP
    assert node.count == 10

    decision = node.restart_plugin(26, timedelta(seconds=7))

    assert decision.response.allowed is True
    assert node.count == 10
    assert "change-rate" in decision.fired_rules


def test_recovery_after_a_correction_is_paced_per_interval_not_per_registration() -> None:
    node = Node(base_csinode())
    node.view.attach_error_list[(NODE, EBS)] = [
        AttachError(code=8, time=T0, volume_attachment="csi-0", message="ResourceExhausted")
    ]
    assert node.put(kubelet_update(node.obj, EBS, 26), timedelta(0)).response.allowed
    assert node.put(kubelet_update(node.obj, EBS, 5), timedelta(minutes=2)).response.allowed
    assert node.state.entries[EBS].correction is not None

    for i in range(10):  # ten cycles in 1.3 s
        node.restart_plugin(25, timedelta(minutes=2, seconds=1 + i * 0.13))
        assert node.count == 5
    node.restart_plugin(25, timedelta(minutes=3, seconds=5))
    assert node.count == 7  # one recoveryStep after the interval


# -- replayed and stripped states, entries without state ------------------------------------------------------


def test_an_older_state_than_the_newest_seen_is_a_replay_judged_from_the_ceilings() -> None:
    # Attack 8: with the guard down the node PUT an older signed state of its own, then installs ebs with 26.
    node = Node(base_csinode())
    assert node.put(kubelet_update(node.obj, EBS, 25), timedelta(0)).response.allowed
    older = copy.deepcopy(node.obj)
    assert node.put(kubelet_update(node.obj, EBS, 5), timedelta(minutes=5)).response.allowed
    newest = node.state.sequence
    assert newest == older_sequence(older) + 1
    node.view.state_sequences[node.obj["metadata"]["uid"]] = newest  # a CSINode watch saw it

    unjudged(node, without_driver(older, EBS))  # the older state, with a removal
    decision = node.restart_plugin(26, timedelta(minutes=6))

    assert decision.state_problem is StateProblem.REPLAYED
    # Not judged from the replayed state (its entry, 25 an hour ago, would pass 26 as a step): from the ceilings only,
    # as the newest state's content is not at hand; with 128 the ceiling would hold it.
    assert node.count == 26
    assert node.restart_plugin(128, timedelta(minutes=6, seconds=30)).response.allowed
    assert node.count == 26  # now paced from the fresh state
    assert node.state.sequence == newest + 1  # the next state is past the newest seen


def older_sequence(obj: dict[str, Any]) -> int:
    found = decode_state(obj["metadata"]["annotations"][STATE_ANNOTATION], obj["metadata"]["uid"], KEYS).state
    assert found is not None
    return found.sequence


def test_a_removed_state_is_named_in_the_detail() -> None:
    node = Node(base_csinode())
    assert node.put(kubelet_update(node.obj, EBS, 25), timedelta(0)).response.allowed
    node.view.state_sequences[node.obj["metadata"]["uid"]] = node.state.sequence
    unjudged(node, with_annotation(node.obj, STATE_ANNOTATION, None))

    decision = node.put(kubelet_update(node.obj, EBS, 24), timedelta(minutes=5))

    assert decision.state_problem is StateProblem.MISSING
    assert "it was removed" in decision.state_detail


def test_entries_without_state_get_the_stateless_rules_at_the_next_judged_write() -> None:
    # Attack 7: with the guard down, a removal that deleted the state, then install ebs 39 and a driver x without
    # a limit; the guard up, a judged write of another driver.
    doc = copy.deepcopy(POLICY.document)
    doc["spec"]["drivers"]["x.csi.example.com"] = {"ceiling": {"max": 10}}
    node = Node(base_csinode(), parse_policy(doc, "x.yaml", POLICY_DIR))
    assert node.put(kubelet_update(node.obj, EBS, 5), timedelta(0)).response.allowed
    stripped = with_annotation(without_driver(node.obj, EBS), STATE_ANNOTATION, None)
    unjudged(node, kubelet_update(kubelet_update(stripped, EBS, 39), "x.csi.example.com", None))

    decision = node.put(kubelet_update(node.obj, "pd.csi.storage.gke.io", 12), timedelta(minutes=5))

    assert decision.response.allowed is True
    assert node.count == CEILING
    assert count_of(node.obj, "x.csi.example.com") == 10
    assert any("has no state entry" in n for n in decision.notes)
