"""evaluate(request, policy, cluster view, now) -> AdmissionDecision: the pure admission pipeline.

Data flows one way: AdmissionRequest -> CSINode diff -> rules (with the verified state, cluster facts and
justifications) -> combined decision -> AdmissionResponse (patch, warnings, audit annotations). No I/O: the
cluster view answers from memory and the clock is an argument, so the same inputs always give the same
decision (tests, ``policy test``, ``replay``). The decision's types (:class:`AdmissionDecision` and its parts)
live in :mod:`webhook.admission.decision` and are importable from here too.

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
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from types import MappingProxyType
from typing import Any

from webhook.admission.budget import IncreaseBudget
from webhook.admission.ceiling_pin import pin_ceiling
from webhook.admission.cluster import AttachError, AttachErrorClass, ClusterView
from webhook.admission.csinode import (
    INT32_MAX,
    CountChange,
    CSINode,
    CSINodeError,
    diff_drivers,
    format_count,
    parse_csinode,
    removed_drivers,
)
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
from webhook.admission.justification import JUSTIFICATION_ANNOTATION, JustificationError, parse_justifications
from webhook.admission.patch import (
    Operation,
    remove_annotation,
    replace_drivers,
    restore_managed_fields,
    set_annotation,
    set_count,
)
from webhook.admission.policy import STATE_INTEGRITY, DriverPolicy, EnforcementAction, Policy
from webhook.admission.review import AdmissionRequest, AdmissionResponse
from webhook.admission.rules import RULES, change_rate
from webhook.admission.rules.base import BudgetAnswer, RuleContext, Violation, Writer
from webhook.admission.rules.change_rate import RULE_ID as CHANGE_RATE
from webhook.admission.rules.change_rate import min_interval
from webhook.admission.rules.writer_identity import RULE_ID as WRITER_IDENTITY
from webhook.admission.state import (
    STATE_ANNOTATION,
    Approval,
    Correction,
    DeclaredVersion,
    DecodedState,
    EntryState,
    GuardState,
    PinnedLabel,
    StateKeys,
    StateProblem,
    decode_state,
    encode_state,
)
from webhook.admission.versions import is_valid_version

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


@dataclass
class _Finding:
    change: CountChange | None
    violation: Violation
    effective: EnforcementAction
    outcome: int = -1  # index of its RuleOutcome


MAX_MESSAGE_LINES = 20
"""Violations a denial's message lists (one line each); more are counted in a last line. The audit record of
each change keeps its own lines, so a CSINode with thousands of drivers gives neither a huge answer nor audit
records that repeat every other change's lines."""


def _line(node: str, change: CountChange | None, v: Violation, suffix: str = "") -> str:
    if change is None:
        # A request-level finding is about an annotation: the guard's state, the justification, driver versions.
        annotation = v.annotation or (STATE_ANNOTATION if v.rule == STATE_INTEGRITY else JUSTIFICATION_ANNOTATION)
        where = f"{node}: {annotation}"
    elif change.registration:
        before = "" if change.old is None else f"{format_count(change.old)} -> "
        where = f"{node}/{change.driver} (registration): {before}{format_count(change.new)}{suffix}"
    else:
        where = f"{node}/{change.driver}: {format_count(change.old)} -> {format_count(change.new)}{suffix}"
    return f"[{v.rule}] {where}: {v.why}; {v.proceed}"


def _clamping_rules(findings: Iterable[_Finding], finals: Mapping[str, int | None]) -> dict[str, list[str]]:
    """Per driver, the rules whose clamp changed its count (in finding order, each once)."""
    rules: dict[str, list[str]] = {}
    for f in findings:
        if f.effective is EnforcementAction.CLAMP and f.change is not None and finals[f.change.driver] != f.change.new:
            named = rules.setdefault(f.change.driver, [])
            if f.violation.rule not in named:
                named.append(f.violation.rule)
    return rules


def _clamp_results(node: str, changes: Iterable[CountChange], finals: Mapping[str, int | None],
                   clamping: Mapping[str, list[str]]) -> list[str]:
    """One line per change that several rules clamped: the count applied, the lowest any of them allows."""
    lines = []
    for c in changes:
        rules = clamping.get(c.driver, [])
        if len(rules) > 1:
            before = "registration: " if c.is_first_registration else f"{format_count(c.old)} -> "
            lines.append(f"{node}/{c.driver}: {before}{format_count(c.new)} clamped to "
                         f"{format_count(finals[c.driver])}, what every one of {', '.join(rules)} allows")
    return lines


def _by_rule_and_change(findings: Iterable[_Finding]) -> list[list[_Finding]]:
    """``findings`` grouped by (rule, driver of the change), in the order each group first appears."""
    groups: dict[tuple[str, str | None], list[_Finding]] = {}
    for f in findings:
        groups.setdefault((f.violation.rule, f.change.driver if f.change else None), []).append(f)
    return list(groups.values())


def _merged_line(node: str, group: Sequence[_Finding], suffix: str = "") -> str:
    """One ``[rule] node/driver: old -> new: why; proceed`` line for findings of one rule about one change."""
    first = group[0]
    why = "; ".join(dict.fromkeys(f.violation.why for f in group))
    proceed = "; ".join(dict.fromkeys(f.violation.proceed for f in group))
    return _line(node, first.change, first.violation._replace(why=why, proceed=proceed), suffix)


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


def _driver_version(
    dp: DriverPolicy, declared: Mapping[str, DeclaredVersion], cluster: ClusterView, node: str, driver: str
) -> str | None:
    """The driver's version on the node from the policy's source. The ``annotation`` source counts only what
    a trusted principal declared (recorded in the signed state), never the annotation's current value: the
    node's kubelet can write the annotation, and would otherwise declare its own version."""
    source = dp.version_source
    if source.type == "pod":
        return cluster.driver_version(node, driver)
    if source.type == "kubelet":
        return cluster.kubelet_version(node)
    found = declared.get(driver)
    return found.version if found is not None else None


def _above(count: int | None, trusted: int | None) -> bool:
    """True when ``count`` is higher than ``trusted`` (None = unbounded, higher than any count)."""
    if trusted is None:
        return False
    return count is None or count > trusted


MAX_REMEMBERED_ANNOTATION = 1024
"""Characters of a driver-versions annotation remembered at most (longer ones are decoded every time, so that
the cache holds at most 1024 x 1 KB; a few drivers need some 30 characters each)."""


@functools.lru_cache(maxsize=1024)
def _published_versions(raw: str) -> Mapping[str, Any]:
    """The driver-versions annotation decoded (empty when it is not a JSON object); remembered per value, as
    every write of a node carries the same one. Read-only: the result is shared."""
    return _decode_versions(raw)


