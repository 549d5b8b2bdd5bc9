"""The annotations a write declares: approvals in ``csinode-guard.io/justification``, driver versions in the
version annotations. Part of classifying a write (:mod:`.classify`).

A justifier's justification becomes approvals, a version reporter's versions declared versions (both recorded
in the next signed state, with who set them); the same annotation changed by anyone else is a writer-identity
finding, not recorded (on a write never refused, the patch puts it back). A justification that does not parse
refuses the write as invalid (400), but on a write never refused, where it is noted and put back.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from types import MappingProxyType
from typing import Any, NamedTuple

from webhook.admission.csinode import CSINode
from webhook.admission.decision import Note
from webhook.admission.justification import JUSTIFICATION_ANNOTATION, JustificationError, parse_justifications
from webhook.admission.policy import Policy
from webhook.admission.review import AdmissionRequest
from webhook.admission.rules.base import Violation
from webhook.admission.rules.writer_identity import RULE_ID as WRITER_IDENTITY
from webhook.admission.state import Approval, DeclaredVersion

MAX_REMEMBERED_ANNOTATION = 1024
"""Characters of a driver-versions annotation remembered at most (longer ones are decoded every time, so that
the cache holds at most 1024 x 1 KB; a few drivers need some 30 characters each)."""


@functools.lru_cache(maxsize=1024)
def _published_versions(raw: str) -> Mapping[str, Any]:
    """The driver-versions annotation decoded (empty when it is not a JSON object); remembered per value, as
    every write of a node carries the same one. Read-only: the result is shared."""
    return _decode_versions(raw)


def _decode_versions(raw: str) -> Mapping[str, Any]:
    try:
        versions = json.loads(raw)
    except (ValueError, RecursionError):  # JSONDecodeError, or an integer over 4300 digits
        return {}
    return MappingProxyType(versions) if isinstance(versions, dict) else {}



class Declarations(NamedTuple):
    """What a write's annotations declare, read once.

    ``approvals`` the state's approvals and the ones a justifier's justification adds (``approvals_recorded`` of
    them new), ``by_driver`` the same grouped by driver (each change looks only at its own); ``declared`` the
    driver versions the trusted reporters declared (``declared_changed`` when this write changed them);
    ``violations`` the request-level writer-identity findings (a stranger's annotation), in order; ``restore``
    the annotations the patch puts back (a stranger's, on a write never refused); ``notes`` what was not
    recorded; ``invalid`` the message when the justification does not parse and the write may be refused.
    """

    approvals: tuple[Approval, ...]
    by_driver: Mapping[str, tuple[Approval, ...]]
    approvals_recorded: int
    declared: Mapping[str, DeclaredVersion]
    declared_changed: bool
    violations: tuple[Violation, ...]
    restore: tuple[str, ...]
    notes: tuple[Note, ...]
    invalid: str | None = None


def read_annotations(
    request: AdmissionRequest,
    policy: Policy,
    now: datetime,
    old: CSINode,
    new: CSINode,
    never_refused: bool,
    approvals: Sequence[Approval],
    declared: Mapping[str, DeclaredVersion],
) -> Declarations:
    """Read the justification and version annotations of ``new`` (against ``old``) on top of the state's
    ``approvals`` and ``declared`` versions; ``never_refused`` is the write's kind (:class:`.classify.Write`)."""
    if not approvals and not declared and _unchanged(old, new, JUSTIFICATION_ANNOTATION, *policy.version_annotations):
        # Nothing recorded and nothing declared (kubelet's periodic writes): there is nothing to read.
        return Declarations((), {}, 0, {}, False, (), (), ())
    recorded = list(approvals)
    violations: list[Violation] = []
    restore: list[str] = []
    notes: list[Note] = []
    added = _justifications(request, policy, now, old, new, never_refused, recorded, violations, restore, notes)
    if isinstance(added, str):
        return Declarations((), {}, 0, {}, False, (), (), (), invalid=added)
    versions = dict(declared)
    changed = _versions(request, policy, now, old, new, never_refused, versions, violations, restore, notes)
    by_driver: dict[str, list[Approval]] = {}
    for a in recorded:
        by_driver.setdefault(a.driver, []).append(a)
    return Declarations(
        approvals=tuple(recorded),
        by_driver={d: tuple(found) for d, found in by_driver.items()},
        approvals_recorded=added,
        declared=versions,
        declared_changed=changed,
        violations=tuple(violations),
        restore=tuple(restore),
        notes=tuple(notes),
    )


def _unchanged(old: CSINode, new: CSINode, *annotations: str) -> bool:
    """True when each of ``annotations`` has the same value on ``new`` as on ``old`` (absent from both counts)."""
    before, after = old.annotations, new.annotations
    return all(after.get(a) == before.get(a) for a in annotations)


def _justifications(
    request: AdmissionRequest, policy: Policy, now: datetime, old: CSINode, new: CSINode, never_refused: bool,
    approvals: list[Approval], violations: list[Violation], restore: list[str], notes: list[Note],
) -> int | str:
    """Append the approvals a justifier's justification adds to ``approvals`` (and what else it finds to the
    other lists); the number added, or the message of an invalid justification on a write that may be refused."""
    old_value = old.annotations.get(JUSTIFICATION_ANNOTATION)
    new_value = new.annotations.get(JUSTIFICATION_ANNOTATION)
    if new_value is None or new_value == old_value:
        return 0
    if not policy.justifiers.contains(request.username, request.groups):
        violations.append(
            Violation(
                rule=WRITER_IDENTITY,
                action=policy.default_driver.rules.identity_action,
                why=f"{request.username or '(anonymous)'} is not a justifier the policy lists",
                proceed="ask a principal listed under spec.justifiers to set the justification",
            ),
        )
        if never_refused:
            restore.append(JUSTIFICATION_ANNOTATION)
        return 0
    try:
        parsed = parse_justifications(new_value)
    except JustificationError as exc:
        if never_refused:
            notes.append(Note(f"{JUSTIFICATION_ANNOTATION} not recorded: {exc}"))
            restore.append(JUSTIFICATION_ANNOTATION)
            return 0
        return str(exc)
    added = 0
    known = {(a.driver, a.min_count, a.max_count, a.expires, a.reason, a.ticket) for a in approvals}
    for j in parsed:
        if j.expires <= now:
            notes.append(Note(f"justification for {j.driver} expired at {j.expires.isoformat()}; not recorded",
                              j.driver))
            continue
        approval = Approval(
            driver=j.driver,
            reason=j.reason,
            min_count=j.min_count,
            max_count=j.max_count,
            expires=j.expires,
            ticket=j.ticket,
            approved_by=request.username,
            approved_at=now,
        )
        key = (j.driver, j.min_count, j.max_count, j.expires, j.reason, j.ticket)
        if key not in known:
            known.add(key)
            approvals.append(approval)
            added += 1
    return added


def _versions(
    request: AdmissionRequest, policy: Policy, now: datetime, old: CSINode, new: CSINode, never_refused: bool,
    declared: dict[str, DeclaredVersion], violations: list[Violation], restore: list[str], notes: list[Note],
) -> bool:
    """Record in ``declared`` the driver versions a trusted principal declares in a version annotation, with who
    set them (True when that changed anything); a change by anyone else is a writer-identity finding (like a
    justification from a stranger) and is not recorded."""
    who = request.username or "(anonymous)"
    changed = False
    for annotation in sorted(policy.version_annotations):
        old_value = old.annotations.get(annotation)
        new_value = new.annotations.get(annotation)
        if new_value == old_value:
            continue
        if not policy.declares_versions(request.username, request.groups):
            violations.append(
                Violation(
                    rule=WRITER_IDENTITY,
                    action=policy.default_driver.rules.identity_action,
                    why=f"{who} is not a version reporter the policy lists, so it cannot declare driver versions",
                    proceed="let a principal listed under spec.versionReporters publish the versions, or use "
                    "versionSource pod or kubelet",
                    annotation=annotation,
                ),
            )
            if never_refused:
                restore.append(annotation)
            continue
        raw = new_value or ""
        versions = (_published_versions if len(raw) <= MAX_REMEMBERED_ANNOTATION else _decode_versions)(raw)
        if new_value and not versions:
            notes.append(Note(f"{annotation} is not a JSON object of driver versions; nothing recorded"))
        for driver, version in versions.items():
            if not isinstance(version, str) or not version:
                continue
            known = declared.get(driver)
            if known is None or known.version != version:
                declared[driver] = DeclaredVersion(version, request.username, now)
                changed = True
        for driver in list(declared):
            source = policy.for_driver(driver).version_source
            if driver not in versions and source.type == "annotation" and source.annotation == annotation:
                del declared[driver]  # the reporter no longer declares it
                changed = True
    return changed
