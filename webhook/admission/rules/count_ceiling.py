"""``count-ceiling``: implausibly high counts.

Findings: bounded -> unbounded (a scheduler treats a missing count as no limit); 2147483647 (kubelet cuts larger
NodeGetInfo values to int32 max: a glitch, not a limit); above the driver's ceiling, refined by a node label
(instance type, VM size) and driver profiles; an increase larger than ``maxStepUp``. The default enforcement
action is ``clamp``: unbounded and int32 max go back to the old count, the others to the ceiling or the step.
A registration (also after a removal: its old count is the one the state retained) is judged the same way; one
without a count (unbounded) or with int32 max and no earlier count is clamped to the ceiling when the driver has
a finite one.
"""

from __future__ import annotations

from webhook.admission.csinode import INT32_MAX, format_count
from webhook.admission.rules.base import RuleContext, Violation, soften_for_decrease

RULE_ID = "count-ceiling"


def check(ctx: RuleContext) -> list[Violation]:
    """Findings for unbounded-after-bounded, int32 max, above the ceiling and a step above ``maxStepUp``."""
    change = ctx.change
    base = ctx.driver_policy.rules.ceiling_action
    # A registration is judged on what it carries, whatever came before (the evaluation never refuses it).
    action = base if change.is_increase or change.registration else soften_for_decrease(base)
    old, new = change.old, change.new
    if new is None:
        if old is None:
            ceiling, ceiling_why = ctx.ceiling
            if not change.registration or ceiling is None:
                return []
            return [
                Violation(
                    rule=RULE_ID,
                    action=action,
                    why=f"registered without a count (unbounded), but the driver has the ceiling {ceiling} "
                    f"({ceiling_why})",
                    proceed="fix the driver's NodeGetInfo max_volumes_per_node",
                    clamp_to=ceiling,
                )
            ]
        return [
            Violation(
                rule=RULE_ID,
                action=action,
                why="the count was removed (unbounded) after being bounded",
                proceed="fix the driver's NodeGetInfo max_volumes_per_node; the old count stays",
                clamp_to=old,
            )
        ]
    found: list[Violation] = []
    ceiling, ceiling_why = ctx.ceiling
    if new >= INT32_MAX:
        keep = old if old is not None else ceiling
        found.append(
            Violation(
                rule=RULE_ID,
                action=action,
                why=f"{INT32_MAX} is kubelet's cut-off for an overflowing NodeGetInfo value",
                proceed="fix the driver's NodeGetInfo max_volumes_per_node",
                clamp_to=keep,
            )
        )
        return found
    if ceiling is not None and new > ceiling:
        found.append(
            Violation(
                rule=RULE_ID,
                action=action,
                why=f"above the ceiling {ceiling} ({ceiling_why})",
                proceed="fix the driver's volume limit (e.g. --volume-attach-limit), or raise the ceiling in "
                "the policy",
                clamp_to=ceiling,
            )
        )
    step = ctx.driver_policy.max_step_up
    if step is not None and old is not None and new - old > step and not ctx.justified:
        found.append(
            Violation(
                rule=RULE_ID,
                action=action,
                why=f"an increase of {new - old} is larger than maxStepUp {step} (from {format_count(old)})",
                proceed="let the count rise in smaller steps, or have an approver justify the jump",
                clamp_to=old + step,
            )
        )
    return found
