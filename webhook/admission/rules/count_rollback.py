"""``count-rollback``: increases that undo a recent correction, increases while frozen, drops to 0.

A correction is an accepted decrease backed by ResourceExhausted evidence (a VolumeAttachment attach error with
gRPC code 8, KEP-4876) or by a justification. Within ``window`` after it, increases rise at most
``recoveryStep`` per change and going back to the pre-correction count needs a justification. Any increase
while the entry is frozen (after a driver version rollback) is a violation, and so is any increase of a driver
whose brake is engaged (:mod:`webhook.admission.brake`: held at the stored count cluster-wide, a registration
clamped to the last trusted count). A decrease to 0 without
justification is a violation with its own enforcement action (``dropToZero``, default ``warn``).

Recovery is gated by attaches (``recoveryGate: attaches``, the default; DESIGN.md, the brake: "Recovery after a
correction advances only while attaches at the new level succeed"): inside ``window``, an increase is held at the
stored count while a capacity-class attach error (VolumeAttachment ``status.attachError.errorCode`` 8, gRPC
ResourceExhausted, for this node and attacher = driver) is stamped after the entry's last accepted change (the
last recovery step, or the correction itself). The external-attacher rewrites ``status.attachError`` (a new
``time``) on every retry of a failing attach and clears it once the volume attaches, so such an error means an
attach at the level the last step set still fails; the error that backed the correction is stamped at or before
it and does not hold the first step. The errors looked at are the ones the evaluation gathered for the change,
those of the last ``evidence.resourceExhaustedWithin``: an older one stands for an attach nobody retried since.

When the attach errors are unknown (the VolumeAttachment cache is not synced, no cluster facts offline), the step
is held too. The design judges an increase on local rules only when a lookup fails; here the lookup *is* the
rule: the step is earned by attaches that succeeded, and an unknown cannot earn it. Holding keeps the count at the
level the correction's evidence supports (the safe direction: pods may wait Pending, none is scheduled to a node
that cannot attach), it lasts at most ``window``, and the next write after the cache syncs is judged again.
``recoveryGate: time`` gives the pace by ``recoveryStep`` alone.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from webhook.admission.brake import describe, release_hint
from webhook.admission.cluster import AttachError, AttachErrorClass
from webhook.admission.csinode import format_count
from webhook.admission.durations import format_duration
from webhook.admission.rules.base import RuleContext, Violation
from webhook.admission.state import Correction, EntryState, format_time

RULE_ID = "count-rollback"


def check(ctx: RuleContext) -> list[Violation]:
    """Findings for frozen entries, recovery after a correction, and drops to 0."""
    change = ctx.change
    rules = ctx.driver_policy.rules
    found: list[Violation] = []
    if ctx.brake is not None and change.is_first_registration:
        first = _first_registration_under_brake(ctx)
        return [first] if first is not None else found
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
    held = _held_by_attaches(ctx, entry, corr)
    if held is not None:
        found.append(held)
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


def _first_registration_under_brake(ctx: RuleContext) -> Violation | None:
    """While the brake of the driver is engaged, a node with no earlier count of it (a node that joins during the
    incident, or a CSINode without state or history) registers at most the highest count trusted before the
    increases whose attaches failed (the evidence's ``from`` counts): the counts above them are what failed. A
    registration is never refused: the finding clamps it."""
    brake = ctx.brake
    change = ctx.change
    if brake is None:
        return None
    cap = max((e.before for e in brake.evidence), default=None)
    if cap is None or (change.new is not None and change.new <= cap):
        return None
    return Violation(
        rule=RULE_ID,
        action=ctx.driver_policy.rules.rollback_action,
        why=f"a first registration of {change.driver} while its increases are held cluster-wide registers at most "
        f"{cap}, the highest count trusted before the increases whose attaches failed: {describe(brake)}",
        proceed=release_hint(change.driver),
        clamp_to=cap,
    )


def last_step(entry: EntryState) -> datetime:
    """When ``entry``'s count last changed by an accepted write: its last recovery step, or its correction."""
    if entry.correction is not None and entry.correction.at > entry.changed_at:
        return entry.correction.at
    return entry.changed_at


def capacity_errors_since_step(ctx: RuleContext, entry: EntryState) -> list[AttachError] | None:
    """The capacity-class attach errors (errorCode 8) of the change's (node, driver) stamped after
    :func:`last_step` of ``entry``, oldest first; None when the attach errors are unknown. Only the errors ``ctx``
    carries are looked at (those of the last ``evidence.resourceExhaustedWithin``)."""
    if ctx.attach_errors is None:
        return None
    step = last_step(entry)
    found = [e for e in ctx.attach_errors if e.error_class is AttachErrorClass.CAPACITY and e.time > step]
    return sorted(found, key=lambda e: e.time)


def _held_by_attaches(ctx: RuleContext, entry: EntryState, corr: Correction) -> Violation | None:
    """The finding that holds a recovery step at the stored count (``recoveryGate: attaches``): a capacity-class
    attach failure since the last step, or attach errors that are unknown; None when the step is judged by
    ``recoveryStep`` alone. Called for an unjustified increase of an entry whose correction ``corr`` is inside
    ``window``."""
    rules = ctx.driver_policy.rules
    if rules.recovery_gate != "attaches":
        return None
    failed = capacity_errors_since_step(ctx, entry)
    if failed is not None and not failed:
        return None
    last = format_time(last_step(entry))
    window_ends = format_time(corr.at + timedelta(seconds=rules.rollback_window))
    if failed is None:
        why = (
            f"the VolumeAttachments are unknown to the guard, so attaches since the last step ({last}) cannot earn "
            f"a recovery step; the window ends at {window_ends}"
        )
        proceed = "judged again at the next write once the guard sees them, or with an approver's justification"
    else:
        newest = failed[-1]
        on = f" on {newest.volume_attachment}" if newest.volume_attachment else ""
        why = (
            f"attach failures with errorCode 8 since the last step ({last}): recovery waits for attaches to succeed; "
            f"newest at {format_time(newest.time)}{on}, {len(failed)} in all; the window ends at {window_ends}"
        )
        proceed = (
            "it passes once attaches succeed (no errorCode 8 after the last step), or with an approver's justification"
        )
    return Violation(rule=RULE_ID, action=rules.rollback_action, why=why, proceed=proceed, clamp_to=ctx.change.old)
