"""The automatic brake: when capacity-class attach failures follow the increases the guard admitted of a driver on
enough nodes, hold every increase of that driver cluster-wide and restore the counts raised inside the lookback.

The evidence (pure, evaluated by the audit leader on every pass, :mod:`webhook.serving.brake_keeper`):

- an **admitted increase**: a CSINode entry whose signed state records ``raised`` (the first increase the guard
  admitted inside ``spec.brake.lookback`` and the count trusted before it, :mod:`webhook.admission.state`);
- a **capacity-class failure** after it: a VolumeAttachment of that node and attacher (= driver) whose
  ``status.attachError.errorCode`` is 8 (gRPC ResourceExhausted, the code the external-attacher copies from
  ControllerPublishVolume; KEP-4876) with ``status.attachError.time`` at or after the increase. Other codes (9
  FailedPrecondition, 4 DeadlineExceeded, ...) are not capacity evidence and engage nothing.

The brake engages for the driver when, among the nodes with an admitted increase inside the lookback, at least
``minNodes`` had a capacity-class failure after it, or at least ``minFraction`` of them did (counted only when two
or more failed: one node is never a fraction). Failures before the driver's last release do not count again. It
releases when ``quietPeriod`` passes without a capacity-class failure of the driver on any node, when the policy
disables the brake, or when an approver asks (``csinode-guard brake release``; the request is the annotation
:data:`RELEASE_ANNOTATION` on the brakes' ConfigMap, honoured only for the engagement it names).

While engaged (:func:`braked_entry`, ``count-rollback``): every increase of the driver is held at the stored
count, a registration above the last trusted count is clamped to it, and an entry raised inside the window is
judged from the count trusted before the increase, so the audit (``spec.reconcile: clamp``) lowers it there.

The record: one ConfigMap (:data:`BRAKES_OBJECT`) in the guard's namespace, ``data.record`` a document signed with
the state key like the nodes' history records (an edited or forged record is ignored)::

    {"v": 1, "brakes": {"ebs.csi.aws.com": {"engagedAt": "...", "windowStart": "...", "lastFailureAt": "...",
      "raisedNodes": 6, "evidence": [{"node": "n1", "from": 20, "to": 30, "raisedAt": "...", "failedAt": "...",
      "volumeAttachment": "csi-...", "code": 8}], "releasedAt": null, "releasedBy": "", "releaseReason": ""}},
     "sig": "<base64url HMAC-SHA256 of the document without sig>"}

Bounded: at most :data:`MAX_EVIDENCE` evidence items per driver and :data:`MAX_BRAKES` drivers. Pure: no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any, NamedTuple

from webhook.admission.cluster import AttachError, AttachErrorClass, Brake, BrakeEvidence
from webhook.admission.csinode import format_count
from webhook.admission.durations import format_duration
from webhook.admission.policy import BrakeSettings
from webhook.admission.signed_records import open_record, seal_record
from webhook.admission.state import EntryState, GuardState, Raised, StateKeys, format_time, parse_time

BRAKES_OBJECT = "csinode-guard-brakes"
"""The name of the ConfigMap in the guard's namespace that records the brakes."""
BRAKES_LABEL = "csinode-guard.io/brakes"
"""The label (value ``"true"``) on the brakes' ConfigMap: the guard's watch selects by it."""
RECORD_KEY = "record"
RELEASE_ANNOTATION = "csinode-guard.io/brake-release"
"""An approver's release request on the brakes' ConfigMap (``csinode-guard brake release`` writes it)."""
FORMAT_VERSION = 1
MAX_EVIDENCE = 50
MAX_BRAKES = 256
MAX_RECORD_BYTES = 512 * 1024
QUIET_PERIOD = "quiet-period"
"""``released_by`` of a brake the quiet period released."""
POLICY = "policy"
"""``released_by`` of a brake released because the policy disabled the brake."""


class RaisedNode(NamedTuple):
    """An increase the guard admitted: ``driver`` on ``node`` from ``before`` to ``after`` (None: unbounded) at
    ``raised_at`` (the first increase inside the lookback, from the entry's signed ``raised``)."""

    node: str
    driver: str
    before: int
    after: int | None
    raised_at: datetime


