"""evaluate(request, policy, cluster view, now) -> AdmissionDecision: the pure admission pipeline, in four stages.

Data flows one way: AdmissionRequest -> CSINode diff -> rules (with the verified state, cluster facts and
justifications) -> combined decision -> AdmissionResponse (patch, warnings, audit annotations). No I/O: the
cluster view answers from memory and the clock is an argument, so the same inputs always give the same
decision (tests, ``policy test``, ``replay``). The decision's types (:class:`AdmissionDecision` and its parts)
live in :mod:`webhook.admission.decision` and are importable from here too.

:func:`evaluate` is four calls in a row, each stage a module taking and returning immutable values:

1. :mod:`.classify` -> :class:`~.classify.Write`: who writes, the scope, the verified state, the changes to
   judge (each from the last count the guard trusts: reconciliation), which of them may only be clamped (a write
   never refused, an entry judged from its last trusted count); :mod:`.annotations` reads what the
   justification and version annotations declare.
2. :mod:`.judge` -> :class:`~.judge.Judgement`: every rule of :mod:`webhook.admission.rules` over every change
   with its context, plus the request-level checks: what each found, in order.
3. :mod:`.settle` -> :class:`~.settle.Settlement`: each finding's effective action (**decided in**
   :mod:`.effective`: scope, exemptions, writes never refused, the kubelet's deny acting as a clamp), each
   entry's final count, moot denials, the cluster budget's answer, the decision and the lines of the answer
   (:mod:`.messages`).
4. :mod:`.record` -> :class:`AdmissionDecision`: the response and its audit annotations; the next signed
   state is **built in** :mod:`.next_state`, the JSON patch in :mod:`.patching`. :mod:`.wording` holds how
   findings and passes read.

Combination: every rule runs on every change. Scope (``spec.enforcementScope``) and exemptions turn findings
into ``dryrun`` (exempt principals are evaluated and audited as if enforced, but never blocked); /validate turns
an unapplied ``clamp`` into ``deny``. Any ``deny`` -> denied (403, one line per violation); otherwise clamps ->
the most restrictive allowed count (closest to the old one); ``warn`` -> warnings; ``dryrun`` -> audit only.

Writes that are never refused (DESIGN.md, the asymmetry): a CREATE, and an UPDATE with a registration or a
removal but no increase of an entry that stays, or with only decreases. kubelet exits when it cannot register
a driver, so on these a ``deny`` acts as a ``clamp`` (to the count the rule would have kept), a finding with
nothing lower to clamp to is a warning, and /validate only warns. A registration is judged from the entry's
retained state (the count before removal, its writer version, freeze and correction); a forged annotation on
such a write is put back by the patch instead of refusing the write. Removals are never judged.

The node's own kubelet raising the count of an entry that stays: a count rule's ``deny`` acts as a ``clamp`` to
the stored count (the count the denial would have kept; /mutate only). kubelet re-registering a driver after its
own restart (the node plugin kept running) writes the same PUT as a periodic update, and a denial would fail that
registration; a clamp keeps the count, and costs one request per period instead of kubelet's four.

Reconciliation: the signed state records the last count the guard accepted. When a write went through unjudged
(the guard down under ``failurePolicy: Ignore``), the object's count differs from it: a lower one counts as
accepted, a higher one is judged as a change from the last accepted count (and is never refused for an entry
the write does not touch).

One judgement: the background audit and ``status`` judge a stored object through these same stages, as its
kubelet's no-op write (:mod:`.stored`), so they allow for each entry the count admission allows.
"""

from __future__ import annotations

from datetime import datetime

from webhook.admission.budget import IncreaseBudget
from webhook.admission.cluster import ClusterView
from webhook.admission.csinode import CSINode, CSINodeError, diff_drivers, format_count, parse_csinode
from webhook.admission.decision import (
    AdmissionDecision,
    ChangeOutcome,
    Decision,
    Mode,
    Note,
    RuleOutcome,
    explain,
    response_summary,
)
from webhook.admission.evaluation.annotations import _published_versions as _published_versions  # its cache
from webhook.admission.evaluation.classify import classify
from webhook.admission.evaluation.deadline import Deadline, OutOfTimeError, check_deadline
from webhook.admission.evaluation.hurried import hurried
from webhook.admission.evaluation.judge import judge
from webhook.admission.evaluation.record import record
from webhook.admission.evaluation.settle import settle
from webhook.admission.policy import Policy
from webhook.admission.review import AdmissionRequest, AdmissionResponse
from webhook.admission.state import StateKeys

