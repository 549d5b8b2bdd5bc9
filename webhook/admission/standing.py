"""Judging what a CSINode stores now, not a write: the audit's pure judgement, and the repair it implies.

Admission sees a count once, when it is written. A count that entered while the guard was down or slow
(registrations, CREATE and decreases reach it under ``failurePolicy: Ignore``), or that a tightened policy no
longer allows, stands until the object is written again. :func:`judge_standing` judges a stored CSINode with
admission's own judgement, not a copy of its rules: each entry as admission would judge it at the node's next
write (:func:`webhook.admission.evaluation.stored.judge_stored`, the stages of ``evaluate`` with the same rule
inputs: the ceiling pinned for the entry, the driver version from the policy's source, attach errors, the
update period, the newest state seen), so the count the audit lowers an entry to is the count admission allows
for it. Besides, ``state-integrity`` on the object: a state annotation that does not verify (edited, forged,
another object's, an unknown format), one that is gone although a state was seen for this object, and one older
than the newest state seen for the object (a replayed state: its ``sequence`` is lower).

A finding that names a count below the stored one and whose effective action is ``clamp`` (in the enforcement
scope, not exempt, its rule set to ``clamp`` or ``deny``) is *repairable*: with ``spec.reconcile: clamp`` (the
default) the audit lowers the stored count to the count admission allows (never raising it,
:func:`lowered_object`). ``warn`` and ``dryrun`` findings and nodes outside ``spec.enforcementScope`` are
reported only. Pure: no I/O, the clock is an argument.
"""

from __future__ import annotations

import copy
import enum
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, NamedTuple

from webhook.admission.cluster import ClusterView
from webhook.admission.csinode import CSINode, format_count
from webhook.admission.evaluation.stored import judge_stored
from webhook.admission.policy import STATE_INTEGRITY, EnforcementAction, Policy
from webhook.admission.state import DecodedState, StateKeys, StateProblem, format_time

RECONCILE_FIELD = "reconcile"
"""``spec.reconcile`` of the GuardPolicy."""


class ReconcileMode(enum.StrEnum):
    """``spec.reconcile``: ``report`` judges standing counts and reports them; ``clamp`` (the default) also
    lowers them."""

    REPORT = "report"
    CLAMP = "clamp"


DEFAULT_RECONCILE = ReconcileMode.CLAMP
"""When the policy does not say: clamp. The writes that must never be refused (registration, CREATE,
decreases) reach the guard with ``failurePolicy: Ignore``, so a count can enter while the guard is down or slower
than the webhook's ``timeoutSeconds``; admission alone would then leave it standing until the node's next judged
write, which may never come. Gatekeeper pairs ``Ignore`` with its audit for the same reason: what fails open must
not stay. A repair only lowers a count (the safe direction), as the guard's ServiceAccount, judged by this
webhook like any write; ``report`` is the opt-out."""


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


def _lower(target: int | None, stored: int | None) -> bool:
    """True when ``target`` is a count below ``stored`` (None = unbounded, above every count)."""
    return target is not None and (stored is None or target < stored)


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
    cluster: ClusterView,
    now: datetime,
    keys: StateKeys,
) -> StandingJudgement:
    """Judge the stored CSINode ``node`` with its state ``decoded`` under ``policy`` at ``now`` (timezone-aware
    UTC): the state's integrity, and each entry as admission judges it at the node's next write
    (:func:`webhook.admission.evaluation.stored.judge_stored`: the same stages and the same inputs -- the pinned
    ceiling, the driver version from the policy's source, attach errors, the update period, the newest state
    sequence ``cluster`` saw). A finding is kept when it names a count below the stored one; ``targets`` are
    the counts admission allows where they are below the stored ones (only from findings whose effective action
    is ``clamp``: in the enforcement scope, not exempt, the rule set to ``clamp`` or ``deny``).

    ``keys`` would verify a state; ``decoded`` is used as given (verified by the watch cache, or read unverified
    by ``status`` without the key). Never raises for any CSINode :func:`webhook.admission.csinode.parse_csinode`
    accepts.
    """
    findings = _state_findings(node, decoded, cluster.newest_state_sequence(node.uid) if node.uid else None,
                               policy)
    stored = judge_stored(node, policy, cluster, now, keys, decoded=decoded)
    targets: dict[str, int] = {}
    for f in stored.settlement.findings:
        change = f.change
        if change is None:
            continue
        count = node.drivers[change.driver].allocatable_count
        allowed = f.violation.clamp_to
        if not _lower(allowed, count):
            continue  # the audit never raises a count, nor reports what is not above an allowed count
        v = f.violation
        findings.append(StandingFinding(node.name, change.driver, v.rule, count, allowed, v.why, v.proceed,
                                        v.action, f.effective is EnforcementAction.CLAMP))
    for change in stored.write.changes:
        count = node.drivers[change.driver].allocatable_count
        final = stored.settlement.finals.get(change.driver)
        if final is not None and _lower(final, count):
            targets[change.driver] = final
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