def admitted_increases(states: Iterable[tuple[str, GuardState | None]], since: datetime) -> dict[str, list[RaisedNode]]:
    """The increases the guard admitted at or after ``since``, by driver: every entry of every verified state
    (node name, state; None skipped) whose ``raised`` is that recent and whose count is still above ``before``."""
    found: dict[str, list[RaisedNode]] = {}
    for node, state in states:
        if state is None:
            continue
        for driver, entry in state.entries.items():
            raised = entry.raised
            if raised is None or raised.at < since or not _above(entry.count, raised.before):
                continue
            found.setdefault(driver, []).append(RaisedNode(node, driver, raised.before, entry.count, raised.at))
    return found


def capacity_failure_after(
    errors: Sequence[AttachError] | None, after: datetime, not_before: datetime | None = None
) -> AttachError | None:
    """The first capacity-class error (gRPC code 8) in ``errors`` at or after ``after`` (to the second: the API
    stamps errors in whole seconds) and, when ``not_before`` is given, later than it; None when there is none or
    the errors are unknown."""
    # attachError.time has whole seconds (metav1.Time): a failure stamped in the second of ``after`` counts.
    second = after.replace(microsecond=0)
    for error in sorted(errors or (), key=lambda e: e.time):
        if error.error_class is not AttachErrorClass.CAPACITY or error.time < second:
            continue
        if not_before is not None and error.time <= not_before:
            continue
        return error
    return None


def gather_evidence(
    raised: Sequence[RaisedNode],
    errors: Callable[[str, str, datetime], Sequence[AttachError] | None],
    not_before: datetime | None = None,
) -> list[BrakeEvidence]:
    """One :class:`BrakeEvidence` per raised node with a capacity-class failure after its increase (and after
    ``not_before``, the driver's last release). ``errors(node, driver, since)`` is
    :meth:`webhook.admission.cluster.ClusterView.attach_errors`."""
    evidence = []
    for item in sorted(raised, key=lambda r: r.node):
        since = item.raised_at.replace(microsecond=0)  # attach errors are stamped in whole seconds
        failure = capacity_failure_after(errors(item.node, item.driver, since), item.raised_at, not_before)
        if failure is not None:
            evidence.append(
                BrakeEvidence(
                    item.node,
                    item.before,
                    item.after,
                    item.raised_at,
                    failure.time,
                    failure.volume_attachment,
                    failure.code,
                )
            )
    return evidence


def crosses_threshold(settings: BrakeSettings, raised_nodes: int, failed_nodes: int) -> bool:
    """True when ``failed_nodes`` of the ``raised_nodes`` nodes with an admitted increase are enough to engage:
    at least ``minNodes``, or at least ``minFraction`` of them with two or more failed."""
    if failed_nodes >= settings.min_nodes:
        return True
    return failed_nodes >= 2 and raised_nodes > 0 and failed_nodes / raised_nodes >= settings.min_fraction


