"""How findings and decisions read: the ``[rule] node/driver: old -> new: why; proceed`` lines, the reasons of a
rule that found nothing, and the note on a large decrease backed by no capacity error. Pure text, no decisions.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from webhook.admission.cluster import AttachError, AttachErrorClass
from webhook.admission.csinode import CountChange, format_count
from webhook.admission.decision import Note
from webhook.admission.justification import JUSTIFICATION_ANNOTATION
from webhook.admission.policy import STATE_INTEGRITY
from webhook.admission.review import MAX_WARNING_LENGTH
from webhook.admission.rules.base import RuleContext, Violation
from webhook.admission.rules.change_rate import RULE_ID as CHANGE_RATE
from webhook.admission.rules.change_rate import min_interval
from webhook.admission.rules.writer_identity import RULE_ID as WRITER_IDENTITY
from webhook.admission.state import STATE_ANNOTATION, Approval
from webhook.admission.versions import MAX_VERSION_LENGTH, is_valid_version

MAX_MESSAGE_LINES = 20
"""Violations a denial's message lists (one line each); more are counted in a last line. The audit record of
each change keeps its own lines, so a CSINode with thousands of drivers gives neither a huge answer nor audit
records that repeat every other change's lines."""


def finding_line(node: str, change: CountChange | None, v: Violation, suffix: str = "") -> str:
    """``[rule] node/driver: old -> new{suffix}: why; proceed`` (``node: annotation`` for a request-level finding)."""
    if change is None:
        # A request-level finding is about an annotation: the guard's state, the justification, driver versions.
        annotation = v.annotation or (STATE_ANNOTATION if v.rule == STATE_INTEGRITY else JUSTIFICATION_ANNOTATION)
        where = f"{node}: {annotation}"
    elif change.registration:
        before = "" if change.old is None else f"{format_count(change.old)} -> "
        where = f"{node}/{change.driver} (registration): {before}{format_count(change.new)}{suffix}"
    else:
        where = f"{node}/{change.driver}: {format_count(change.old)} -> {format_count(change.new)}{suffix}"
    return f"[{v.rule}] {where}: {v.why}; {v.proceed}"


ADVICE_WITHIN = 200
"""A shortened warning's advice starts within this many characters (kubectl and client-go print warnings whole,
but some front ends show only the start of a line)."""


def warning_line(line: str, why: str, advice: str, limit: int = MAX_WARNING_LENGTH) -> str:
    """``line`` (``[rule] where: why; advice``, one :func:`finding_line`) as an AdmissionResponse warning of at most
    ``limit`` characters: a line that fits is returned as it is; a longer one keeps ``[rule] where:`` (the rule,
    node, driver and change) and the advice whole and shortens the reason between them (``...``), so that the
    advice starts within :data:`ADVICE_WITHIN` characters where the two leave room for it. The whole reason stays
    in the audit record and the denial message, which have no such limit. An advice too long to fit is cut at its
    end (by :func:`webhook.admission.review.clean_warning`)."""
    line, why, advice = (" ".join(t.split()) for t in (line, why, advice))
    tail = f": {why}; {advice}"
    if len(line) <= limit or not line.endswith(tail):
        return line
    prefix = line[: len(line) - len(tail)] + ": "
    room = min(ADVICE_WITHIN, limit - len(advice)) - len(prefix) - len("...; ")
    return f"{prefix}{why[:max(room, 0)].rstrip()}...; {advice}"



