"""``change-rate``: increases of one entry that come too often.

An increase sooner than max(``minInterval``, the CSIDriver's ``spec.nodeAllocatableUpdatePeriodSeconds``) after
the entry's last accepted change is a violation (default ``deny``: kubelet retries at its next period, KEP-4876).
Decreases are exempt. A registration (a node plugin registering again, after a restart or an uninstall) is paced
from the entry's last accepted count and time, which the state keeps across removal: inside the interval it keeps
the last accepted count (the evaluation never refuses a registration, so a ``deny`` acts as a clamp to it), so that
uninstall/install cycles gain nothing. A first registration (no history) is judged by the ceilings only.

The cluster-wide increase budget (``clusterBudget``, per replica) is the rule's second input, as the cluster view
is an input of the others: an increase the budget does not grant is a violation (:func:`check_budget`). The
evaluation owns the token bucket: once every rule judged every change, it asks the bucket for the increases it
would admit, one by one within the node's fair share (:meth:`webhook.admission.budget.IncreaseBudget.admit`), and
gives each its answer in ``RuleContext.cluster_budget``. Increases of a driver the cluster has no CSIDriver object
for ask nothing of the budget (:meth:`webhook.admission.cluster.ClusterView.csidriver_exists`).
"""

from __future__ import annotations

from webhook.admission.budget import node_share
from webhook.admission.durations import format_duration
from webhook.admission.rules.base import RuleContext, Violation

RULE_ID = "change-rate"


def min_interval(ctx: RuleContext) -> float:
    """Seconds that must pass between accepted changes of this entry before an increase."""
    period = ctx.update_period or 0.0
    return max(ctx.driver_policy.rules.min_interval, period)


def check(ctx: RuleContext) -> list[Violation]:
    """Violation when an increase (also a registration above the entry's last accepted count) follows the
    entry's last accepted change too closely; ``clamp_to`` is the last accepted count."""
    if not ctx.change.is_increase or ctx.entry is None or ctx.justified:
        return []
    interval = min_interval(ctx)
    elapsed = (ctx.now - ctx.entry.changed_at).total_seconds()
    if elapsed >= interval:
        return []
    return [
        Violation(
            rule=RULE_ID,
            action=ctx.driver_policy.rules.rate_action,
            why=f"{format_duration(max(elapsed, 0))} after the last accepted change; the minimum is "
            f"{format_duration(interval)}",
            proceed="the count is held at the last accepted one until a write after the interval"
            if ctx.change.registration
            else "kubelet retries at its next update period; if the driver flaps, fix its NodeGetInfo",
            clamp_to=ctx.change.old,
        )
    ]


def check_budget(ctx: RuleContext) -> list[Violation]:
    """Violation when the cluster-wide increase budget (``ctx.cluster_budget``) did not grant this increase (the
    node's share of the window or the bucket used up; clamped to the old count); nothing before the budget was
    asked, when it granted it, or for a decrease or a registration."""
    budget = ctx.cluster_budget
    if budget is None or budget.room or not ctx.change.is_increase or ctx.change.registration:
        return []
    return [
        Violation(
            rule=RULE_ID,
            action=ctx.driver_policy.rules.rate_action,
            why=f"the cluster-wide increase budget ({budget.rate:g}/s, burst {budget.burst}, "
            f"{node_share(budget.burst)}/node) is used up",
            proceed="kubelet retries at its next update period; many nodes raising counts at once is worth a look",
            clamp_to=ctx.change.old,
        )
    ]
