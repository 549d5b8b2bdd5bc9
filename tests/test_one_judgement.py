"""One judgement of a stored entry: the audit (and ``status``) allow the count admission allows.

A differential test. For generated stored CSINodes and signed states -- ceiling pins, freezes, corrections,
approvals, writer versions, replayed and forged states -- and generated cluster facts -- Node labels, the driver
pods' and the kubelet's versions, CSIDriver update periods, attach errors -- the count the background audit
lowers each entry to (:func:`webhook.admission.standing.judge_standing`, the targets it repairs to; the stored
count where it repairs nothing) equals the count admission stores for that entry when the node's own kubelet next
writes the object (a judged write that lowers another driver: /mutate, its patch applied as the apiserver
applies it). Policies: the bundled one, one whose rules deny instead of clamp and pace increases by 10 minutes,
one that refuses unknown driver versions, one with an enforcement scope the node is outside of, and one that
takes EBS versions from what a trusted reporter declared (recorded in the signed state).
"""

from __future__ import annotations

import copy
import json
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kube import KUBELET, NODE, NODE_GROUPS, apply_response, count_of, driver_entry, kubelet_update, review

from webhook.admission.cluster import AttachError, StaticClusterView
from webhook.admission.csinode import INT32_MAX, parse_csinode
from webhook.admission.evaluation import Mode, evaluate
from webhook.admission.policy import Policy, bundled_policy_path, load_policy, parse_policy
from webhook.admission.review import build_response, parse_review
from webhook.admission.standing import judge_standing
from webhook.admission.state import (
    STATE_ANNOTATION,
    Approval,
    Correction,
    DeclaredVersion,
    EntryState,
    GuardState,
    PinnedLabel,
    StateKeys,
    decode_state,
    encode_state,
)

KEYS = StateKeys([b"one-judgement-test-key-012345678"])
OTHER_KEYS = StateKeys([b"not-the-guards-key-0123456789abc"])
NOW = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)
UID = "3f1c2e0a-5b6d-4e7f-8a9b-0c1d2e3f4a5b"
EBS = "ebs.csi.aws.com"  # ceiling by instance type (profile), version from its node pod
PD = "pd.csi.storage.gke.io"  # ceiling by machine type, version from the kubelet
OTHER = "other.csi.example.com"  # no ceiling, kubelet version
BYSTANDER = "bystander.csi.example.com"  # the driver the kubelet's write lowers
DRIVERS = (EBS, PD, OTHER)
INSTANCE_TYPE = "node.kubernetes.io/instance-type"
TYPES = ("m6i.large", "c7i.48xlarge", "c7i.large", "n2-standard-8", "e2-small", "t2.micro")
VERSIONS = ("v1.30.0", "v1.37.0", "v1.40.1", "not-a-version")


def _policy(change: Any = None) -> Policy:
    doc = copy.deepcopy(load_policy().document)
    if change is not None:
        change(doc["spec"])
    return parse_policy(doc, policy_dir=bundled_policy_path().parent)


def _strict(spec: dict[str, Any]) -> None:
    rules = spec["rules"]
    rules["count-ceiling"]["enforcementAction"] = "deny"
    rules["count-rollback"]["enforcementAction"] = "clamp"
    rules["change-rate"]["minInterval"] = "10m"
    spec["defaults"]["minVersion"] = "v1.35.0"


def _unknown_refused(spec: dict[str, Any]) -> None:
    spec["rules"]["writer-version"]["onUnknown"] = "deny"


def _canary(spec: dict[str, Any]) -> None:
    spec["enforcementScope"] = {"nodeSelector": {"matchLabels": {"canary": "true"}}}


def _declared_versions(spec: dict[str, Any]) -> None:
    spec["drivers"][EBS]["versionSource"] = {"type": "annotation"}
    spec["versionReporters"] = {"users": ["version-reporter"]}


POLICIES = (_policy(), _policy(_strict), _policy(_unknown_refused), _policy(_canary), _policy(_declared_versions))

counts = st.none() | st.integers(0, 140) | st.sampled_from([0, 26, 27, 28, 40, 43, 127, 128, INT32_MAX])
moments = st.integers(-3 * 3600, 8 * 3600).map(lambda s: NOW - timedelta(seconds=s))
versions = st.none() | st.sampled_from(VERSIONS)


@st.composite
def entries(draw: st.DrawFn) -> EntryState:
    count = draw(counts)
    correction = None
    if draw(st.booleans()):
        correction = Correction(at=draw(moments), before=draw(counts), after=count,
                                basis=draw(st.sampled_from(["resource-exhausted", "justification"])))
    pinned = None
    if draw(st.booleans()):
        pinned = PinnedLabel(draw(st.sampled_from([INSTANCE_TYPE, "other-label"])), draw(st.sampled_from(TYPES)))
    return EntryState(
        count=count,
        changed_at=draw(moments),
        writer_version=draw(versions),
        frozen_until=draw(st.none() | moments),
        correction=correction,
        pinned=pinned,
    )


@st.composite
def approvals(draw: st.DrawFn) -> Approval:
    low = draw(st.integers(0, 100))
    return Approval(driver=draw(st.sampled_from(DRIVERS)), reason="capacity test", min_count=low,
                    max_count=low + draw(st.integers(0, 100)), expires=draw(moments), ticket="OPS-1",
                    approved_by="alice", approved_at=NOW - timedelta(hours=1))


class Case(NamedTuple):
    """A stored CSINode, the cluster's facts, and the policy."""

    stored: dict[str, Any]
    view: StaticClusterView
    policy: Policy


