"""The guard's state on the CSINode: one signed annotation, ``csinode-guard.io/state``.

Rules need history: when an entry last changed, to what, by which writer version, its last correction, whether
it is frozen, and the approvals (justifications) recorded for the object. The /mutate endpoint writes this
annotation on every change it admits; it is keyed by the CSINode's ``metadata.uid`` (a recreated CSINode starts
fresh) and signed with HMAC-SHA256 (``cryptography``) so that an edited, forged, truncated or copied state is
detected and ignored. Keys rotate: the first key signs, every key verifies.

Wire format (JSON, compact, keys sorted)::

    {"v": 1, "uid": "<metadata.uid>",
     "drivers": {"ebs.csi.aws.com": {
         "count": 23, "changedAt": "2026-11-30T01:02:03.000Z", "writerVersion": "v1.37.0", "frozenUntil": null,
         "correction": {"at": "...", "from": 25, "to": 23, "basis": "resource-exhausted"}}},
     "approvals": [{"driver": "...", "reason": "...", "minCount": 0, "maxCount": 10, "expires": "...",
                    "ticket": "...", "approvedBy": "alice", "approvedAt": "..."}],
     "declared": {"ebs.csi.aws.com": {"version": "v1.37.0", "by": "system:serviceaccount:kube-system:reporter",
                                      "at": "..."}},
     "sig": "<base64url HMAC-SHA256 of the document without sig>"}

Optional members, each left out when unset (so states written before they existed keep their bytes):

- ``drivers.<name>.pinned``: ``{"label": "node.kubernetes.io/instance-type", "value": "m6i.large"}``, the value of
  the node label that selected the entry's ceiling when the guard first applied a label-selected ceiling. The node's
  kubelet may set that label on its own Node (NodeRestriction): a later value may lower the ceiling, never raise it
  above the pinned value's, until an approver's justification covers the higher count
  (:mod:`webhook.admission.ceiling_pin`).
- ``drivers.<name>.reported``: the count the node's kubelet asked for (what the driver reports, NodeGetInfo
  ``max_volumes_per_node``) when the guard stored less (``count``) at the write that last changed the entry: the
  guard holds the node below what its driver reports (``csinode-guard status``, the
  ``csinode_guard_held_below_reported_nodes`` metric). Recorded only when the entry is written anyway (a clamp back
  to the stored count stays a byte-identical no-op) and only for a finite report below 2147483647.
- ``drivers.<name>.removedAt``: when the guard first wrote a state while the driver was not in the object (a
  removed driver's history is kept for :data:`webhook.admission.state_bounds.REMOVED_RETENTION` from then; cleared
  when the driver is back).
- ``drivers.<name>.raised``: ``{"at": "...", "from": 20}``, the first increase of the entry the guard admitted within
  the brake's ``lookback`` and the count trusted before it (None ``from``: never; the entry is left without it). The
  audit leader relates capacity-class attach failures to these increases, and an engaged brake restores ``from``
  (:mod:`webhook.admission.brake`). Cleared when the count comes back to ``from`` or below.
- ``scope``: the ``enforcementScope.nodeSelector`` (canonical JSON of its ``matchLabels``) the object was judged
  in: once in scope, a node that removes the label stays enforced (leaving needs a justifier's annotation).
- ``cut``: how many entries were left out when the state was written, to keep it within its bounds (a cap on
  entries, the apiserver's 256 KiB annotation limit: :mod:`webhook.admission.state_bounds`).
- ``seq``: the state's sequence, +1 for every state the guard writes for the object (absent = 0). A state older
  than the newest one a replica saw for the object (``ClusterView.newest_state_sequence``) is a replay.

``declared`` (left out when empty, so states written before it existed keep their bytes) holds the driver
versions a trusted principal declared in the ``csinode-guard.io/driver-versions`` annotation, with who set them
and when: the ``annotation`` version source reads only these, never the annotation itself, which the node's
kubelet can write. Entries of drivers that are not in the object now are kept (kubelet removes a driver whose
node plugin restarts and registers it again: its history must survive that).
"""

from __future__ import annotations

import base64
import binascii
import enum
import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any, NamedTuple

import orjson
from cryptography.hazmat.primitives import constant_time, hashes
from cryptography.hazmat.primitives import hmac as crypto_hmac

STATE_ANNOTATION = "csinode-guard.io/state"
FORMAT_VERSION = 1
MIN_KEY_BYTES = 16


