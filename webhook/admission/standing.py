"""Judging what a CSINode stores now, not a write: the audit's pure judgement, and the repair it implies.

Admission sees a count once, when it is written. A count that entered while the guard was down (registrations,
CREATE and decreases reach it under ``failurePolicy: Ignore``), or that a tightened policy no longer allows,
stands until the object is written again. :func:`judge_standing` judges each driver entry of a stored CSINode
with the rules that need no transition, using the very rule functions admission uses:

- ``count-ceiling`` (:func:`webhook.admission.rules.count_ceiling.check`) on the entry as if it registered now,
  from the last count the signed state accepted: above the ceiling (driver, node label, profile), 2147483647,
  unbounded where the driver has a finite ceiling or after a bounded accepted count, and a rise over the
  accepted count larger than ``maxStepUp``;
- ``count-rollback`` (:func:`webhook.admission.rules.count_rollback.check`) when the stored count is above the
  accepted one: a rise while the entry is frozen, or one that undoes a recent correction;
- ``state-integrity`` on the object: a state annotation that does not verify (edited, forged, another object's,
  an unknown format), one that is gone although a state was seen for this object, and one older than the newest
  state seen for the object (a replayed state: its ``sequence`` is lower).

A finding whose rule's enforcement action is ``clamp`` or ``deny`` and that names a lower count is *repairable*:
with ``spec.reconcile: clamp`` the audit lowers the stored count to the lowest such count (never raising it,
:func:`lowered_object`). ``warn`` and ``dryrun`` findings, nodes outside ``spec.enforcementScope``, and exempt
nothing (no requester) are reported only. Pure: no I/O, the clock is an argument.
"""

from __future__ import annotations

import copy
import enum
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, NamedTuple

from webhook.admission.csinode import CountChange, CSINode, format_count
from webhook.admission.policy import STATE_INTEGRITY, EnforcementAction, Policy
from webhook.admission.rules import count_ceiling, count_rollback
from webhook.admission.rules.base import RuleContext, Violation, Writer
from webhook.admission.state import DecodedState, StateProblem, format_time

RECONCILE_FIELD = "reconcile"
"""``spec.reconcile`` of the GuardPolicy."""


class ReconcileMode(enum.StrEnum):
    """``spec.reconcile``: ``report`` judges standing counts and reports them; ``clamp`` also lowers them."""

    REPORT = "report"
    CLAMP = "clamp"


DEFAULT_RECONCILE = ReconcileMode.REPORT
"""When the policy does not say: report only (a repair writes to CSINodes; an operator opts in)."""


def reconcile_mode(policy: Policy) -> ReconcileMode:
    """The policy's ``spec.reconcile`` (``report`` or ``clamp``, the schema's values; absent: the default)."""
    spec = policy.document.get("spec") if isinstance(policy.document, Mapping) else None
    value = spec.get(RECONCILE_FIELD) if isinstance(spec, Mapping) else None
    return ReconcileMode(value) if isinstance(value, str) and value in set(ReconcileMode) else DEFAULT_RECONCILE


class StandingFinding(NamedTuple):
    """One finding about a stored CSINode: ``driver`` None for the object's state; ``stored`` the count in etcd
    (None = unbounded); ``allowed`` the count the rule allows (None: it names none); ``repairable`` when the
    reconciler may lower the count to ``allowed``."""

    node: str
    driver: str | None
    rule: str
    stored: int | None
    allowed: int | None
    why: str
    proceed: str
    enforcement: EnforcementAction
    repairable: bool

    @property
    def key(self) -> str:
        """What makes a finding the same finding over passes: ``rule/driver/stored/allowed``."""
        return f"{self.rule}/{self.driver or '-'}/{self.stored}/{self.allowed}"

    def line(self) -> str:
        """``[rule] node/driver: stored N (allowed M): why; proceed`` (one line, for Events, logs and status)."""
        if self.driver is None:
            return f"[{self.rule}] {self.node}: {self.why}; {self.proceed}"
        allowed = f" (allowed {format_count(self.allowed)})" if self.allowed is not None else ""
        return f"[{self.rule}] {self.node}/{self.driver}: stored {format_count(self.stored)}{allowed}: " \
               f"{self.why}; {self.proceed}"


