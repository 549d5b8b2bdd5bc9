"""``change-rate``: increases of one entry that come too often.

An increase sooner than max(``minInterval``, the CSIDriver's ``spec.nodeAllocatableUpdatePeriodSeconds``) after
the entry's last accepted change is a violation (default ``deny``: kubelet retries at its next period, KEP-4876).
Decreases and registrations (a plugin registering, also right after a restart) are exempt. The cluster-wide
increase budget (per replica) is checked by the evaluation, which owns the token bucket.
"""

from __future__ import annotations

from webhook.durations import format_duration
from webhook.rules.base import RuleContext, Violation

RULE_ID = "change-rate"


def min_interval(ctx: RuleContext) -> float:
    """Seconds that must pass between accepted changes of this entry before an increase."""
    period = ctx.update_period or 0.0
    return max(ctx.driver_policy.rules.min_interval, period)


def check(ctx: RuleContext) -> list[Violation]:
    """Violation when an increase follows the entry's last accepted change too closely."""
    if not ctx.change.is_increase or ctx.change.registration or ctx.entry is None or ctx.justified:
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
            proceed="kubelet retries at its next update period; if the driver flaps, fix its NodeGetInfo",
            clamp_to=ctx.change.old,
        )
    ]
