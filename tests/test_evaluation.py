"""evaluate(): how the five rules combine into one AdmissionResponse, with state, justifications, evidence, budget.

Every test goes through the real interfaces: an AdmissionReview shaped as kube-apiserver sends it for a kubelet
PUT (tests/kube.py) -> parse_review -> evaluate with a StaticClusterView -> build_response, and for /mutate the
returned JSONPatch applied as the apiserver would apply it.
"""

from __future__ import annotations

import base64
import copy
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from kube import (
    EBS,
    KUBELET,
    NODE,
    apply_response,
    base_csinode,
    count_of,
    counts,
    driver_entry,
    kubelet_update,
    review,
    with_annotation,
    without_driver,
)

from webhook.admission.budget import IncreaseBudget
from webhook.admission.cluster import AttachError, StaticClusterView, UnknownClusterView
from webhook.admission.evaluation import AdmissionDecision, Decision, Mode, evaluate, explain, response_summary
from webhook.admission.policy import EnforcementAction, Policy, load_policy, parse_policy
from webhook.admission.review import build_response, parse_review
from webhook.admission.state import (
    Approval,
    Correction,
    DeclaredVersion,
    EntryState,
    GuardState,
    StateKeys,
    StateProblem,
    decode_state,
    encode_state,
)

T0 = datetime(2026, 11, 30, 2, 0, tzinfo=UTC)
KEYS = StateKeys([b"evaluation-test-hmac-key-32bytes"])
UID = "9f1c2a7e-3d64-4c1b-8f0e-2b6a5d4c3e21"
REQUEST_UID = "705ab4f5-6393-11e8-b7cc-42010a800002"
STATE = "csinode-guard.io/state"
STATE_POINTER = "/metadata/annotations/csinode-guard.io~1state"
JUSTIFICATION = "csinode-guard.io/justification"
VERSIONS = "csinode-guard.io/driver-versions"
INSTANCE_TYPE = "node.kubernetes.io/instance-type"
EFS = "efs.csi.aws.com"
GCE = "pd.csi.storage.gke.io"
OTHER_KUBELET = "system:node:ip-10-0-9-9.ec2.internal"
APPROVER = ("alice", ["csinode-guard:approvers", "system:authenticated"])
BREAK_GLASS = ("sre-oncall", ["csinode-guard:break-glass", "system:authenticated"])
STRANGER = ("bob", ["system:authenticated"])
WRITER = ("count-operator", ["system:authenticated"])  # under spec.writers in WRITER_POLICY
WHERE = f"{NODE}/{EBS}"

POD_SOURCE = {
    "type": "pod", "namespace": "kube-system", "selector": {"matchLabels": {"app": "ebs-csi-node"}},
    "container": "ebs-plugin",
}
# The shape of policies/default.yaml, spelled out so that these tests do not move with the shipped policy.
POLICY_DOC: dict[str, Any] = {
    "apiVersion": "csinode-guard.io/v1alpha1",
    "kind": "GuardPolicy",
    "metadata": {"name": "evaluation-test"},
    "spec": {
        "justifiers": {"groups": ["csinode-guard:approvers"]},
        "exemptions": {"groups": ["csinode-guard:break-glass"]},
        "evidence": {"resourceExhaustedWithin": "15m", "largeDecreaseFraction": 0.5},
        "rules": {
            "writer-identity": {"enforcementAction": "deny"},
            "writer-version": {"enforcementAction": "deny", "onUnknown": "allow", "freezeFor": "6h"},
            "count-ceiling": {"enforcementAction": "clamp"},
            "count-rollback": {
                "enforcementAction": "deny",
                "window": "1h",
                "recoveryStep": 2,
                "dropToZero": {"enforcementAction": "warn"},
            },
            "change-rate": {"enforcementAction": "deny", "minInterval": "60s"},
            "state-integrity": {"enforcementAction": "deny"},
        },
        "defaults": {"versionSource": {"type": "annotation", "annotation": VERSIONS}, "maxStepUp": 16},
        "drivers": {
            EBS: {"ceiling": {"max": 128, "nodeLabel": INSTANCE_TYPE, "unknown": 27}, "versionSource": POD_SOURCE},
            GCE: {"ceiling": {"max": 127}},
        },
    },
}