__all__ = [
    "AdmissionDecision",
    "ChangeOutcome",
    "Decision",
    "Mode",
    "Note",
    "RuleOutcome",
    "evaluate",
    "explain",
    "response_summary",
    "unjudged",
]
"""The evaluation's public API; the decision's types and renderings live in :mod:`webhook.admission.decision`."""

def _invalid(message: str, code: int = 400) -> AdmissionDecision:
    return AdmissionDecision(
        response=AdmissionResponse(
            allowed=False,
            status_code=code,
            reason="BadRequest" if code == 400 else "Invalid",
            message=message,
            audit_annotations={"decision": Decision.INVALID.value},
        ),
        decision=Decision.INVALID,
    )


def _skip(warning: str | None = None) -> AdmissionDecision:
    return AdmissionDecision(
        response=AdmissionResponse(
            allowed=True,
            warnings=(warning,) if warning else (),
            audit_annotations={"decision": Decision.SKIP.value},
        ),
        decision=Decision.SKIP,
        notes=(Note(warning),) if warning else (),
    )



def evaluate(
    request: AdmissionRequest,
    policy: Policy,
    cluster: ClusterView,
    now: datetime,
    keys: StateKeys,
    *,
    mode: Mode = Mode.MUTATE,
    budget: IncreaseBudget | None = None,
    budget_clock: float | None = None,
    deadline: Deadline | None = None,
    budget_seconds: float | None = None,
) -> AdmissionDecision:
    """Judge one AdmissionRequest against ``policy`` at ``now`` (timezone-aware UTC).

    ``cluster`` answers node labels, versions, attach errors and driver periods (None = unknown); ``keys``
    verify the state on ``oldObject`` and sign the new one. ``budget`` (only consulted in /mutate; a dry-run
    request is judged against it without taking from it) is the per-replica cluster-wide increase budget, read
    with ``budget_clock`` seconds: an input of change-rate, asked once every rule judged every change, for the
    increases the request would then admit.

    ``deadline`` (None: no time budget) answers True once the internal time budget (``budget_seconds``, for the
    wording) is spent; looked at between the stages and while judging, before the budget is taken from: past it
    the answer is :func:`~.hurried.hurried`'s (ceilings for registrations, increases held at the stored count).

    Never raises for bad input: an UPDATE without ``oldObject`` or with an object that is not a CSINode gives an
    ``invalid`` decision (``allowed: false``, code 400). A CREATE is judged as the registration of each of its
    drivers (never refused; a state it carries belongs to another object and is removed); a DELETE is judged as
    the removal of every driver entry (:func:`_deletion`; ``oldObject`` required, else ``invalid``); another
    resource or operation reaching the webhook is allowed with a warning.
    """
    if not request.is_csinode:
        what = f"{request.resource}.{request.group}/{request.version}"
        if request.sub_resource:
            what += f"/{request.sub_resource}"
        return _skip(f"csinode-guard judges only storage.k8s.io/v1 csinodes, not {what}; check its webhook rules")
    if request.operation == "DELETE":
        return _deletion(request, policy, cluster, now, keys, mode)
    if request.operation not in ("CREATE", "UPDATE"):
        return _skip(f"csinode-guard judges only CREATE, UPDATE and DELETE of csinodes, not {request.operation}")
    if request.old_object is None and request.operation == "UPDATE":
        return _invalid("UPDATE of a CSINode without oldObject: csinode-guard cannot tell what changed")
    if request.object is None:
        return _invalid(f"{request.operation} of a CSINode without object")
    try:
        new = parse_csinode(request.object, "object")
        if request.operation == "CREATE":
            old = CSINode(new.name, "", {}, {}, False)
        else:
            old = parse_csinode(request.old_object or {}, "oldObject")
    except CSINodeError as exc:
        return _invalid(f"not a valid CSINode: {exc}")
    except RecursionError:
        return _invalid("not a valid CSINode: nested too deeply")
    try:
        check_deadline(deadline)
        write = classify(request, policy, cluster, now, keys, mode, old, new)
        check_deadline(deadline)
        if write.declarations.invalid is not None:
            return _invalid(write.declarations.invalid)
        judgement = judge(write, cluster, keys, deadline)
        check_deadline(deadline)
    except OutOfTimeError:
        return hurried(request, policy, cluster, old, new, mode, keys, budget_seconds)
    settlement = settle(write, judgement, budget, budget_clock)
    return record(write, judgement, settlement, keys)