def decide_brake(
    driver: str,
    settings: BrakeSettings,
    current: Brake | None,
    raised: Sequence[RaisedNode],
    errors: Callable[[str, str, datetime], Sequence[AttachError] | None],
    newest_failure: datetime | None,
    now: datetime,
) -> Brake | None:
    """The driver's brake after this pass at ``now`` (UTC): ``current`` as recorded (None: never engaged),
    ``raised`` the driver's admitted increases inside the lookback, ``errors`` the attach errors lookup,
    ``newest_failure`` the newest capacity-class failure of the driver on any node since ``current``'s window
    (None: none). Returns ``current`` when nothing changes, an engaged brake, or a released one. Never raises."""
    now = now.replace(microsecond=now.microsecond // 1000 * 1000)  # as the record keeps it
    if current is not None and current.engaged:
        if not settings.enabled:
            return replace(current, released_at=now, released_by=POLICY, release_reason="spec.brake.enabled is false")
        last = max(current.last_failure_at, newest_failure) if newest_failure is not None else current.last_failure_at
        updated = current if last == current.last_failure_at else replace(current, last_failure_at=last)
        release_at = quiet_release_at(updated, settings)
        if release_at is not None and now >= release_at:
            return replace(
                updated,
                released_at=now,
                released_by=QUIET_PERIOD,
                release_reason=f"no capacity-class attach failure of {driver} for "
                f"{format_duration(settings.quiet_period)}",
            )
        return updated
    if not settings.enabled:
        return current
    evidence = gather_evidence(raised, errors, current.released_at if current is not None else None)
    if not crosses_threshold(settings, len(raised), len(evidence)):
        return current
    return Brake(
        driver=driver,
        engaged_at=now,
        window_start=now - timedelta(seconds=settings.lookback),
        last_failure_at=max(e.failed_at for e in evidence),
        evidence=tuple(evidence[:MAX_EVIDENCE]),
        raised_nodes=len(raised),
    )


def newest_capacity_failure(
    nodes: Iterable[str],
    driver: str,
    errors: Callable[[str, str, datetime], Sequence[AttachError] | None],
    since: datetime,
) -> datetime | None:
    """The newest capacity-class attach failure (gRPC code 8) of ``driver`` on any of ``nodes`` at or after
    ``since`` (UTC), None when there is none or the errors are unknown. ``errors`` as in :func:`gather_evidence`."""
    times = [
        e.time
        for node in nodes
        for e in errors(node, driver, since) or ()
        if e.error_class is AttachErrorClass.CAPACITY
    ]
    return max(times) if times else None


def decide_brakes(
    settings: BrakeSettings,
    current: Mapping[str, Brake],
    states: Sequence[tuple[str, GuardState | None]],
    errors: Callable[[str, str, datetime], Sequence[AttachError] | None],
    now: datetime,
) -> dict[str, Brake]:
    """One leader pass at ``now`` (UTC) over the whole cluster: every driver's brake after it (driver -> brake,
    engaged or released; drivers nothing ever engaged are absent). ``current`` the brakes as recorded before it,
    ``states`` every CSINode's (node name, verified guard state; None: no valid state), ``errors(node, driver,
    since)`` the attach errors lookup (:meth:`webhook.admission.cluster.ClusterView.attach_errors`).

    The one decision every path takes: the audit leader (:mod:`webhook.serving.brake_keeper`), ``policy test``
    and ``replay`` (:mod:`webhook.simulation`) differ only in where the states and the errors come from. A result
    equal to ``current`` means nothing changed. Never raises."""
    increases = admitted_increases(states, now - timedelta(seconds=settings.lookback))
    nodes = [node for node, _ in states]
    updated = dict(current)
    for driver in sorted(set(increases) | {d for d, b in current.items() if b.engaged}):
        before = current.get(driver)
        newest = None
        if before is not None and before.engaged:
            newest = newest_capacity_failure(nodes, driver, errors, before.window_start)
        after = decide_brake(driver, settings, before, increases.get(driver, ()), errors, newest, now)
        if after is not None and after != before:
            updated[driver] = after
    return updated


class ReleaseRequest(NamedTuple):
    """An approver's request to release ``driver``'s brake that engaged at ``engaged_at``, with ``reason``;
    ``requester`` the username ``csinode-guard brake release`` read from a SelfSubjectReview."""

    driver: str
    engaged_at: datetime
    reason: str
    requester: str


def encode_release_request(request: ReleaseRequest) -> str:
    """The :data:`RELEASE_ANNOTATION` value for ``request`` (JSON)."""
    return json.dumps(
        {
            "driver": request.driver,
            "engagedAt": format_time(request.engaged_at),
            "reason": request.reason,
            "requester": request.requester,
        },
        sort_keys=True,
    )


def parse_release_request(value: str | None) -> ReleaseRequest | None:
    """The request in a :data:`RELEASE_ANNOTATION` value, None when absent or not one. Never raises."""
    if not value or len(value) > 4096:
        return None
    try:
        doc = json.loads(value)
        if not isinstance(doc, dict):
            return None
        fields = [doc.get(k) for k in ("driver", "engagedAt", "reason", "requester")]
        if not all(isinstance(f, str) for f in fields) or not fields[0] or not fields[2]:
            return None
        return ReleaseRequest(str(fields[0]), parse_time(str(fields[1])), str(fields[2]), str(fields[3]))
    except (ValueError, RecursionError):
        return None


def honour_release(current: Brake | None, request: ReleaseRequest, now: datetime) -> Brake | None:
    """``current`` released by the approver's ``request`` at ``now``; None when the request does not name this
    engaged brake (another driver, an engagement that already ended)."""
    if current is None or not current.engaged or request.driver != current.driver:
        return None
    if format_time(request.engaged_at) != format_time(current.engaged_at):  # the record keeps milliseconds
        return None
    return replace(
        current, released_at=now, released_by=request.requester or "(unknown approver)", release_reason=request.reason
    )


def braked_entry(entry: EntryState, brake: Brake | None) -> EntryState:
    """``entry`` as the rules judge it while ``brake`` is engaged: an entry the guard raised inside the brake's
    window is judged from the count trusted before the increase (so the stored count above it is clamped back),
    never from a higher one. Any other entry is returned as it is."""
    raised = entry.raised
    if brake is None or raised is None or raised.at < brake.window_start or not _above(entry.count, raised.before):
        return entry
    return replace(entry, count=raised.before)


def next_raised(
    previous: Raised | None, old: int | None, final: int | None, now: datetime, lookback: float
) -> Raised | None:
    """The ``raised`` an entry records after the guard admitted ``old`` -> ``final`` (None = unbounded) at ``now``:
    an increase from a bounded count starts one (or keeps the one started inside ``lookback`` seconds, whose
    ``before`` is the count trusted before the whole run of increases); a count back at or below ``before``
    clears it; one older than the lookback is dropped."""
    if previous is not None and previous.at < now - timedelta(seconds=lookback):
        previous = None
    increase = old is not None and _above(final, old)
    if increase and previous is None and old is not None:
        return Raised(now, old)
    if previous is not None and not _above(final, previous.before):
        return None
    return previous


def describe(brake: Brake, quiet_period: float | None = None) -> str:
    """One line about an engaged brake: since when, and the evidence (failed nodes of raised nodes)."""
    nodes = ", ".join(
        f"{e.node} ({format_count(e.before)} -> {format_count(e.after)}, errorCode {e.code} on {e.volume_attachment})"
        for e in brake.evidence[:3]
    )
    more = f" and {len(brake.evidence) - 3} more" if len(brake.evidence) > 3 else ""
    quiet = f"; it releases {format_duration(quiet_period)} after the last one" if quiet_period is not None else ""
    return (
        f"the brake on {brake.driver} engaged at {format_time(brake.engaged_at)}: capacity-class attach "
        f"failures followed admitted increases on {len(brake.evidence)} of {brake.raised_nodes} nodes: "
        f"{nodes}{more}{quiet}"
    )


def quiet_release_at(brake: Brake, settings: BrakeSettings) -> datetime | None:
    """When (UTC) the quiet period releases ``brake`` unless another capacity-class failure of its driver comes
    first: ``settings.quiet_period`` seconds after its last one (:func:`decide_brake`; the leader releases it at
    its first pass after that). None when it is released already or ``settings.enabled`` is false (the leader
    releases it at its next pass)."""
    if not brake.engaged or not settings.enabled:
        return None
    return brake.last_failure_at + timedelta(seconds=settings.quiet_period)


def release_hint(driver: str) -> str:
    """How an approver releases the brake on ``driver``."""
    return (
        f"wait for the quiet period, or have an approver run `csinode-guard brake release {driver} --reason "
        "TEXT`; fix the driver's count first"
    )


def _above(count: int | None, trusted: int | None) -> bool:
    if trusted is None:
        return False
    return count is None or count > trusted


# --- the record -----------------------------------------------------------------------------------------------


def _brake_document(brake: Brake) -> dict[str, Any]:
    return {
        "engagedAt": format_time(brake.engaged_at),
        "windowStart": format_time(brake.window_start),
        "lastFailureAt": format_time(brake.last_failure_at),
        "raisedNodes": brake.raised_nodes,
        "evidence": [
            {
                "node": e.node,
                "from": e.before,
                "to": e.after,
                "raisedAt": format_time(e.raised_at),
                "failedAt": format_time(e.failed_at),
                "volumeAttachment": e.volume_attachment,
                "code": e.code,
            }
            for e in brake.evidence[:MAX_EVIDENCE]
        ],
        "releasedAt": format_time(brake.released_at) if brake.released_at is not None else None,
        "releasedBy": brake.released_by,
        "releaseReason": brake.release_reason,
    }


def encode_brakes(brakes: Mapping[str, Brake], keys: StateKeys) -> str:
    """The signed ``data.record`` value for ``brakes`` (driver -> brake; deterministic; at most
    :data:`MAX_BRAKES`, the engaged ones and the most recent kept first)."""
    ordered = sorted(brakes.values(), key=lambda b: (not b.engaged, -b.engaged_at.timestamp(), b.driver))
    doc: dict[str, Any] = {"v": FORMAT_VERSION, "brakes": {b.driver: _brake_document(b) for b in ordered[:MAX_BRAKES]}}
    return seal_record(doc, keys)


BRAKES_FIELDS = frozenset({"v", "brakes"})
"""The fields of the brakes record besides its signature."""


def decode_brakes(value: str | None, keys: StateKeys) -> dict[str, Brake] | None:
    """The verified brakes of a ``data.record`` value (driver -> brake), None when absent, malformed, too long or
    not signed by a state key. Never raises."""
    doc = open_record(value, keys, version=FORMAT_VERSION, fields=BRAKES_FIELDS, max_bytes=MAX_RECORD_BYTES)
    if doc is None or not isinstance(doc["brakes"], dict):
        return None
    try:
        return {str(driver): _decode_brake(str(driver), raw) for driver, raw in doc["brakes"].items()}
    except (KeyError, TypeError, ValueError, AttributeError, RecursionError):
        return None


def read_brakes_unverified(value: str | None) -> dict[str, Brake] | None:
    """The brakes a ``data.record`` value claims, *without* checking its signature (``csinode-guard brake list``
    and ``status`` without the state key: what an editor of the ConfigMap could have written); None when absent or
    malformed. The guard itself never uses it. Never raises."""
    if not value or len(value) > MAX_RECORD_BYTES:
        return None
    try:
        doc = json.loads(value)
        if not isinstance(doc, dict) or doc.get("v") != FORMAT_VERSION or not isinstance(doc.get("brakes"), dict):
            return None
        return {str(driver): _decode_brake(str(driver), raw) for driver, raw in doc["brakes"].items()}
    except (KeyError, TypeError, ValueError, AttributeError, RecursionError):
        return None


def brake_json(brake: Brake, settings: BrakeSettings | None = None) -> dict[str, Any]:
    """``brake`` as ``csinode-guard brake list -o json`` and ``status -o json`` show it: the record's document with
    its driver and whether it is engaged; with the policy's ``settings``, ``releasesAt`` (:func:`quiet_release_at`,
    None when it is released or brakes are disabled)."""
    document = {"driver": brake.driver, "engaged": brake.engaged, **_brake_document(brake)}
    if settings is not None:
        release = quiet_release_at(brake, settings)
        document["releasesAt"] = format_time(release) if release is not None else None
    return document


def _decode_brake(driver: str, raw: Mapping[str, Any]) -> Brake:
    released = raw.get("releasedAt")
    return Brake(
        driver=driver,
        engaged_at=parse_time(raw["engagedAt"]),
        window_start=parse_time(raw["windowStart"]),
        last_failure_at=parse_time(raw["lastFailureAt"]),
        evidence=tuple(
            BrakeEvidence(
                str(e["node"]),
                int(e["from"]),
                None if e["to"] is None else int(e["to"]),
                parse_time(e["raisedAt"]),
                parse_time(e["failedAt"]),
                str(e["volumeAttachment"]),
                None if e.get("code") is None else int(e["code"]),
            )
            for e in raw["evidence"]
        ),
        raised_nodes=int(raw["raisedNodes"]),
        released_at=parse_time(released) if released is not None else None,
        released_by=str(raw.get("releasedBy", "")),
        release_reason=str(raw.get("releaseReason", "")),
    )


def brake_audit_record(
    brake: Brake, *, now: datetime, policy_hash: str, policy_generation: int, quiet_period: float | None = None
) -> dict[str, Any]:
    """The audit-log record of a brake that engaged or released (JSON-ready): ``source``/``endpoint``/``trigger``
    ``audit``/``audit``/``brake``, ``decision`` ``brake-engaged`` or ``brake-released``, ``user`` the approver who
    released it (None otherwise), ``message`` what happened and ``brake`` the record's document."""
    released = brake.released_at is not None
    if released:
        message = (
            f"the brake on {brake.driver} (engaged at {format_time(brake.engaged_at)}) released by "
            f"{brake.released_by}: {brake.release_reason}"
        )
    else:
        message = describe(brake, quiet_period)
    approver = released and brake.released_by not in (QUIET_PERIOD, POLICY)
    return {
        "time": format_time(now),
        "source": "audit",
        "endpoint": "audit",
        "trigger": "brake",
        "uid": None,
        "operation": None,
        "dryRun": False,
        "user": brake.released_by if approver else None,
        "groups": [],
        "node": None,
        "driver": brake.driver,
        "decision": "brake-released" if released else "brake-engaged",
        "allowed": True,
        "policyHash": policy_hash,
        "policyGeneration": policy_generation,
        "latencyMs": 0.0,
        "rules": [],
        "message": message,
        "brake": _brake_document(brake),
    }
