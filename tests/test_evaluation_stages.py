"""The evaluation's four stages one at a time: classify, judge, settle and record take and return values.

Each test builds a real AdmissionRequest (the shapes kube-apiserver sends, tests/kube.py), runs the stages up to
the one under test and checks the value it returns; the last checks that :func:`evaluate` is the four in a row.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from tests.kube import EBS, KUBELET, NODE, base_csinode, kubelet_update, review, with_annotation, without_driver
from webhook.admission.budget import IncreaseBudget
from webhook.admission.cluster import UnknownClusterView
from webhook.admission.csinode import CSINode, parse_csinode
from webhook.admission.decision import Decision, Mode
from webhook.admission.evaluation import evaluate
from webhook.admission.evaluation.classify import Write, classify
from webhook.admission.evaluation.effective import effective_action, keeps_stored_count
from webhook.admission.evaluation.judge import Found, Judgement, Remark, judge
from webhook.admission.evaluation.record import record
from webhook.admission.evaluation.settle import Settlement, settle
from webhook.admission.justification import JUSTIFICATION_ANNOTATION
from webhook.admission.policy import EnforcementAction, load_policy
from webhook.admission.review import AdmissionRequest, parse_review
from webhook.admission.rules.base import Violation
from webhook.admission.state import STATE_ANNOTATION, EntryState, GuardState, StateKeys, encode_state

NOW = datetime(2026, 11, 30, 2, 0, tzinfo=UTC)
KEYS = StateKeys([b"stages-test-hmac-key-32-bytes-ok"])
POLICY = load_policy(None)
CLUSTER = UnknownClusterView()


def _stored(count: int | None, state_count: int | None = None) -> dict[str, Any]:
    """The node's CSINode with EBS at ``count``, and a signed state that accepted ``state_count`` an hour ago."""
    obj = kubelet_update(base_csinode(), EBS, count)
    if state_count is None:
        return obj
    state = GuardState(obj["metadata"]["uid"], {EBS: EntryState(state_count, NOW - timedelta(hours=1))}, sequence=1)
    return with_annotation(obj, STATE_ANNOTATION, encode_state(state, KEYS))


def _request(old: dict[str, Any] | None, new: dict[str, Any], **kw: Any) -> AdmissionRequest:
    return parse_review(json.dumps(review(old, new, **kw)).encode())


def _objects(request: AdmissionRequest) -> tuple[CSINode, CSINode]:
    new = parse_csinode(request.object or {}, "object")
    if request.operation == "CREATE":
        return CSINode(new.name, "", {}, {}, False), new
    return parse_csinode(request.old_object or {}, "oldObject"), new


def _classify(request: AdmissionRequest, mode: Mode = Mode.MUTATE) -> Write:
    old, new = _objects(request)
    return classify(request, POLICY, CLUSTER, NOW, KEYS, mode, old, new)


def _settle(write: Write, budget: IncreaseBudget | None = None) -> tuple[Judgement, Settlement]:
    judgement = judge(write, CLUSTER, KEYS)
    return judgement, settle(write, judgement, budget, 0.0)


# -- classify ---------------------------------------------------------------------------------------------------
def test_classify_a_kubelet_increase_is_one_change_that_may_be_refused() -> None:
    write = _classify(_request(_stored(25), _stored(39)))
    assert [(c.driver, c.old, c.new) for c in write.changes] == [(EBS, 25, 39)]
    assert write.writer.is_node_kubelet and not write.never_refused and not write.soft_drivers
    assert write.node == NODE and write.in_scope and not write.exempt


def test_classify_a_registration_by_the_kubelet_is_never_refused() -> None:
    stored = without_driver(_stored(25), EBS)
    write = _classify(_request(stored, kubelet_update(stored, EBS, 25)))
    assert write.never_refused
    assert [(c.driver, c.registration) for c in write.changes] == [(EBS, True)]


def test_classify_judges_a_count_above_the_accepted_one_from_the_accepted_one() -> None:
    """The stored 39 went through unjudged; the state accepted 25: the write is judged as 25 -> 30, clamped only."""
    write = _classify(_request(_stored(39, state_count=25), _stored(30, state_count=25)))
    assert [(c.old, c.new) for c in write.changes] == [(25, 30)]
    assert write.soft_drivers == {EBS} and write.stored_before == {EBS: 39}
    assert "above the last count csinode-guard accepted (25)" in write.notes[0]


def test_classify_reads_a_strangers_justification_as_a_finding_not_an_approval() -> None:
    justification = json.dumps([{"driver": EBS, "reason": "r", "minCount": 0, "maxCount": 40,
                                 "expires": "2026-12-01T00:00:00Z"}])
    new = with_annotation(_stored(25), JUSTIFICATION_ANNOTATION, justification)
    stranger = _classify(_request(_stored(25), new, user="mallory", groups=[]))
    assert [v.rule for v in stranger.declarations.violations] == ["writer-identity"]
    assert stranger.declarations.approvals == () and stranger.declarations.restore == ()
    approver = _classify(_request(_stored(25), new, user="alice", groups=["csinode-guard:approvers"]))
    assert approver.declarations.violations == () and approver.declarations.approvals_recorded == 1
    assert approver.declarations.by_driver[EBS][0].approved_by == "alice"


def test_classify_returns_an_immutable_value() -> None:
    write = _classify(_request(_stored(25), _stored(39)))
    with pytest.raises(AttributeError):
        write.never_refused = True  # type: ignore[misc]


