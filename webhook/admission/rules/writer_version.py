"""``writer-version``: counts from outdated or rolled-back driver versions.

The driver's version on the node comes from the policy's ``versionSource`` (a CSINode annotation, the driver's
node pod, or the kubelet version). Below ``minVersion`` is a violation; older than the version recorded for the
entry's last accepted change is a version rollback: a violation unless justified, and it freezes increases of
the entry for ``freezeFor``. Decreases are the safe direction: their findings are at most warnings. At a
registration (a node plugin restart) the entry's retained history counts: an older driver than the one of the
last accepted change keeps the last accepted count (a ``deny`` acts as a clamp to it there) and freezes.
"""

from __future__ import annotations

from webhook.admission.durations import format_duration
from webhook.admission.policy import EnforcementAction
from webhook.admission.rules.base import RuleContext, Violation, soften_for_decrease
from webhook.admission.versions import VersionError, compare_versions

RULE_ID = "writer-version"


def check(ctx: RuleContext) -> list[Violation]:
    """Findings for an unknown version (``onUnknown``), a version below ``minVersion`` and a version rollback."""
    rules = ctx.driver_policy.rules
    increase = ctx.change.is_increase

    def action(base: EnforcementAction) -> EnforcementAction:
        return base if increase else soften_for_decrease(base)

    version = ctx.driver_version
    found: list[Violation] = []
    if version is None:
        if rules.version_on_unknown != "allow" and increase:
            found.append(
                Violation(
                    rule=RULE_ID,
                    action=EnforcementAction(rules.version_on_unknown),
                    why="the driver's version on this node is unknown",
                    proceed=f"publish the version ({ctx.driver_policy.version_source.type} source) "
                    "or set writer-version.onUnknown: allow",
                )
            )
        return found
    minimum = ctx.driver_policy.min_version
    try:
        if minimum is not None and compare_versions(version, minimum) < 0:
            found.append(
                Violation(
                    rule=RULE_ID,
                    action=action(rules.version_action),
                    why=f"driver version {version} is below minVersion {minimum}",
                    proceed=f"upgrade {ctx.change.driver} on this node to {minimum} or later",
                )
            )
        recorded = ctx.entry.writer_version if ctx.entry else None
        if recorded is not None and compare_versions(version, recorded) < 0:
            justified = ctx.justified
            freeze_note = f"increases are frozen for {format_duration(rules.freeze_for)}"
            if justified:
                found.append(
                    Violation(
                        rule=RULE_ID,
                        action=EnforcementAction.DRYRUN,
                        why=f"driver version rolled back {recorded} -> {version} (justified); {freeze_note}",
                        proceed="none needed",
                        freeze=True,
                    )
                )
            else:
                found.append(
                    Violation(
                        rule=RULE_ID,
                        action=action(rules.version_action),
                        why=f"driver version rolled back {recorded} -> {version}; {freeze_note}",
                        proceed="roll the driver forward, or have an approver justify the rollback",
                        clamp_to=ctx.change.old,
                        freeze=True,
                    )
                )
    except VersionError as exc:
        if increase and rules.version_on_unknown != "allow":
            found.append(
                Violation(
                    rule=RULE_ID,
                    action=EnforcementAction(rules.version_on_unknown),
                    why=f"the driver's version cannot be compared ({exc})",
                    proceed="publish a semantic version such as v1.37.0",
                )
            )
    return found