def merged(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(dict(base))
    for key, value in over.items():
        # A versionSource is one of three shapes: it is replaced, never merged.
        nested = isinstance(value, Mapping) and isinstance(out.get(key), Mapping) and key != "versionSource"
        out[key] = merged(out[key], value) if nested else value
    return out


def make_policy(**spec: Any) -> Policy:
    return parse_policy(merged(POLICY_DOC, {"spec": spec}), "evaluation-test.yaml")


POLICY = make_policy()
WRITER_POLICY = make_policy(writers={"users": [WRITER[0]]})


# -- objects -------------------------------------------------------------------------------------------------------


def history(count: int | None = 25, *, ago: float = 3600, version: str | None = "v1.37.0", **entry: Any) -> GuardState:
    """A verified state whose EBS entry last changed to ``count`` ``ago`` seconds before T0."""
    return GuardState(
        uid=UID,
        entries={EBS: EntryState(count=count, changed_at=T0 - timedelta(seconds=ago), writer_version=version, **entry)},
    )


ANNOTATION_SOURCE = {"type": "annotation", "annotation": VERSIONS}
REPORTER = "system:serviceaccount:kube-system:version-reporter"


def declared_history(version: str, count: int = 25) -> GuardState:
    """``history(count)`` plus ``version`` declared for EBS by the version reporter (recorded in the state)."""
    return history(count)._replace(declared={EBS: DeclaredVersion(version, REPORTER, T0 - timedelta(hours=2))})


def signed(obj: dict[str, Any], state: GuardState | None) -> dict[str, Any]:
    return obj if state is None else with_annotation(obj, STATE, encode_state(state, KEYS))


def stored(
    count: int | None = 25, *, state: GuardState | str | None = "recent", version: str | None = "v1.37.0"
) -> dict[str, Any]:
    """The stored CSINode: EFS then EBS at ``count`` (kubelet appended it), the driver version, a signed state."""
    obj = kubelet_update(base_csinode(), EBS, count)
    if version is not None:
        obj = with_annotation(obj, VERSIONS, json.dumps({EBS: version}))
    return signed(obj, history(count) if state == "recent" else state)  # type: ignore[arg-type]


def with_drivers(obj: dict[str, Any], *entries: dict[str, Any]) -> dict[str, Any]:
    new = copy.deepcopy(obj)
    new["spec"]["drivers"] = [copy.deepcopy(e) for e in entries]
    return new


def with_version(obj: dict[str, Any], version: str) -> dict[str, Any]:
    return with_annotation(obj, VERSIONS, json.dumps({EBS: version}))


def justification(
    low: int, high: int, *, driver: str = EBS, expires: str = "2026-11-30T04:00:00Z", reason: str = "node drain"
) -> str:
    return json.dumps(
        [{"driver": driver, "reason": reason, "minCount": low, "maxCount": high, "expires": expires, "ticket": "OPS-1"}]
    )


def approval(low: int, high: int, *, expires: datetime = T0 + timedelta(hours=2)) -> Approval:
    return Approval(
        driver=EBS,
        reason="node drain",
        min_count=low,
        max_count=high,
        expires=expires,
        ticket="OPS-1",
        approved_by="alice",
        approved_at=T0 - timedelta(minutes=10),
    )


# -- judging -------------------------------------------------------------------------------------------------------


@dataclass
class Judged:
    """One evaluation: the AdmissionDecision, the ``response`` of the AdmissionReview, the object after /mutate."""

    decision: AdmissionDecision
    body: dict[str, Any]
    final: dict[str, Any] | None

    @property
    def patch(self) -> list[dict[str, Any]]:
        raw = self.body.get("patch")
        return json.loads(base64.b64decode(raw)) if raw else []

    @property
    def lines(self) -> list[str]:
        return str(self.body["status"]["message"]).split("\n")

    @property
    def state(self) -> GuardState | None:
        assert self.final is not None
        return decode_state((self.final["metadata"].get("annotations") or {}).get(STATE), UID, KEYS).state


def judge(
    old: dict[str, Any] | None,
    new: dict[str, Any] | None,
    *,
    user: tuple[str, list[str]] | str = KUBELET,
    at: float = 0.0,
    policy: Policy = POLICY,
    cluster: Any = None,
    mode: Mode = Mode.MUTATE,
    dry_run: bool = False,
    budget: IncreaseBudget | None = None,
    budget_clock: float | None = None,
    operation: str = "UPDATE",
    edit: Callable[[dict[str, Any]], None] | None = None,
) -> Judged:
    username, groups = (user, None) if isinstance(user, str) else user
    doc = review(old, new, user=username, groups=groups, operation=operation, dry_run=dry_run, uid=REQUEST_UID)
    if edit is not None:
        edit(doc["request"])
    request = parse_review(json.dumps(doc).encode())
    decision = evaluate(
        request,
        policy,
        cluster if cluster is not None else StaticClusterView(),
        T0 + timedelta(seconds=at),
        KEYS,
        mode=mode,
        budget=budget,
        budget_clock=budget_clock,
    )
    envelope = build_response(request.uid, decision.response, allow_patch=mode is Mode.MUTATE)
    assert (envelope["apiVersion"], envelope["kind"], envelope["response"]["uid"]) == (
        "admission.k8s.io/v1",
        "AdmissionReview",
        REQUEST_UID,
    )
    body = envelope["response"]
    final = apply_response(new, envelope) if mode is Mode.MUTATE and body["allowed"] and new is not None else None
    return Judged(decision, body, final)


class Apiserver:
    """One stored CSINode; each PUT goes through /mutate, then /validate on the mutated object, then is stored."""

    def __init__(self, obj: dict[str, Any], **options: Any) -> None:
        self.obj = obj
        self.options = options

    def put(self, new: dict[str, Any], at: float, *, user: tuple[str, list[str]] | str = KUBELET) -> Judged:
        mutated = judge(self.obj, new, user=user, at=at, **self.options)
        if mutated.body["allowed"]:
            assert mutated.final is not None
            validated = judge(self.obj, mutated.final, user=user, at=at, mode=Mode.VALIDATE, **self.options)
            assert validated.body["allowed"], validated.body.get("status")
            self.obj = mutated.final
        return mutated

    def kubelet(self, count: int | None, at: float, *, version: str | None = None) -> Judged:
        if version is not None:  # the driver's node pod now runs this version (the pod version source)
            self.options["cluster"] = running(version)
        return self.put(kubelet_update(self.obj, EBS, count), at)


def running(version: str) -> StaticClusterView:
    """A cluster view whose EBS node pod on NODE runs ``version`` (the policy's pod version source)."""
    return StaticClusterView(driver_versions={NODE: {EBS: version}})


def message_line(rule: str, old: int | str, new: int | str, why: str, how: str, where: str = WHERE) -> str:
    return f"[{rule}] {where}: {old} -> {new}: {why}; {how}"


def clamp_line(rule: str, old: int | str, new: int | str, to: int | str, why: str, how: str,
               where: str = WHERE) -> str:
    """A clamp's warning line (as :func:`message_line`, with the count it was clamped to)."""
    return f"[{rule}] {where}: {old} -> {new} (clamped to {to}): {why}; {how}"


KUBELET_CLAMP = "deny acts as clamp for the node's kubelet (to the stored count"


LINE = re.compile(
    r"^\[(?P<rule>[a-z-]+)\] (?P<node>[^/ ]+)/(?P<driver>[^:]+): (?P<old>\w+) -> (?P<new>\w+)"
    r"(?: \(clamped to (?P<final>\w+)\))?: [^;]+; .+$"
)


def parts(line: str) -> dict[str, str]:
    """The parts of one ``[rule] node/driver: old -> new: why; how`` line (fails when it is not one)."""
    match = LINE.match(line)
    assert match is not None, line
    return match.groupdict()
RATE_HOW = "kubelet retries at its next update period; if the driver flaps, fix its NodeGetInfo"
IDENTITY_HOW = (
    "let the node's kubelet report the count, add the principal to spec.writers, "
    "or have an approver set a csinode-guard.io/justification"
)
CEILING_HOW = "fix the driver's volume limit (e.g. --volume-attach-limit), or raise the ceiling in the policy"


# -- requests that are never judged --------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [Mode.MUTATE, Mode.VALIDATE])
def test_the_nodes_own_delete_is_allowed_without_a_patch(mode: Mode) -> None:
    # kubelet deletes its CSINode when its Node's UID changed (kubernetes#137199), then creates it again.
    judged = judge(stored(25), None, operation="DELETE", mode=mode)

    assert judged.body["allowed"] is True
    assert "patch" not in judged.body and "warnings" not in judged.body
    assert judged.body["auditAnnotations"]["decision"] == "allow"
    assert judged.decision.node == NODE
    assert judged.decision.new_state is None


@pytest.mark.parametrize("mode", [Mode.MUTATE, Mode.VALIDATE])
def test_a_strangers_delete_is_refused_by_writer_identity(mode: Mode) -> None:
    # A node without a CSINode has no limit for the scheduler: a stranger's DELETE lifts every limit at once.
    judged = judge(stored(25), None, operation="DELETE", user=STRANGER, mode=mode)

    assert judged.body["allowed"] is False
    assert judged.body["status"]["code"] == 403
    message = judged.body["status"]["message"]
    assert message.startswith(f"[writer-identity] {NODE}: CSINode {NODE} (deletion): bob is not"), message
    assert f"(stored: {EFS}=unbounded, {EBS}=25)" in message
    assert judged.body["auditAnnotations"]["rules"] == "writer-identity"


def test_a_strangers_delete_of_a_csinode_without_drivers_is_refused_too() -> None:
    judged = judge(base_csinode(), None, operation="DELETE", user=STRANGER)

    assert judged.body["allowed"] is False
    assert f"CSINode {NODE} (deletion)" in judged.body["status"]["message"]


GARBAGE_COLLECTOR = ("system:serviceaccount:kube-system:generic-garbage-collector",
                     ["system:serviceaccounts", "system:serviceaccounts:kube-system"])


@pytest.mark.parametrize(
    ("cluster", "allowed"),
    [
        pytest.param(StaticClusterView(nodes_complete=True), True, id="its-node-is-known-to-be-gone"),
        pytest.param(StaticClusterView(nodes={NODE: {"labels": {}}}, nodes_complete=True), False,
                     id="its-node-exists"),
        pytest.param(StaticClusterView(), False, id="the-nodes-are-unknown"),
    ],
)
def test_the_garbage_collectors_delete_passes_only_once_the_node_is_known_to_be_gone(
    cluster: StaticClusterView, allowed: bool
) -> None:
    """kube-controller-manager's garbage collector deletes a CSINode whose owner Node is gone (the CSINode's
    ownerReference); with no Node there is no node to schedule to, so that DELETE lifts no live limit. While the
    Node exists, or the guard cannot tell, the same DELETE is a stranger's and is refused."""
    judged = judge(stored(25), None, operation="DELETE", user=GARBAGE_COLLECTOR, cluster=cluster)

    assert judged.body["allowed"] is allowed, judged.body


@pytest.mark.parametrize("user", [pytest.param(OTHER_KUBELET, id="another node's kubelet"),
                                  pytest.param(APPROVER, id="an approver (a justifier, not a writer)")])
def test_nobody_else_deletes_either(user: Any) -> None:
    assert judge(stored(25), None, operation="DELETE", user=user).body["allowed"] is False


def test_a_listed_writer_may_delete_and_break_glass_is_only_audited() -> None:
    by_writer = judge(stored(25), None, operation="DELETE", user=WRITER, policy=WRITER_POLICY)
    assert by_writer.body["allowed"] is True

    exempt = judge(stored(25), None, operation="DELETE", user=BREAK_GLASS)
    assert exempt.body["allowed"] is True
    assert exempt.body["auditAnnotations"] == {"decision": "allow", "policy": POLICY.hash,
                                                "rules": "writer-identity", "exempt": "true"}


def test_a_delete_without_old_object_is_a_bad_request() -> None:
    judged = judge(None, None, operation="DELETE", user=STRANGER)

    assert judged.body["allowed"] is False
    assert judged.body["status"]["code"] == 400
    assert "oldObject" in judged.body["status"]["message"]


def without_uid(obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` as mutating admission sees a CREATE: the apiserver fills in ``metadata.uid`` only afterwards."""
    new = copy.deepcopy(obj)
    new["metadata"].pop("uid", None)
    return new


def test_kubelet_creating_its_csinode_is_allowed() -> None:
    judged = judge(None, without_uid(base_csinode()), operation="CREATE")

    assert judged.body == {
        "uid": REQUEST_UID, "allowed": True, "auditAnnotations": {"decision": "allow", "policy": POLICY.hash},
    }


@pytest.mark.parametrize(
    ("count", "final"),
    [
        pytest.param(2147483647, 27, id="int32 max"),
        pytest.param(128, 27, id="above the ceiling"),
        pytest.param(None, 27, id="unbounded with a known ceiling"),
        pytest.param(20, 20, id="within the ceiling"),
    ],
)
@pytest.mark.parametrize("mode", [Mode.MUTATE, Mode.VALIDATE])
def test_a_create_is_clamped_never_refused(count: int | None, final: int, mode: Mode) -> None:
    obj = without_uid(kubelet_update(base_csinode(), EBS, count))

    judged = judge(None, obj, operation="CREATE", mode=mode)

    assert judged.body["allowed"] is True
    if mode is Mode.MUTATE:
        assert judged.final is not None
        assert count_of(judged.final, EBS) == final
        assert judged.decision.decision is (Decision.CLAMP if final != count else Decision.ALLOW)
    else:  # /validate cannot patch: it warns, it never refuses a CREATE
        assert judged.decision.decision is (Decision.WARN if final != count else Decision.ALLOW)


def test_a_create_with_a_copied_state_is_clamped_and_the_state_removed() -> None:
    # The state of the deleted CSINode (another UID, a recent accepted 128 recorded) copied into the CREATE.
    copied = GuardState(uid="0d7e0c8e-old-object", entries={EBS: EntryState(128, T0 - timedelta(minutes=1))})
    obj = without_uid(signed(kubelet_update(base_csinode(), EBS, 128), copied))

    judged = judge(None, obj, operation="CREATE")

    assert judged.body["allowed"] is True
    assert judged.final is not None
    assert count_of(judged.final, EBS) == 27
    assert STATE not in (judged.final["metadata"].get("annotations") or {})
    assert judged.decision.fired_rules == ["count-ceiling"]


@pytest.mark.parametrize(
    ("edit", "warning"),
    [
        pytest.param(
            lambda r: r.update(resource={"group": "", "version": "v1", "resource": "nodes"}),
            "csinode-guard judges only storage.k8s.io/v1 csinodes, not nodes./v1; check its webhook rules",
            id="another resource",
        ),
        pytest.param(
            lambda r: r.update(subResource="status"),
            "csinode-guard judges only storage.k8s.io/v1 csinodes, not csinodes.storage.k8s.io/v1/status; "
            "check its webhook rules",
            id="a subresource of csinodes",
        ),
        pytest.param(
            lambda r: r.update(operation="CONNECT"),
            "csinode-guard judges only CREATE, UPDATE and DELETE of csinodes, not CONNECT",
            id="another operation",
        ),
    ],
)
def test_a_misconfigured_registration_is_allowed_with_a_warning(
    edit: Callable[[dict[str, Any]], None], warning: str
) -> None:
    judged = judge(stored(), kubelet_update(stored(), EBS, 99), edit=edit)

    assert judged.body == {
        "uid": REQUEST_UID,
        "allowed": True,
        "warnings": [warning],
        "auditAnnotations": {"decision": "skip"},
    }


@pytest.mark.parametrize(
    ("count", "user", "final", "rules"),
    [
        pytest.param(25, KUBELET, 25, [], id="kubelet registering a driver with a count"),
        pytest.param(None, KUBELET, 27, ["count-ceiling"], id="kubelet registering a driver without a count"),
        pytest.param(2147483647, KUBELET, 27, ["count-ceiling"], id="kubelet registering a driver at int32 max"),
    ],
)
def test_a_driver_registration_is_clamped_never_refused(
    count: int | None, user: str, final: int, rules: list[str]
) -> None:
    old = base_csinode()
    judged = judge(old, kubelet_update(old, EBS, count), user=user)

    assert judged.body["allowed"] is True
    assert judged.final is not None
    assert count_of(judged.final, EBS) == final
    assert judged.decision.fired_rules == rules
    assert judged.state is not None
    assert judged.state.entries[EBS].count == final


def test_a_driver_removal_by_the_nodes_kubelet_is_always_allowed() -> None:
    old = stored(25)
    new = without_driver(old, EBS)

    judged = judge(old, new)

    assert judged.body["allowed"] is True
    assert "patch" not in judged.body
    assert "warnings" not in judged.body


def test_a_driver_removal_by_a_stranger_is_refused_by_writer_identity() -> None:
    # A removed entry has no limit for the scheduler: a stranger's removal would lift the node's limit.
    old = stored(25)

    judged = judge(old, without_driver(old, EBS), user=STRANGER)

    assert judged.body["allowed"] is False
    assert judged.body["status"]["message"].startswith(f"[writer-identity] {NODE}: spec.drivers[{EBS}] (removal)")


def test_a_put_that_changes_no_count_is_allowed_without_a_patch() -> None:
    old = stored(25)
    judged = judge(old, kubelet_update(old, EBS, 25), at=1)

    assert judged.body == {
        "uid": REQUEST_UID,
        "allowed": True,
        "auditAnnotations": {"decision": "allow", "policy": POLICY.hash},
    }


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        pytest.param(
            None,
            kubelet_update(stored(), EBS, 23),
            "UPDATE of a CSINode without oldObject: csinode-guard cannot tell what changed",
            id="no oldObject",
        ),
        pytest.param(stored(), None, "UPDATE of a CSINode without object", id="no object"),
    ],
)
def test_an_update_without_both_objects_is_refused_with_code_400(
    old: dict[str, Any] | None, new: dict[str, Any] | None, message: str
) -> None:
    judged = judge(old, new)

    assert judged.body == {
        "uid": REQUEST_UID,
        "allowed": False,
        "status": {"code": 400, "reason": "BadRequest", "message": message},
        "auditAnnotations": {"decision": "invalid"},
    }
    assert judged.decision.decision is Decision.INVALID


@pytest.mark.parametrize(
    ("new", "message"),
    [
        pytest.param(
            with_drivers(stored(), driver_entry(EFS, None), {"name": EBS, "allocatable": {"count": -1}}),
            "not a valid CSINode: object.spec.drivers[1].allocatable.count must be an integer from 0 to 2147483647 "
            "(int32)",
            id="a negative count",
        ),
        pytest.param(
            with_drivers(stored(), driver_entry(EBS, 23), driver_entry(EBS, 25)),
            "not a valid CSINode: object.spec.drivers has driver 'ebs.csi.aws.com' twice",
            id="a driver listed twice",
        ),
    ],
)
def test_an_object_that_is_not_a_csinode_is_refused_with_code_400(new: dict[str, Any], message: str) -> None:
    judged = judge(stored(), new)

    assert judged.body["allowed"] is False
    assert judged.body["status"] == {"code": 400, "reason": "BadRequest", "message": message}
    assert "patch" not in judged.body


# -- admitted changes and their state ------------------------------------------------------------------------------


def test_a_decrease_by_the_nodes_kubelet_is_admitted_and_recorded_in_signed_state() -> None:
    old = stored(25)

    judged = judge(old, kubelet_update(old, EBS, 23), at=5)

    assert set(judged.body) == {"uid", "allowed", "patchType", "patch", "auditAnnotations"}
    assert judged.body["allowed"] is True
    assert judged.body["auditAnnotations"] == {"decision": "allow", "policy": POLICY.hash}
    assert [op["path"] for op in judged.patch] == [STATE_POINTER]
    assert judged.final is not None
    assert counts(judged.final) == {EFS: None, EBS: 23}
    assert judged.state == GuardState(
        uid=UID,
        entries={EBS: EntryState(count=23, changed_at=T0 + timedelta(seconds=5), writer_version="v1.37.0")},
        sequence=1,
    )


def test_the_first_change_creates_the_annotations_when_the_object_has_none() -> None:
    old = kubelet_update(base_csinode(), EBS, 25)
    del old["metadata"]["annotations"]

    judged = judge(old, kubelet_update(old, EBS, 23))

    assert judged.patch[0]["op"] == "add"
    assert judged.patch[0]["path"] == "/metadata/annotations"
    assert list(judged.patch[0]["value"]) == [STATE]
    assert judged.state is not None
    assert judged.state.entries[EBS].count == 23


@pytest.mark.parametrize(
    ("state", "problem"),
    [
        pytest.param(None, StateProblem.MISSING, id="no state yet"),
        pytest.param(GuardState(uid="recreated-object", entries=history().entries), StateProblem.OTHER_OBJECT,
                     id="a state copied from another CSINode"),
    ],
)
def test_an_entry_without_usable_state_is_judged_as_new(state: GuardState | None, problem: StateProblem) -> None:
    old = stored(25, state=state)

    judged = judge(old, kubelet_update(old, EBS, 26), at=-3595)  # 5 s after the change the unusable state records

    assert judged.body["allowed"] is True
    assert judged.decision.state_problem is problem
    assert judged.decision.fired_rules == []
    assert judged.state is not None
    assert judged.state.uid == UID


def test_a_forged_state_is_ignored_and_the_entry_judged_as_new() -> None:
    old = with_annotation(stored(25, state=None), STATE, encode_state(history(5, ago=1), StateKeys([b"x" * 32])))

    judged = judge(old, kubelet_update(old, EBS, 26))

    assert judged.decision.state_problem is StateProblem.BAD_SIGNATURE
    assert judged.body["allowed"] is True
    assert "state: ignored (bad-signature: signature does not verify); entries judged as new" in explain(
        judged.decision
    )


# -- any deny denies -----------------------------------------------------------------------------------------------


def test_every_deny_is_one_line_of_a_403_forbidden() -> None:
    old = stored(25, state=history(25, ago=20))

    judged = judge(old, kubelet_update(old, EBS, 26), user=OTHER_KUBELET)

    assert judged.body == {
        "uid": REQUEST_UID,
        "allowed": False,
        "status": {
            "code": 403,
            "reason": "Forbidden",
            "message": "\n".join(
                [
                    message_line(
                        "writer-identity", 25, 26,
                        f"written by another node's kubelet ({OTHER_KUBELET})", IDENTITY_HOW,
                    ),
                    message_line(
                        "change-rate", 25, 26, "20s after the last accepted change; the minimum is 1m", RATE_HOW
                    ),
                ]
            ),
        },
        "auditAnnotations": {"decision": "deny", "policy": POLICY.hash, "rules": "writer-identity,change-rate"},
    }
    assert judged.decision.decision is Decision.DENY
    assert [parts(line)["rule"] for line in judged.lines] == ["writer-identity", "change-rate"]


def test_a_deny_wins_over_a_clamp_and_returns_no_patch() -> None:
    old = stored(25, state=history(25, ago=20))

    judged = judge(old, kubelet_update(old, EBS, 39), user=STRANGER)

    assert judged.body["allowed"] is False
    assert "patch" not in judged.body
    assert "patchType" not in judged.body
    assert [parts(line)["rule"] for line in judged.lines] == ["writer-identity", "change-rate"]
    assert judged.body["auditAnnotations"]["rules"] == "writer-identity,count-ceiling,change-rate"
    assert [(c.change.driver, c.final) for c in judged.decision.changes] == [(EBS, 25)]


def test_for_the_nodes_kubelet_a_deny_acts_as_a_clamp_to_the_stored_count() -> None:
    old = stored(25, state=history(25, ago=20))

    judged = judge(old, kubelet_update(old, EBS, 39))

    assert judged.body["allowed"] is True
    assert judged.decision.decision is Decision.CLAMP
    assert judged.body["auditAnnotations"] == {"decision": "clamp", "policy": judged.body["auditAnnotations"]["policy"],
                                               "rules": "count-ceiling,change-rate"}
    assert [(c.change.driver, c.final) for c in judged.decision.changes] == [(EBS, 25)]
    rate = [o for o in judged.decision.outcomes if o.rule == "change-rate"]
    assert [(o.enforcement, o.effective) for o in rate] == [(EnforcementAction.DENY, EnforcementAction.CLAMP)]
    assert f"{WHERE}: change-rate {KUBELET_CLAMP} 25; kubelet's write succeeds)" in judged.body["warnings"]


def test_denies_of_several_drivers_are_one_line_each() -> None:
    old = with_drivers(stored(), driver_entry(EFS, None), driver_entry(EBS, 25), driver_entry(GCE, 10))

    judged = judge(old, with_drivers(old, driver_entry(EFS, None), driver_entry(EBS, 20), driver_entry(GCE, 12)),
                   user=STRANGER)

    assert [(m["rule"], m["driver"], m["old"], m["new"]) for m in map(parts, judged.lines)] == [
        ("writer-identity", EBS, "25", "20"),
        ("writer-identity", GCE, "10", "12"),
    ]


@pytest.mark.parametrize(
    "groups",
    [pytest.param(["system:authenticated"], id="the node's name without the system:nodes group")],
)
def test_only_the_node_identity_in_system_nodes_is_the_nodes_kubelet(groups: list[str]) -> None:
    old = stored(25)
    judged = judge(old, kubelet_update(old, EBS, 23), user=(KUBELET, groups))
    assert judged.lines[0].startswith(
        f"[writer-identity] {WHERE}: 25 -> 23: written as {KUBELET} but without the group system:nodes"
    )


# -- clamps --------------------------------------------------------------------------------------------------------


def test_a_count_above_the_ceiling_is_clamped_with_a_warning() -> None:
    old = stored(25)

    judged = judge(old, kubelet_update(old, EBS, 39))

    assert set(judged.body) == {"uid", "allowed", "warnings", "patchType", "patch", "auditAnnotations"}
    assert judged.body["warnings"] == [
        message_line("count-ceiling", 25, "39 (clamped to 27)", "above the ceiling 27 (ceiling for unknown node)",
                     CEILING_HOW)
    ]
    assert judged.body["auditAnnotations"] == {"decision": "clamp", "policy": POLICY.hash, "rules": "count-ceiling"}
    assert judged.patch[0] == {"op": "add", "path": "/spec/drivers/1/allocatable/count", "value": 27}
    assert judged.final is not None
    assert counts(judged.final) == {EFS: None, EBS: 27}
    assert judged.state is not None
    assert judged.state.entries[EBS].count == 27
    assert response_summary(judged.decision) == {"decision": "clamp", "rules": ["count-ceiling"], "finals": {EBS: 27}}


def test_several_clamps_take_the_most_restrictive_count() -> None:
    old = stored(5)

    judged = judge(old, kubelet_update(old, EBS, 39))

    assert judged.final is not None
    assert counts(judged.final)[EBS] == 21
    assert [w.split(": ")[1] for w in judged.body["warnings"]] == ["5 -> 39 (clamped to 21)"] * 2
    assert [w.split(": ")[2].split(" (")[0] for w in judged.body["warnings"]] == [
        "above the ceiling 27",
        "an increase of 34 is larger than maxStepUp 16",
    ]


def test_a_clamp_and_a_warning_are_both_reported() -> None:
    policy = make_policy(rules={"change-rate": {"enforcementAction": "warn"}})
    old = stored(25, state=history(25, ago=10))

    judged = judge(old, kubelet_update(old, EBS, 30), policy=policy)

    assert judged.decision.decision is Decision.CLAMP
    assert [parts(w)["rule"] for w in judged.body["warnings"]] == ["count-ceiling", "change-rate"]


@pytest.mark.parametrize(
    ("stored_order", "report"),
    [
        pytest.param([EFS, EBS], None, id="an unbounded report of the last driver"),
        pytest.param([EBS, EFS], None, id="an unbounded report that kubelet re-appended"),
        pytest.param([EBS, EFS], 2147483647, id="an int32-max report that kubelet re-appended"),
    ],
)
def test_a_clamp_back_to_the_stored_count_leaves_the_object_byte_identical(
    stored_order: list[str], report: int | None
) -> None:
    entries = {EFS: driver_entry(EFS, None), EBS: driver_entry(EBS, 25)}
    old = signed(with_version(with_drivers(base_csinode(), *(entries[d] for d in stored_order)), "v1.37.0"), history())
    put = kubelet_update(old, EBS, report)

    judged = judge(old, put)

    assert judged.body["allowed"] is True
    assert judged.decision.decision is Decision.CLAMP
    assert judged.final is not None
    assert json.dumps(judged.final) == json.dumps(old)
    assert all(op["path"] != STATE_POINTER for op in judged.patch)
    assert judged.decision.new_state is None
    if stored_order != [d["name"] for d in put["spec"]["drivers"]]:
        assert judged.patch == [{"op": "replace", "path": "/spec/drivers", "value": old["spec"]["drivers"]}]


def test_a_write_that_edits_the_state_is_refused_even_with_a_clamp() -> None:
    old = with_drivers(stored(), driver_entry(EBS, 25), driver_entry(EFS, None))
    put = with_annotation(kubelet_update(old, EBS, None), STATE, '{"forged": true}')

    judged = judge(old, put)

    assert judged.body["allowed"] is False
    assert "[state-integrity]" in judged.body["status"]["message"]


def test_an_unbounded_entry_clamped_next_to_an_admitted_change_gets_its_count_back() -> None:
    old = with_drivers(stored(), driver_entry(EFS, None), driver_entry(GCE, 10), driver_entry(EBS, 25))
    new = with_drivers(old, driver_entry(EFS, None), driver_entry(GCE, 12), driver_entry(EBS, None))

    judged = judge(old, new)

    assert {"op": "add", "path": "/spec/drivers/2/allocatable", "value": {"count": 25}} in judged.patch
    assert judged.final is not None
    assert counts(judged.final) == {EFS: None, GCE: 12, EBS: 25}
    assert judged.state is not None
    assert judged.state.entries[EBS] == history().entries[EBS]
    assert judged.state.entries[GCE].count == 12


# -- warn and dryrun -----------------------------------------------------------------------------------------------


def test_a_drop_to_zero_without_justification_is_admitted_with_a_warning() -> None:
    old = stored(25)

    judged = judge(old, kubelet_update(old, EBS, 0))

    assert set(judged.body) == {"uid", "allowed", "warnings", "patchType", "patch", "auditAnnotations"}
    assert judged.body["warnings"] == [
        message_line(
            "count-rollback", 25, 0, "a drop to 0 stops every new attach on this node",
            "have an approver set a csinode-guard.io/justification covering 0",
        )
    ]
    assert judged.body["auditAnnotations"] == {"decision": "warn", "policy": POLICY.hash, "rules": "count-rollback"}
    assert judged.final is not None
    assert counts(judged.final)[EBS] == 0


def test_a_dryrun_rule_is_audited_but_neither_warns_nor_blocks() -> None:
    policy = make_policy(rules={"change-rate": {"enforcementAction": "dryrun"}})
    old = stored(25, state=history(25, ago=10))

    judged = judge(old, kubelet_update(old, EBS, 26), policy=policy)

    assert set(judged.body) == {"uid", "allowed", "patchType", "patch", "auditAnnotations"}
    assert judged.body["auditAnnotations"] == {"decision": "allow", "policy": policy.hash, "rules": "change-rate"}
    (violation,) = [o for o in judged.decision.outcomes if o.result == "violation"]
    assert (violation.rule, violation.enforcement, violation.effective) == (
        "change-rate",
        EnforcementAction.DRYRUN,
        EnforcementAction.DRYRUN,
    )
    assert judged.final is not None
    assert counts(judged.final)[EBS] == 26


# -- enforcementScope and exemptions -------------------------------------------------------------------------------

CANARY = make_policy(enforcementScope={"nodeSelector": {"matchLabels": {"csinode-guard.io/enforce": "true"}}})


@pytest.mark.parametrize(
    ("cluster", "in_scope"),
    [
        pytest.param(StaticClusterView(nodes={NODE: {"labels": {"csinode-guard.io/enforce": "true"}}}), True,
                     id="a node the selector matches is enforced"),
        pytest.param(StaticClusterView(nodes={NODE: {"labels": {"csinode-guard.io/enforce": "false"}}}), False,
                     id="a node the selector does not match is judged in dryrun"),
        pytest.param(StaticClusterView(), True,
                     id="a node whose labels are unknown is enforced (it could make them unknown to leave the canary)"),
    ],
)
def test_enforcement_scope_limits_enforcement_to_matching_nodes(cluster: StaticClusterView, in_scope: bool) -> None:
    old = stored(25)

    judged = judge(old, kubelet_update(old, EBS, 39), policy=CANARY, cluster=cluster)

    assert judged.decision.in_scope is in_scope
    assert judged.body["allowed"] is True
    assert judged.final is not None
    assert counts(judged.final)[EBS] == (27 if in_scope else 39)
    assert ("warnings" in judged.body) is in_scope
    assert judged.body["auditAnnotations"]["rules"] == "count-ceiling"
    effective = [o.effective for o in judged.decision.outcomes if o.result == "violation"]
    assert effective == [EnforcementAction.CLAMP if in_scope else EnforcementAction.DRYRUN]


def test_an_exempt_principal_is_never_blocked_but_audited_as_if_enforced() -> None:
    old = stored(25, state=history(25, ago=10))

    judged = judge(old, kubelet_update(old, EBS, 39), user=BREAK_GLASS)

    assert set(judged.body) == {"uid", "allowed", "patchType", "patch", "auditAnnotations"}
    assert judged.body["auditAnnotations"] == {
        "decision": "allow",
        "policy": POLICY.hash,
        "rules": "writer-identity,count-ceiling,change-rate",
        "exempt": "true",
    }
    assert judged.decision.exempt is True
    assert [(o.rule, o.enforcement, o.effective) for o in judged.decision.outcomes if o.result == "violation"] == [
        ("writer-identity", EnforcementAction.DENY, EnforcementAction.DRYRUN),
        ("count-ceiling", EnforcementAction.CLAMP, EnforcementAction.DRYRUN),
        ("change-rate", EnforcementAction.DENY, EnforcementAction.DRYRUN),
    ]
    assert judged.final is not None
    assert counts(judged.final)[EBS] == 39
    assert judged.state is not None
    assert judged.state.entries[EBS].count == 39


def test_an_exempt_principal_passes_validate_too() -> None:
    old = stored(25)
    mutated = judge(old, kubelet_update(old, EBS, 39), user=BREAK_GLASS)
    assert mutated.final is not None

    validated = judge(old, mutated.final, user=BREAK_GLASS, mode=Mode.VALIDATE)

    assert validated.body["allowed"] is True


# -- /validate -----------------------------------------------------------------------------------------------------


def test_validate_never_returns_a_patch() -> None:
    old = stored(25)
    mutated = judge(old, kubelet_update(old, EBS, 23))
    assert mutated.final is not None

    validated = judge(old, mutated.final, mode=Mode.VALIDATE)

    assert validated.body == {
        "uid": REQUEST_UID,
        "allowed": True,
        "auditAnnotations": {"decision": "allow", "policy": POLICY.hash},
    }
    assert validated.decision.response.patch == ()


def test_validate_turns_an_unapplied_clamp_into_a_deny() -> None:
    old = stored(25)

    judged = judge(old, kubelet_update(old, EBS, 39), mode=Mode.VALIDATE)

    assert judged.body["allowed"] is False
    assert judged.body["status"]["code"] == 403
    assert judged.lines[0] == message_line(
        "count-ceiling", 25, 39, "above the ceiling 27 (ceiling for unknown node)", CEILING_HOW
    )
    assert "patch" not in judged.body


def test_validate_allows_what_mutate_clamped() -> None:
    old = stored(25)
    mutated = judge(old, kubelet_update(old, EBS, 39))
    assert mutated.final is not None

    assert judge(old, mutated.final, mode=Mode.VALIDATE).body["allowed"] is True


def test_validate_catches_a_count_changed_after_mutate() -> None:
    old = stored(25)
    mutated = judge(old, kubelet_update(old, EBS, 23))
    assert mutated.final is not None
    rewritten = kubelet_update(mutated.final, EBS, 24)  # a later mutating webhook

    judged = judge(old, rewritten, mode=Mode.VALIDATE)

    assert judged.lines == [
        message_line(
            "state-integrity", 25, 24,
            "the state records 23, so the count changed after csinode-guard's /mutate ran",
            "find the mutating webhook that rewrites allocatable.count and remove it",
        )
    ]


@pytest.mark.parametrize(
    ("state", "why", "how"),
    [
        pytest.param(
            "recent",
            "the state records 25, so the count changed after csinode-guard's /mutate ran",
            "find the mutating webhook that rewrites allocatable.count and remove it",
            id="the stored state still records the old count",
        ),
        pytest.param(
            None,
            "the final object's csinode-guard.io/state is not valid (missing)",
            "make sure csinode-guard's /mutate webhook is registered",
            id="there is no state at all",
        ),
    ],
)
def test_validate_refuses_a_change_that_mutate_never_saw(state: str | None, why: str, how: str) -> None:
    old = stored(25, state=state)

    judged = judge(old, kubelet_update(old, EBS, 23), mode=Mode.VALIDATE)

    assert judged.lines == [message_line("state-integrity", 25, 23, why, how)]


def test_validate_refuses_a_forged_state_without_a_count_change_naming_the_state_annotation() -> None:
    old = stored(25)

    judged = judge(old, with_annotation(old, STATE, '{"sig": "forged"}'), mode=Mode.VALIDATE)

    assert judged.lines == [
        f"[state-integrity] {NODE}: {STATE}: the final object's {STATE} is not valid (bad-signature); "
        "make sure csinode-guard's /mutate webhook is registered"
    ]


def test_validate_with_state_integrity_in_dryrun_only_audits() -> None:
    policy = make_policy(rules={"state-integrity": {"enforcementAction": "dryrun"}})
    old = stored(25)

    judged = judge(old, kubelet_update(old, EBS, 23), mode=Mode.VALIDATE, policy=policy)

    assert judged.body["allowed"] is True
    assert judged.body["auditAnnotations"]["rules"] == "state-integrity"


# -- the state annotation belongs to the guard ---------------------------------------------------------------------


@pytest.mark.parametrize("user", [KUBELET, STRANGER], ids=["the node's kubelet", "a stranger"])
def test_a_request_that_edits_the_state_is_refused(user: str) -> None:
    old = stored(25, state=history(25, frozen_until=T0 + timedelta(hours=3)))
    forged = encode_state(history(25), StateKeys([b"attacker-key-attacker-key-32byte"]))

    judged = judge(old, with_annotation(old, STATE, forged), user=user)

    assert judged.body["allowed"] is False
    assert "changes the guard's state" in judged.body["status"]["message"]


def test_a_request_that_removes_the_state_is_refused_also_with_a_removal() -> None:
    # Attack 7's first write: the node removes a driver and deletes the state in one PUT.
    old = stored(25)
    judged = judge(old, with_annotation(without_driver(old, EBS), STATE, None))
    assert judged.body["allowed"] is False
    assert "removes the guard's state" in judged.body["status"]["message"]


def test_a_stale_copy_with_an_older_state_is_left_to_the_apiservers_conflict() -> None:
    """A PUT based on an older resourceVersion carries that copy's state: the apiserver refuses it with 409
    Conflict (the client GETs again), so the guard does not answer 403 for a state change first."""
    old = with_resource_version(stored(25), "200")
    stale = with_resource_version(with_annotation(old, STATE, None), "100")
    current = with_resource_version(with_annotation(old, STATE, None), "200")

    assert judge(old, stale).body["allowed"] is True
    assert judge(old, current).body["allowed"] is False


def with_resource_version(obj: dict[str, Any], version: str) -> dict[str, Any]:
    changed = copy.deepcopy(obj)
    changed["metadata"]["resourceVersion"] = version
    return changed


def test_the_guards_own_state_met_again_on_reinvocation_is_not_refused() -> None:
    old = stored(25)
    first = judge(old, kubelet_update(old, EBS, 23))
    assert first.final is not None and first.state is not None

    again = judge(old, first.final)  # /mutate reinvoked after another webhook changed the object

    assert again.body["allowed"] is True
    assert again.state is not None and again.state.sequence == first.state.sequence


def test_a_request_that_adds_a_state_where_there_was_none_is_refused() -> None:
    old = stored(25, state=None)

    judged = judge(old, with_annotation(old, STATE, encode_state(history(25), KEYS)))

    assert judged.body["allowed"] is False


def test_a_request_that_edits_the_state_with_a_decrease_is_refused() -> None:
    old = stored(25)
    new = with_annotation(kubelet_update(old, EBS, 23), STATE, '{"drivers": {}}')

    judged = judge(old, new)

    assert judged.body["allowed"] is False


def _same_decision_cases() -> list[Any]:
    old = stored(25)
    recent = stored(25, state=history(25, ago=10))
    return [
        pytest.param(old, kubelet_update(old, EBS, 23), id="an admitted decrease"),
        pytest.param(old, kubelet_update(old, EBS, 39), id="a clamp"),
        pytest.param(old, kubelet_update(old, EBS, 0), id="a warning"),
        pytest.param(recent, kubelet_update(recent, EBS, 26), id="a deny"),
        pytest.param(old, with_annotation(old, JUSTIFICATION, justification(0, 0)), id="a refused justification"),
    ]


@pytest.mark.parametrize(("old", "new"), _same_decision_cases())
def test_a_dry_run_request_gets_the_same_decision(old: dict[str, Any], new: dict[str, Any]) -> None:
    real = judge(old, new)
    dry = judge(old, new, dry_run=True)

    assert dry.body == real.body
    assert dry.decision.decision is real.decision.decision


def test_a_dry_run_request_gets_the_budget_decision_without_taking_from_it() -> None:
    budget = IncreaseBudget(rate=1, burst=1)
    old = stored(25)
    put = kubelet_update(old, EBS, 26)

    assert judge(old, put, dry_run=True, budget=budget, budget_clock=0).body["allowed"] is True
    assert budget.available(0) == 1
    assert judge(old, put, budget=budget, budget_clock=0).body["allowed"] is True
    dry = judge(old, put, dry_run=True, policy=WRITER_POLICY, user=WRITER, budget=budget, budget_clock=0)
    real = judge(old, put, policy=WRITER_POLICY, user=WRITER, budget=budget, budget_clock=0)

    assert dry.body == real.body
    assert real.body["allowed"] is False
    dry_held = judge(old, put, dry_run=True, budget=budget, budget_clock=0)
    real_held = judge(old, put, budget=budget, budget_clock=0)
    assert dry_held.body == real_held.body
    assert [c.final for c in real_held.decision.changes] == [25], "the node's kubelet's is held at the stored count"


# -- justifications ------------------------------------------------------------------------------------------------


def test_a_justification_from_a_non_justifier_is_refused_by_writer_identity() -> None:
    old = stored(25)

    judged = judge(old, with_annotation(old, JUSTIFICATION, justification(0, 0)), user=STRANGER)

    assert judged.body["allowed"] is False
    assert judged.lines == [
        f"[writer-identity] {NODE}: {JUSTIFICATION}: bob is not a justifier the policy lists; "
        "ask a principal listed under spec.justifiers to set the justification"
    ]


def test_a_justification_from_a_justifier_is_recorded_in_the_state() -> None:
    old = stored(25)

    judged = judge(old, with_annotation(old, JUSTIFICATION, justification(0, 0)), user=APPROVER, at=30)

    assert judged.body["allowed"] is True
    assert judged.decision.approvals_recorded == 1
    assert judged.state is not None
    assert judged.state.approvals == (
        Approval(
            driver=EBS,
            reason="node drain",
            min_count=0,
            max_count=0,
            expires=datetime(2026, 11, 30, 4, 0, tzinfo=UTC),
            ticket="OPS-1",
            approved_by="alice",
            approved_at=T0 + timedelta(seconds=30),
        ),
    )
    assert judged.state.entries == history().entries


def test_a_justification_kubelet_keeps_on_its_put_is_not_judged_again() -> None:
    server = Apiserver(stored(25))
    server.put(with_annotation(server.obj, JUSTIFICATION, justification(0, 0)), 10, user=APPROVER)

    judged = server.kubelet(0, 20)

    assert judged.body["allowed"] is True
    assert "warnings" not in judged.body
    assert judged.state is not None
    assert len(judged.state.approvals) == 1
    assert judged.state.entries[EBS].correction == Correction(
        at=T0 + timedelta(seconds=20), before=25, after=0, basis="justification"
    )


def test_a_justification_lets_another_writer_change_the_count() -> None:
    old = signed(stored(25, state=None), GuardState(uid=UID, entries=history().entries, approvals=(approval(20, 26),)))

    justified = judge(old, kubelet_update(old, EBS, 26), user=STRANGER)

    assert set(justified.body) == {"uid", "allowed", "patchType", "patch", "auditAnnotations"}
    assert justified.body["auditAnnotations"] == {"decision": "allow", "policy": POLICY.hash}
    assert judge(old, kubelet_update(old, EBS, 27), user=STRANGER).body["allowed"] is False


def test_an_approver_may_justify_and_change_in_one_request() -> None:
    old = stored(25)
    new = with_annotation(kubelet_update(old, EBS, 0), JUSTIFICATION, justification(0, 0))

    judged = judge(old, new, user=APPROVER)

    assert judged.body["allowed"] is True
    assert "warnings" not in judged.body


@pytest.mark.parametrize(
    ("value", "warns"),
    [
        pytest.param(justification(0, 0), False, id="a justification covering 0 silences the warning"),
        pytest.param(justification(0, 0, expires="2026-11-30T01:00:00Z"), True, id="an expired justification"),
        pytest.param(justification(1, 10), True, id="a justification whose range leaves out 0"),
        pytest.param(justification(0, 0, driver=GCE), True, id="a justification for another driver"),
    ],
)
def test_only_a_matching_unexpired_justification_counts(value: str, warns: bool) -> None:
    server = Apiserver(stored(25))
    server.put(with_annotation(server.obj, JUSTIFICATION, value), 10, user=APPROVER)

    judged = server.kubelet(0, 20)

    assert judged.body["allowed"] is True
    assert ("warnings" in judged.body) is warns


def test_an_expired_justification_is_named_in_a_warning_and_not_recorded() -> None:
    old = stored(25)

    judged = judge(
        old,
        with_annotation(old, JUSTIFICATION, justification(0, 0, expires="2026-11-30T01:00:00Z")),
        user=APPROVER,
    )

    assert judged.body["warnings"] == ["justification for ebs.csi.aws.com expired at 2026-11-30T01:00:00+00:00; "
                                       "not recorded"]
    assert judged.decision.approvals_recorded == 0
    assert "patch" not in judged.body


def test_a_recorded_approval_expires() -> None:
    state = GuardState(uid=UID, entries=history().entries, approvals=(approval(0, 0, expires=T0 - timedelta(1)),))
    old = signed(stored(25, state=None), state)

    judged = judge(old, kubelet_update(old, EBS, 0))

    assert "warnings" in judged.body
    assert judged.state is not None
    assert judged.state.approvals == ()


def test_a_malformed_justification_from_a_justifier_is_refused_with_code_400() -> None:
    old = stored(25)
    value = json.dumps([{"driver": EBS, "reason": " ", "minCount": 0, "maxCount": 0, "expires": "2026-12-01"}])

    judged = judge(old, with_annotation(old, JUSTIFICATION, value), user=APPROVER)

    assert judged.body["status"] == {
        "code": 400,
        "reason": "BadRequest",
        "message": "csinode-guard.io/justification[0].reason must say why",
    }


@pytest.mark.parametrize(
    ("value", "message"),
    [
        pytest.param("{not json", "csinode-guard.io/justification is not JSON", id="text that is not JSON"),
        pytest.param('"approve"', "csinode-guard.io/justification must be a JSON list of objects", id="a string"),
        pytest.param("[1]", "csinode-guard.io/justification[0] must be an object", id="a list of numbers"),
        pytest.param(
            json.dumps([{"reason": "r", "minCount": 0, "maxCount": 0, "expires": "2026-12-01T00:00:00Z"}]),
            "csinode-guard.io/justification[0].driver must be a driver name",
            id="no driver",
        ),
        pytest.param(
            json.dumps([{"driver": EBS, "reason": "r", "minCount": 0, "maxCount": 0, "expires": "soon"}]),
            "csinode-guard.io/justification[0].expires must be an RFC 3339 time",
            id="an expiry that is not a time",
        ),
        pytest.param(
            json.dumps([{"driver": EBS, "reason": "r", "minCount": -1, "maxCount": 0, "expires": "2026-12-01"}]),
            "csinode-guard.io/justification[0].minCount must be an integer from 0 to 2147483647",
            id="a negative minimum",
        ),
        pytest.param(
            json.dumps([{"driver": EBS, "reason": "r", "minCount": 5, "maxCount": "9", "expires": "2026-12-01"}]),
            "csinode-guard.io/justification[0].maxCount must be an integer from 0 to 2147483647",
            id="a maximum that is text",
        ),
        pytest.param(
            json.dumps([{"driver": EBS, "reason": "r", "minCount": 5, "maxCount": 2**64, "expires": "2026-12-01"}]),
            "csinode-guard.io/justification[0].maxCount must be an integer from 0 to 2147483647",
            id="a maximum beyond int32 (the signed state must hold it exactly)",
        ),
        pytest.param(
            json.dumps([{"driver": EBS, "reason": "r", "minCount": 5, "maxCount": 9,
                         "expires": "9999-12-31T23:30:00-01:00"}]),
            "csinode-guard.io/justification[0].expires must be an RFC 3339 time",
            id="an expiry that UTC cannot hold",
        ),
        pytest.param(
            json.dumps([{"driver": f"d{i}", "reason": "r", "minCount": 0, "maxCount": 1, "expires": "2026-12-01"}
                        for i in range(257)]),
            "csinode-guard.io/justification has 257 entries; at most 256",
            id="too many entries",
        ),
        pytest.param(
            json.dumps([{"driver": EBS, "reason": "r", "minCount": 9, "maxCount": 5, "expires": "2026-12-01"}]),
            "csinode-guard.io/justification[0]: minCount 9 is above maxCount 5",
            id="a range the wrong way round",
        ),
    ],
)
def test_a_justification_that_does_not_parse_is_refused_naming_the_field(value: str, message: str) -> None:
    old = stored(25)

    judged = judge(old, with_annotation(old, JUSTIFICATION, value), user=APPROVER)

    assert judged.body["allowed"] is False
    assert judged.body["status"]["code"] == 400
    assert judged.body["status"]["message"].startswith(message)


def test_a_single_justification_object_is_taken_as_a_list_of_one() -> None:
    old = stored(25)
    value = json.dumps({"driver": EBS, "reason": "drain", "minCount": 0, "maxCount": 0, "expires": "2026-12-01"})

    judged = judge(old, with_annotation(old, JUSTIFICATION, value), user=APPROVER)

    assert judged.state is not None
    assert [(a.driver, a.expires, a.ticket) for a in judged.state.approvals] == [
        (EBS, datetime(2026, 12, 1, tzinfo=UTC), "")
    ]


# -- ResourceExhausted evidence ------------------------------------------------------------------------------------


def attach_errors(*codes: int | None, ago: float = 60) -> StaticClusterView:
    return StaticClusterView(
        attach_error_list={
            (NODE, EBS): [
                AttachError(code=code, time=T0 - timedelta(seconds=ago), volume_attachment=f"csi-{i}")
                for i, code in enumerate(codes)
            ]
        }
    )


def test_a_decrease_backed_by_resource_exhausted_is_a_correction() -> None:
    old = stored(25)

    judged = judge(old, kubelet_update(old, EBS, 23), cluster=attach_errors(8))

    assert judged.state is not None
    assert judged.state.entries[EBS].correction == Correction(at=T0, before=25, after=23, basis="resource-exhausted")
    assert [c.correction for c in judged.decision.changes] == ["resource-exhausted"]


@pytest.mark.parametrize(
    "cluster",
    [
        pytest.param(attach_errors(7), id="permission denied"),
        pytest.param(attach_errors(9), id="failed precondition"),
        pytest.param(attach_errors(4, 14), id="transient errors"),
        pytest.param(attach_errors(None), id="an error without code"),
        pytest.param(attach_errors(8, ago=16 * 60), id="resource exhausted older than resourceExhaustedWithin"),
        pytest.param(StaticClusterView(known_attach_errors=False), id="attach errors unknown"),
        pytest.param(StaticClusterView(), id="no attach errors"),
    ],
)
def test_a_decrease_without_recent_resource_exhausted_evidence_is_no_correction(cluster: StaticClusterView) -> None:
    old = stored(25)

    judged = judge(old, kubelet_update(old, EBS, 23), cluster=cluster)

    assert judged.body["allowed"] is True
    assert judged.state is not None
    assert judged.state.entries[EBS].correction is None


def test_an_increase_undoing_a_correction_within_the_window_is_held_at_the_stored_count() -> None:
    server = Apiserver(stored(25), cluster=attach_errors(8))
    server.kubelet(23, 0)

    judged = server.kubelet(25, 120)

    assert judged.decision.decision is Decision.CLAMP
    assert [c.final for c in judged.decision.changes] == [23]
    assert judged.body["warnings"][0] == clamp_line(
        "count-rollback", 23, 25, 23,
        "back to 25 undoes the correction 25 -> 23 at 2026-11-30T02:00:00.000Z within 1h",
        "have an approver justify the restore, or wait for the window to pass",
    )
    assert server.kubelet(24, 180).body["allowed"] is True
    assert server.kubelet(25, 3601).body["allowed"] is True


def test_a_large_decrease_with_only_non_capacity_errors_is_named_in_a_warning() -> None:
    old = stored(25)

    judged = judge(old, kubelet_update(old, EBS, 10), cluster=attach_errors(7, 9, 9))

    assert judged.body["allowed"] is True
    assert judged.body["warnings"] == [
        f"{WHERE}: 25 -> 10 coincides only with non-capacity attach errors (permission: 1, precondition: 2); "
        "lowering the count on any attach failure is a driver mistake"
    ]
    assert judged.decision.decision is Decision.ALLOW


@pytest.mark.parametrize(
    ("new", "cluster"),
    [
        pytest.param(20, attach_errors(7), id="a small decrease"),
        pytest.param(10, attach_errors(7, 8), id="a large decrease with a capacity error among them"),
        pytest.param(10, StaticClusterView(), id="a large decrease without attach errors"),
    ],
)
def test_no_capacity_warning_otherwise(new: int, cluster: StaticClusterView) -> None:
    old = stored(25)
    assert "warnings" not in judge(old, kubelet_update(old, EBS, new), cluster=cluster).body


# -- the cluster-wide increase budget ------------------------------------------------------------------------------


def test_an_exhausted_budget_denies_increases_until_it_refills() -> None:
    """A listed writer's increase is refused while the budget is used up; the node's kubelet's is held at the
    stored count (a change-rate deny acts as clamp for it)."""
    budget = IncreaseBudget(rate=1, burst=1)
    old = stored(25)
    put = kubelet_update(old, EBS, 26)
    used_up = "the cluster-wide increase budget (1/s, burst 1, 1/node) is used up"
    how = "kubelet retries at its next update period; many nodes raising counts at once is worth a look"

    assert judge(old, put, budget=budget, budget_clock=100.0).body["allowed"] is True
    judged = judge(old, put, policy=WRITER_POLICY, user=WRITER, budget=budget, budget_clock=100.2)
    held = judge(old, put, budget=budget, budget_clock=100.2)

    assert judged.lines == [message_line("change-rate", 25, 26, used_up, how)]
    assert held.body["allowed"] is True
    assert held.body["warnings"][0] == clamp_line("change-rate", 25, 26, 25, used_up, how)
    assert [c.final for c in held.decision.changes] == [25]
    assert judge(old, put, budget=budget, budget_clock=101.2).body["allowed"] is True
    assert budget.available(101.2) == 0, "the refilled token went to the write that passed"


INVENTED = [f"d{i:02d}.invented.example.com" for i in range(50)]


def _registered_with(drivers: list[str], count: int, *, node: str = NODE) -> Apiserver:
    """A CSINode of ``node`` whose kubelet registered ``drivers`` at ``count`` (through /mutate and /validate, so the
    state records each entry), judged with a roomy budget and no CSIDriver objects for them."""
    obj = copy.deepcopy(base_csinode())
    obj["metadata"]["name"] = node
    server = Apiserver(obj, cluster=StaticClusterView(csidrivers=frozenset({EBS})))
    user = (f"system:node:{node}", ["system:nodes", "system:authenticated"])
    registered = with_drivers(obj, *obj["spec"]["drivers"], *(driver_entry(d, count) for d in drivers))
    assert server.put(registered, 0, user=user).body["allowed"]
    return server


def _raised(obj: dict[str, Any], drivers: list[str], by: int) -> dict[str, Any]:
    new = copy.deepcopy(obj)
    for entry in new["spec"]["drivers"]:
        if entry["name"] in drivers:
            entry["allocatable"] = {"count": entry["allocatable"]["count"] + by}
    return new


def _finals(judged: Judged) -> dict[str, int | None]:
    return {c.change.driver: c.final for c in judged.decision.changes}


def test_attack_8_invented_drivers_draw_nothing_and_another_nodes_increase_is_admitted() -> None:
    """Issue 32, attack 8: node-a raises 50 drivers the cluster has no CSIDriver object for, all in one PUT; they
    are judged by their own entries' rules and ask nothing of the budget, so node-b's increase of a real driver
    still has room."""
    budget = IncreaseBudget(rate=5, burst=50)
    node_a = _registered_with(INVENTED, 1)
    node_a.options["budget"], node_a.options["budget_clock"] = budget, 3600.0
    flood = node_a.put(_raised(node_a.obj, INVENTED, 1), 3600)
    assert flood.body["allowed"] is True
    assert set(_finals(flood).values()) == {2}, "judged by their ceilings only: all 50 raised"
    assert budget.available(3600) == 50

    node_b = "ip-10-0-2-2.ec2.internal"
    b = _registered_with([EBS], 10, node=node_b)
    user_b = (f"system:node:{node_b}", ["system:nodes"])
    b.options["budget"], b.options["budget_clock"] = budget, 3600.0
    raised = b.put(_raised(b.obj, [EBS], 2), 3600, user=user_b)
    assert _finals(raised) == {EBS: 12}


def test_the_increases_of_one_write_are_granted_one_by_one_within_the_nodes_share() -> None:
    """Real drivers (CSIDriver objects): a node raising 8 in one PUT gets its share (burst 50 // 10 = 5), in the
    object's order; the other 3 are held at their stored count (a clamp: kubelet's write succeeds). Another node
    still gets its share from what is left."""
    real = [f"d{i}.real.example.com" for i in range(8)]
    budget = IncreaseBudget(rate=5, burst=50)
    server = _registered_with(real, 10)
    server.options["cluster"] = StaticClusterView(csidrivers=frozenset(real))
    server.options["budget"], server.options["budget_clock"] = budget, 3600.0
    judged = server.put(_raised(server.obj, real, 1), 3600)

    assert judged.body["allowed"] is True
    assert _finals(judged) == {d: 11 if i < 5 else 10 for i, d in enumerate(real)}
    assert judged.body["auditAnnotations"]["decision"] == "clamp"
    assert budget.available(3600) == 45
    assert budget.admit("ip-10-0-2-2.ec2.internal", 6, 3600) == 5, "another node: its own share"
    assert budget.admit(NODE, 1, 3600 + 9.9) == 0, "node-a's share is spent for the window (10 s)"
    assert budget.admit(NODE, 1, 3600 + 10) == 1


def test_a_dry_run_is_granted_what_a_real_write_would_be_and_takes_nothing() -> None:
    budget = IncreaseBudget(rate=1, burst=20)  # share 2
    assert budget.admit(NODE, 3, 0, dry_run=True) == 2
    assert budget.available(0) == 20 and budget.node_used(NODE, 0) == 0
    assert budget.admit(NODE, 3, 0) == 2
    assert budget.admit(NODE, 1, 0, dry_run=True) == 0


def test_decreases_validate_and_denied_requests_take_nothing_from_the_budget() -> None:
    budget = IncreaseBudget(rate=1, burst=1)
    old = stored(25)
    recent = stored(25, state=history(25, ago=5))

    judge(old, kubelet_update(old, EBS, 20), budget=budget, budget_clock=0)
    judge(old, kubelet_update(old, EBS, 26), budget=budget, budget_clock=0, mode=Mode.VALIDATE)
    denied = judge(recent, kubelet_update(recent, EBS, 26), policy=WRITER_POLICY, user=WRITER, budget=budget,
                   budget_clock=0)
    assert denied.body["allowed"] is False
    held = judge(recent, kubelet_update(recent, EBS, 26), budget=budget, budget_clock=0)
    assert [c.final for c in held.decision.changes] == [25], "the node's kubelet's too-fast increase is held"

    assert budget.available(0) == 1


def test_an_increase_clamped_back_to_the_old_count_takes_nothing_from_the_budget() -> None:
    budget = IncreaseBudget(rate=1, burst=1)
    old = stored(25)

    judge(old, kubelet_update(old, EBS, None), budget=budget, budget_clock=0)

    assert budget.available(0) == 1


# -- driver versions and freezes -----------------------------------------------------------------------------------


def test_a_driver_rollback_freezes_increases_for_freeze_for() -> None:
    server = Apiserver(stored(25))

    rollback = server.kubelet(23, 0, version="v1.30.0")
    assert rollback.body["allowed"] is True
    assert rollback.body["warnings"] == [
        message_line(
            "writer-version", 25, 23,
            "driver version rolled back v1.37.0 -> v1.30.0; increases are frozen for 6h",
            "roll the driver forward, or have an approver justify the rollback",
        )
    ]
    assert rollback.state is not None
    assert rollback.state.entries[EBS].frozen_until == T0 + timedelta(hours=6)
    assert rollback.state.entries[EBS].writer_version == "v1.30.0"

    frozen = server.kubelet(24, 600)
    line = clamp_line(
        "count-rollback", 23, 24, 23,
        "increases are frozen until 2026-11-30T08:00:00.000Z after a driver version rollback",
        "wait for the freeze to end (rolling the driver forward does not lift it), or have an approver justify "
        "the increase",
    )
    # The whole line is longer than the apiserver keeps: the reason is shortened, the advice kept whole, starting
    # within 200 characters (the audit record has the whole reason).
    advice = ("wait for the freeze to end (rolling the driver forward does not lift it), or have an approver justify "
              "the increase")
    warning = frozen.body["warnings"][0]
    assert len(line) > 256 and len(warning) <= 256
    assert warning == line[: warning.index("...; ")] + "...; " + advice, warning
    assert warning.index(advice) <= 200
    assert [c.final for c in frozen.decision.changes] == [23], "the node's kubelet's increase is held while frozen"
    assert server.kubelet(20, 700).body["allowed"] is True
    assert server.kubelet(22, 6 * 3600).body["allowed"] is True


def test_an_increase_from_a_rolled_back_driver_is_held_at_the_stored_count_and_nothing_is_recorded() -> None:
    old = stored(23)

    judged = judge(old, kubelet_update(old, EBS, 25), cluster=running("v1.30.0"))

    assert judged.decision.decision is Decision.CLAMP
    assert [c.final for c in judged.decision.changes] == [23]
    assert judged.body["warnings"][0] == clamp_line(
        "writer-version", 23, 25, 23,
        "driver version rolled back v1.37.0 -> v1.30.0; increases are frozen for 6h",
        "roll the driver forward, or have an approver justify the rollback",
    )
    assert judged.decision.new_state is None


def test_a_justified_rollback_is_admitted_and_still_freezes() -> None:
    state = GuardState(uid=UID, entries=history(23).entries, approvals=(approval(0, 30),))
    old = signed(stored(23, state=None), state)

    judged = judge(old, kubelet_update(old, EBS, 25), cluster=running("v1.30.0"))

    assert judged.body["allowed"] is True
    assert "warnings" not in judged.body
    assert judged.state is not None
    assert judged.state.entries[EBS].frozen_until == T0 + timedelta(hours=6)


@pytest.mark.parametrize(
    ("drivers", "cluster", "new", "final"),
    [
        pytest.param({EBS: {"minVersion": "v1.38.0", "versionSource": ANNOTATION_SOURCE}}, None,
                     signed(stored(25, state=None), declared_history("v1.37.0")), 25,
                     id="a version a reporter declared is read from the state"),
        pytest.param({EBS: {"minVersion": "v1.38.0", "versionSource": ANNOTATION_SOURCE}}, None,
                     None, 26, id="the annotation the kubelet can write is not read"),
        pytest.param(
            {EBS: {"minVersion": "v1.35.0", "versionSource": {"type": "kubelet"}}},
            StaticClusterView(nodes={NODE: {"labels": {}, "kubeletVersion": "v1.34.2-eks-1a2b3c"}}),
            None,
            25,
            id="the kubelet version source asks the cluster",
        ),
        pytest.param(
            {
                EBS: {
                    "minVersion": "v1.35.0",
                    "versionSource": {
                        "type": "pod", "namespace": "kube-system",
                        "selector": {"matchLabels": {"app": "ebs-csi-node"}}, "container": "ebs-plugin",
                    },
                }
            },
            StaticClusterView(driver_versions={NODE: {EBS: "v1.40.0"}}),
            None,
            26,
            id="the pod version source asks the cluster",
        ),
    ],
)
def test_the_driver_version_comes_from_the_configured_source(
    drivers: dict[str, Any], cluster: StaticClusterView | None, new: dict[str, Any] | None, final: int
) -> None:
    """A below-minVersion driver's increase by the node's kubelet is held at the stored count (25); a driver at
    or above it gets its 26. The same write from a listed writer is refused for the held cases."""
    old = new if new is not None else stored(25)
    put = kubelet_update(old, EBS, 26)

    judged = judge(old, put, policy=make_policy(drivers=drivers), cluster=cluster)
    assert judged.body["allowed"] is True
    assert [c.final for c in judged.decision.changes] == [final]
    writer_policy = make_policy(drivers=drivers, writers={"users": [WRITER[0]]})
    by_writer = judge(old, put, policy=writer_policy, cluster=cluster, user=WRITER)
    assert by_writer.body["allowed"] is (final == 26)


def test_change_rate_waits_for_the_drivers_update_period() -> None:
    old = stored(25, state=history(25, ago=120))
    cluster = StaticClusterView(driver_periods={EBS: 300.0})

    judged = judge(old, kubelet_update(old, EBS, 26), cluster=cluster)

    assert judged.body["warnings"][0] == clamp_line(
        "change-rate", 25, 26, 25, "2m after the last accepted change; the minimum is 5m", RATE_HOW
    )
    assert [c.final for c in judged.decision.changes] == [25]


# -- real input ----------------------------------------------------------------------------------------------------

DATA = Path(__file__).parent / "data"


@pytest.mark.parametrize(
    ("name", "decision", "rules"),
    [
        pytest.param("review-register.json", "allow", [], id="kubelet registers EBS"),
        pytest.param("review-eni-25-to-23.json", "allow", [], id="network interfaces take two slots"),
        pytest.param("review-report-39.json", "clamp", ["count-ceiling"], id="a report above the ceiling"),
        pytest.param("review-unbounded.json", "clamp", ["count-ceiling"], id="an unbounded report"),
        pytest.param("review-drop-to-zero.json", "warn", ["count-rollback"], id="a drop to zero"),
        pytest.param("review-other-node.json", "deny", ["writer-identity"], id="another node's kubelet"),
    ],
)
def test_recorded_apiserver_reviews_under_the_bundled_policy(name: str, decision: str, rules: list[str]) -> None:
    path = DATA / name
    if not path.exists():
        pytest.skip(f"{name} is not in tests/data")
    request = parse_review(path.read_bytes())

    result = evaluate(request, load_policy(), UnknownClusterView(), T0, KEYS)

    assert result.decision.value == decision
    assert result.fired_rules == rules


def test_explain_gives_one_line_per_rule_outcome() -> None:
    old = stored(25)
    judged = judge(old, kubelet_update(old, EBS, 39))

    lines = explain(judged.decision)

    assert len(lines) == 5
    assert lines[0] == "writer-identity  ebs.csi.aws.com: pass - written by the node's own kubelet"
    assert lines[2].startswith("count-ceiling    ebs.csi.aws.com: violation (clamp -> clamp) - [count-ceiling]")
