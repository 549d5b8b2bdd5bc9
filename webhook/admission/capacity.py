"""``csinode-guard status``: capacity and usage per (node, driver), built from listed objects. Pure.

Inputs are the JSON objects of one LIST per kind (CSINodes, Nodes, VolumeAttachments, Pending Pods); nothing
here talks to the API. For every ``spec.drivers[]`` entry of every CSINode (matched by driver name) a
:class:`CapacityRow` says:

- ``count``: the reported ``allocatable.count`` (None: unbounded, no ``allocatable`` or no ``count``);
- the guard's last accepted count and when, its writer version, frozen and corrected entries with until-when,
  from the signed ``csinode-guard.io/state`` annotation (verified with the state key when given; otherwise read
  as it claims and marked ``unverified``);
- the ceiling the policy applies to that node and why (:meth:`webhook.admission.policy.Ceiling.resolve` on the Node's
  labels: instance type, profile, driver ceiling);
- ``attached``: VolumeAttachments for (``spec.nodeName``, ``spec.attacher``) with ``status.attached: true``;
- ``headroom``: the effective allowed count minus attached volumes: the reported count, but never more than the
  ceiling the policy applies (a count stored above it, e.g. while the guard was down, is no capacity the guard
  stands behind); None when unbounded and without a ceiling;
- ``pending``: Pods Pending as Unschedulable on volume limits, nominated to that node (the scheduler names no
  node for an unschedulable pod otherwise; the cluster-wide number is in the summary);
- recent attach errors (``status.attachError.time`` within a window) by
:class:`webhook.admission.cluster.AttachErrorClass`;
- ``reported``: what the driver reports when the guard holds the entry below it (the state's ``reported``,
  :mod:`webhook.admission.held_below`); the report's ``held`` section lists those entries per driver.

Rows sort by least headroom (unbounded last). :func:`format_table` renders kubectl-like columns.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from webhook.admission.cluster import AttachErrorClass, classify_attach_error
from webhook.admission.csinode import format_count
from webhook.admission.held_below import HeldBelow, format_held, held_below_reported, held_by_driver
from webhook.admission.policy import Policy
from webhook.admission.state import (
    STATE_ANNOTATION,
    DecodedState,
    EntryState,
    StateKeys,
    StateProblem,
    decode_state,
    format_time,
    parse_time,
    read_state_unverified,
)

VOLUME_LIMIT_MESSAGES = ("exceed max volume count", "max volume count", "NodeVolumeLimits")
"""Substrings of the scheduler's Unschedulable message for the volume-limits filter (NodeVolumeLimits plugin:
``node(s) exceed max volume count``)."""

ERROR_CLASS_ORDER = (
    AttachErrorClass.CAPACITY,
    AttachErrorClass.PERMISSION,
    AttachErrorClass.PRECONDITION,
    AttachErrorClass.TRANSIENT,
    AttachErrorClass.OTHER,
)
ERROR_CLASS_NAMES = {
    AttachErrorClass.CAPACITY: "ResourceExhausted",
    AttachErrorClass.PERMISSION: "permission",
    AttachErrorClass.PRECONDITION: "topology",
    AttachErrorClass.TRANSIENT: "transient",
    AttachErrorClass.OTHER: "other",
}
"""How the table names each class (ResourceExhausted / permission / topology / transient / other)."""


@dataclass(frozen=True)
class CapacityRow:
    """One (node, driver) entry. Counts are volumes; times are UTC. None means unbounded or unknown.

    ``state`` is ``verified``, ``unverified`` (no key given), ``none`` (no state for this entry) or the
    :class:`webhook.admission.state.StateProblem` that made the annotation unusable (``bad-signature``, ...).
    """

    node: str
    driver: str
    count: int | None
    bounded: bool
    accepted: int | None
    accepted_known: bool
    accepted_at: datetime | None
    writer_version: str | None
    state: str
    ceiling: int | None
    ceiling_why: str
    attached: int
    headroom: int | None
    pending: int
    attach_errors: Mapping[str, int]
    frozen_until: datetime | None
    corrected_until: datetime | None
    correction: str
    reported: int | None = None

    @property
    def over_ceiling(self) -> bool:
        """The reported count is above the ceiling (unbounded counts as above any ceiling)."""
        if self.ceiling is None:
            return False
        return self.count is None or self.count > self.ceiling

    def to_json(self) -> dict[str, Any]:
        """The row as JSON (``-o json``): camelCase keys, RFC 3339 times, null for unbounded/unknown."""
        return {
            "node": self.node,
            "driver": self.driver,
            "allocatableCount": self.count,
            "acceptedCount": self.accepted if self.accepted_known else None,
            "acceptedAt": _time(self.accepted_at),
            "writerVersion": self.writer_version,
            "state": self.state,
            "ceiling": self.ceiling,
            "ceilingReason": self.ceiling_why,
            "overCeiling": self.over_ceiling,
            "attachedVolumes": self.attached,
            "headroom": self.headroom,
            "pendingOnVolumeLimits": self.pending,
            "attachErrors": dict(self.attach_errors),
            "frozenUntil": _time(self.frozen_until),
            "correctedUntil": _time(self.corrected_until),
            "correction": self.correction or None,
        }


@dataclass(frozen=True)
class CapacitySummary:
    """The one-line cluster summary: nodes and drivers seen, frozen entries, entries over their ceiling, total
    headroom (bounded entries), attached volumes, Pods Pending on volume limits cluster-wide."""

    nodes: int
    drivers: int
    entries: int
    frozen: int
    over_ceiling: int
    headroom: int
    unbounded: int
    attached: int
    pending_on_limits: int

    def line(self) -> str:
        """``5000 nodes, 2 drivers, 10000 entries: 3 frozen, 1 over ceiling, headroom 12345 ...``."""
        return (
            f"{self.nodes} nodes, {self.drivers} drivers, {self.entries} entries: {self.frozen} frozen, "
            f"{self.over_ceiling} over ceiling, headroom {self.headroom} ({self.unbounded} unbounded), "
            f"{self.attached} attached, {self.pending_on_limits} pods pending on volume limits"
        )

    def to_json(self) -> dict[str, int]:
        """The summary as JSON."""
        return {
            "nodes": self.nodes,
            "drivers": self.drivers,
            "entries": self.entries,
            "frozen": self.frozen,
            "overCeiling": self.over_ceiling,
            "headroom": self.headroom,
            "unbounded": self.unbounded,
            "attachedVolumes": self.attached,
            "pendingOnVolumeLimits": self.pending_on_limits,
        }


@dataclass(frozen=True)
class CapacityReport:
    """The rows (sorted by least headroom), the summary over them, and the entries held below their driver's
    report (``held``)."""

    rows: list[CapacityRow]
    summary: CapacitySummary
    held: HeldBelow = field(default_factory=HeldBelow)


def _time(value: datetime | None) -> str | None:
    return format_time(value) if value is not None else None


def _count(entry: Mapping[str, Any]) -> tuple[int | None, bool]:
    allocatable = entry.get("allocatable")
    if isinstance(allocatable, Mapping):
        count = allocatable.get("count")
        if isinstance(count, int) and not isinstance(count, bool):
            return count, True
    return None, False


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    meta = obj.get("metadata")
    return meta if isinstance(meta, Mapping) else {}


def _spec(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    spec = obj.get("spec")
    return spec if isinstance(spec, Mapping) else {}


def _status(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    status = obj.get("status")
    return status if isinstance(status, Mapping) else {}


def count_attached(volume_attachments: Iterable[Mapping[str, Any]]) -> Counter[tuple[str, str]]:
    """Attached VolumeAttachments (``status.attached: true``) per (``spec.nodeName``, ``spec.attacher``)."""
    counts: Counter[tuple[str, str]] = Counter()
    for va in volume_attachments:
        spec = _spec(va)
        if _status(va).get("attached") is True:
            counts[(str(spec.get("nodeName") or ""), str(spec.get("attacher") or ""))] += 1
    return counts


def count_attach_errors(
    volume_attachments: Iterable[Mapping[str, Any]], since: datetime
) -> dict[tuple[str, str], Counter[str]]:
    """Attach errors (``status.attachError`` with ``time >= since``) per (node, attacher) and class name.

    An error without a parseable ``time`` counts as recent (the apiserver always sets it; an old external-attacher
    may not)."""
    found: dict[tuple[str, str], Counter[str]] = {}
    for va in volume_attachments:
        error = _status(va).get("attachError")
        if not isinstance(error, Mapping):
            continue
        when = error.get("time")
        try:
            if isinstance(when, str) and parse_time(when) < since:
                continue
        except ValueError:
            pass
        code = error.get("errorCode")
        error_class = classify_attach_error(code if isinstance(code, int) and not isinstance(code, bool) else None)
        spec = _spec(va)
        key = (str(spec.get("nodeName") or ""), str(spec.get("attacher") or ""))
        found.setdefault(key, Counter())[ERROR_CLASS_NAMES[error_class]] += 1
    return found


def is_pending_on_volume_limits(pod: Mapping[str, Any]) -> bool:
    """A Pending Pod whose ``PodScheduled`` condition is Unschedulable because of volume limits."""
    status = _status(pod)
    if status.get("phase") != "Pending":
        return False
    for condition in status.get("conditions") or []:
        if not isinstance(condition, Mapping) or condition.get("type") != "PodScheduled":
            continue
        message = str(condition.get("message") or "")
        if condition.get("status") == "False" and any(m in message for m in VOLUME_LIMIT_MESSAGES):
            return True
    return False


def _decode(annotation: str | None, uid: str, keys: StateKeys | None) -> tuple[DecodedState, str]:
    if not annotation:
        return DecodedState(None, StateProblem.MISSING), "none"
    if keys is not None:
        decoded = decode_state(annotation, uid, keys)
        return decoded, "verified" if decoded.state is not None else str(decoded.problem)
    decoded = read_state_unverified(annotation, uid)
    return decoded, "unverified" if decoded.state is not None else str(decoded.problem)


def build_report(
    csinodes: Sequence[Mapping[str, Any]],
    nodes: Sequence[Mapping[str, Any]],
    volume_attachments: Sequence[Mapping[str, Any]],
    pending_pods: Sequence[Mapping[str, Any]],
    *,
    policy: Policy,
    now: datetime,
    keys: StateKeys | None = None,
    errors_within: timedelta = timedelta(hours=1),
    node_names: Iterable[str] | None = None,
    driver_names: Iterable[str] | None = None,
) -> CapacityReport:
    """The :class:`CapacityReport` of the listed objects at ``now``.

    ``node_names`` (e.g. the Nodes a ``--selector`` matched, or ``--node``) and ``driver_names`` (``--driver``)
    restrict the rows; None means all. A CSINode whose Node is not listed gets the ceiling for an unknown node.
    ``errors_within`` is how far back attach errors count as recent.
    """
    wanted_nodes = set(node_names) if node_names is not None else None
    wanted_drivers = set(driver_names) if driver_names is not None else None
    labels_by_node: dict[str, Mapping[str, str]] = {}
    for node in nodes:
        meta = _meta(node)
        labels = meta.get("labels")
        labels_by_node[str(meta.get("name") or "")] = labels if isinstance(labels, Mapping) else {}
    attached = count_attached(volume_attachments)
    errors = count_attach_errors(volume_attachments, now - errors_within)
    pending_on_limits = [p for p in pending_pods if is_pending_on_volume_limits(p)]
    pending_by_node = Counter(str(_status(p).get("nominatedNodeName") or "") for p in pending_on_limits)
    rows: list[CapacityRow] = []
    for obj in csinodes:
        meta = _meta(obj)
        name = str(meta.get("name") or "")
        if wanted_nodes is not None and name not in wanted_nodes:
            continue
        drivers = _spec(obj).get("drivers")
        if not isinstance(drivers, list):
            continue  # spec.drivers is null on a CSINode without drivers
        annotations = meta.get("annotations")
        annotation = annotations.get(STATE_ANNOTATION) if isinstance(annotations, Mapping) else None
        decoded, state_word = _decode(annotation, str(meta.get("uid") or ""), keys)
        node_labels = labels_by_node.get(name)
        for entry in drivers:
            if not isinstance(entry, Mapping) or not isinstance(entry.get("name"), str):
                continue
            driver = str(entry["name"])
            if wanted_drivers is not None and driver not in wanted_drivers:
                continue
            rows.append(_row(name, driver, entry, decoded, state_word, node_labels, attached, errors,
                             pending_by_node, policy, now))
    rows.sort(key=lambda r: (r.headroom is None, r.headroom if r.headroom is not None else 0, r.node, r.driver))
    summary = CapacitySummary(
        nodes=len({r.node for r in rows}),
        drivers=len({r.driver for r in rows}),
        entries=len(rows),
        frozen=sum(1 for r in rows if r.frozen_until is not None),
        over_ceiling=sum(1 for r in rows if r.over_ceiling),
        headroom=sum(r.headroom for r in rows if r.headroom is not None),
        unbounded=sum(1 for r in rows if not r.bounded),
        attached=sum(r.attached for r in rows),
        pending_on_limits=len(pending_on_limits),
    )
    held = held_by_driver(
        ((r.node, r.driver, r.count, r.reported) for r in rows if r.reported is not None and r.count is not None),
        len(pending_on_limits),
    )
    return CapacityReport(rows=rows, summary=summary, held=held)


def _row(
    node: str,
    driver: str,
    entry: Mapping[str, Any],
    decoded: DecodedState,
    state_word: str,
    node_labels: Mapping[str, str] | None,
    attached: Counter[tuple[str, str]],
    errors: Mapping[tuple[str, str], Counter[str]],
    pending_by_node: Counter[str],
    policy: Policy,
    now: datetime,
) -> CapacityRow:
    count, bounded = _count(entry)
    driver_policy = policy.for_driver(driver)
    ceiling, why = driver_policy.ceiling.resolve(node_labels)
    if not why:
        why = "no ceiling" if ceiling is None else "driver ceiling"
    if node_labels is None and ceiling is not None:
        why += " (Node not found)"
    state: EntryState | None = decoded.state.entries.get(driver) if decoded.state is not None else None
    if decoded.state is not None and state is None:
        state_word = "none"
    used = attached.get((node, driver), 0)
    frozen = state.frozen_until if state is not None and state.frozen_until and state.frozen_until > now else None
    corrected_until = None
    correction = ""
    if state is not None and state.correction is not None:
        until = state.correction.at + timedelta(seconds=driver_policy.rules.rollback_window)
        if until > now:
            corrected_until = until
            correction = (f"{format_count(state.correction.before)}->{format_count(state.correction.after)} "
                          f"({state.correction.basis})")
    return CapacityRow(
        node=node,
        driver=driver,
        count=count,
        bounded=bounded,
        accepted=state.count if state is not None else None,
        accepted_known=state is not None,
        accepted_at=state.changed_at if state is not None else None,
        writer_version=state.writer_version if state is not None else None,
        state=state_word,
        ceiling=ceiling,
        ceiling_why=why,
        attached=used,
        headroom=_headroom(count if bounded else None, ceiling, used),
        pending=pending_by_node.get(node, 0),
        attach_errors=dict(errors.get((node, driver), Counter())),
        frozen_until=frozen,
        corrected_until=corrected_until,
        correction=correction,
        reported=held_below_reported(count if bounded else None, state),
    )


def _headroom(count: int | None, ceiling: int | None, attached: int) -> int | None:
    """min(count, ceiling) minus ``attached``; None (unbounded) counts as no limit, and None when both are."""
    limits = [v for v in (count, ceiling) if v is not None]
    return min(limits) - attached if limits else None


def _ago(when: datetime | None, now: datetime) -> str:
    """kubectl's AGE style: ``45s``, ``12m``, ``3h``, ``2d``."""
    if when is None:
        return "-"
    seconds = int((now - when).total_seconds())
    if seconds < 0:
        return "0s"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _errors_cell(errors: Mapping[str, int]) -> str:
    order = [ERROR_CLASS_NAMES[c] for c in ERROR_CLASS_ORDER]
    parts = [f"{name}={errors[name]}" for name in order if errors.get(name)]
    return ",".join(parts) or "-"


