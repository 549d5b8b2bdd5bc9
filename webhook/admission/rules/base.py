"""What every rule sees (:class:`RuleContext`) and returns (:class:`Violation`).

A rule is a pure function ``check(ctx) -> list[Violation]`` over one count change. It never performs I/O; the
evaluation gathers the facts (state, cluster view answers, justifications) into the context first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import NamedTuple

from webhook.admission.cluster import AttachError, Brake
from webhook.admission.csinode import CountChange
from webhook.admission.policy import DriverPolicy, EnforcementAction, Policy
from webhook.admission.state import Approval, EntryState


class Writer(NamedTuple):
    """The requester: ``userInfo.username``/``groups`` and how the policy sees it."""

    username: str
    groups: tuple[str, ...]
    is_node_kubelet: bool
    is_listed_writer: bool


class BudgetAnswer(NamedTuple):
    """The cluster-wide increase budget's answer for the count increases a request would have admitted.

    The budget is ``spec.rules.change-rate.clusterBudget`` (a token bucket per replica,
    :class:`webhook.admission.budget.IncreaseBudget`): ``rate`` increases per second, at most ``burst`` stored. ``room``
    is False when it did not grant this increase (the node's fair share or the bucket used up; the increases of
    one write are granted one by one, in order).
    """

    rate: float
    burst: int
    room: bool


class RuleContext(NamedTuple):
    """Facts for judging one :class:`CountChange` at ``now`` (UTC), an immutable named tuple.

    ``entry`` is the verified state of the entry (None = judged as new); ``approvals`` are the recorded
    justifications for this change's driver (including any recorded by this very request); ``driver_version``
    is the version of the driver on the node from the policy's source (None = unknown); ``node_labels`` None = unknown;
    ``attach_errors`` are recent errors for (node, driver) (None = unknown); ``update_period`` is the CSIDriver's
    ``nodeAllocatableUpdatePeriodSeconds`` (None = unset or unknown). ``resolved_ceiling`` is the driver's
    ceiling for the node when the caller resolved it already (the evaluation does, once per change).
    ``cluster_budget`` is the cluster-wide increase budget's answer for the request (None: not asked — no budget,
    /validate, a refused request, or before every rule judged every change: the evaluation asks it only for the
    increases it would admit). ``brake`` is the driver's engaged brake (None: none, or unknown).
    """

    change: CountChange
    policy: Policy
    driver_policy: DriverPolicy
    writer: Writer
    entry: EntryState | None
    approvals: Sequence[Approval]
    driver_version: str | None
    node_labels: Mapping[str, str] | None
    attach_errors: Sequence[AttachError] | None
    update_period: float | None
    now: datetime
    resolved_ceiling: tuple[int | None, str] | None = None
    cluster_budget: BudgetAnswer | None = None
    brake: Brake | None = None

    @property
    def ceiling(self) -> tuple[int | None, str]:
        """The driver's ceiling for this node (count, None = none) and why."""
        if self.resolved_ceiling is not None:
            return self.resolved_ceiling
        return self.driver_policy.ceiling.resolve(self.node_labels)

    @property
    def justified(self) -> bool:
        """True when a recorded, unexpired approval for this driver covers the new count."""
        return any(a.covers(self.change.driver, self.change.new, self.now) for a in self.approvals)

    def justification_for(self) -> Approval | None:
        """The first approval that covers this change, if any."""
        for a in self.approvals:
            if a.covers(self.change.driver, self.change.new, self.now):
                return a
        return None


class Violation(NamedTuple):
    """One finding of a rule against one change.

    ``action`` is the configured enforcement action for this finding (the evaluation may soften it: scope,
    exemptions, dry run). ``clamp_to`` is the nearest allowed count when the finding can be clamped (None: it
    cannot); on a write that is never refused (a registration, a CREATE) a ``deny`` acts as a clamp to it.
    ``freeze`` asks the evaluation to freeze increases of the entry when the change is admitted. ``annotation``
    names the annotation a request-level finding (no change) is about.
    """

    rule: str
    action: EnforcementAction
    why: str
    proceed: str
    clamp_to: int | None = None
    freeze: bool = False
    annotation: str = ""


def soften_for_decrease(action: EnforcementAction) -> EnforcementAction:
    """A lower count is the safe direction: ``deny`` becomes ``warn``; others stay (clamp lowers further)."""
    return EnforcementAction.WARN if action is EnforcementAction.DENY else action