class StateProblem(enum.StrEnum):
    """Why a state annotation was not used (the metric label ``reason``)."""

    MISSING = "missing"
    MALFORMED = "malformed"
    BAD_SIGNATURE = "bad-signature"
    OTHER_OBJECT = "other-object"
    UNSUPPORTED_VERSION = "unsupported-version"
    REPLAYED = "replayed"


@functools.lru_cache(maxsize=256)
def format_time(when: datetime) -> str:
    """RFC 3339 UTC with milliseconds, e.g. ``2026-11-30T01:02:03.000Z``.

    Remembered for recent values: one review formats its clock for the state and for the audit record.
    """
    if when.tzinfo is not UTC:
        when = when.astimezone(UTC)
    return when.isoformat(timespec="milliseconds")[:-6] + "Z"


def parse_time(text: str) -> datetime:
    """Parse an RFC 3339 time (``Z`` or offset); naive times are taken as UTC. Raises ValueError."""
    parsed = datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


class Correction(NamedTuple):
    """An accepted decrease backed by ResourceExhausted evidence or a justification (``basis``)."""

    at: datetime
    before: int | None
    after: int | None
    basis: str


class Approval(NamedTuple):
    """A justification recorded from an approver's annotation: allows counts in [min_count, max_count]."""

    driver: str
    reason: str
    min_count: int
    max_count: int
    expires: datetime
    ticket: str
    approved_by: str
    approved_at: datetime

    def covers(self, driver: str, count: int | None, now: datetime) -> bool:
        """True when this approval is for ``driver``, unexpired at ``now`` and ``count`` is in its range."""
        if driver != self.driver or now >= self.expires:
            return False
        if count is None:
            return False
        return self.min_count <= count <= self.max_count


class Raised(NamedTuple):
    """The first increase of an entry the guard admitted within the brake's lookback: when (``at``, UTC) and the
    count trusted before it (``before``; a bounded count: an entry that was unbounded is never raised)."""

    at: datetime
    before: int


class PinnedLabel(NamedTuple):
    """The node label ``label`` had ``value`` when it selected the entry's ceiling (see :mod:`ceiling_pin`)."""

    label: str
    value: str


@dataclass(frozen=True)
class EntryState:
    """History of one (node, driver) entry: last accepted count (None = unbounded) and when it changed;
    ``pinned`` the label value that selected its ceiling (None: nothing pinned yet); ``removed_at`` when the
    guard first recorded the driver as gone from the object (None: present, or not recorded yet); ``reported`` the
    count the node's kubelet asked for when the guard stored less at ``changed_at`` (None: not held below it)."""

    count: int | None
    changed_at: datetime
    writer_version: str | None = None
    frozen_until: datetime | None = None
    correction: Correction | None = None
    pinned: PinnedLabel | None = None
    removed_at: datetime | None = None
    reported: int | None = None
    raised: Raised | None = None


class DeclaredVersion(NamedTuple):
    """A driver version a trusted principal declared (``set_by``, its ``userInfo.username``) at ``set_at``."""

    version: str
    set_by: str
    set_at: datetime


class GuardState(NamedTuple):
    """Decoded state of one CSINode (``uid``): entries by driver name, recorded approvals, the driver
    versions trusted principals declared (``declared``, by driver name), the enforcement scope the object was
    judged in (``scope``, None: none pinned), the state's ``sequence`` (0 for a state without one) and ``cut``, how
    many entries were left out to keep it within its bounds when it was written (:mod:`.state_bounds`)."""

    uid: str
    entries: Mapping[str, EntryState] = MappingProxyType({})
    approvals: tuple[Approval, ...] = ()
    declared: Mapping[str, DeclaredVersion] = MappingProxyType({})
    scope: str | None = None
    sequence: int = 0
    cut: int = 0

    def with_entry(self, driver: str, entry: EntryState) -> GuardState:
        """A copy with ``driver``'s entry replaced."""
        entries = dict(self.entries)
        entries[driver] = entry
        return self._replace(entries=entries)

    def pruned(self, now: datetime, drivers: Sequence[str] | None = None) -> GuardState:
        """A copy without expired approvals and, when ``drivers`` is given, without entries of other drivers."""
        entries = self.entries
        if drivers is not None:
            entries = {k: v for k, v in self.entries.items() if k in drivers}
        return self._replace(entries=entries, approvals=tuple(a for a in self.approvals if a.expires > now))