@st.composite
def cases(draw: st.DrawFn) -> Case:
    present = draw(st.lists(st.sampled_from(DRIVERS), min_size=1, max_size=3, unique=True))
    stored: dict[str, Any] = {
        "apiVersion": "storage.k8s.io/v1", "kind": "CSINode",
        "metadata": {"name": NODE, "uid": UID, "resourceVersion": "41", "annotations": {}},
        "spec": {"drivers": [driver_entry(d, draw(counts)) for d in present] + [driver_entry(BYSTANDER, 5)]},
    }
    kept = draw(st.lists(st.sampled_from(DRIVERS), max_size=3, unique=True))  # also drivers removed since
    sequence = draw(st.integers(1, 9))
    declared = {}
    if (version := draw(versions)) is not None:  # what a trusted reporter declared (the annotation source)
        declared[EBS] = DeclaredVersion(version, "version-reporter", NOW - timedelta(hours=2))
    state = GuardState(UID, {d: draw(entries()) for d in kept}, tuple(draw(st.lists(approvals(), max_size=2))),
                       declared, sequence=sequence)
    how = draw(st.sampled_from(["signed", "signed", "signed", "none", "forged", "replayed"]))
    newest: dict[str, int] = {}
    if how in ("signed", "replayed"):
        stored["metadata"]["annotations"][STATE_ANNOTATION] = encode_state(state, KEYS)
        newest[UID] = sequence + 1 if how == "replayed" else sequence
    elif how == "forged":
        stored["metadata"]["annotations"][STATE_ANNOTATION] = encode_state(state, OTHER_KEYS)
    nodes: dict[str, dict[str, Any]] = {}
    if draw(st.booleans()):
        labels = {INSTANCE_TYPE: draw(st.sampled_from(TYPES))} if draw(st.booleans()) else {}
        if draw(st.booleans()):
            labels["canary"] = "true"
        nodes[NODE] = {"labels": labels, "kubeletVersion": draw(versions)}
    pod_version = draw(versions)
    errors = {
        (NODE, d): [AttachError(code=draw(st.sampled_from([8, 4, None])), time=draw(moments),
                                volume_attachment=f"csi-{d}-{i}", message="attach failed")
                    for i in range(draw(st.integers(0, 2)))]
        for d in DRIVERS
    }
    view = StaticClusterView(
        nodes=nodes,
        driver_versions={NODE: {EBS: pod_version}} if pod_version else {},
        driver_periods={d: float(p) for d in DRIVERS if (p := draw(st.none() | st.integers(10, 900))) is not None},
        attach_error_list=errors,
        state_sequences=newest,
    )
    return Case(stored, view, draw(st.sampled_from(POLICIES)))


def audit_allows(case: Case) -> dict[str, int | None]:
    """What the audit leaves stored per driver: its repair target, else the stored count."""
    node = parse_csinode(case.stored)
    decoded = decode_state(node.annotations.get(STATE_ANNOTATION), node.uid, KEYS)
    judgement = judge_standing(node, decoded, case.policy, case.view, NOW, KEYS)
    return {d: judgement.targets.get(d, count_of(case.stored, d)) for d in DRIVERS if d in node.drivers}


def admission_allows(case: Case) -> dict[str, int | None]:
    """What admission stores per driver when the node's kubelet next writes the object (it lowers another
    driver; every entry it does not touch is reconciled from its last trusted count)."""
    write = kubelet_update(case.stored, BYSTANDER, 4)
    request = parse_review(json.dumps(review(case.stored, write, user=KUBELET, groups=NODE_GROUPS)))
    decision = evaluate(request, case.policy, case.view, NOW, KEYS, mode=Mode.MUTATE)
    assert decision.response.allowed, decision.response.message
    final = apply_response(write, build_response(request.uid, decision.response, allow_patch=True))
    assert count_of(final, BYSTANDER) == 4
    return {d: count_of(final, d) for d in DRIVERS if any(e["name"] == d for e in case.stored["spec"]["drivers"])}


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_the_count_the_audit_allows_is_the_count_admission_allows_for_the_same_entry(case: Case) -> None:
    assert audit_allows(case) == admission_allows(case)


def test_the_generated_cases_reach_the_lowering_paths() -> None:
    """The differential is not vacuous: the attack of a pinned ceiling (the node relabels itself c7i.48xlarge and
    registers 128 while the guard is down) is lowered to the pin by both, not to the step over the accepted count
    (43) nor to the new label's ceiling (128)."""
    stored: dict[str, Any] = {
        "apiVersion": "storage.k8s.io/v1", "kind": "CSINode",
        "metadata": {"name": NODE, "uid": UID, "resourceVersion": "41", "annotations": {}},
        "spec": {"drivers": [driver_entry(EBS, 128), driver_entry(BYSTANDER, 5)]},
    }
    pinned = EntryState(count=27, changed_at=NOW - timedelta(hours=1), pinned=PinnedLabel(INSTANCE_TYPE, "m6i.large"))
    stored["metadata"]["annotations"][STATE_ANNOTATION] = encode_state(GuardState(UID, {EBS: pinned}, sequence=3), KEYS)
    view = StaticClusterView(nodes={NODE: {"labels": {INSTANCE_TYPE: "c7i.48xlarge"}}}, state_sequences={UID: 3})
    case = Case(stored, view, POLICIES[0])
    assert audit_allows(case) == admission_allows(case) == {EBS: 27}
