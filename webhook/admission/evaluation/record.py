"""Stage 4, record: a settled write -> the :class:`AdmissionDecision`: the AdmissionResponse (a denial's 403 and
lines, or the warnings and, in /mutate, the JSON patch with the next signed state), its audit annotations, and
every rule outcome, change outcome and note for the audit records.

A refused write: every entry keeps what is stored (which may be above the count judged from). An admitted one:
the state of :mod:`.next_state`, the patch of :mod:`.patching`.
"""

from __future__ import annotations

from webhook.admission.csinode import CountChange
from webhook.admission.decision import AdmissionDecision, ChangeOutcome, Decision, Mode
from webhook.admission.evaluation.classify import Write
from webhook.admission.evaluation.judge import Judgement
from webhook.admission.evaluation.next_state import next_state
from webhook.admission.evaluation.patching import patch_operations
from webhook.admission.evaluation.settle import Settlement
from webhook.admission.review import AdmissionResponse
from webhook.admission.state import GuardState, StateKeys


def record(write: Write, judgement: Judgement, settlement: Settlement, keys: StateKeys) -> AdmissionDecision:
    """The decision on ``write`` as settled; ``keys`` sign the next state."""
    notes = settlement.notes
    if settlement.decision is Decision.DENY:
        response = AdmissionResponse(
            allowed=False,
            status_code=403,
            reason="Forbidden",
            message="\n".join(settlement.message),
            warnings=(*settlement.warnings, *notes),
            audit_annotations=audit_annotations(write, settlement, Decision.DENY),
        )
        # Refused: every entry keeps what is stored (which may be above the count judged from).
        outcomes = [
            _with_stored(write, ChangeOutcome(c, _stored_count(write, c), judgement.contexts[c.driver].driver_version))
            for c in write.changes
        ]
        return _decision(write, settlement, response, outcomes, None)
    new_state, change_outcomes = next_state(write, judgement, settlement)
    change_outcomes = [_with_stored(write, o) for o in change_outcomes]
    ops = (patch_operations(write.request, write.old, write.new, write.changes, settlement.finals,
                            write.declarations.restore, new_state, keys)
           if write.mode is Mode.MUTATE else [])
    response = AdmissionResponse(
        allowed=True,
        warnings=(*settlement.warnings, *notes),
        patch=tuple(ops),
        audit_annotations=audit_annotations(write, settlement, settlement.decision),
    )
    return _decision(write, settlement, response, change_outcomes, new_state)


def audit_annotations(write: Write, settlement: Settlement, decision: Decision) -> dict[str, str]:
    """``auditAnnotations`` of the answer: the decision, the policy's hash, the rules that found something (in
    order, each once) and ``exempt``."""
    fired = []
    for f in settlement.findings:
        if f.violation.rule not in fired:
            fired.append(f.violation.rule)
    annotations = {"decision": decision.value, "policy": write.policy.hash}
    if fired:
        annotations["rules"] = ",".join(fired)
    if write.exempt:
        annotations["exempt"] = "true"
    return annotations


def _with_stored(write: Write, outcome: ChangeOutcome) -> ChangeOutcome:
    driver = outcome.change.driver
    stored_before = write.stored_before
    return outcome._replace(stored=(stored_before[driver],)) if driver in stored_before else outcome


def _stored_count(write: Write, change: CountChange) -> int | None:
    stored = write.old.drivers.get(change.driver)
    return stored.allocatable_count if stored is not None else change.old


def _decision(write: Write, settlement: Settlement, response: AdmissionResponse, changes: list[ChangeOutcome],
              new_state: GuardState | None) -> AdmissionDecision:
    return AdmissionDecision(
        response=response,
        decision=settlement.decision,
        node=write.node,
        outcomes=settlement.outcomes,
        changes=tuple(changes),
        state_problem=write.decoded.problem,
        state_detail=write.decoded.detail,
        exempt=write.exempt,
        in_scope=write.in_scope,
        approvals_recorded=write.declarations.approvals_recorded,
        new_state=new_state,
        notes=settlement.notes,
    )