def _keyed(key: bytes) -> crypto_hmac.HMAC:
    return crypto_hmac.HMAC(key, hashes.SHA256())


def _hmac_sha256(keyed: crypto_hmac.HMAC, payload: bytes) -> bytes:
    mac = keyed.copy()  # a copy of the keyed context: the key schedule is not redone per signature
    mac.update(payload)
    return mac.finalize()


class StateKeys:
    """HMAC-SHA256 keys for the state: the first signs, all verify (rotation: put the new key first).

    Raises ValueError when no key is given or a key is shorter than 16 bytes. The keys never appear in
    ``repr`` or ``str``.
    """

    def __init__(self, keys: Sequence[bytes]) -> None:
        if not keys:
            raise ValueError("at least one state HMAC key is required")
        for k in keys:
            if len(k) < MIN_KEY_BYTES:
                raise ValueError(f"a state HMAC key must have at least {MIN_KEY_BYTES} bytes")
        self._keys = tuple(_keyed(k) for k in keys)

    def __repr__(self) -> str:
        return f"StateKeys(<{len(self._keys)} key(s)>)"

    def sign(self, payload: bytes) -> str:
        """Base64url HMAC-SHA256 of ``payload`` with the signing (first) key."""
        return base64.urlsafe_b64encode(_hmac_sha256(self._keys[0], payload)).decode("ascii")

    def verify(self, payload: bytes, signature: str) -> bool:
        """True when ``signature`` is a valid HMAC of ``payload`` under any key (constant-time compare).

        Only the exact base64url encoding :meth:`sign` produces counts (no stray characters, no unused bits).
        """
        try:
            raw = base64.urlsafe_b64decode(signature.encode("ascii"))
        except (binascii.Error, UnicodeEncodeError, ValueError):
            return False
        if base64.urlsafe_b64encode(raw).decode("ascii") != signature:
            return False  # the decoder skips stray characters and unused bits: only the exact encoding counts
        return any(constant_time.bytes_eq(_hmac_sha256(key, payload), raw) for key in self._keys)


_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def _canonical(doc: Any) -> bytes:
    """Compact JSON, keys sorted, ASCII only (``\\uXXXX`` escapes): the one form the guard signs and writes.

    orjson writes the same bytes as ``json`` with these settings whenever its output is ASCII (sorted keys
    then compare alike, and both escape ``"``, ``\\`` and control characters the same way); text with
    non-ASCII characters and what orjson refuses (integers beyond 64 bits) go to ``json``.
    """
    try:
        text = orjson.dumps(doc, option=orjson.OPT_SORT_KEYS)
        if text.isascii():
            return text
    except (orjson.JSONEncodeError, TypeError):
        pass
    return _CANONICAL.encode(doc).encode("ascii")


def _opt_time(value: datetime | None) -> str | None:
    return format_time(value) if value is not None else None


_VERSION_TAIL = b',"v":' + str(FORMAT_VERSION).encode("ascii") + b"}"
"""How every canonical state document ends (``v`` sorts last)."""


def entry_document(e: EntryState) -> dict[str, Any]:
    """One entry as the state document holds it (``drivers.<name>``), before canonical encoding."""
    entry: dict[str, Any] = {
        "count": e.count,
        "changedAt": format_time(e.changed_at),
        "writerVersion": e.writer_version,
        "frozenUntil": _opt_time(e.frozen_until),
        "correction": None
        if e.correction is None
        else {
            "at": format_time(e.correction.at),
            "from": e.correction.before,
            "to": e.correction.after,
            "basis": e.correction.basis,
        },
    }
    if e.pinned is not None:
        entry["pinned"] = {"label": e.pinned.label, "value": e.pinned.value}
    if e.removed_at is not None:
        entry["removedAt"] = format_time(e.removed_at)
    if e.reported is not None:
        entry["reported"] = e.reported
    if e.raised is not None:
        entry["raised"] = {"at": format_time(e.raised.at), "from": e.raised.before}
    return entry


def canonical_size(doc: Any) -> int:
    """Bytes of ``doc`` in the canonical form the guard signs and writes (ASCII: bytes = characters)."""
    return len(_canonical(doc))


