"""Stage 2, judge: every rule over every change of a :class:`~.classify.Write`, with its context -> a Judgement.

The rules are the ones of :mod:`webhook.admission.rules`, as they are; this stage builds each change's
:class:`~webhook.admission.rules.base.RuleContext` (the driver's policy, the state's entry and approvals, the
driver version from the policy's source, the ceiling pinned for the entry, attach errors, the update period) and
records, in order, what each rule found: a pass with its reason, or its violations. Request-level findings come
first (a stranger's annotation, a removal by anyone but the node's kubelet or a listed writer, a write that
changes the guard's state), then each change's, then (/validate) state-integrity. What a finding *does* is
decided later (:mod:`.effective`, :mod:`.settle`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from webhook.admission.ceiling_pin import pin_ceiling
from webhook.admission.cluster import ClusterView
from webhook.admission.csinode import CountChange, format_count, removed_drivers
from webhook.admission.decision import Mode, Note, RuleOutcome
from webhook.admission.evaluation.classify import Write
from webhook.admission.evaluation.deadline import CHECK_EVERY, Deadline, check_deadline
from webhook.admission.evaluation.wording import capacity_note, pass_reason
from webhook.admission.policy import STATE_INTEGRITY, DriverPolicy, EnforcementAction
from webhook.admission.rules import RULES, change_rate
from webhook.admission.rules.base import BudgetAnswer, RuleContext, Violation
from webhook.admission.rules.writer_identity import RULE_ID as WRITER_IDENTITY
from webhook.admission.state import STATE_ANNOTATION, DeclaredVersion, PinnedLabel, StateKeys, decode_state
from webhook.admission.state_bounds import no_room


class Found(NamedTuple):
    """A violation on change ``change`` (its index; None: about the request); ``force`` an effective action
    that holds whatever the scope and the write (a refusal for everyone), else None."""

    change: int | None
    violation: Violation
    force: EnforcementAction | None = None


class Remark(NamedTuple):
    """A note the judging made (a large decrease that only non-capacity attach errors back)."""

    note: Note


Verdict = RuleOutcome | Found | Remark
"""One item of what the rules found, in the order they found it: a rule's ``pass`` outcome on a change (with its
reason), a violation, or a note."""


class Judgement(NamedTuple):
    """What the rules found about one write: ``verdicts`` in order; ``contexts`` each judged driver's rule
    context; ``pins`` the ceiling label pinned per judged entry; ``unbudgeted`` the judged drivers the cluster
    has no CSIDriver object for (they ask nothing of the cluster budget)."""

    verdicts: tuple[Verdict, ...]
    contexts: Mapping[str, RuleContext]
    pins: Mapping[str, PinnedLabel | None]
    unbudgeted: frozenset[str] = frozenset()


def driver_version(
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


def judge(write: Write, cluster: ClusterView, keys: StateKeys, deadline: Deadline | None = None) -> Judgement:
    """Run every rule on ``write``: the request-level checks, each change's rules, /validate's integrity check.

    Raises :class:`~.deadline.OutOfTimeError` when ``deadline`` passes (looked at every ``CHECK_EVERY`` changes)."""
    verdicts: list[Verdict] = [Found(None, v) for v in write.declarations.violations]
    verdicts.extend(_removals(write, cluster))
    if write.mode is Mode.MUTATE and not write.create:
        verdicts.extend(_state_written(write, keys))
    contexts: dict[str, RuleContext] = {}
    pins: dict[str, PinnedLabel | None] = {}
    for index, change in enumerate(write.changes):
        if index % CHECK_EVERY == CHECK_EVERY - 1:
            check_deadline(deadline)
        ctx, pin = _context(write, cluster, change)
        pins[change.driver] = pin
        contexts[change.driver] = ctx
        for rule_id, check in RULES:
            found = check(ctx)
            if not found:
                verdicts.append(RuleOutcome(rule_id, change.driver, "pass", None, None, pass_reason(rule_id, ctx)))
            for v in found:
                verdicts.append(Found(index, v))
        note = capacity_note(change, ctx.attach_errors, write.policy.large_decrease_fraction)
        if note:
            verdicts.append(Remark(note))
    if write.mode is Mode.VALIDATE:
        verdicts.extend(_integrity(write, keys))
    unbudgeted = frozenset(c.driver for c in write.changes if cluster.csidriver_exists(c.driver) is False)
    return Judgement(tuple(verdicts), contexts, pins, unbudgeted)


def judge_budget(ctx: RuleContext, answer: BudgetAnswer) -> list[Violation]:
    """change-rate given the cluster budget's answer for the request (asked once every rule judged every change,
    for the increases the request would then admit)."""
    return change_rate.check_budget(ctx._replace(cluster_budget=answer))


def _context(write: Write, cluster: ClusterView, change: CountChange) -> tuple[RuleContext, PinnedLabel | None]:
    policy, node, now = write.policy, write.node, write.now
    dp = policy.for_driver(change.driver)
    errors = cluster.attach_errors(node, change.driver, now - policy.evidence_window)
    entry = write.entries.get(change.driver)
    approvals = write.declarations.by_driver.get(change.driver, ())
    pinned = pin_ceiling(dp.ceiling, write.labels, entry.pinned if entry else None, approvals,
                         driver=change.driver, count=change.new, now=now)
    ctx = RuleContext(  # positional, in the order of its fields (keywords cost about 1 µs per change)
        change, policy, dp, write.writer, entry, approvals,
        driver_version(dp, write.declarations.declared, cluster, node, change.driver),
        write.labels,  # node_labels
        errors,  # attach_errors
        cluster.driver_update_period(change.driver),  # update_period
        now,
        (pinned.ceiling, pinned.why),  # resolved_ceiling
        None,  # cluster_budget: asked later
        cluster.brake(change.driver),  # brake
    )
    return ctx, pinned.pin


def _removals(write: Write, cluster: ClusterView) -> list[Found]:
    """writer-identity on removals: a driver entry removed by anyone but the node's own kubelet or a writer the
    policy lists is refused (a removed entry is unbounded to the scheduler). The node's own removals are never
    judged (kubelet removes the driver of a node plugin that goes away), nor the DELETE of a CSINode whose Node
    is known to be gone (the garbage collector's, following the CSINode's ownerReference to its Node: no node is
    left for a pod to be scheduled to)."""
    if write.writer.is_node_kubelet or write.writer.is_listed_writer:
        return []
    who = write.request.username or "(anonymous)"
    if write.request.operation == "DELETE":
        if cluster.node_exists(write.node) is False:
            return []
        return _deletion(write, who)
    return [Found(None, Violation(
        rule=WRITER_IDENTITY,
        action=write.policy.for_driver(name).rules.identity_action,
        why=f"{who} is not the node's kubelet nor a writer the policy lists, and a removed driver entry has no "
        "limit for the scheduler",
        proceed="let the node's kubelet remove it (it does when the node plugin goes away), or add the "
        "principal to spec.writers",
        annotation=f"spec.drivers[{name}] (removal)",
    )) for name in removed_drivers(write.old, write.new)]


def _deletion(write: Write, who: str) -> list[Found]:
    """writer-identity on a DELETE by anyone but the node's own kubelet or a listed writer: one finding about the
    object, with the strictest writer-identity action of the drivers it stores (the default rules' for an object
    without drivers: kubelet registers its drivers into that object, and without it none has a limit until kubelet
    re-creates it)."""
    dps = [write.policy.for_driver(name) for name in write.old.drivers] or [write.policy.default_driver]
    actions = {dp.rules.identity_action for dp in dps}
    action = next(a for a in EnforcementAction if a in actions)  # declared from the strictest (deny) down
    stored = ", ".join(f"{n}={format_count(d.allocatable_count)}" for n, d in write.old.drivers.items()) or "none"
    return [Found(None, Violation(
        rule=WRITER_IDENTITY,
        action=action,
        why=f"{who} is not the node's kubelet nor a writer the policy lists, and a deleted CSINode leaves every "
        f"driver of the node without a limit for the scheduler (stored: {stored})",
        proceed="let the node's kubelet delete it (it does when its Node is re-created), or add the principal "
        "to spec.writers",
        annotation=f"CSINode {write.node} (deletion)",
    ))]


def _state_written(write: Write, keys: StateKeys) -> list[Found]:
    """A write that changes or removes ``csinode-guard.io/state`` is refused for everyone (exempt principals:
    dry run): only the guard's own patch writes it. The guard's own state, met again when /mutate is reinvoked,
    is recognised by its signature and its sequence (the stored one + 1). An UPDATE based on an older
    ``resourceVersion`` than the stored one is left to the apiserver, which refuses it with 409 Conflict (its
    state is that older copy's): a client that GETs again on a conflict, as kubelet and the reconciler do, then
    writes the current state."""
    old, new = write.old, write.new
    old_value = old.annotations.get(STATE_ANNOTATION)
    new_value = new.annotations.get(STATE_ANNOTATION)
    if new_value == old_value:
        return []
    if new.resource_version and new.resource_version != old.resource_version:
        return []
    own = decode_state(new_value, write.uid, keys).state
    if own is not None and own.sequence == write.base_sequence + 1:
        return []
    what = "removes" if new_value is None else "changes"
    return [Found(None, Violation(
        rule=STATE_INTEGRITY,
        action=EnforcementAction.DENY,
        why=f"the write {what} the guard's state; only csinode-guard's mutating webhook writes it",
        proceed="keep the annotation as stored (kubelet does); csinode-guard restore puts a count back",
    ), force=EnforcementAction.DRYRUN if write.exempt else EnforcementAction.DENY)]


def _integrity(write: Write, keys: StateKeys) -> list[Found]:
    """/validate: the final object's state must verify and record the count of every change (what /mutate
    admitted); else a state-integrity finding per change (or about the request)."""
    changes = write.changes
    old_value = write.old.annotations.get(STATE_ANNOTATION)
    new_value = write.new.annotations.get(STATE_ANNOTATION)
    if write.create or not write.uid:
        return []  # no state can be signed for an object without a UID; /mutate removed any it carried
    if not changes and new_value == old_value:
        return []
    action = write.policy.default_driver.rules.integrity_action
    if no_room({k: v for k, v in write.new.annotations.items() if k != STATE_ANNOTATION}):
        return []  # no room for a state next to the object's other annotations: /mutate wrote none (state_bounds)
    decoded = decode_state(new_value, write.uid, keys)
    if decoded.state is None:
        problem = decoded.problem.value if decoded.problem else "unknown"
        why = f"the final object's {STATE_ANNOTATION} is not valid ({problem})"
        targets: list[int | None] = list(range(len(changes))) if changes else [None]
        return [Found(i, Violation(STATE_INTEGRITY, action, why, "make sure csinode-guard's /mutate webhook is "
                                   "registered")) for i in targets]
    found = []
    for i, c in enumerate(changes):
        entry = decoded.state.entries.get(c.driver)
        if entry is None and decoded.state.cut:
            continue  # left out of a state cut to its bounds (state_bounds): judged from the ceilings next time
        if entry is None or entry.count != c.new:
            recorded = format_count(entry.count) if entry else "nothing"
            found.append(Found(i, Violation(
                STATE_INTEGRITY,
                action,
                f"the state records {recorded}, so the count changed after csinode-guard's /mutate ran",
                "find the mutating webhook that rewrites allocatable.count and remove it",
            )))
    return found
