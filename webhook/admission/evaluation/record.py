"""Stage 4, record: a settled write -> the :class:`AdmissionDecision`: the AdmissionResponse (a denial's 403 and
lines, or the warnings and, in /mutate, the JSON patch with the next signed state), its audit annotations, and
every rule outcome, change outcome and note for the audit records.

A refused write: every entry keeps what is stored (which may be above the count judged from). An admitted one:
the state of :mod:`.next_state`, the patch of :mod:`.patching`.
"""

from __future__ import annotations

from webhook.admission.csinode import CountChange
from webhook.admission.decision import AdmissionDecision, ChangeOutcome, Decision, Mode, Note
from webhook.admission.evaluation.classify import Write
from webhook.admission.evaluation.judge import Judgement
from webhook.admission.evaluation.next_state import next_state
from webhook.admission.evaluation.patching import patch_operations
from webhook.admission.evaluation.settle import Settlement
from webhook.admission.review import AdmissionResponse
from webhook.admission.state import STATE_ANNOTATION, GuardState, StateKeys
from webhook.admission.state_bounds import MAX_ENTRIES, Bounded, bound_state, state_room


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
    if new_state is not None:
        # Within its bounds (state_bounds): without room for any, the stored state stays as it is.
        bounded = bound_state(new_state, write.now, state_room(_final_annotations(write)))
        if bounded.dropped:
            notes = (*notes, _bounds_note(write, bounded, len(new_state.entries)))
        new_state = bounded.state
    ops = (patch_operations(write.request, write.old, write.new, write.changes, settlement.finals,
                            write.declarations.restore, new_state, keys)
           if write.mode is Mode.MUTATE else [])
    response = AdmissionResponse(
        allowed=True,
        warnings=(*settlement.warnings, *notes),
        patch=tuple(ops),
        audit_annotations=audit_annotations(write, settlement, settlement.decision),
    )
    return _decision(write, settlement._replace(notes=notes), response, change_outcomes, new_state)


def _final_annotations(write: Write) -> dict[str, str]:
    """The annotations the admitted object will have besides the state: the request's, with the ones the patch
    puts back as stored (:attr:`~.annotations.Declarations.restore`)."""
    final = {k: v for k, v in write.new.annotations.items() if k != STATE_ANNOTATION}
    for key in write.declarations.restore:
        before = write.old.annotations.get(key)
        if before is None:
            final.pop(key, None)
        else:
            final[key] = before
    return final


def _bounds_note(write: Write, bounded: Bounded, entries: int) -> Note:
    """What a state cut to its bounds left out (a warning of at most 256 characters)."""
    if bounded.state is None:
        return Note(f"{write.node}: no room for csinode-guard's state next to the object's other annotations "
                    "(apiserver limit 256 KiB): the stored state is not updated; what it lacks is judged from the "
                    "ceilings")
    kept = len(bounded.state.entries)
    return Note(f"{write.node}: csinode-guard's state keeps {kept} of {entries} entries (at most "
                f"{MAX_ENTRIES}, within the 256 KiB annotation limit); the other {len(bounded.dropped)} are judged "
                "from the ceilings")


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