def state_document(state: GuardState) -> dict[str, Any]:
    """The document of ``state`` the guard signs (without ``sig``), before canonical encoding."""
    drivers = {name: entry_document(e) for name, e in state.entries.items()}  # any order: the form sorts keys
    approvals = [
        {
            "driver": a.driver,
            "reason": a.reason,
            "minCount": a.min_count,
            "maxCount": a.max_count,
            "expires": format_time(a.expires),
            "ticket": a.ticket,
            "approvedBy": a.approved_by,
            "approvedAt": format_time(a.approved_at),
        }
        for a in state.approvals
    ]
    doc: dict[str, Any] = {"v": FORMAT_VERSION, "uid": state.uid, "drivers": drivers, "approvals": approvals}
    if state.declared:  # sorts before "sig": the splice below still holds
        doc["declared"] = {
            name: {"version": d.version, "by": d.set_by, "at": format_time(d.set_at)}
            for name, d in sorted(state.declared.items())
        }
    if state.scope is not None:  # sorts before "sig" as well
        doc["scope"] = state.scope
    if state.sequence:
        doc["seq"] = state.sequence
    if state.cut:  # sorts before "drivers": the splice in encode_state still holds
        doc["cut"] = state.cut
    return doc


def encode_state(state: GuardState, keys: StateKeys) -> str:
    """Serialize and sign ``state``; the result is the annotation value (deterministic for equal states)."""
    doc = state_document(state)
    payload = _canonical(doc)
    signature = keys.sign(payload)
    # Keys sorted: "sig" goes right before the last two, "uid" (a string) and "v". Splicing it in gives the bytes
    # _canonical(doc + sig) would give, without encoding the document twice.
    tail = b',"uid":' + _canonical(state.uid) + _VERSION_TAIL
    head = payload[: -len(tail)]
    return (head + b',"sig":"' + signature.encode("ascii") + b'"' + tail).decode("ascii")


class DecodedState(NamedTuple):
    """Result of :func:`decode_state`: the state, or None with the :class:`StateProblem` that made it unusable."""

    state: GuardState | None
    problem: StateProblem | None = None
    detail: str = ""