def _decode_versions(raw: str) -> Mapping[str, Any]:
    try:
        versions = json.loads(raw)
    except (ValueError, RecursionError):  # JSONDecodeError, or an integer over 4300 digits
        return {}
    return MappingProxyType(versions) if isinstance(versions, dict) else {}


_BOOKKEEPING = ("resourceVersion", "managedFields", "generation")
"""``metadata`` fields the apiserver maintains itself: compared apart when a write is checked for being a no-op."""


def _restore_managed_fields(obj: Mapping[str, Any] | None, old: Mapping[str, Any] | None) -> list[Operation]:
    """The operation restoring the stored ``metadata.managedFields`` when ``obj`` (with the stored drivers
    restored) differs from ``old`` in nothing else but what the apiserver maintains; else no operation.

    The apiserver computes managed fields from the object its writer sent, before mutating admission (kube-
    apiserver's update handler); a kubelet that reported no count gives up ``f:allocatable`` there although the
    clamp kept the count. Restoring them makes the stored object byte-identical, so etcd is not written.
    """
    if not isinstance(obj, Mapping) or not isinstance(old, Mapping):
        return []
    meta, old_meta = obj.get("metadata"), old.get("metadata")
    if not isinstance(meta, Mapping) or not isinstance(old_meta, Mapping):
        return []
    if meta.get("managedFields") == old_meta.get("managedFields"):
        return []
    rest = {k: v for k, v in meta.items() if k not in _BOOKKEEPING}
    old_rest = {k: v for k, v in old_meta.items() if k not in _BOOKKEEPING}
    spec, old_spec = obj.get("spec") or {}, old.get("spec") or {}
    if rest != old_rest or not isinstance(spec, Mapping) or not isinstance(old_spec, Mapping):
        return []
    if {k: v for k, v in spec.items() if k != "drivers"} != {k: v for k, v in old_spec.items() if k != "drivers"}:
        return []
    others = {k: v for k, v in obj.items() if k not in ("metadata", "spec")}
    if others != {k: v for k, v in old.items() if k not in ("metadata", "spec")}:
        return []
    stored = old_meta.get("managedFields")
    return [restore_managed_fields(stored if isinstance(stored, list) else None)]


def _raw_drivers(obj: Mapping[str, Any] | None) -> list[Any]:
    """``spec.drivers`` of a raw object that ``parse_csinode`` accepted (a falsy spec or list means none)."""
    spec = (obj or {}).get("spec") or {}
    return list(spec.get("drivers") or [])


def _in_scope(policy: Policy, labels: Mapping[str, str] | None) -> bool:
    """True when ``spec.enforcementScope.nodeSelector`` selects the node (or there is none). A node whose labels
    are unknown (Node missing, cache not synced) is enforced: the node could otherwise leave the canary by making
    its labels unknown."""
    wanted = policy.scope_match_labels
    if wanted is None or labels is None:
        return True
    return all(labels.get(k) == v for k, v in wanted.items())


def _scope_key(policy: Policy) -> str | None:
    """The enforcement scope as recorded in the state: canonical JSON of its ``matchLabels`` (None: no scope)."""
    wanted = policy.scope_match_labels
    return None if wanted is None else json.dumps(dict(wanted), sort_keys=True, separators=(",", ":"))


def _closest_to_old(change: CountChange, targets: Sequence[int]) -> int:
    if change.is_increase:
        return min(targets)
    return max(targets)


def _pass_reason(rule: str, ctx: RuleContext) -> str:
    if rule == WRITER_IDENTITY:
        if ctx.writer.is_node_kubelet:
            return "written by the node's own kubelet"
        if ctx.writer.is_listed_writer:
            return f"{ctx.writer.username} is a writer the policy lists"
        return "justified by a recorded approval"
    if rule == "writer-version":
        return _version_pass_reason(ctx)
    if rule == "count-ceiling":
        ceiling, why = ctx.ceiling
        return f"within the ceiling {format_count(ceiling)} {('(' + why + ')') if why else ''}".rstrip()
    if rule == CHANGE_RATE:
        if ctx.change.registration:
            return "registrations are exempt"
        if not ctx.change.is_increase:
            return "decreases are exempt"
        if ctx.entry is None:
            return "no earlier change recorded"
        elapsed = (ctx.now - ctx.entry.changed_at).total_seconds()
        reason = f"{elapsed:.0f}s since the last accepted change (minimum {min_interval(ctx):.0f}s)"
        approval = ctx.justification_for() if elapsed < min_interval(ctx) else None
        if approval is not None:  # change_rate.check lets a justified increase through at any pace
            reason += f"; the minimum is lifted by {_approval_text(approval)}"
        return reason
    if ctx.change.is_first_registration:
        return "first registration: no earlier count to roll back to"
    return "no correction or freeze in effect" if ctx.change.is_increase else "decrease"


def _approval_text(approval: Approval) -> str:
    """``the justification by alice (OPS-4711) for counts 20..27``: which recorded approval lifted a rule."""
    ticket = f" ({approval.ticket})" if approval.ticket else ""
    return (f"the justification by {approval.approved_by or '(unknown)'}{ticket} for counts "
            f"{approval.min_count}..{approval.max_count}")


def _version_pass_reason(ctx: RuleContext) -> str:
    """Why writer-version found nothing: the version and its source, and when the version is unknown or cannot
    be compared (not a semantic version), that onUnknown let it through (or that the change is a decrease)."""
    version, source = ctx.driver_version, ctx.driver_policy.version_source.type
    compared_with = ctx.driver_policy.min_version or (ctx.entry.writer_version if ctx.entry else None)
    if version is not None and (compared_with is None or is_valid_version(version)):
        return f"driver version {version} ({source} source)"
    what = (f"driver version unknown ({source} source)" if version is None
            else f"driver version {version} ({source} source) cannot be compared: not a semantic version")
    if ctx.change.is_first_registration:
        return f"{what}; a first registration is not held back by onUnknown"
    if not ctx.change.is_increase:
        return f"{what}; decreases are not held back by onUnknown"
    return f"{what}; writer-version.onUnknown: {ctx.driver_policy.rules.version_on_unknown} applied"


