"""The bounds of the guard's state: how long a removed driver's history is kept, how many entries, how many bytes.

A write the guard admits carries its next signed state in the ``csinode-guard.io/state`` annotation
(:mod:`webhook.admission.state`). Unbounded, that state grows with the drivers an object ever had: some 130 bytes
per entry, so that between 1,500 and 2,000 drivers the guard's own patch pushed the object's annotations past the
apiserver's limit and the apiserver refused the kubelet's registration ("metadata.annotations: Too long";
kubelet then marks the node NotReady): an outage the guard caused (issue 32, attack 6). Three bounds, applied to
every state the guard writes:

1. **Retention of removed drivers** (:data:`REMOVED_RETENTION`, 30 days). kubelet removes a driver whose node
   plugin restarts and registers it again, so a removed driver's entry is kept: the first state written while the
   driver is not in the object records ``removedAt``; 30 days later the entry is dropped. A driver that comes back
   clears ``removedAt``.
2. **A cap on entries** (:data:`MAX_ENTRIES`, 512).
3. **The apiserver's annotation limit**: kube-apiserver refuses an object whose annotations total more than
   256 KiB, counting the bytes of every key and value (apimachinery ``ValidateAnnotationsSize``: ``sum(len(k) +
   len(v)) <= 256 * 1024``). The state gets at most what the object's other annotations leave, less
   :data:`ANNOTATION_HEADROOM`, and never more than :data:`MAX_STATE_BYTES`.

When an entry must go, the guard keeps first the entries that protect something — a pinned ceiling label, a
freeze still running, a recorded correction — then the most recently changed ones (ties by driver name). An
entry that is not kept is judged as a driver without history: from the ceilings (an untouched entry above its
ceiling is clamped at the next write; a registration is judged by the ceilings; an increase from the stored count
by every rule that needs no history). Approvals and declared versions are always kept; when even they do not fit
(other annotations fill the object), no new state is written and the stored one stays as it is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from datetime import datetime, timedelta
from typing import NamedTuple

from webhook.admission.state import (
    STATE_ANNOTATION,
    EntryState,
    GuardState,
    canonical_size,
    entry_document,
    state_document,
)

REMOVED_RETENTION = timedelta(days=30)
"""How long the entry of a driver that is no longer in the object is kept, from the first state written without it."""
MAX_ENTRIES = 512
"""Entries one state holds at most."""
ANNOTATION_LIMIT_BYTES = 256 * 1024
"""kube-apiserver's limit on the total size of an object's annotations (apimachinery ``TotalAnnotationSizeLimitB``)."""
ANNOTATION_HEADROOM = 4 * 1024
"""Bytes left free under :data:`ANNOTATION_LIMIT_BYTES` (an annotation another writer adds in a later write)."""
MAX_STATE_BYTES = 96 * 1024
"""The state annotation's value is never longer than this (some 700 entries of ordinary driver names)."""
SIGNATURE_BYTES = 53
"""What the signature adds to the document: ``,"sig":"`` + 44 base64 characters + ``"``."""


def annotation_bytes(annotations: Mapping[str, str]) -> int:
    """The size the apiserver holds to :data:`ANNOTATION_LIMIT_BYTES`: UTF-8 bytes of every key plus its value."""
    return sum(len(k.encode()) + len(v.encode()) for k, v in annotations.items())


def state_room(others: Mapping[str, str]) -> int:
    """Bytes the state annotation's value may take next to the object's ``others`` (every annotation but the
    state): what the limit leaves, less the state's key and :data:`ANNOTATION_HEADROOM`, at most
    :data:`MAX_STATE_BYTES` (may be negative: no room at all)."""
    left = ANNOTATION_LIMIT_BYTES - ANNOTATION_HEADROOM - annotation_bytes(others) - len(STATE_ANNOTATION)
    return min(MAX_STATE_BYTES, left)


def mark_removed(entries: Mapping[str, EntryState], present: Collection[str], now: datetime) -> dict[str, EntryState]:
    """``entries`` with the retention applied at ``now``: an entry of a driver not in ``present`` records when it
    was first seen gone (``removed_at``) and is dropped :data:`REMOVED_RETENTION` after that; an entry of a driver
    that is present again forgets ``removed_at``."""
    out: dict[str, EntryState] = {}
    for name, entry in entries.items():
        if name in present:
            out[name] = entry if entry.removed_at is None else _replace(entry, removed_at=None)
        elif entry.removed_at is None:
            out[name] = _replace(entry, removed_at=now)
        elif now - entry.removed_at <= REMOVED_RETENTION:
            out[name] = entry
    return out


def _replace(entry: EntryState, *, removed_at: datetime | None) -> EntryState:
    return dataclasses.replace(entry, removed_at=removed_at)  # every other field kept, those added later too


def protects(entry: EntryState, now: datetime) -> bool:
    """True when ``entry`` holds something the rules cannot get back from the ceilings: a pinned ceiling label,
    a freeze running at ``now``, a recorded correction, or an admitted increase the brake may restore."""
    return (entry.pinned is not None or entry.correction is not None or entry.raised is not None
            or (entry.frozen_until is not None and entry.frozen_until > now))


class Bounded(NamedTuple):
    """A state cut to its bounds: ``state`` (None: not even the entry-less state fits) and the drivers whose
    entries it left out (``dropped``, for the note)."""

    state: GuardState | None
    dropped: tuple[str, ...] = ()


MIN_STATE_ROOM = 1024
"""With less room than this for the state, none is kept (:func:`no_room`)."""


def no_room(others: Mapping[str, str]) -> bool:
    """True when an object with the annotations ``others`` (all but the state) leaves no useful room for a state:
    /mutate then writes no new one, and /validate does not ask the final object for one."""
    return state_room(others) < MIN_STATE_ROOM


def bound_state(state: GuardState, now: datetime, room: int) -> Bounded:
    """``state`` with at most :data:`MAX_ENTRIES` entries and an encoding of at most ``room`` bytes (see the
    module docstring for which entries are kept). Linear in the entries, plus a sort of them when they do not
    all fit; nothing is encoded more than once."""
    empty = canonical_size(state_document(state._replace(entries={}))) + SIGNATURE_BYTES
    if empty > room or room < MIN_STATE_ROOM:
        return Bounded(None, tuple(sorted(state.entries)))
    sizes = {name: canonical_size({name: entry_document(e)}) - 1 for name, e in state.entries.items()}
    # Each entry adds its ``"name":{...}`` and a comma: its own document less the braces, plus one.
    if len(state.entries) <= MAX_ENTRIES and empty + sum(sizes.values()) <= room:
        return Bounded(state._replace(cut=0))
    ranked = sorted(state.entries.items(),
                    key=lambda item: (not protects(item[1], now), -item[1].changed_at.timestamp(), item[0]))
    kept: dict[str, EntryState] = {}
    used = empty
    for name, entry in ranked:
        if len(kept) >= MAX_ENTRIES:
            break
        if used + sizes[name] > room:
            continue  # a smaller entry further down may still fit
        kept[name] = entry
        used += sizes[name]
    dropped = tuple(sorted(name for name in state.entries if name not in kept))
    return Bounded(state._replace(entries=kept, cut=len(dropped)), dropped)