def _opt_int(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError("count must be an integer or null")
    return value


def _decode_entry(raw: Any) -> EntryState:
    if not isinstance(raw, dict):
        raise ValueError("driver entry must be an object")
    corr = raw.get("correction")
    correction = None
    if corr is not None:
        correction = Correction(
            at=parse_time(corr["at"]),
            before=_opt_int(corr.get("from")),
            after=_opt_int(corr.get("to")),
            basis=str(corr["basis"]),
        )
    frozen = raw.get("frozenUntil")
    version = raw.get("writerVersion")
    pinned = raw.get("pinned")
    removed = raw.get("removedAt")
    reported = _opt_int(raw.get("reported"))
    raised = raw.get("raised")
    raised_before = _opt_int(raised["from"]) if raised is not None else None
    return EntryState(
        count=_opt_int(raw.get("count")),
        changed_at=parse_time(raw["changedAt"]),
        writer_version=str(version) if version is not None else None,
        frozen_until=parse_time(frozen) if frozen is not None else None,
        correction=correction,
        pinned=PinnedLabel(str(pinned["label"]), str(pinned["value"])) if pinned is not None else None,
        removed_at=parse_time(removed) if removed is not None else None,
        reported=reported,
        raised=Raised(parse_time(raised["at"]), raised_before)
        if raised is not None and raised_before is not None else None,
    )


def _decode_approval(raw: Any) -> Approval:
    if not isinstance(raw, dict):
        raise ValueError("approval must be an object")
    return Approval(
        driver=str(raw["driver"]),
        reason=str(raw.get("reason", "")),
        min_count=int(raw["minCount"]),
        max_count=int(raw["maxCount"]),
        expires=parse_time(raw["expires"]),
        ticket=str(raw.get("ticket", "")),
        approved_by=str(raw.get("approvedBy", "")),
        approved_at=parse_time(raw["approvedAt"]),
    )


def _decode_declared(raw: Any) -> DeclaredVersion:
    if not isinstance(raw, dict):
        raise ValueError("declared version must be an object")
    return DeclaredVersion(version=str(raw["version"]), set_by=str(raw["by"]), set_at=parse_time(raw["at"]))


_MISSING = DecodedState(None, StateProblem.MISSING)


def decode_state(value: str | None, uid: str, keys: StateKeys) -> DecodedState:
    """Verify and decode an annotation value for the object ``uid``. Never raises.

    Returns a :class:`DecodedState` whose ``state`` is None when the value is missing, not the expected JSON,
    not signed by any key, not byte for byte the form :func:`encode_state` writes, of an unknown format version
    or recorded for another object (UID).
    """
    if value is None or value == "":
        return _MISSING
    try:
        doc = orjson.loads(value)
    except orjson.JSONDecodeError:
        try:  # what orjson refuses and json reads (NaN, lone surrogates) then fails the canonical-form check
            doc = json.loads(value)
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, or an integer over 4300 digits
            return DecodedState(None, StateProblem.MALFORMED, f"not JSON: {exc}")
    if not isinstance(doc, dict) or not isinstance(doc.get("sig"), str):
        return DecodedState(None, StateProblem.MALFORMED, "no signature")
    signature = doc.pop("sig")
    try:
        payload = _canonical(doc)
        spelled = _canonical({**doc, "sig": signature}).decode("ascii")
    except (TypeError, ValueError, RecursionError) as exc:  # nested too deeply for json, or not encodable
        return DecodedState(None, StateProblem.MALFORMED, f"not a state document: {exc}")
    if not keys.verify(payload, signature):
        return DecodedState(None, StateProblem.BAD_SIGNATURE, "signature does not verify")
    if spelled != value:
        # The guard writes exactly this form; any other spelling of the same document was edited by someone else.
        return DecodedState(None, StateProblem.MALFORMED, "not in the canonical form csinode-guard writes")
    if doc.get("v") != FORMAT_VERSION:
        return DecodedState(None, StateProblem.UNSUPPORTED_VERSION, f"format version {doc.get('v')!r}")
    if doc.get("uid") != uid or not uid:
        return DecodedState(None, StateProblem.OTHER_OBJECT, "state was recorded for another object")
    return _decode_document(doc, uid)


def _decode_document(doc: dict[str, Any], uid: str) -> DecodedState:
    """The entries, approvals and declared versions of a state document already checked for version and UID."""
    try:
        drivers = doc.get("drivers") or {}
        if not isinstance(drivers, dict):
            raise ValueError("drivers must be an object")
        entries = {str(k): _decode_entry(v) for k, v in drivers.items()}
        approvals = tuple(_decode_approval(a) for a in doc.get("approvals") or [])
        raw_declared = doc.get("declared") or {}
        if not isinstance(raw_declared, dict):
            raise ValueError("declared must be an object")
        declared = {str(k): _decode_declared(v) for k, v in raw_declared.items()}
        scope = doc.get("scope")
        if scope is not None and not isinstance(scope, str):
            raise ValueError("scope must be a string")
        sequence = doc.get("seq", 0)
        if isinstance(sequence, bool) or not isinstance(sequence, int) or sequence < 0:
            raise ValueError("seq must be a non-negative integer")
        cut = doc.get("cut", 0)
        if isinstance(cut, bool) or not isinstance(cut, int) or cut < 0:
            raise ValueError("cut must be a non-negative integer")
    except (KeyError, TypeError, ValueError, AttributeError) as exc:  # a signed state with a field of a wrong type
        return DecodedState(None, StateProblem.MALFORMED, f"bad field: {exc}")
    return DecodedState(GuardState(uid=uid, entries=entries, approvals=approvals, declared=declared, scope=scope,
                                   sequence=sequence, cut=cut))


def read_state_unverified(value: str | None, uid: str) -> DecodedState:
    """Decode an annotation value for the object ``uid`` *without* checking its signature. Never raises.

    For read-only views when no state key is at hand (``csinode-guard status`` without ``--state-key-file``):
    the result says what the annotation claims, which an editor of the CSINode could have forged. The guard
    itself never uses it. Problems are reported as in :func:`decode_state`, except ``BAD_SIGNATURE``.
    """
    if value is None or value == "":
        return _MISSING
    try:
        doc = json.loads(value)
    except (ValueError, RecursionError) as exc:
        return DecodedState(None, StateProblem.MALFORMED, f"not JSON: {exc}")
    if not isinstance(doc, dict):
        return DecodedState(None, StateProblem.MALFORMED, "not a state document")
    if doc.get("v") != FORMAT_VERSION:
        return DecodedState(None, StateProblem.UNSUPPORTED_VERSION, f"format version {doc.get('v')!r}")
    if doc.get("uid") != uid or not uid:
        return DecodedState(None, StateProblem.OTHER_OBJECT, "state was recorded for another object")
    return _decode_document(doc, uid)