def _capacity_note(change: CountChange, errors: Sequence[AttachError] | None, fraction: float) -> Note | None:
    if change.is_increase or change.old is None or change.new is None or not errors:
        return None
    if change.old == 0 or (change.old - change.new) / change.old < fraction:
        return None
    if any(e.error_class is AttachErrorClass.CAPACITY for e in errors):
        return None
    counts: dict[str, int] = {}
    for e in errors:
        counts[e.error_class.value] = counts.get(e.error_class.value, 0) + 1
    listed = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))
    return Note(
        f"{change.node}/{change.driver}: {format_count(change.old)} -> {format_count(change.new)} coincides only "
        f"with non-capacity attach errors ({listed}); lowering the count on any attach failure is a driver mistake",
        change.driver,
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
) -> AdmissionDecision:
    """Judge one AdmissionRequest against ``policy`` at ``now`` (timezone-aware UTC).

    ``cluster`` answers node labels, versions, attach errors and driver periods (None = unknown); ``keys``
    verify the state on ``oldObject`` and sign the new one. ``budget`` (only consulted in /mutate; a dry-run
    request is judged against it without taking from it) is the per-replica cluster-wide increase budget, read
    with ``budget_clock`` seconds: an input of change-rate, asked once every rule judged every change, for the
    increases the request would then admit.

    Never raises for bad input: an UPDATE without ``oldObject`` or with an object that is not a CSINode gives an
    ``invalid`` decision (``allowed: false``, code 400). A CREATE is judged as the registration of each of its
    drivers (never refused; a state it carries belongs to another object and is removed); a DELETE is allowed
    unjudged; another resource or operation reaching the webhook is allowed with a warning.
    """
    if not request.is_csinode:
        what = f"{request.resource}.{request.group}/{request.version}"
        if request.sub_resource:
            what += f"/{request.sub_resource}"
        return _skip(f"csinode-guard judges only storage.k8s.io/v1 csinodes, not {what}; check its webhook rules")
    if request.operation == "DELETE":
        return _skip()
    if request.operation not in ("CREATE", "UPDATE"):
        return _skip(f"csinode-guard judges only CREATE and UPDATE of csinodes, not {request.operation}")
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
    return _Evaluation(request, policy, cluster, now, keys, mode, budget, budget_clock, old, new).run()


