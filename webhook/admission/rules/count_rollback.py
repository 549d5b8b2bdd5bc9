"""``count-rollback``: increases that undo a recent correction, increases while frozen, drops to 0.

A correction is an accepted decrease backed by ResourceExhausted evidence (a VolumeAttachment attach error with
gRPC code 8, KEP-4876) or by a justification. Within ``window`` after it, increases rise at most
``recoveryStep`` per change and going back to the pre-correction count needs a justification. Any increase
while the entry is frozen (after a driver version rollback) is a violation, and so is any increase of a driver
whose brake is engaged (:mod:`webhook.admission.brake`: held at the stored count cluster-wide, a registration
clamped to the last trusted count). A decrease to 0 without
justification is a violation with its own enforcement action (``dropToZero``, default ``warn``).
"""

from __future__ import annotations

from datetime import timedelta

from webhook.admission.brake import describe, release_hint
from webhook.admission.csinode import format_count
from webhook.admission.durations import format_duration
from webhook.admission.rules.base import RuleContext, Violation
from webhook.admission.state import format_time

RULE_ID = "count-rollback"


def check(ctx: RuleContext) -> list[Violation]:
    """Findings for frozen entries, recovery after a correction, and drops to 0."""
    change = ctx.change
    rules = ctx.driver_policy.rules
    found: list[Violation] = []
    if not change.is_increase:
        if change.new == 0 and not ctx.justified:
            found.append(
                Violation(
                    rule=RULE_ID,
                    action=rules.drop_to_zero_action,
                    why="a drop to 0 stops every new attach on this node",
                    proceed="have an approver set a csinode-guard.io/justification covering 0",
                    clamp_to=change.old,
                )
            )
        return found
    if ctx.brake is not None and change.old is not None:
        # Held cluster-wide: not even a justification lets an increase of a braked driver through (the approver's
        # way is to release the brake).
        found.append(
            Violation(
                rule=RULE_ID,
                action=rules.rollback_action,
                why=f"increases of {change.driver} are held cluster-wide: {describe(ctx.brake)}",
                proceed=release_hint(change.driver),
                clamp_to=change.old,
            )
        )
        return found
    if ctx.justified:
        return found
    entry = ctx.entry
    if entry is None:
        return found
    old = change.old
    if entry.frozen_until is not None and ctx.now < entry.frozen_until:
        found.append(
            Violation(
                rule=RULE_ID,
                action=rules.rollback_action,
                why=f"increases are frozen until {format_time(entry.frozen_until)} after a driver version rollback",
                proceed="wait for the freeze to end (rolling the driver forward does not lift it), or have an approver "
                "justify the increase",
                clamp_to=old,
            )
        )
        return found
    corr = entry.correction
    if corr is None or old is None or ctx.now >= corr.at + timedelta(seconds=rules.rollback_window):
        return found
    new = change.new
    since = f"the correction {format_count(corr.before)} -> {format_count(corr.after)} at {format_time(corr.at)}"
    if corr.before is None or (new is None or new >= corr.before):
        limit = old + rules.recovery_step
        if corr.before is not None:
            limit = min(limit, corr.before - 1)
        found.append(
            Violation(
                rule=RULE_ID,
                action=rules.rollback_action,
                why=f"back to {format_count(new)} undoes {since} within {format_duration(rules.rollback_window)}",
                proceed="have an approver justify the restore, or wait for the window to pass",
                clamp_to=max(limit, old),
            )
        )
    elif new - old > rules.recovery_step:
        found.append(
            Violation(
                rule=RULE_ID,
                action=rules.rollback_action,
                why=f"rises by {new - old} within {format_duration(rules.rollback_window)} after {since}; "
                f"recoveryStep is {rules.recovery_step}",
                proceed="let the count recover in smaller steps",
                clamp_to=old + rules.recovery_step,
            )
        )
    return found
