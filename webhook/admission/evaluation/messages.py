"""The lines of an answer from settled findings: a denial's message and warnings, an admission's warnings.

A denial names every rule that found something, once per change: a message line per denying (rule, change),
its findings' reasons joined (at most ``MAX_MESSAGE_LINES``), and a warning per other (rule, change) whose finding
would show in an admitted answer (clamp, warn). An admission warns once per clamping or warning finding, and
once per change that several rules clamped (the count applied, the lowest any of them allows). Dry-run findings
stay in the audit record only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from webhook.admission.csinode import CountChange, format_count
from webhook.admission.decision import Decision
from webhook.admission.evaluation.effective import Finding
from webhook.admission.evaluation.wording import MAX_MESSAGE_LINES, finding_line, warning_line
from webhook.admission.policy import EnforcementAction


def clamping_rules(findings: Iterable[Finding], finals: Mapping[str, int | None]) -> dict[str, list[str]]:
    """Per driver, the rules whose clamp changed its count (in finding order, each once)."""
    rules: dict[str, list[str]] = {}
    for f in findings:
        if f.effective is EnforcementAction.CLAMP and f.change is not None and finals[f.change.driver] != f.change.new:
            named = rules.setdefault(f.change.driver, [])
            if f.violation.rule not in named:
                named.append(f.violation.rule)
    return rules


def clamp_results(node: str, changes: Iterable[CountChange], finals: Mapping[str, int | None],
                  clamping: Mapping[str, list[str]]) -> list[str]:
    """One line per change that several rules clamped: the count applied, the lowest any of them allows."""
    lines = []
    for c in changes:
        rules = clamping.get(c.driver, [])
        if len(rules) > 1:
            before = "registration: " if c.is_first_registration else f"{format_count(c.old)} -> "
            lines.append(f"{node}/{c.driver}: {before}{format_count(c.new)} clamped to "
                         f"{format_count(finals[c.driver])}, what every one of {', '.join(rules)} allows")
    return lines


def by_rule_and_change(findings: Iterable[Finding]) -> list[list[Finding]]:
    """``findings`` grouped by (rule, driver of the change), in the order each group first appears."""
    groups: dict[tuple[str, str | None], list[Finding]] = {}
    for f in findings:
        groups.setdefault((f.violation.rule, f.change.driver if f.change else None), []).append(f)
    return list(groups.values())


def merged_line(node: str, group: Sequence[Finding], suffix: str = "", *, warning: bool = False) -> str:
    """One ``[rule] node/driver: old -> new: why; proceed`` line for findings of one rule about one change; with
    ``warning``, fitted to a warning's length with the advice whole (:func:`warning_line`)."""
    first = group[0]
    why = "; ".join(dict.fromkeys(f.violation.why for f in group))
    proceed = "; ".join(dict.fromkeys(f.violation.proceed for f in group))
    line = finding_line(node, first.change, first.violation._replace(why=why, proceed=proceed), suffix)
    return warning_line(line, why, proceed) if warning else line


def denial_lines(node: str, denied: Sequence[Finding], findings: Sequence[Finding],
                 finals: Mapping[str, int | None]) -> tuple[list[str], list[str]]:
    """(message lines, warnings) of a denial: every rule that found something is named, once per change.

    The message has a line per denying (rule, change), its findings' reasons joined; the warnings a line per
    other (rule, change) whose finding would show in an admitted answer (clamp, warn), so that an operator
    who fixes what the denial says is not surprised by the next rule. Dry-run findings stay in the audit
    record only, as for an admitted write.
    """
    lines = [merged_line(node, group) for group in by_rule_and_change(denied)]
    if len(lines) > MAX_MESSAGE_LINES:
        rest = len(lines) - MAX_MESSAGE_LINES
        lines = [*lines[:MAX_MESSAGE_LINES], f"... and {rest} more violations (the audit log has each)"]
    named = {(f.violation.rule, f.change.driver if f.change else None) for f in denied}
    quiet = [f for f in findings
             if f.effective in (EnforcementAction.CLAMP, EnforcementAction.WARN)
             and (f.violation.rule, f.change.driver if f.change else None) not in named]
    warnings = []
    for group in by_rule_and_change(quiet):
        f = group[0]
        final = finals.get(f.change.driver) if f.change is not None else None
        clamps = f.effective is EnforcementAction.CLAMP and f.change is not None and final != f.change.new
        suffix = f" (would be clamped to {format_count(final)})" if clamps else ""
        warnings.append(merged_line(node, group, suffix, warning=True))
    return lines, warnings


def admitted_lines(node: str, changes: Sequence[CountChange], findings: Sequence[Finding],
                   finals: Mapping[str, int | None]) -> tuple[Decision, list[str]]:
    """The decision of an admitted write (clamp, warn or allow) and its warnings (without the notes)."""
    warnings: list[str] = []
    decision = Decision.ALLOW
    clamping = clamping_rules(findings, finals)
    for f in findings:
        final = finals[f.change.driver] if f.change is not None else None
        if f.effective is EnforcementAction.CLAMP and f.change is not None and final != f.change.new:
            decision = Decision.CLAMP
            several = len(clamping[f.change.driver]) > 1  # each line then says what its own rule allows
            suffix = (f" (this rule allows {format_count(f.violation.clamp_to)})" if several
                      else f" (clamped to {format_count(final)})")
            warnings.append(warning_line(finding_line(node, f.change, f.violation, suffix), f.violation.why,
                                         f.violation.proceed))
        elif f.effective is EnforcementAction.WARN:
            if decision is Decision.ALLOW:
                decision = Decision.WARN
            warnings.append(warning_line(finding_line(node, f.change, f.violation), f.violation.why,
                                         f.violation.proceed))
    warnings.extend(clamp_results(node, changes, finals, clamping))
    return decision, warnings