def pass_reason(rule: str, ctx: RuleContext) -> str:
    """Why ``rule`` found nothing on ``ctx.change`` (the message of its ``pass`` outcome)."""
    if rule == WRITER_IDENTITY:
        if ctx.writer.is_node_kubelet:
            return "written by the node's own kubelet"
        if ctx.writer.is_listed_writer:
            return f"{ctx.writer.username} is a writer the policy lists"
        return "justified by a recorded approval"
    if rule == "writer-version":
        return version_pass_reason(ctx)
    if rule == "count-ceiling":
        return _ceiling_reason(*ctx.ceiling)
    if rule == CHANGE_RATE:
        if ctx.change.registration:
            return "registrations are exempt"
        if not ctx.change.is_increase:
            return "decreases are exempt"
        if ctx.entry is None:
            return "no earlier change recorded"
        elapsed = (ctx.now - ctx.entry.changed_at).total_seconds()
        minimum = min_interval(ctx)
        reason = f"{elapsed:.0f}s since the last accepted change (minimum {minimum:.0f}s)"
        approval = ctx.justification_for() if elapsed < minimum else None
        if approval is not None:  # change_rate.check lets a justified increase through at any pace
            reason += f"; the minimum is lifted by {approval_text(approval)}"
        return reason
    if ctx.change.is_first_registration:
        return "first registration: no earlier count to roll back to"
    return "no correction or freeze in effect" if ctx.change.is_increase else "decrease"


def approval_text(approval: Approval) -> str:
    """``the justification by alice (OPS-4711) for counts 20..27``: which recorded approval lifted a rule."""
    ticket = f" ({approval.ticket})" if approval.ticket else ""
    return (f"the justification by {approval.approved_by or '(unknown)'}{ticket} for counts "
            f"{approval.min_count}..{approval.max_count}")


def version_pass_reason(ctx: RuleContext) -> str:
    """Why writer-version found nothing: the version and its source, and when the version is unknown or cannot
    be compared (not a semantic version), that onUnknown let it through (or that the change is a decrease)."""
    dp, change = ctx.driver_policy, ctx.change
    version = ctx.driver_version
    compared = bool(dp.min_version or (ctx.entry.writer_version if ctx.entry else None))
    # Only version strings short enough to be versions are remembered (bounded in count and bytes).
    reason = _version_reason if version is None or len(version) <= MAX_VERSION_LENGTH else _version_reason.__wrapped__
    return reason(version, dp.version_source.type, compared, change.is_first_registration, change.is_increase,
                  dp.rules.version_on_unknown)


@functools.lru_cache(maxsize=256)
def _ceiling_reason(ceiling: int | None, why: str) -> str:
    """The count-ceiling pass: remembered, as every write of a driver on a node type reads the same."""
    return f"within the ceiling {format_count(ceiling)} {('(' + why + ')') if why else ''}".rstrip()


@functools.lru_cache(maxsize=256)
def _version_reason(version: str | None, source: str, compared: bool, first_registration: bool, increase: bool,
                    on_unknown: str) -> str:
    """The writer-version pass (:func:`version_pass_reason`): remembered per version and what it depends on."""
    if version is not None and (not compared or is_valid_version(version)):
        return f"driver version {version} ({source} source)"
    what = (f"driver version unknown ({source} source)" if version is None
            else f"driver version {version} ({source} source) cannot be compared: not a semantic version")
    if first_registration:
        return f"{what}; a first registration is not held back by onUnknown"
    if not increase:
        return f"{what}; decreases are not held back by onUnknown"
    return f"{what}; writer-version.onUnknown: {on_unknown} applied"


def capacity_note(change: CountChange, errors: Sequence[AttachError] | None, fraction: float) -> Note | None:
    """The note on a decrease by ``fraction`` or more that coincides only with non-capacity attach errors."""
    if change.is_increase or change.old is None or change.new is None or not errors:
        return None
    if change.old == 0 or (change.old - change.new) / change.old < fraction:
        return None
    if any(e.error_class is AttachErrorClass.CAPACITY for e in errors):
        return None
    counts: dict[str, int] = {}
    for e in errors:
        counts[e.error_class.value] = counts.get(e.error_class.value, 0) + 1
    listed = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))
    return Note(
        f"{change.node}/{change.driver}: {format_count(change.old)} -> {format_count(change.new)} coincides only "
        f"with non-capacity attach errors ({listed}); lowering the count on any attach failure is a driver mistake",
        change.driver,
    )

