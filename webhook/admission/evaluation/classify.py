"""Stage 1, classify: the request, the old and new CSINode, the verified state and the writer -> a :class:`Write`.

Decided once, here, and never changed later: who writes (:class:`~webhook.admission.rules.base.Writer`), whether
the node is judged in the enforcement scope, the verified state (a replayed or removed one is not used), the
changes to judge, each from the last count the guard trusts, and which of them may only be clamped or warned
about (``never_refused``, ``soft_drivers``), and what the write's annotations declare
(:mod:`.annotations`).

Writes that are never refused (DESIGN.md, the asymmetry): a CREATE, and an UPDATE with a registration or a
removal but no increase of an entry that stays, by the node's own kubelet. A registration is judged from the
entry's retained state (the count before removal); removals are not changes.

Reconciliation: the signed state records the last count the guard accepted. When a write went through unjudged
(the guard down under ``failurePolicy: Ignore``), the object's count differs from it: a lower one counts as
accepted, a higher one is judged as a change from the last accepted count (and is never refused for an entry
the write does not touch); an untouched entry without state is judged by the ceilings. While the brake of a driver
is engaged, an entry the guard raised inside the brake's window counts from the count trusted before the increase
(:mod:`webhook.admission.brake`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import NamedTuple

from webhook.admission.brake import braked_entry
from webhook.admission.ceiling_pin import pin_ceiling
from webhook.admission.cluster import ClusterView
from webhook.admission.csinode import INT32_MAX, CountChange, CSINode, diff_drivers, format_count, removed_drivers
from webhook.admission.decision import Mode, Note
from webhook.admission.evaluation.annotations import Declarations, read_annotations
from webhook.admission.node_history import retained_guard_state
from webhook.admission.policy import Policy
from webhook.admission.review import AdmissionRequest
from webhook.admission.rules.base import Writer
from webhook.admission.state import (
    STATE_ANNOTATION,
    DecodedState,
    EntryState,
    GuardState,
    StateKeys,
    StateProblem,
    decode_state,
)


class Write(NamedTuple):
    """One classified write: the inputs, and what was decided about them once.

    ``node`` the CSINode's name; ``create`` a CREATE; ``uid`` the object's UID (at CREATE none yet: no state can
    be signed); ``exempt`` the requester is exempt (judged as a dry run); ``labels`` the Node's labels a ceiling
    may be selected by (:meth:`ClusterView.vouched_node_labels`: not those the node set itself; None = unknown);
    ``scope_key`` the scope as the state records it, ``scope_matched`` all its labels select the node,
    ``scope_pinned`` the verified state pinned it, ``in_scope`` either; ``decoded`` the verified state
    (``state`` None when missing, invalid or replayed), ``base_sequence`` the sequence the next state follows;
    ``entries`` the state's entries; ``changes`` the changes to judge (in the object's order, then the
    reconciled untouched entries); ``never_refused`` the whole write; ``soft_drivers`` entries judged from their
    last trusted count (clamped, never refused); ``stored_before`` their stored count; ``notes`` what
    classifying found; ``declarations`` what the annotations declare.
    """

    request: AdmissionRequest
    policy: Policy
    now: datetime
    mode: Mode
    old: CSINode
    new: CSINode
    node: str
    create: bool
    uid: str
    writer: Writer
    exempt: bool
    labels: Mapping[str, str] | None
    scope_key: str | None
    scope_matched: bool
    scope_pinned: bool
    in_scope: bool
    decoded: DecodedState
    base_sequence: int
    entries: Mapping[str, EntryState]
    changes: tuple[CountChange, ...]
    never_refused: bool
    soft_drivers: frozenset[str]
    stored_before: Mapping[str, int | None]
    notes: tuple[Note, ...]
    declarations: Declarations


def above(count: int | None, trusted: int | None) -> bool:
    """True when ``count`` is higher than ``trusted`` (None = unbounded, higher than any count)."""
    if trusted is None:
        return False
    return count is None or count > trusted


def in_scope(policy: Policy, labels: Mapping[str, str] | None) -> bool:
    """True when ``spec.enforcementScope.nodeSelector`` selects the node (or there is none). A node whose labels
    are unknown (Node missing, cache not synced) is enforced: the node could otherwise leave the canary by making
    its labels unknown."""
    wanted = policy.scope_match_labels
    if wanted is None or labels is None:
        return True
    return all(labels.get(k) == v for k, v in wanted.items())


def scope_key(policy: Policy) -> str | None:
    """The enforcement scope as recorded in the state: canonical JSON of its ``matchLabels`` (None: no scope)."""
    wanted = policy.scope_match_labels
    return None if wanted is None else json.dumps(dict(wanted), sort_keys=True, separators=(",", ":"))


def checked_for_replay(decoded: DecodedState, newest: int | None) -> DecodedState:
    """``decoded``, or why it is not used: a verified state older than the newest one seen for the object
    (``ClusterView.newest_state_sequence``) is a replay (the node PUT back an older state of its own while the
    guard was down), so the entries are judged from the ceilings (the newest state's content is not at hand). A
    missing state on an object a state was seen for was removed: said in the detail (logged)."""
    state = decoded.state
    if newest is None:
        return decoded
    if state is not None and state.sequence < newest:
        return DecodedState(
            None, StateProblem.REPLAYED,
            f"state sequence {state.sequence} is older than {newest}, the newest seen for this object (replayed); "
            "its entries are judged from the ceilings",
        )
    if state is None and decoded.problem is StateProblem.MISSING:
        return DecodedState(
            None, StateProblem.MISSING,
            f"the object had a state (sequence {newest} seen) and it was removed; its entries are judged from the "
            "ceilings",
        )
    return decoded


def retained_history(cluster: ClusterView, node: str, keys: StateKeys) -> GuardState | None:
    """The node's retained state (:mod:`webhook.admission.node_history`), verified; None when there is none."""
    retained = cluster.retained_state(node)
    return retained_guard_state(retained, keys) if retained is not None else None


def braked_entries(entries: Mapping[str, EntryState], cluster: ClusterView) -> Mapping[str, EntryState]:
    """``entries`` as the rules judge them: an entry of a driver whose brake is engaged (``ClusterView.brake``) and
    that the guard raised inside the brake's window starts from the count trusted before the increase
    (:func:`webhook.admission.brake.braked_entry`), so its stored count is judged as a change from it and clamped."""
    out: dict[str, EntryState] | None = None
    for driver, entry in entries.items():
        if entry.raised is None:
            continue
        braked = braked_entry(entry, cluster.brake(driver))
        if braked is not entry:
            if out is None:
                out = dict(entries)
            out[driver] = braked
    return entries if out is None else out


def classify(
    request: AdmissionRequest,
    policy: Policy,
    cluster: ClusterView,
    now: datetime,
    keys: StateKeys,
    mode: Mode,
    old: CSINode,
    new: CSINode,
    *,
    decoded: DecodedState | None = None,
) -> Write:
    """Classify the CREATE or UPDATE ``request`` of ``old`` (an empty CSINode at CREATE) into ``new``.

    ``decoded`` is ``old``'s state when the caller decoded it already (the audit's watch cache verified it; ``status``
    without the key reads it unverified); None: decoded here from ``old``'s annotation with ``keys``."""
    node = new.name or old.name or request.name
    uid = old.uid or new.uid
    key = scope_key(policy)
    matched = in_scope(policy, cluster.node_labels(node))
    # Ceilings are selected only by labels the node did not set itself (label_provenance): the scope by all.
    labels = cluster.vouched_node_labels(node)
    writer = Writer(
        username=request.username,
        groups=request.groups,
        is_node_kubelet=request.username == f"system:node:{node}" and "system:nodes" in request.groups,
        is_listed_writer=policy.writers.contains(request.username, request.groups),
    )
    newest = cluster.newest_state_sequence(uid) if uid else None
    if decoded is None:
        decoded = decode_state(old.annotations.get(STATE_ANNOTATION), uid, keys)
    decoded = checked_for_replay(decoded, newest)
    state = decoded.state
    if state is None:
        # No usable state on the object (a CREATE, a re-created CSINode, a removed or replayed state): the node's
        # history, kept by name where only the guard writes, carries what the guard trusted about it.
        state = retained_history(cluster, node, keys)
    # Once judged in the enforcement scope, an object stays in it: the node can remove a label from itself.
    pinned = state is not None and key is not None and state.scope == key
    entries: Mapping[str, EntryState] = braked_entries(state.entries, cluster) if state is not None else {}
    create = request.operation == "CREATE"
    changes = _Changes(node, policy, labels, entries, old, new)
    never_refused = changes.never_refused(create, writer)
    declarations = read_annotations(request, policy, now, old, new, never_refused,
                                    state.approvals if state is not None else (),
                                    state.declared if state is not None else {})
    # Positional, in the order of Write's fields: a NamedTuple built from 25 keywords costs some 4 µs per write.
    return Write(
        request, policy, now, mode, old, new, node, create, uid, writer,
        policy.exemptions.contains(request.username, request.groups),  # exempt
        labels,
        key, matched, pinned, matched or pinned,  # scope_key, scope_matched, scope_pinned, in_scope
        decoded,
        # base_sequence: past the stored one and past the newest any replica saw for the object.
        max(decoded.state.sequence if decoded.state is not None else 0, newest or 0),
        entries, changes.judged, never_refused,
        frozenset(changes.soft), changes.stored_before, tuple(changes.notes),  # soft_drivers, stored_before, notes
        declarations,
    )


class _Changes:
    """The changes to judge, worked out in the constructor (its attributes are not changed afterwards).

    A registration of an entry that appears starts from the count the state retained for it (the count before
    removal; None without history). Any other entry starts from the lower of the stored count and the state's:
    a higher stored count went through unjudged, so it is judged as a change from the state's count — also for
    an entry the write does not touch — and is clamped, never refused (a refusal would keep the untrusted count).
    """

    def __init__(self, node: str, policy: Policy, labels: Mapping[str, str] | None,
                 entries: Mapping[str, EntryState], old: CSINode, new: CSINode) -> None:
        notes: list[Note] = []
        soft: set[str] = set()
        stored_before: dict[str, int | None] = {}
        raw = diff_drivers(old, new, registrations=True)
        touched = {c.driver for c in raw}
        changes: list[CountChange] = []
        for c in raw:
            entry = entries.get(c.driver)
            if c.registration and c.driver not in old.drivers:
                changes.append(c._replace(old=entry.count) if entry is not None else c)
                continue
            if entry is None or not above(c.old, entry.count):
                changes.append(c)
                continue
            notes.append(Note(
                f"{node}/{c.driver}: the stored count {format_count(c.old)} is above the last count "
                f"csinode-guard accepted ({format_count(entry.count)}): judged from {format_count(entry.count)}",
                c.driver,
            ))
            rebased = c._replace(old=entry.count)
            if rebased.old == rebased.new and not rebased.registration:
                continue
            stored_before[c.driver] = c.old
            # Refusing would keep the stored count, which is higher than anything trusted: clamp instead.
            soft.add(rebased.driver)
            changes.append(rebased)
        stateless: list[CountChange] = []
        for name, driver in new.drivers.items():
            entry = entries.get(name)
            if name in touched or name not in old.drivers:
                continue
            if entry is None or not above(driver.allocatable_count, entry.count):
                found = _beyond_ceiling(node, policy, labels, name, driver.allocatable_count, driver.position, entry)
                if found is not None:
                    notes.append(found[1])
                    soft.add(name)
                    stored_before[name] = driver.allocatable_count
                    stateless.append(found[0])
                continue
            if above(driver.allocatable_count, entry.count):
                notes.append(Note(
                    f"{node}/{name}: the stored count {format_count(driver.allocatable_count)} is above the "
                    f"last count csinode-guard accepted ({format_count(entry.count)}); it went through unjudged "
                    "and is judged now",
                    name,
                ))
                soft.add(name)
                stored_before[name] = driver.allocatable_count
                changes.append(CountChange(node, name, entry.count, driver.allocatable_count, driver.position))
        changes.extend(stateless)
        self.raw = raw
        self.structural_kind = bool(removed_drivers(old, new)) or any(c.registration for c in raw)
        self.judged = tuple(changes)
        self.notes = notes
        self.soft = soft
        self.stored_before = stored_before

    def never_refused(self, create: bool, writer: Writer) -> bool:
        """True when the whole write is never refused: a CREATE, registration or removal and no increase of an
        entry that stays, by the node's own kubelet.

        The webhook entries' matchConditions split writes the same way (webhook/kube/registration.py): these
        reach the guard under failurePolicy Ignore, and the guard never refuses them either (kubelet exits when it
        cannot register a driver). Decreases also come under Ignore but are judged as usual. Only the node's own
        kubelet: anyone else's CREATE, registration or removal is judged by writer-identity (webhook/kube/
        registration.py sends it to the Fail entry)."""
        increase = any(c.is_increase and not c.registration for c in self.raw)
        return (create or self.structural_kind) and not increase and writer.is_node_kubelet


def _beyond_ceiling(node: str, policy: Policy, labels: Mapping[str, str] | None, name: str, count: int | None,
                    position: int, entry: EntryState | None) -> tuple[CountChange, Note] | None:
    """An entry the write does not touch, stored at or below the last count the guard accepted for it (``entry``),
    or without a state entry (``entry`` None: it went through unjudged, or its state was removed or replayed):
    judged by the stateless rules -- unbounded where the driver has a finite ceiling, 2147483647, above the
    ceiling (the one pinned for the entry) -- as a registration of its stored count from the accepted one,
    clamped, never refused. A count the guard accepted stands above its ceiling only when the policy was
    tightened since. None when there is nothing to judge (the common case: one ceiling lookup per entry).

    The audit and ``status`` judge a stored object as this very write (:mod:`webhook.admission.standing`), so a
    standing count above a tightened ceiling is lowered by the next write as the audit would lower it."""
    dp = policy.for_driver(name)
    ceiling = pin_ceiling(dp.ceiling, labels, entry.pinned if entry is not None else None).ceiling
    if ceiling is None and count is not None and count < INT32_MAX:
        return None
    if ceiling is not None and count is not None and count <= ceiling:
        return None
    if ceiling is None and count is None:
        return None
    if entry is None:
        why = "has no state entry (it went through unjudged); judged by the ceilings now"
    else:
        why = (f"is above its ceiling, although csinode-guard accepted {format_count(entry.count)} (the policy "
               "changed since); judged by the ceilings now")
    note = Note(f"{node}/{name}: the stored count {format_count(count)} {why}", name)
    old = entry.count if entry is not None else None
    return CountChange(node, name, old, count, position, registration=True), note