class _Evaluation:
    """One evaluation's working set; see :func:`evaluate`."""

    def __init__(
        self,
        request: AdmissionRequest,
        policy: Policy,
        cluster: ClusterView,
        now: datetime,
        keys: StateKeys,
        mode: Mode,
        budget: IncreaseBudget | None,
        budget_clock: float | None,
        old: CSINode,
        new: CSINode,
    ) -> None:
        self.request = request
        self.policy = policy
        self.cluster = cluster
        self.now = now
        self.keys = keys
        self.mode = mode
        self.budget = budget
        self._budget_clock = budget_clock
        self.old = old
        self.new = new
        self.node = new.name or old.name or request.name
        self.create = request.operation == "CREATE"
        # At CREATE the object has no UID yet while mutating admission runs: no state can be signed for it.
        self.uid = old.uid or new.uid
        self.findings: list[_Finding] = []
        self.findings_by_change: dict[int, list[_Finding]] = {}  # by id() of the CountChange: linear in drivers
        self.outcomes: list[RuleOutcome] = []
        self.outcomes_from: dict[int, int] = {}  # id() of a judged CountChange -> index of its first outcome
        self.notes: list[Note] = []
        self.contexts: dict[str, RuleContext] = {}
        self.exempt = policy.exemptions.contains(request.username, request.groups)
        self.labels = cluster.node_labels(self.node)
        self.scope_key = _scope_key(policy)
        self.scope_matched = _in_scope(policy, self.labels)
        self.in_scope = self.scope_matched  # and the scope the state pinned: set below, once the state is read
        self.writer = Writer(
            username=request.username,
            groups=request.groups,
            is_node_kubelet=request.username == f"system:node:{self.node}" and "system:nodes" in request.groups,
            is_listed_writer=policy.writers.contains(request.username, request.groups),
        )
        self.decoded: DecodedState = decode_state(old.annotations.get(STATE_ANNOTATION), self.uid, keys)
        newest = cluster.newest_state_sequence(self.uid) if self.uid else None
        self._check_replay(newest)
        state = self.decoded.state
        # The next state's sequence: past the stored one and past the newest any replica saw for the object.
        self.base_sequence = max(state.sequence if state is not None else 0, newest or 0)
        self.entries: Mapping[str, EntryState] = state.entries if state is not None else {}
        self.approvals: list[Approval] = list(state.approvals) if state is not None else []
        self.approvals_by_driver: dict[str, tuple[Approval, ...]] = {}
        self.approvals_recorded = 0
        self.declared: dict[str, DeclaredVersion] = dict(state.declared) if state is not None else {}
        # Once judged in the enforcement scope, an object stays in it: the node can remove a label from itself.
        self.scope_pinned = state is not None and self.scope_key is not None and state.scope == self.scope_key
        self.in_scope = self.scope_matched or self.scope_pinned
        self.pins: dict[str, PinnedLabel | None] = {}  # the ceiling label pinned per judged entry
        self.declared_changed = False
        self.never_refused = False  # the whole write: set by run() before any rule runs
        self.soft_drivers: set[str] = set()  # entries the write does not touch, reconciled: never refused
        self.restore_annotations: list[str] = []  # annotations a stranger changed on a write never refused
        self.stored_before: dict[str, int | None] = {}  # entries judged from the state's count: what was stored
        self._stateless: list[CountChange] = []  # untouched entries without state, judged by the ceilings

    def _check_replay(self, newest: int | None) -> None:
        """A verified state older than the newest one seen for the object (``ClusterView.newest_state_sequence``)
        is a replay (the node PUT back an older state of its own while the guard was down): not used, so the
        entries are judged from the ceilings (the newest state's content is not at hand). A missing state on an
        object a state was seen for was removed: said in the detail (logged)."""
        state = self.decoded.state
        if newest is None:
            return
        if state is not None and state.sequence < newest:
            self.decoded = DecodedState(
                None, StateProblem.REPLAYED,
                f"state sequence {state.sequence} is older than {newest}, the newest seen for this object (replayed); "
                "its entries are judged from the ceilings",
            )
        elif state is None and self.decoded.problem is StateProblem.MISSING:
            self.decoded = DecodedState(
                None, StateProblem.MISSING,
                f"the object had a state (sequence {newest} seen) and it was removed; its entries are judged from the "
                "ceilings",
            )

    @property
    def budget_clock(self) -> float:
        """Seconds on the budget's clock: the caller's, or ``now`` as a timestamp."""
        return self._budget_clock if self._budget_clock is not None else self.now.timestamp()

    # -- findings -------------------------------------------------------------------------------------------
    def _soft(self, change: CountChange | None, rule: str) -> bool:
        """True when ``rule``'s findings on ``change`` (None: request-level) may clamp or warn but never deny: on
        a write that is never refused, and for a count rule on an entry judged from its last trusted count (a
        refusal would keep the untrusted stored count; who writes is judged as usual)."""
        if self.never_refused:
            return True
        if change is None or rule == WRITER_IDENTITY:
            return False
        # A registration is never refused by a count rule, also when it shares its write with an increase.
        return change.driver in self.soft_drivers or (change.registration and self.writer.is_node_kubelet)

    def _keeps_stored_count(self, v: Violation, change: CountChange | None) -> bool:
        """True when a ``deny`` of ``v`` would only keep the stored count of a rise the node's own kubelet writes.

        The node's kubelet (``system:node:<node>`` in ``system:nodes``) raising the count of an entry that stays
        (not a registration; /mutate only): a count rule's denial (change-rate, the cluster budget, a freeze, a
        recovery or version-rollback check, minVersion, a ceiling set to deny) keeps the stored count, and
        costs kubelet four requests per period — or, when kubelet restarted while its node plugin kept running,
        fails the plugin's registration: kubelet's InstallCSIDriver (pkg/volume/csi/nodeinfomanager) rewrites an
        entry with the same nodeID and topologyKeys but another count with the very PUT of a periodic update.
        Such a denial acts as a clamp to the stored count. Request-level findings (annotations), writer-identity,
        state-integrity and decreases (the drop to 0) are judged as configured.
        """
        return (
            self.writer.is_node_kubelet
            and self.mode is Mode.MUTATE
            and change is not None
            and not change.registration
            and change.is_increase
            and change.old is not None
            and v.rule not in (WRITER_IDENTITY, STATE_INTEGRITY)
        )

    def _effective(self, v: Violation, change: CountChange | None) -> EnforcementAction:
        action = v.action
        if not self.in_scope or self.exempt:
            return EnforcementAction.DRYRUN
        if self._soft(change, v.rule) and action in (EnforcementAction.DENY, EnforcementAction.CLAMP):
            # Never refused: a deny acts as a clamp; with nothing lower to clamp to (or in /validate, which
            # cannot patch) the finding is a warning.
            lowers = change is not None and v.clamp_to is not None and (change.new is None or v.clamp_to < change.new)
            return EnforcementAction.CLAMP if lowers and self.mode is Mode.MUTATE else EnforcementAction.WARN
        if action is EnforcementAction.CLAMP and v.clamp_to is None and change is not None and not change.is_increase:
            # Nothing to clamp to, and a lower count is the safe direction: say so, do not block.
            return EnforcementAction.WARN
        if action is EnforcementAction.CLAMP and (self.mode is Mode.VALIDATE or v.clamp_to is None):
            return EnforcementAction.DENY
        return action

    def _passed_at(self, change: CountChange, rule: str) -> int | None:
        """The index of ``rule``'s "pass" outcome on ``change``, if it has one (among the change's own outcomes:
        :meth:`_judge` records them together)."""
        start = self.outcomes_from.get(id(change))
        if start is None:
            return None
        for i in range(start, len(self.outcomes)):
            o = self.outcomes[i]
            if o.driver != change.driver:
                return None
            if o.rule == rule and o.result == "pass":
                return i
        return None

    def _add(self, change: CountChange | None, v: Violation, force: EnforcementAction | None = None) -> None:
        """Record a finding. A rule has one outcome per change: a pass, or its violations; so a violation found
        once the rule knows more (change-rate, given the cluster budget's answer) takes the place of its pass.
        ``force`` sets the effective action whatever the scope and the write (a refusal for everyone)."""
        effective = force or self._effective(v, change)
        if effective is EnforcementAction.DENY and change is not None and self._keeps_stored_count(v, change):
            # deny acts as clamp for the node's kubelet: to the count the denial would have kept (the stored one).
            effective = EnforcementAction.CLAMP
            v = v._replace(clamp_to=change.old)
            note = Note(
                f"{self.node}/{change.driver}: {v.rule} deny acts as clamp for the node's kubelet "
                f"(to the stored count {format_count(change.old)}; kubelet's write succeeds)",
                change.driver,
            )
            if note not in self.notes:
                self.notes.append(note)
        passed = self._passed_at(change, v.rule) if change is not None else None
        at = len(self.outcomes) if passed is None else passed
        finding = _Finding(change, v, effective, at)
        self.findings.append(finding)
        if change is not None:
            self.findings_by_change.setdefault(id(change), []).append(finding)
        suffix = ""
        if effective is EnforcementAction.CLAMP:
            suffix = f" (clamped to {format_count(v.clamp_to)})"
        outcome = RuleOutcome(
            rule=v.rule,
            driver=change.driver if change else None,
            result="violation",
            enforcement=v.action,
            effective=effective,
            message=_line(self.node, change, v, suffix),
        )
        if at < len(self.outcomes):
            self.outcomes[at] = outcome
        else:
            self.outcomes.append(outcome)

    # -- steps ----------------------------------------------------------------------------------------------
    def _record_justifications(self) -> AdmissionDecision | None:
        old_value = self.old.annotations.get(JUSTIFICATION_ANNOTATION)
        new_value = self.new.annotations.get(JUSTIFICATION_ANNOTATION)
        if new_value is None or new_value == old_value:
            return None
        if not self.policy.justifiers.contains(self.request.username, self.request.groups):
            self._add(
                None,
                Violation(
                    rule=WRITER_IDENTITY,
                    action=self.policy.default_driver.rules.identity_action,
                    why=f"{self.request.username or '(anonymous)'} is not a justifier the policy lists",
                    proceed="ask a principal listed under spec.justifiers to set the justification",
                ),
            )
            if self.never_refused:
                self.restore_annotations.append(JUSTIFICATION_ANNOTATION)
            return None
        try:
            parsed = parse_justifications(new_value)
        except JustificationError as exc:
            if self.never_refused:
                self.notes.append(Note(f"{JUSTIFICATION_ANNOTATION} not recorded: {exc}"))
                self.restore_annotations.append(JUSTIFICATION_ANNOTATION)
                return None
            return _invalid(str(exc))
        known = {(a.driver, a.min_count, a.max_count, a.expires, a.reason, a.ticket) for a in self.approvals}
        for j in parsed:
            if j.expires <= self.now:
                self.notes.append(
                    Note(f"justification for {j.driver} expired at {j.expires.isoformat()}; not recorded", j.driver)
                )
                continue
            approval = Approval(
                driver=j.driver,
                reason=j.reason,
                min_count=j.min_count,
                max_count=j.max_count,
                expires=j.expires,
                ticket=j.ticket,
                approved_by=self.request.username,
                approved_at=self.now,
            )
            key = (j.driver, j.min_count, j.max_count, j.expires, j.reason, j.ticket)
            if key not in known:
                known.add(key)
                self.approvals.append(approval)
                self.approvals_recorded += 1
        return None

    def _index_approvals(self) -> None:
        """Group the approvals by driver once, so that each change looks only at its own (linear judging, not
        drivers x approvals)."""
        by_driver: dict[str, list[Approval]] = {}
        for a in self.approvals:
            by_driver.setdefault(a.driver, []).append(a)
        self.approvals_by_driver = {d: tuple(found) for d, found in by_driver.items()}

    def _record_versions(self) -> None:
        """Record the driver versions a trusted principal declares in a version annotation, with who set them;
        a change by anyone else is a writer-identity finding (like a justification from a stranger) and is
        not recorded (on a write never refused, the patch puts the annotation back)."""
        who = self.request.username or "(anonymous)"
        for annotation in sorted(self.policy.version_annotations):
            old_value = self.old.annotations.get(annotation)
            new_value = self.new.annotations.get(annotation)
            if new_value == old_value:
                continue
            if not self.policy.declares_versions(self.request.username, self.request.groups):
                self._add(
                    None,
                    Violation(
                        rule=WRITER_IDENTITY,
                        action=self.policy.default_driver.rules.identity_action,
                        why=f"{who} is not a version reporter the policy lists, so it cannot declare driver versions",
                        proceed="let a principal listed under spec.versionReporters publish the versions, or use "
                        "versionSource pod or kubelet",
                        annotation=annotation,
                    ),
                )
                if self.never_refused:
                    self.restore_annotations.append(annotation)
                continue
            raw = new_value or ""
            versions = (_published_versions if len(raw) <= MAX_REMEMBERED_ANNOTATION else _decode_versions)(raw)
            if new_value and not versions:
                self.notes.append(Note(f"{annotation} is not a JSON object of driver versions; nothing recorded"))
            for driver, version in versions.items():
                if not isinstance(version, str) or not version:
                    continue
                known = self.declared.get(driver)
                if known is None or known.version != version:
                    self.declared[driver] = DeclaredVersion(version, self.request.username, self.now)
                    self.declared_changed = True
            for driver in list(self.declared):
                source = self.policy.for_driver(driver).version_source
                if driver not in versions and source.type == "annotation" and source.annotation == annotation:
                    del self.declared[driver]  # the reporter no longer declares it
                    self.declared_changed = True

    def _judge_removals(self) -> None:
        """writer-identity on removals: a driver entry removed by anyone but the node's own kubelet or a writer the
        policy lists is refused (a removed entry is unbounded to the scheduler). The node's own removals are never
        judged (kubelet removes the driver of a node plugin that goes away)."""
        if self.writer.is_node_kubelet or self.writer.is_listed_writer:
            return
        who = self.request.username or "(anonymous)"
        for name in removed_drivers(self.old, self.new):
            self._add(None, Violation(
                rule=WRITER_IDENTITY,
                action=self.policy.for_driver(name).rules.identity_action,
                why=f"{who} is not the node's kubelet nor a writer the policy lists, and a removed driver entry has no "
                "limit for the scheduler",
                proceed="let the node's kubelet remove it (it does when the node plugin goes away), or add the "
                "principal to spec.writers",
                annotation=f"spec.drivers[{name}] (removal)",
            ))

    def _check_state_written(self) -> None:
        """A write that changes or removes ``csinode-guard.io/state`` is refused for everyone (exempt principals:
        dry run): only the guard's own patch writes it. The guard's own state, met again when /mutate is reinvoked,
        is recognised by its signature and its sequence (the stored one + 1). An UPDATE based on an older
        ``resourceVersion`` than the stored one is left to the apiserver, which refuses it with 409 Conflict (its
        state is that older copy's): a client that GETs again on a conflict, as kubelet and the reconciler do, then
        writes the current state."""
        old_value = self.old.annotations.get(STATE_ANNOTATION)
        new_value = self.new.annotations.get(STATE_ANNOTATION)
        if new_value == old_value:
            return
        if self.new.resource_version and self.new.resource_version != self.old.resource_version:
            return
        own = decode_state(new_value, self.uid, self.keys).state
        if own is not None and own.sequence == self.base_sequence + 1:
            return
        what = "removes" if new_value is None else "changes"
        self._add(None, Violation(
            rule=STATE_INTEGRITY,
            action=EnforcementAction.DENY,
            why=f"the write {what} the guard's state; only csinode-guard's mutating webhook writes it",
            proceed="keep the annotation as stored (kubelet does); csinode-guard restore puts a count back",
        ), force=EnforcementAction.DRYRUN if self.exempt else EnforcementAction.DENY)

    def _classify(self) -> list[CountChange]:
        """The changes to judge, each from the last count the guard trusts, and whether the write may be refused.

        A registration of an entry that appears starts from the count the state retained for it (the count
        before removal; None without history). Any other entry starts from the lower of the stored count and
        the state's: a higher stored count went through unjudged, so it is judged as a change from the state's
        count — also for an entry the write does not touch — and is clamped, never refused (a refusal would
        keep the untrusted count).
        """
        raw = diff_drivers(self.old, self.new, registrations=True)
        touched = {c.driver for c in raw}
        structural = self.create or bool(removed_drivers(self.old, self.new)) or any(c.registration for c in raw)
        increase = any(c.is_increase and not c.registration for c in raw)
        # The webhook entries' matchConditions split writes the same way (webhook/kube/registration.py): these reach
        # the guard under failurePolicy Ignore, and the guard never refuses them either (kubelet exits when it
        # cannot register a driver). Decreases also come under Ignore but are judged as usual.
        # Only the node's own kubelet: anyone else's CREATE, registration or removal is judged by writer-identity
        # (webhook/kube/registration.py sends it to the Fail entry).
        self.never_refused = structural and not increase and self.writer.is_node_kubelet
        changes: list[CountChange] = []
        for c in raw:
            entry = self.entries.get(c.driver)
            if c.registration and c.driver not in self.old.drivers:
                changes.append(c._replace(old=entry.count) if entry is not None else c)
                continue
            if entry is None or not _above(c.old, entry.count):
                changes.append(c)
                continue
            self.notes.append(Note(
                f"{self.node}/{c.driver}: the stored count {format_count(c.old)} is above the last count "
                f"csinode-guard accepted ({format_count(entry.count)}): judged from {format_count(entry.count)}",
                c.driver,
            ))
            rebased = c._replace(old=entry.count)
            if rebased.old == rebased.new and not rebased.registration:
                continue
            self.stored_before[c.driver] = c.old
            # Refusing would keep the stored count, which is higher than anything trusted: clamp instead.
            self.soft_drivers.add(rebased.driver)
            changes.append(rebased)
        for name, driver in self.new.drivers.items():
            entry = self.entries.get(name)
            if name in touched or name not in self.old.drivers:
                continue
            if entry is None:
                self._reconcile_stateless(name, driver.allocatable_count, driver.position)
                continue
            if _above(driver.allocatable_count, entry.count):
                self.notes.append(Note(
                    f"{self.node}/{name}: the stored count {format_count(driver.allocatable_count)} is above the "
                    f"last count csinode-guard accepted ({format_count(entry.count)}); it went through unjudged "
                    "and is judged now",
                    name,
                ))
                self.soft_drivers.add(name)
                self.stored_before[name] = driver.allocatable_count
                changes.append(CountChange(self.node, name, entry.count, driver.allocatable_count, driver.position))
        changes.extend(self._stateless)
        return changes

    def _reconcile_stateless(self, name: str, count: int | None, position: int) -> None:
        """An entry the write does not touch and the state has no entry for (it went through unjudged, or its
        state was removed or replayed): judged by the stateless rules -- unbounded where the driver has a finite
        ceiling, 2147483647, above the ceiling -- as a registration of its stored count, clamped, never refused."""
        dp = self.policy.for_driver(name)
        ceiling = pin_ceiling(dp.ceiling, self.labels, None).ceiling
        if ceiling is None and count is not None and count < INT32_MAX:
            return
        if ceiling is not None and count is not None and count <= ceiling:
            return
        if ceiling is None and count is None:
            return
        self.notes.append(Note(
            f"{self.node}/{name}: the stored count {format_count(count)} has no state entry (it went through "
            "unjudged); judged by the ceilings now",
            name,
        ))
        self.soft_drivers.add(name)
        self.stored_before[name] = count
        self._stateless.append(CountChange(self.node, name, None, count, position, registration=True))

    def _judge(self, change: CountChange) -> None:
        dp = self.policy.for_driver(change.driver)
        errors = self.cluster.attach_errors(
            self.node, change.driver, self.now - self.policy.evidence_window
        )
        entry = self.entries.get(change.driver)
        approvals = self.approvals_by_driver.get(change.driver, ())
        pinned = pin_ceiling(dp.ceiling, self.labels, entry.pinned if entry else None, approvals,
                             driver=change.driver, count=change.new, now=self.now)
        ctx = RuleContext(
            change=change,
            policy=self.policy,
            driver_policy=dp,
            writer=self.writer,
            entry=entry,
            approvals=approvals,
            driver_version=_driver_version(dp, self.declared, self.cluster, self.node, change.driver),
            node_labels=self.labels,
            attach_errors=errors,
            update_period=self.cluster.driver_update_period(change.driver),
            now=self.now,
            resolved_ceiling=(pinned.ceiling, pinned.why),
        )
        self.pins[change.driver] = pinned.pin
        self.contexts[change.driver] = ctx
        self.outcomes_from[id(change)] = len(self.outcomes)
        for rule_id, check in RULES:
            found = check(ctx)
            if not found:
                self.outcomes.append(
                    RuleOutcome(rule_id, change.driver, "pass", None, None, _pass_reason(rule_id, ctx))
                )
            for v in found:
                self._add(change, v)
        note = _capacity_note(change, errors, self.policy.large_decrease_fraction)
        if note:
            self.notes.append(note)

    def _check_budget(self, finals: Mapping[str, int | None], changes: Sequence[CountChange]) -> bool:
        """Ask the cluster-wide budget for the increases the request would admit (taking them; a dry run only
        looks) and let change-rate judge each with its answer; True when that found something (it was used up)."""
        if self.budget is None or self.mode is not Mode.MUTATE:
            return False
        rising = [c for c in changes if not c.registration and self._rises(c, finals[c.driver])]
        if not rising:
            return False
        if self.request.dry_run:
            # A dry run gets the decision a real request would get, but takes nothing from the budget.
            room = self.budget.available(self.budget_clock) + 1e-9 >= len(rising)
        else:
            room = self.budget.take(len(rising), self.budget_clock)
        answer = BudgetAnswer(self.budget.rate, self.budget.burst, room)
        found = False
        for c in rising:
            ctx = self.contexts[c.driver]._replace(cluster_budget=answer)
            self.contexts[c.driver] = ctx
            for v in change_rate.check_budget(ctx):
                self._add(c, v)
                found = True
        return found

    def _denial_lines(self, denied: Sequence[_Finding], finals: Mapping[str, int | None]) -> tuple[
        list[str], list[str]
    ]:
        """(message lines, warnings) of a denial: every rule that found something is named, once per change.

        The message has a line per denying (rule, change), its findings' reasons joined; the warnings a line per
        other (rule, change) whose finding would show in an admitted answer (clamp, warn), so that an operator
        who fixes what the denial says is not surprised by the next rule. Dry-run findings stay in the audit
        record only, as for an admitted write.
        """
        lines = [_merged_line(self.node, group) for group in _by_rule_and_change(denied)]
        if len(lines) > MAX_MESSAGE_LINES:
            rest = len(lines) - MAX_MESSAGE_LINES
            lines = [*lines[:MAX_MESSAGE_LINES], f"... and {rest} more violations (the audit log has each)"]
        named = {(f.violation.rule, f.change.driver if f.change else None) for f in denied}
        quiet = [f for f in self.findings
                 if f.effective in (EnforcementAction.CLAMP, EnforcementAction.WARN)
                 and (f.violation.rule, f.change.driver if f.change else None) not in named]
        warnings = []
        for group in _by_rule_and_change(quiet):
            f = group[0]
            final = finals.get(f.change.driver) if f.change is not None else None
            clamps = f.effective is EnforcementAction.CLAMP and f.change is not None and final != f.change.new
            suffix = f" (would be clamped to {format_count(final)})" if clamps else ""
            warnings.append(_merged_line(self.node, group, suffix))
        return lines, warnings

    def _settle_moot_denials(self, finals: Mapping[str, int | None]) -> None:
        """A denial that only forbids any rise (change-rate, a freeze) is moot when clamps already keep the old
        count: the write then becomes a clamp that changes nothing — one request per period instead of kubelet's
        four retries of a denial (DESIGN.md, write amplification)."""
        if self.mode is not Mode.MUTATE:
            return
        for f in self.findings:
            c = f.change
            if (
                c is not None
                and f.effective is EnforcementAction.DENY
                and c.old is not None
                and f.violation.clamp_to == c.old
                and finals[c.driver] == c.old
                and c.new != c.old
            ):
                f.effective = EnforcementAction.CLAMP
                self.outcomes[f.outcome] = self.outcomes[f.outcome]._replace(
                    effective=EnforcementAction.CLAMP,
                    message=_line(self.node, c, f.violation, f" (clamped to {format_count(c.old)})"),
                )

    def _with_stored(self, outcome: ChangeOutcome) -> ChangeOutcome:
        driver = outcome.change.driver
        return outcome._replace(stored=(self.stored_before[driver],)) if driver in self.stored_before else outcome

    def _stored_count(self, change: CountChange) -> int | None:
        stored = self.old.drivers.get(change.driver)
        return stored.allocatable_count if stored is not None else change.old

    def _freezes(self, f: _Finding) -> bool:
        """A version rollback freezes increases unless its finding only ran as a dry run."""
        if not f.violation.freeze or not self.in_scope or self.exempt:
            return False
        if f.violation.action is EnforcementAction.DRYRUN:  # a justified rollback still freezes
            return f.change is not None and (
                self.policy.for_driver(f.change.driver).rules.version_action is not EnforcementAction.DRYRUN
            )
        return f.effective is not EnforcementAction.DRYRUN

    @staticmethod
    def _rises(change: CountChange, final: int | None) -> bool:
        if final is None:
            return change.old is not None
        return change.old is not None and final > change.old

    def _finals(self, changes: Sequence[CountChange]) -> dict[str, int | None]:
        finals: dict[str, int | None] = {}
        grouped = self.findings_by_change
        for c in changes:
            targets = [
                f.violation.clamp_to
                for f in grouped.get(id(c), ())
                if f.effective is EnforcementAction.CLAMP and f.violation.clamp_to is not None
            ]
            finals[c.driver] = _closest_to_old(c, targets) if targets else c.new
        return finals

    def _check_integrity(self, changes: Sequence[CountChange]) -> None:
        old_value = self.old.annotations.get(STATE_ANNOTATION)
        new_value = self.new.annotations.get(STATE_ANNOTATION)
        if self.create or not self.uid:
            return  # no state can be signed for an object without a UID; /mutate removed any it carried
        if not changes and new_value == old_value:
            return
        action = self.policy.default_driver.rules.integrity_action
        decoded = decode_state(new_value, self.uid, self.keys)
        if decoded.state is None:
            problem = decoded.problem.value if decoded.problem else "unknown"
            why = f"the final object's {STATE_ANNOTATION} is not valid ({problem})"
            targets: list[CountChange | None] = list(changes) if changes else [None]
            for c in targets:
                self._add(
                    c,
                    Violation(STATE_INTEGRITY, action, why, "make sure csinode-guard's /mutate webhook is registered"),
                )
            return
        for c in changes:
            entry = decoded.state.entries.get(c.driver)
            if entry is None or entry.count != c.new:
                recorded = format_count(entry.count) if entry else "nothing"
                self._add(
                    c,
                    Violation(
                        STATE_INTEGRITY,
                        action,
                        f"the state records {recorded}, so the count changed after csinode-guard's /mutate ran",
                        "find the mutating webhook that rewrites allocatable.count and remove it",
                    ),
                )

    def _next_state(self, changes: Sequence[CountChange], finals: Mapping[str, int | None]) -> tuple[
        GuardState | None, list[ChangeOutcome]
    ]:
        entries: dict[str, EntryState] | None = None  # a copy, made at the first changed entry
        outcomes: list[ChangeOutcome] = []
        grouped = self.findings_by_change
        for c in changes:
            final = finals[c.driver]
            ctx = self.contexts[c.driver]
            prev = self.entries.get(c.driver)
            freeze = any(self._freezes(f) for f in grouped.get(id(c), ()))
            if final == c.old and not c.registration:
                outcomes.append(ChangeOutcome(c, final, ctx.driver_version))
                continue
            if (
                c.registration
                and prev is not None
                and prev.count == final
                and not freeze
                and ctx.driver_version in (None, prev.writer_version)
                and self.pins.get(c.driver, prev.pinned) == prev.pinned
            ):
                # A plugin restart that brings the entry back as it was: nothing new to record (no state churn).
                outcomes.append(ChangeOutcome(c, final, ctx.driver_version))
                continue
            frozen_until = prev.frozen_until if prev and prev.frozen_until and prev.frozen_until > self.now else None
            if freeze:
                frozen_until = self.now + timedelta(seconds=ctx.driver_policy.rules.freeze_for)
            correction = prev.correction if prev else None
            basis = None
            lower = final is not None and (c.old is None or final < c.old)
            if lower:
                capacity = [e for e in ctx.attach_errors or () if e.error_class is AttachErrorClass.CAPACITY]
                if capacity:
                    basis = "resource-exhausted"
                elif any(a.covers(c.driver, final, self.now) for a in self.approvals_by_driver.get(c.driver, ())):
                    basis = "justification"
                if basis:
                    correction = Correction(at=self.now, before=c.old, after=final, basis=basis)
            same = c.registration and prev is not None and prev.count == final
            entry = EntryState(
                count=final,
                changed_at=prev.changed_at if same and prev is not None else self.now,
                writer_version=ctx.driver_version or (prev.writer_version if prev else None),
                frozen_until=frozen_until,
                correction=correction,
                pinned=self.pins.get(c.driver, prev.pinned if prev else None),
            )
            if entries is None:
                entries = dict(self.entries)
            entries[c.driver] = entry
            outcomes.append(ChangeOutcome(c, final, ctx.driver_version, basis, freeze))
        if (entries is None and not self.approvals_recorded and not self.declared_changed) or not self.uid:
            return None, outcomes
        # Entries of drivers that are not in the object now are kept: kubelet removes a driver whose node plugin
        # restarts and registers it again, and its history (freeze, correction, version) must survive that.
        approvals = tuple(a for a in self.approvals if a.expires > self.now)  # expired approvals are dropped
        # The scope stays pinned until a justifier's annotation on the object lets a node that left it go.
        keep_scope = self.scope_matched or (self.scope_pinned and not self.approvals_recorded)
        state = GuardState(
            self.uid,
            self.entries if entries is None else entries,
            approvals,
            self.declared,
            scope=self.scope_key if keep_scope and self.in_scope else None,
            sequence=self.base_sequence + 1,
        )
        return state, outcomes

    def _patch(self, changes: Sequence[CountChange], finals: Mapping[str, int | None],
               new_state: GuardState | None) -> list[Operation]:
        ops: list[Operation] = []
        restore_bookkeeping = False
        clamped = [c for c in changes if finals[c.driver] != c.new]
        if clamped:
            raw_new = _raw_drivers(self.request.object)
            raw_old = _raw_drivers(self.request.old_object)
            # Copy-on-write: only the entries a clamp rewrites are copied (the request's objects stay as sent).
            final_drivers = list(raw_new)
            for c in clamped:
                final = finals[c.driver]
                if final is None:  # pragma: no cover - a clamp target is always a count
                    continue
                entry = dict(final_drivers[c.position])
                final_drivers[c.position] = entry
                allocatable = entry.get("allocatable")
                ops.append(set_count(c.position, final, isinstance(allocatable, dict)))
                if isinstance(allocatable, dict):
                    entry["allocatable"] = {**allocatable, "count": final}
                else:
                    entry["allocatable"] = {"count": final}
            by_name = {d.get("name"): d for d in final_drivers if isinstance(d, dict)}
            old_by_name = {d.get("name"): d for d in raw_old if isinstance(d, dict)}
            if by_name == old_by_name:
                # The clamped result equals the stored drivers: restore their stored order (kubelet re-appended
                # the driver) and, when nothing else changes, kubelet's stored managed fields, so that the PUT
                # is a no-op for the apiserver (nothing written to etcd, no new resourceVersion).
                if final_drivers != raw_old:
                    ops = [replace_drivers(raw_old)]
                restore_bookkeeping = True
        exists = self.new.has_annotations
        for key in dict.fromkeys(self.restore_annotations):
            # A stranger's annotation on a write that is never refused: put back, not refused.
            before = self.old.annotations.get(key)
            if before is None:
                ops.append(remove_annotation(key))
            else:
                ops.extend(set_annotation(key, before, exists))
                exists = True
        old_value = self.old.annotations.get(STATE_ANNOTATION)
        new_value = self.new.annotations.get(STATE_ANNOTATION)
        if new_state is not None:
            ops.extend(set_annotation(STATE_ANNOTATION, encode_state(new_state, self.keys), exists))
        elif new_value != old_value:
            # Whatever a request itself puts in the state annotation is replaced (at CREATE: removed, as it was
            # recorded for another object).
            if old_value is None:
                ops.append(remove_annotation(STATE_ANNOTATION))
            else:
                ops.extend(set_annotation(STATE_ANNOTATION, old_value, exists))
        if restore_bookkeeping and not any(op["path"].startswith("/metadata") for op in ops):
            ops.extend(_restore_managed_fields(self.request.object, self.request.old_object))
        return ops

    # -- the pipeline ---------------------------------------------------------------------------------------
    def run(self) -> AdmissionDecision:
        changes = self._classify()
        invalid = self._record_justifications()
        if invalid is not None:
            return invalid
        self._record_versions()
        self._index_approvals()
        self._judge_removals()
        if self.mode is Mode.MUTATE and not self.create:
            self._check_state_written()
        for change in changes:
            self._judge(change)
        if self.mode is Mode.VALIDATE:
            self._check_integrity(changes)
        finals = self._finals(changes)
        self._settle_moot_denials(finals)
        denied = [f for f in self.findings if f.effective is EnforcementAction.DENY]
        if not denied and self._check_budget(finals, changes):
            finals = self._finals(changes)
            denied = [f for f in self.findings if f.effective is EnforcementAction.DENY]
        problem = self.decoded.problem
        detail = self.decoded.detail
        if denied:
            lines, others = self._denial_lines(denied, finals)
            response = AdmissionResponse(
                allowed=False,
                status_code=403,
                reason="Forbidden",
                message="\n".join(lines),
                warnings=(*others, *self.notes),
                audit_annotations=self._audit_annotations(Decision.DENY),
            )
            # Refused: every entry keeps what is stored (which may be above the count judged from).
            outcomes = [
                self._with_stored(ChangeOutcome(c, self._stored_count(c), self.contexts[c.driver].driver_version))
                for c in changes
            ]
            return self._decision(response, Decision.DENY, outcomes, None, problem, detail)
        new_state, change_outcomes = self._next_state(changes, finals)
        change_outcomes = [self._with_stored(o) for o in change_outcomes]
        ops = self._patch(changes, finals, new_state) if self.mode is Mode.MUTATE else []
        warnings: list[str] = []
        decision = Decision.ALLOW
        clamping = _clamping_rules(self.findings, finals)
        for f in self.findings:
            final = finals[f.change.driver] if f.change is not None else None
            if f.effective is EnforcementAction.CLAMP and f.change is not None and final != f.change.new:
                decision = Decision.CLAMP
                several = len(clamping[f.change.driver]) > 1  # each line then says what its own rule allows
                suffix = (f" (this rule allows {format_count(f.violation.clamp_to)})" if several
                          else f" (clamped to {format_count(final)})")
                warnings.append(_line(self.node, f.change, f.violation, suffix))
            elif f.effective is EnforcementAction.WARN:
                if decision is Decision.ALLOW:
                    decision = Decision.WARN
                warnings.append(_line(self.node, f.change, f.violation))
        warnings.extend(_clamp_results(self.node, changes, finals, clamping))
        warnings.extend(self.notes)
        response = AdmissionResponse(
            allowed=True,
            warnings=tuple(warnings),
            patch=tuple(ops),
            audit_annotations=self._audit_annotations(decision),
        )
        return self._decision(response, decision, change_outcomes, new_state, problem, detail)

    def _audit_annotations(self, decision: Decision) -> dict[str, str]:
        fired = []
        for f in self.findings:
            if f.violation.rule not in fired:
                fired.append(f.violation.rule)
        annotations = {"decision": decision.value, "policy": self.policy.hash}
        if fired:
            annotations["rules"] = ",".join(fired)
        if self.exempt:
            annotations["exempt"] = "true"
        return annotations

    def _decision(
        self,
        response: AdmissionResponse,
        decision: Decision,
        changes: list[ChangeOutcome],
        new_state: GuardState | None,
        problem: StateProblem | None,
        detail: str,
    ) -> AdmissionDecision:
        return AdmissionDecision(
            response=response,
            decision=decision,
            node=self.node,
            outcomes=tuple(self.outcomes),
            changes=tuple(changes),
            state_problem=problem,
            state_detail=detail,
            exempt=self.exempt,
            in_scope=self.in_scope,
            approvals_recorded=self.approvals_recorded,
            new_state=new_state,
            notes=tuple(self.notes),
        )


def unjudged(request: AdmissionRequest) -> AdmissionDecision:
    """The decision when judging ``request`` failed with an unexpected error (a bug): the design's asymmetry.

    A write that raises a count (or makes it unbounded) is refused (403), since nothing vouches for it; any
    other write is admitted unjudged with a warning. When even the objects cannot be read, the write is refused
    (400), as :func:`evaluate` refuses objects that are not CSINodes. All carry ``auditAnnotations.decision:
    error``.
    """
    annotations = {"decision": "error"}
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
