"""The answer past the time budget: what the guard already knows to be safe, instead of no answer.

A guard that does not answer within the webhook's ``timeoutSeconds`` lets the apiserver apply the failurePolicy:
``Ignore`` on the entry of the writes never refused (registrations, CREATE, decreases), so a registration of ebs
at 128 hidden among thousands of other drivers went through unjudged and stayed (issue 32, attack 5). So the
evaluation has an internal budget well under ``timeoutSeconds`` (:mod:`.deadline`); past it the guard answers
with checks that cost a few microseconds per driver and need no history:

- a registration (a driver that appears, every driver of a CREATE): the ceilings only — a count above the
  ceiling the node's labels select (or unbounded where that ceiling is finite) is clamped to it; the retained
  history (pin, count before removal, freeze) is not read;
- an increase of an entry that stays (or a change to unbounded), by the node's own kubelet: held at the stored
  count (the clamp a count rule's denial acts as for the kubelet); by anyone else: refused (403), as
  :func:`webhook.admission.evaluation.unjudged` does;
- a decrease and a removal: admitted (the safe direction).

No new state is written (the stored one stays, so the next write is judged from it in full), and the guard's
annotations the request changed (its state, a justification, declared versions) are put back as stored. /validate
refuses an increase it sees and only warns about a registration above its ceiling (never refused). The answer
says so in a warning and in ``auditAnnotations.hurried``.
"""

from __future__ import annotations

from collections.abc import Mapping

from webhook.admission.ceiling_pin import pin_ceiling
from webhook.admission.cluster import ClusterView
from webhook.admission.csinode import CountChange, CSINode, diff_drivers, format_count
from webhook.admission.decision import AdmissionDecision, ChangeOutcome, Decision, Mode, Note
from webhook.admission.evaluation.patching import patch_operations
from webhook.admission.justification import JUSTIFICATION_ANNOTATION
from webhook.admission.policy import Policy
from webhook.admission.review import AdmissionRequest, AdmissionResponse
from webhook.admission.state import StateKeys


def _rises(change: CountChange) -> bool:
    if change.old is None:
        return False
    return change.new is None or change.new > change.old


def _ceiling_clamp(policy: Policy, labels: Mapping[str, str] | None, change: CountChange) -> int | None:
    """The count the ceilings allow a registration (``change.new`` when it is within them)."""
    ceiling = pin_ceiling(policy.for_driver(change.driver).ceiling, labels, None).ceiling
    if ceiling is not None and (change.new is None or change.new > ceiling):
        return ceiling
    return change.new


def hurried(request: AdmissionRequest, policy: Policy, cluster: ClusterView, old: CSINode, new: CSINode,
            mode: Mode, keys: StateKeys, budget_seconds: float | None = None) -> AdmissionDecision:
    """The answer to the CREATE or UPDATE ``request`` of ``old`` into ``new`` when the evaluation ran out of time
    (see the module docstring); ``budget_seconds`` only words the warning. Linear in the drivers; never raises
    for objects :func:`webhook.admission.csinode.parse_csinode` accepted."""
    node = new.name or old.name or request.name
    kubelet = request.username == f"system:node:{node}" and "system:nodes" in request.groups
    create = request.operation == "CREATE"
    labels = cluster.node_labels(node)
    changes = diff_drivers(old, new, registrations=True)
    finals: dict[str, int | None] = {}
    rising: list[CountChange] = []
    for c in changes:
        if c.registration or create or c.driver not in old.drivers:
            finals[c.driver] = _ceiling_clamp(policy, labels, c)
        elif _rises(c):
            finals[c.driver] = c.old
            rising.append(c)
        else:
            finals[c.driver] = c.new
    spent = f" ({budget_seconds:g} s)" if budget_seconds is not None else ""
    annotations = {"decision": "", "policy": policy.hash, "hurried": "true"}
    if rising and (not kubelet or mode is Mode.VALIDATE):
        listed = ", ".join(f"{c.driver}: {format_count(c.old)} -> {format_count(c.new)}" for c in rising[:5])
        message = (f"csinode-guard could not judge this write within its time budget{spent}, so it refuses its count "
                   f"increases ({listed}{', ...' if len(rising) > 5 else ''}); decreases and registrations are "
                   "judged by the ceilings")
        return AdmissionDecision(
            response=AdmissionResponse(allowed=False, status_code=403, reason="Forbidden", message=message,
                                       audit_annotations={**annotations, "decision": Decision.DENY.value}),
            decision=Decision.DENY, node=node,
            changes=tuple(ChangeOutcome(c, c.old, None) for c in changes),
            notes=(Note("time budget spent: count increases refused unjudged"),),
        )
    clamped = [c for c in changes if finals[c.driver] != c.new]
    note = Note(f"csinode-guard answered {node} past its time budget{spent}: registrations judged by the ceilings "
                f"only ({len(clamped)} clamped), increases held at the stored count, no new state recorded")
    decision = Decision.CLAMP if clamped else Decision.ALLOW
    restore = tuple(k for k in (JUSTIFICATION_ANNOTATION, *sorted(policy.version_annotations))
                    if old.annotations.get(k) != new.annotations.get(k))
    ops = (patch_operations(request, old, new, changes, finals, restore, None, keys)
           if mode is Mode.MUTATE else [])
    return AdmissionDecision(
        response=AdmissionResponse(allowed=True, warnings=(note,), patch=tuple(ops),
                                   audit_annotations={**annotations, "decision": decision.value}),
        decision=decision, node=node,
        changes=tuple(ChangeOutcome(c, finals[c.driver], None) for c in changes),
        notes=(note,),
    )
