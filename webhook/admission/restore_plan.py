"""The plan of ``csinode-guard restore``: the CSINode update that puts a driver's count back to the last count
the guard trusted. Pure: takes the CSINode as read and returns the whole object to PUT.

The trusted count is the driver's entry in the guard's signed state (``csinode-guard.io/state``), verified with
the state keys (or read unverified with ``--no-verify``); the update sets ``spec.drivers[].allocatable.count``
to it and adds a justification (``csinode-guard.io/justification``) covering exactly that count, so the change
passes writer-identity, count-rollback and change-rate when the operator is a justifier the policy lists.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from webhook.admission.justification import JUSTIFICATION_ANNOTATION, JustificationError, parse_justifications
from webhook.admission.state import STATE_ANNOTATION, StateKeys, StateProblem, decode_state, format_time


class RestoreError(Exception):
    """Why a count cannot be restored (the message is for the operator)."""


@dataclass(frozen=True)
class TrustedCount:
    """The driver's entry in the guard's state: the last accepted ``count`` (None = unbounded)."""

    count: int | None
    changed_at: str | None
    writer_version: str | None
    verified: bool


@dataclass(frozen=True)
class JustificationRequest:
    """What the operator states for the justification restore adds."""

    reason: str
    ticket: str | None
    expires: datetime


@dataclass(frozen=True)
class RestorePlan:
    """The update :func:`plan_restore` decided on: ``body`` is the whole CSINode to PUT."""

    node: str
    driver: str
    trusted: TrustedCount
    current: int | None
    body: dict[str, Any]
    justification: str
    notes: tuple[str, ...]

    @property
    def resource_version(self) -> str:
        """The resourceVersion the PUT is conditional on."""
        return str(self.body["metadata"].get("resourceVersion"))

    @property
    def target(self) -> int:
        """The count written: the trusted count (never None in a plan)."""
        assert self.trusted.count is not None
        return self.trusted.count


def find_driver(csinode: Mapping[str, Any], driver: str) -> dict[str, Any] | None:
    """The ``spec.drivers`` entry named ``driver`` (by name, never by index), or None."""
    for entry in (csinode.get("spec") or {}).get("drivers") or []:
        if isinstance(entry, dict) and entry.get("name") == driver:
            return entry
    return None


def allocatable_count(entry: Mapping[str, Any]) -> int | None:
    """``allocatable.count`` of a driver entry; None when absent (unbounded)."""
    count = (entry.get("allocatable") or {}).get("count")
    return count if isinstance(count, int) and not isinstance(count, bool) else None


def read_trusted_count(csinode: Mapping[str, Any], driver: str, keys: StateKeys | None) -> TrustedCount:
    """The trusted count of ``driver`` from the state on ``csinode``; verified unless ``keys`` is None.

    Raises :class:`RestoreError` when there is no state, it does not verify (or, unverified, cannot be read),
    it belongs to another object, or it has no entry for ``driver``.
    """
    metadata = csinode.get("metadata") or {}
    node = metadata.get("name", "?")
    uid = str(metadata.get("uid") or "")
    value = (metadata.get("annotations") or {}).get(STATE_ANNOTATION)
    if not value:
        raise RestoreError(
            f"CSINode {node} has no {STATE_ANNOTATION} annotation: the guard has not accepted a count change there "
            "(or the state was removed), so there is no trusted count to restore"
        )
    if keys is None:
        return _read_unverified(value, uid, node, driver)
    decoded = decode_state(value, uid, keys)
    if decoded.state is None:
        problem = decoded.problem or StateProblem.MALFORMED
        hint = {
            StateProblem.BAD_SIGNATURE: "wrong --state-key-file, or the state was edited by someone else",
            StateProblem.OTHER_OBJECT: "the state was copied from another CSINode, or the CSINode was recreated",
            StateProblem.UNSUPPORTED_VERSION: "written by a newer csinode-guard; use that version's restore",
        }.get(problem, "the annotation was edited by someone other than the guard")
        raise RestoreError(
            f"the state on CSINode {node} does not verify ({problem.value}: {decoded.detail}); {hint}. "
            "Nothing was changed"
        )
    entry = decoded.state.entries.get(driver)
    if entry is None:
        raise RestoreError(_no_entry(node, driver, sorted(decoded.state.entries)))
    return TrustedCount(entry.count, format_time(entry.changed_at), entry.writer_version, verified=True)


def _no_entry(node: str, driver: str, known: list[str]) -> str:
    listed = ", ".join(known) if known else "none"
    return (
        f"the guard's state on CSINode {node} has no entry for {driver} (entries: {listed}): it has not accepted "
        "a count change of that driver, so there is no trusted count to restore"
    )


def _read_unverified(value: str, uid: str, node: str, driver: str) -> TrustedCount:
    """The entry read without checking the signature (``--no-verify``); the structure is still checked."""
    try:
        doc = json.loads(value)
    except (ValueError, RecursionError) as exc:
        raise RestoreError(f"the state on CSINode {node} is not JSON: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("drivers"), dict):
        raise RestoreError(f"the state on CSINode {node} is malformed (no drivers object)")
    if doc.get("uid") != uid:
        raise RestoreError(
            f"the state on CSINode {node} was recorded for another object (uid {doc.get('uid')!r}, this CSINode "
            f"is {uid!r}): it says nothing about this node"
        )
    raw = doc["drivers"].get(driver)
    if raw is None:
        raise RestoreError(_no_entry(node, driver, sorted(map(str, doc["drivers"]))))
    if not isinstance(raw, dict):
        raise RestoreError(f"the state's entry for {driver} on CSINode {node} is malformed (not an object)")
    count = raw.get("count")
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 0):
        raise RestoreError(f"the state's entry for {driver} on CSINode {node} has no valid count: {count!r}")
    changed_at, version = raw.get("changedAt"), raw.get("writerVersion")
    return TrustedCount(
        count,
        str(changed_at) if changed_at is not None else None,
        str(version) if version is not None else None,
        verified=False,
    )


def build_justifications(
    existing: str | None, driver: str, count: int, request: JustificationRequest, now: datetime
) -> tuple[str, list[str]]:
    """The justification annotation value with a new entry for exactly ``count`` of ``driver``, and notes.

    Valid unexpired entries already on the object are kept (in order, unchanged); expired ones are dropped. An
    annotation that does not parse is replaced (the guard would reject any update that changes it otherwise).
    """
    notes: list[str] = []
    kept: list[Any] = []
    if existing:
        try:
            parsed = parse_justifications(existing)
        except JustificationError as exc:
            notes.append(f"replacing the {JUSTIFICATION_ANNOTATION} annotation, which does not parse: {exc}")
        else:
            raw = json.loads(existing)
            raw_entries = raw if isinstance(raw, list) else [raw]
            for entry, justification in zip(raw_entries, parsed, strict=True):
                if justification.expires > now:
                    kept.append(entry)
            if len(kept) < len(raw_entries):
                notes.append(f"dropping {len(raw_entries) - len(kept)} expired justification(s)")
    new: dict[str, Any] = {
        "driver": driver,
        "reason": request.reason,
        "minCount": count,
        "maxCount": count,
        "expires": format_time(request.expires),
    }
    if request.ticket:
        new["ticket"] = request.ticket
    kept.append(new)
    return json.dumps(kept, separators=(",", ":")), notes


def plan_restore(
    csinode: Mapping[str, Any],
    driver: str,
    keys: StateKeys | None,
    request: JustificationRequest,
    now: datetime,
) -> RestorePlan:
    """The update that restores ``driver``'s trusted count on ``csinode`` (as read, with its resourceVersion).

    Raises :class:`RestoreError` when the driver is not in the CSINode, there is no usable state or entry, the
    trusted count is unbounded, or the count already equals it.
    """
    metadata = csinode.get("metadata") or {}
    node = str(metadata.get("name", "?"))
    entry = find_driver(csinode, driver)
    if entry is None:
        names = [str(d.get("name")) for d in (csinode.get("spec") or {}).get("drivers") or [] if isinstance(d, dict)]
        listed = ", ".join(names) if names else "none"
        raise RestoreError(f"driver {driver} is not in CSINode {node} (drivers: {listed})")
    trusted = read_trusted_count(csinode, driver, keys)
    current = allocatable_count(entry)
    if trusted.count is None:
        raise RestoreError(
            f"the last trusted count of {driver} on {node} is unbounded: restore writes bounded counts only (a "
            "justification covers a count range, and count-ceiling does not let a bounded count become unbounded)"
        )
    if current == trusted.count:
        raise RestoreError(
            f"nothing to restore: {driver} on {node} already has count {current}, the last trusted count"
        )
    body = copy.deepcopy(dict(csinode))
    target = find_driver(body, driver)
    assert target is not None
    allocatable = target.get("allocatable")
    if not isinstance(allocatable, dict):
        allocatable = target["allocatable"] = {}
    allocatable["count"] = trusted.count
    annotations = body["metadata"].setdefault("annotations", {})
    value, notes = build_justifications(annotations.get(JUSTIFICATION_ANNOTATION), driver, trusted.count, request, now)
    annotations[JUSTIFICATION_ANNOTATION] = value
    return RestorePlan(node, driver, trusted, current, body, value, tuple(notes))