# -- judge ------------------------------------------------------------------------------------------------------
def test_judge_records_every_rule_on_every_change_in_order() -> None:
    judgement = judge(_classify(_request(_stored(25), _stored(39))), CLUSTER, KEYS)
    found = [v for v in judgement.verdicts if isinstance(v, Found)]
    assert [(f.change, f.violation.rule, f.violation.clamp_to) for f in found] == [(0, "count-ceiling", 27)]
    passes = [v for v in judgement.verdicts if not isinstance(v, (Found, Remark))]
    assert [p.rule for p in passes] == ["writer-identity", "writer-version", "count-rollback", "change-rate"]
    assert judgement.contexts[EBS].change.new == 39


def test_judge_puts_request_level_findings_first() -> None:
    """Another principal's removal of a driver entry: a writer-identity finding about the request, before any
    change's (there is none)."""
    write = _classify(_request(_stored(25), without_driver(_stored(25), EBS), user="mallory", groups=[]))
    judgement = judge(write, CLUSTER, KEYS)
    first = judgement.verdicts[0]
    assert isinstance(first, Found) and first.change is None and first.violation.rule == "writer-identity"


# -- effective --------------------------------------------------------------------------------------------------
def test_effective_action_follows_the_scope_the_write_and_the_endpoint() -> None:
    write = _classify(_request(_stored(25), _stored(39)))
    change = write.changes[0]
    clamp = Violation("count-ceiling", EnforcementAction.CLAMP, "why", "proceed", clamp_to=27)
    deny = Violation("change-rate", EnforcementAction.DENY, "why", "proceed", clamp_to=25)
    assert effective_action(write, clamp, change) is EnforcementAction.CLAMP
    assert effective_action(write._replace(mode=Mode.VALIDATE), clamp, change) is EnforcementAction.DENY
    assert effective_action(write._replace(in_scope=False), clamp, change) is EnforcementAction.DRYRUN
    assert effective_action(write._replace(never_refused=True), deny, change) is EnforcementAction.CLAMP
    assert effective_action(write._replace(never_refused=True, mode=Mode.VALIDATE), deny,
                            change) is EnforcementAction.WARN
    assert keeps_stored_count(write, deny, change)  # the node's kubelet raising its count: held, not refused
    assert not keeps_stored_count(write._replace(mode=Mode.VALIDATE), deny, change)


# -- settle -----------------------------------------------------------------------------------------------------
def test_settle_clamps_to_the_ceiling() -> None:
    _, settlement = _settle(_classify(_request(_stored(25), _stored(39))))
    assert settlement.decision is Decision.CLAMP and settlement.finals == {EBS: 27}
    assert settlement.message == () and "(clamped to 27)" in settlement.warnings[0]


def test_settle_a_used_up_budget_holds_the_kubelets_increase_at_the_stored_count() -> None:
    """change-rate given the budget's answer takes the place of its pass; its deny acts as a clamp to 25."""
    budget = IncreaseBudget(0.001, 1)
    assert budget.take(1, 0.0)
    write = _classify(_request(_stored(25), _stored(26)))
    _, free = _settle(write, IncreaseBudget(1.0, 5))
    _, held = _settle(write, budget)
    assert free.decision is Decision.ALLOW and free.finals == {EBS: 26}
    assert held.decision is Decision.CLAMP and held.finals == {EBS: 25}
    rate = [o for o in held.outcomes if o.rule == "change-rate"]
    assert [(o.result, o.effective) for o in rate] == [("violation", EnforcementAction.CLAMP)]
    assert len(held.outcomes) == len(free.outcomes)  # in the pass's place
    assert any("deny acts as clamp" in n for n in held.notes)


def test_settle_a_denial_lists_its_lines_and_keeps_the_other_findings_as_warnings() -> None:
    write = _classify(_request(_stored(25), _stored(39), user="system:node:other", groups=["system:nodes"]))
    _, settlement = _settle(write)
    assert settlement.decision is Decision.DENY
    assert [line.split("]")[0] for line in settlement.message] == ["[writer-identity"]
    assert any("[count-ceiling]" in w and "would be clamped to 27" in w for w in settlement.warnings)


# -- record -----------------------------------------------------------------------------------------------------
def test_record_an_admitted_clamp_patches_the_count_and_signs_the_next_state() -> None:
    write = _classify(_request(_stored(25, state_count=25), _stored(39, state_count=25)))
    judgement, settlement = _settle(write)
    decision = record(write, judgement, settlement, KEYS)
    assert decision.response.allowed and decision.decision is Decision.CLAMP
    assert decision.new_state is not None and decision.new_state.entries[EBS].count == 27
    assert decision.new_state.sequence == 2
    paths = [op["path"] for op in decision.response.patch]
    assert paths[0].endswith("/allocatable/count") and any("csinode-guard.io~1state" in p for p in paths)


def test_record_a_denial_keeps_every_stored_count_and_writes_no_state() -> None:
    write = _classify(_request(_stored(25), _stored(39), user="system:node:other", groups=["system:nodes"]))
    judgement, settlement = _settle(write)
    decision = record(write, judgement, settlement, KEYS)
    assert not decision.response.allowed and decision.response.status_code == 403
    assert decision.new_state is None and [c.final for c in decision.changes] == [25]
    assert decision.response.audit_annotations["rules"] == "writer-identity,count-ceiling"


def test_evaluate_is_the_four_stages_in_a_row() -> None:
    request = _request(_stored(25, state_count=25), _stored(39, state_count=25), uid="stages")
    write = _classify(request)
    judgement, settlement = _settle(write)
    staged = record(write, judgement, settlement, KEYS)
    whole = evaluate(request, POLICY, CLUSTER, NOW, KEYS, mode=Mode.MUTATE, budget=None, budget_clock=0.0)
    assert staged == whole
    assert whole.response.patch[0]["value"] == 27 and request.username == KUBELET