class StandingJudgement(NamedTuple):
    """All findings of one CSINode and the repair they imply: ``targets`` maps a driver to the count to lower it
    to (only drivers with a repairable finding whose count is below the stored one)."""

    node: str
    uid: str
    findings: tuple[StandingFinding, ...]
    targets: Mapping[str, int]


_NOBODY = Writer(username="", groups=(), is_node_kubelet=False, is_listed_writer=False)
"""No requester: the audit judges what is stored, not who wrote it."""


def _lower(target: int | None, stored: int | None) -> bool:
    """True when ``target`` is a count below ``stored`` (None = unbounded, above every count)."""
    return target is not None and (stored is None or target < stored)


def _above(count: int | None, trusted: int | None) -> bool:
    """True when ``count`` is higher than ``trusted`` (None = unbounded)."""
    if trusted is None:
        return False
    return count is None or count > trusted


def _in_scope(policy: Policy, labels: Mapping[str, str] | None) -> bool:
    wanted = policy.scope_match_labels
    if wanted is None:
        return True
    return labels is not None and all(labels.get(k) == v for k, v in wanted.items())


def _state_findings(
    node: CSINode, decoded: DecodedState, newest_sequence: int | None, policy: Policy
) -> list[StandingFinding]:
    action = policy.default_driver.rules.integrity_action
    problem = decoded.problem

    def finding(why: str, proceed: str) -> StandingFinding:
        return StandingFinding(node.name, None, STATE_INTEGRITY, None, None, why, proceed, action, False)

    if problem is StateProblem.MISSING:
        if newest_sequence is None:
            return []  # no judged change yet: normal
        return [finding("the csinode-guard.io/state annotation is gone although a state was seen for this object",
                        "find who removed it (the apiserver's audit log); its counts are judged on ceilings only")]
    if problem is not None:
        return [finding(f"the csinode-guard.io/state annotation is not usable ({problem.value}: {decoded.detail})",
                        "find who edited it (the apiserver's audit log); its counts are judged on ceilings only")]
    state = decoded.state
    sequence = getattr(state, "sequence", None)
    if isinstance(sequence, int) and newest_sequence is not None and sequence < newest_sequence:
        return [finding(f"the state's sequence {sequence} is older than {newest_sequence}, seen for this object: "
                        "a replayed state", "find who wrote it back (the apiserver's audit log)")]
    return []


def judge_standing(
    node: CSINode,
    decoded: DecodedState,
    policy: Policy,
    labels: Mapping[str, str] | None,
    now: datetime,
    *,
    newest_sequence: int | None = None,
) -> StandingJudgement:
    """Judge the stored CSINode ``node`` (its drivers and counts) with its verified state ``decoded`` under
    ``policy`` at ``now`` (timezone-aware UTC). ``labels`` are the Node's labels (None = unknown: the
    ceilings for an unknown node apply); ``newest_sequence`` the highest state sequence seen for the object.

    Never raises for any CSINode :func:`webhook.admission.csinode.parse_csinode` accepts.
    """
    findings = _state_findings(node, decoded, newest_sequence, policy)
    state = decoded.state
    entries = state.entries if state is not None else {}
    approvals = state.approvals if state is not None else ()
    enforce = _in_scope(policy, labels)
    targets: dict[str, int] = {}
    for driver in node.drivers.values():
        dp = policy.for_driver(driver.name)
        entry = entries.get(driver.name)
        accepted = entry.count if entry is not None else None
        stored = driver.allocatable_count
        change = CountChange(node.name, driver.name, accepted, stored, driver.position, registration=True)
        ctx = RuleContext(
            change=change, policy=policy, driver_policy=dp, writer=_NOBODY, entry=entry,
            approvals=tuple(a for a in approvals if a.driver == driver.name), driver_version=None,
            node_labels=labels, attach_errors=None, update_period=None, now=now,
            resolved_ceiling=dp.ceiling.resolve(labels),
        )
        violations: list[Violation] = list(count_ceiling.check(ctx))
        if entry is not None and _above(stored, accepted):
            violations += count_rollback.check(ctx._replace(change=change._replace(registration=False)))
        for v in violations:
            if not _lower(v.clamp_to, stored):
                continue  # the audit never raises a count, nor reports what is not above an allowed count
            repairable = enforce and v.action in (EnforcementAction.CLAMP, EnforcementAction.DENY)
            findings.append(StandingFinding(node.name, driver.name, v.rule, stored, v.clamp_to, v.why, v.proceed,
                                            v.action, repairable))
            if repairable and v.clamp_to is not None:
                targets[driver.name] = min(targets.get(driver.name, v.clamp_to), v.clamp_to)
    return StandingJudgement(node.name, node.uid, tuple(findings), targets)