def _deletion(request: AdmissionRequest, policy: Policy, cluster: ClusterView, now: datetime, keys: StateKeys,
              mode: Mode) -> AdmissionDecision:
    """A DELETE of a CSINode, judged as the removal of every driver entry it stores: the scheduler has no limit for
    a node without a CSINode, so a stranger's DELETE is a stranger's removal of every entry at once (writer-identity
    refuses it, :func:`.judge.judge`; one finding also for an object without drivers). The node's own kubelet
    deletes its CSINode when its Node's UID changed (kubernetes#137199) and a listed writer may: admitted. The
    AdmissionRequest of a DELETE carries ``oldObject`` (the stored object) and no ``object``; nothing is patched
    (there is no object to patch) and no state is written; the budget is not consulted (nothing rises)."""
    if request.old_object is None:
        return _invalid("DELETE of a CSINode without oldObject: csinode-guard cannot tell what is deleted")
    try:
        old = parse_csinode(request.old_object, "oldObject")
    except CSINodeError as exc:
        return _invalid(f"not a valid CSINode: {exc}")
    except RecursionError:
        return _invalid("not a valid CSINode: nested too deeply")
    gone = old._replace(drivers={})
    write = classify(request, policy, cluster, now, keys, mode, old, gone)
    judgement = judge(write, cluster, keys)
    decision = record(write, judgement, settle(write, judgement, None, None), keys)
    return decision._replace(response=decision.response._replace(patch=()), new_state=None)



def unjudged(request: AdmissionRequest) -> AdmissionDecision:
    """The decision when judging ``request`` failed with an unexpected error (a bug): the design's asymmetry.

    A write that raises a count (or makes it unbounded) is refused (403), since nothing vouches for it; any
    other write is admitted unjudged with a warning. When even the objects cannot be read, the write is refused
    (400), as :func:`evaluate` refuses objects that are not CSINodes. A DELETE makes every entry unbounded: the
    node's own kubelet's is admitted (it must never fail), anyone else's refused (403). All carry
    ``auditAnnotations.decision: error``.
    """
    annotations = {"decision": "error"}
    if request.operation == "DELETE":
        return _unjudged_deletion(request, annotations)
    try:
        old = parse_csinode(request.old_object or {}, "oldObject")
        new = parse_csinode(request.object or {}, "object")
        rising = [c for c in diff_drivers(old, new) if c.is_increase] if request.operation == "UPDATE" else []
    except Exception:  # the fallback of a failure must not fail itself; unreadable objects are refused
        return AdmissionDecision(
            response=AdmissionResponse(
                allowed=False, status_code=400, reason="BadRequest", audit_annotations=annotations,
                message="csinode-guard could not judge this write (internal error) nor read its objects",
            ),
            decision=Decision.INVALID,
            notes=(Note("internal error: unreadable objects refused"),),
        )
    if rising:
        listed = ", ".join(f"{c.driver}: {format_count(c.old)} -> {format_count(c.new)}" for c in rising[:5])
        message = (
            f"csinode-guard could not judge this write (internal error), so it refuses its count increases "
            f"({listed}{', ...' if len(rising) > 5 else ''}); decreases and other writes are admitted"
        )
        return AdmissionDecision(
            response=AdmissionResponse(
                allowed=False, status_code=403, reason="Forbidden", message=message, audit_annotations=annotations
            ),
            decision=Decision.DENY,
            node=new.name or old.name or request.name,
            notes=(Note("internal error: count increases refused unjudged"),),
        )
    return AdmissionDecision(
        response=AdmissionResponse(
            allowed=True,
            warnings=("csinode-guard could not judge this write (internal error); it raises no count and was "
                      "admitted unjudged",),
            audit_annotations=annotations,
        ),
        decision=Decision.SKIP,
        notes=(Note("internal error: admitted unjudged"),),
    )


def _unjudged_deletion(request: AdmissionRequest, annotations: dict[str, str]) -> AdmissionDecision:
    """:func:`unjudged` for a DELETE: the node's own kubelet's admitted with a warning, anyone else's refused."""
    node = request.name
    if request.username == f"system:node:{node}" and "system:nodes" in request.groups:
        return AdmissionDecision(
            response=AdmissionResponse(
                allowed=True, audit_annotations=annotations,
                warnings=("csinode-guard could not judge this write (internal error); the node's own DELETE was "
                          "admitted unjudged",),
            ),
            decision=Decision.SKIP,
            node=node,
            notes=(Note("internal error: the node's own DELETE admitted unjudged"),),
        )
    return AdmissionDecision(
        response=AdmissionResponse(
            allowed=False, status_code=403, reason="Forbidden", audit_annotations=annotations,
            message="csinode-guard could not judge this write (internal error), so it refuses the DELETE of a "
            "CSINode by anyone but the node's own kubelet (every driver would lose its limit)",
        ),
        decision=Decision.DENY,
        node=node,
        notes=(Note("internal error: a DELETE refused unjudged"),),
    )