def _flags(row: CapacityRow) -> str:
    flags = []
    if row.frozen_until is not None:
        flags.append(f"frozen until {format_time(row.frozen_until)}")
    if row.corrected_until is not None:
        flags.append(f"corrected {row.correction} until {format_time(row.corrected_until)}")
    if row.over_ceiling:
        flags.append("over ceiling")
    if row.reported is not None:
        flags.append(f"held {_cell(row.count)}/{row.reported} reported")
    return "; ".join(flags) or "-"


def _cell(value: int | None, unbounded: str = "unbounded") -> str:
    return unbounded if value is None else str(value)


def table_rows(report: CapacityReport, now: datetime, *, wide: bool = False) -> list[list[str]]:
    """Header and cells of the table (``wide`` adds why, writer version, errors, pending and when)."""
    header = ["NODE", "DRIVER", "COUNT", "CEILING", "ATTACHED", "HEADROOM", "ACCEPTED", "AGE", "STATE", "FLAGS"]
    if wide:
        header += ["CEILING-REASON", "WRITER-VERSION", "ATTACH-ERRORS", "PENDING", "ACCEPTED-AT"]
    lines = [header]
    for r in report.rows:
        cells = [
            r.node,
            r.driver,
            _cell(r.count) if r.bounded else "unbounded",
            _cell(r.ceiling, "-"),
            str(r.attached),
            _cell(r.headroom, "-"),
            format_count(r.accepted) if r.accepted_known else "-",
            _ago(r.accepted_at, now),
            r.state,
            _flags(r),
        ]
        if wide:
            cells += [r.ceiling_why, r.writer_version or "-", _errors_cell(r.attach_errors), str(r.pending),
                      _time(r.accepted_at) or "-"]
        lines.append(cells)
    return lines


def format_columns(lines: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns separated by three spaces, as kubectl prints them."""
    if not lines:
        return ""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    out = []
    for line in lines:
        out.append("   ".join(cell.ljust(widths[i]) for i, cell in enumerate(line)).rstrip())
    return "\n".join(out) + "\n"


def format_table(report: CapacityReport, now: datetime, *, wide: bool = False) -> str:
    """The summary line, then the table (or a note when no entry matched)."""
    text = report.summary.line() + "\n"
    if not report.rows:
        return text + "No CSINode driver entries matched.\n"
    return text + format_columns(table_rows(report, now, wide=wide)) + format_held(report.held)


def report_json(report: CapacityReport) -> dict[str, Any]:
    """``-o json``: ``{"summary": {...}, "entries": [...], "heldBelowReported": {...}}``."""
    return {"summary": report.summary.to_json(), "entries": [r.to_json() for r in report.rows],
            "heldBelowReported": report.held.to_json()}