def lowered_object(obj: Mapping[str, Any], targets: Mapping[str, int]) -> tuple[dict[str, Any], dict[str, int]]:
    """A copy of the CSINode JSON ``obj`` whose driver entries named in ``targets`` carry their target count where
    the stored count is higher (unbounded counts as higher), and the drivers lowered with their new counts.

    Never raises a count: an entry at or below its target, or no longer present, is left as it is (matched by
    name: kubelet re-appends the driver it updates). ``obj`` is not modified.
    """
    result = copy.deepcopy(dict(obj))
    lowered: dict[str, int] = {}
    drivers: Sequence[Any] = ((result.get("spec") or {}).get("drivers")) or []
    for entry in drivers:
        if not isinstance(entry, dict):
            continue
        name = entry.get("name")
        if not isinstance(name, str) or name not in targets:
            continue
        allocatable = entry.get("allocatable")
        count = allocatable.get("count") if isinstance(allocatable, dict) else None
        target = targets[name]
        if _lower(target, count if isinstance(count, int) else None):
            entry["allocatable"] = {**(allocatable if isinstance(allocatable, dict) else {}), "count": target}
            lowered[name] = target
    return result, lowered


AUDIT_ENDPOINT = "audit"
"""The ``endpoint`` (and ``source``) of the audit's records: they come from the audit, not from a request."""


def audit_record(
    finding: StandingFinding,
    *,
    now: datetime,
    trigger: str,
    policy_hash: str,
    policy_generation: int,
    decision: str,
    final: int | None,
    message: str = "",
) -> dict[str, Any]:
    """One audit-log record of ``finding`` (JSON-ready): ``source``/``endpoint`` ``audit``, no request (``uid``,
    ``operation``, ``user`` are null), ``decision`` ``standing-violation`` (reported), ``repaired``, ``dry-run``,
    ``conflict``, ``refused`` or ``error``; ``old`` the stored count, ``new`` the allowed one, ``final`` the count
    after the audit (the stored one unless repaired)."""
    def count(value: int | None) -> int | str:
        return "unbounded" if value is None else value

    effective = "clamp" if decision == "repaired" else "report"
    record: dict[str, Any] = {
        "time": format_time(now),
        "source": AUDIT_ENDPOINT,
        "endpoint": AUDIT_ENDPOINT,
        "trigger": trigger,
        "uid": None,
        "operation": None,
        "dryRun": decision == "dry-run",
        "user": None,
        "groups": [],
        "node": finding.node,
        "driver": finding.driver,
        "decision": decision,
        "allowed": True,
        "policyHash": policy_hash,
        "policyGeneration": policy_generation,
        "latencyMs": 0.0,
        "old": count(finding.stored),
        "new": count(finding.allowed),
        "final": count(final),
        "rules": [{"rule": finding.rule, "result": "violation", "enforcement": finding.enforcement.value,
                   "effective": effective, "message": finding.line()}],
    }
    if message:
        record["message"] = message
    return record
