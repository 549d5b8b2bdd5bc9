"""Where the next signed state is built: the finals of an admitted write -> :class:`GuardState` and the
:class:`ChangeOutcome` of each change.

An entry whose count does not change keeps its state; a registration that brings an entry back as it was
records nothing new (no state churn). Otherwise the entry records the final count, when it changed, the writer's
version, a freeze (a version rollback freezes increases for ``freezeFor``), a correction (a lower count backed
by a capacity attach error or a justification), the ceiling label pinned for it, when the guard stored less than
the node's kubelet asked for, that report (``reported``: :func:`held_below`), and the first increase admitted
inside the brake's lookback with the count trusted before it (``raised``,
:func:`webhook.admission.brake.next_raised`). Entries of drivers that are
no longer in the object are kept (kubelet removes and registers again a driver whose node plugin restarts)
for :data:`~webhook.admission.state_bounds.REMOVED_RETENTION` after the first state written without them;
expired approvals are dropped; the enforcement scope stays pinned until a justifier's annotation lets a node
that left it go. No state without an object UID (a CREATE) or when nothing changed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from datetime import timedelta

from webhook.admission.brake import next_raised
from webhook.admission.cluster import AttachErrorClass
from webhook.admission.csinode import INT32_MAX
from webhook.admission.decision import ChangeOutcome
from webhook.admission.evaluation.classify import Write
from webhook.admission.evaluation.judge import Judgement
from webhook.admission.evaluation.settle import Settlement
from webhook.admission.state import Correction, EntryState, GuardState
from webhook.admission.state_bounds import mark_removed


def held_below(asked: int | None, final: int | None, prev: EntryState | None, *, kubelet: bool) -> int | None:
    """The ``reported`` count to record for an entry written at ``final``: what the node's kubelet ``asked`` for when
    it is finite, below 2147483647 and above ``final`` (the guard holds the node below what its driver reports);
    for another writer's write (a listed writer, a restore), the report recorded before, while it is still above
    ``final``; else None."""
    if not kubelet:
        asked = prev.reported if prev is not None else None
    if asked is None or final is None or asked >= INT32_MAX or asked <= final:
        return None
    return asked


def _record_restores(write: Write, entries: dict[str, EntryState] | None) -> dict[str, EntryState] | None:
    """``entries`` with every restore under the brake recorded (a copy of ``write.entries`` made when needed).

    While a brake holds a driver, an entry the guard raised is judged from the count trusted before the increase
    (:func:`webhook.admission.brake.braked_entry`) while its signed state still records the raised count. A write
    that puts the object's count back at that trusted count (the audit's restore) is then no change to judge, yet
    the state must say what etcd holds: such an entry is recorded at the trusted count, ``raised`` cleared, so the
    next engagement's evidence starts from a new increase and a later release does not find the old count."""
    recorded = write.decoded.state.entries if write.decoded.state is not None else {}
    changed = {c.driver for c in write.changes}
    for driver, entry in write.entries.items():
        before = recorded.get(driver)
        if driver in changed or before is None or before.raised is None or before.count == entry.count:
            continue
        now_stored = write.new.drivers.get(driver)
        if now_stored is None or now_stored.allocatable_count != entry.count:
            continue
        if entries is None:
            entries = dict(write.entries)
        # changed_at stays the entry's: a restore is the guard's own correction, not a change that paces the next
        # increase (change-rate), which the brake holds anyway while it is engaged.
        entries[driver] = replace(entry, raised=None)
    return entries


def next_state(write: Write, judgement: Judgement, settlement: Settlement) -> tuple[
    GuardState | None, list[ChangeOutcome]
]:
    """The state to sign for the admitted ``write`` (None: none to write) and each change's outcome."""
    now, finals, pins = write.now, settlement.finals, judgement.pins
    declarations = write.declarations
    entries: dict[str, EntryState] | None = None  # a copy, made at the first changed entry
    outcomes: list[ChangeOutcome] = []
    for i, c in enumerate(write.changes):
        final = finals[c.driver]
        ctx = judgement.contexts[c.driver]
        prev = write.entries.get(c.driver)
        freeze = i in settlement.freezing
        raised = next_raised(prev.raised if prev else None, c.old, final, now, write.policy.brake.lookback)
        # A count judged from the count before a braked increase (``prev`` is that view, the state still records
        # the raised count) and held there is recorded: it clears ``raised``.
        restored = prev is not None and prev.raised is not None and raised is None
        if final == c.old and not c.registration and not restored:
            outcomes.append(ChangeOutcome(c, final, ctx.driver_version))
            continue
        if (
            c.registration
            and write.decoded.state is not None  # entries from the node's history: the new object needs a state
            and prev is not None
            and prev.count == final
            and not freeze
            and ctx.driver_version in (None, prev.writer_version)
            and pins.get(c.driver, prev.pinned) == prev.pinned
            and prev.removed_at is None
            and raised == prev.raised
        ):
            # A plugin restart that brings the entry back as it was: nothing new to record (no state churn). Not
            # so on a re-created CSINode judged from the node's history: it has no state of its own yet, and
            # without one /validate finds the state missing and every later write is judged from the record.
            # Nor while a brake judges the entry from the count before its increase (``prev`` is that view: the state
            # still records the raised count, and the registration clamped to the trusted one clears ``raised``).
            outcomes.append(ChangeOutcome(c, final, ctx.driver_version))
            continue
        frozen_until = prev.frozen_until if prev and prev.frozen_until and prev.frozen_until > now else None
        if freeze:
            frozen_until = now + timedelta(seconds=ctx.driver_policy.rules.freeze_for)
        correction = prev.correction if prev else None
        basis = None
        lower = final is not None and (c.old is None or final < c.old)
        if lower:
            capacity = [e for e in ctx.attach_errors or () if e.error_class is AttachErrorClass.CAPACITY]
            if capacity:
                basis = "resource-exhausted"
            elif any(a.covers(c.driver, final, now) for a in declarations.by_driver.get(c.driver, ())):
                basis = "justification"
            if basis:
                correction = Correction(at=now, before=c.old, after=final, basis=basis)
        same = c.registration and prev is not None and prev.count == final
        entry = EntryState(
            count=final,
            changed_at=prev.changed_at if same and prev is not None else now,
            writer_version=ctx.driver_version or (prev.writer_version if prev else None),
            frozen_until=frozen_until,
            correction=correction,
            pinned=pins.get(c.driver, prev.pinned if prev else None),
            reported=held_below(c.new, final, prev, kubelet=write.writer.is_node_kubelet),
            # The first increase admitted inside the brake's lookback and the count trusted before it.
            raised=raised,
        )
        if entries is None:
            entries = dict(write.entries)
        entries[c.driver] = entry
        outcomes.append(ChangeOutcome(c, final, ctx.driver_version, basis, freeze))
    entries = _record_restores(write, entries)
    if (entries is None and not declarations.approvals_recorded and not declarations.declared_changed) or not write.uid:
        return None, outcomes
    # Entries of drivers that are not in the object now are kept: kubelet removes a driver whose node plugin
    # restarts and registers it again, and its history (freeze, correction, version) must survive that.
    approvals = tuple(a for a in declarations.approvals if a.expires > now)  # expired approvals are dropped
    # The scope stays pinned until a justifier's annotation on the object lets a node that left it go.
    keep_scope = write.scope_matched or (write.scope_pinned and not declarations.approvals_recorded)
    # Removed drivers' entries are kept for a stated retention (webhook.admission.state_bounds); the entry cap and
    # the annotation size are applied in record, which knows the patched object's annotations.
    kept: Mapping[str, EntryState] = mark_removed(write.entries if entries is None else entries, write.new.drivers,
                                                  now)
    state = GuardState(
        write.uid,
        kept,
        approvals,
        declarations.declared,
        scope=write.scope_key if keep_scope and write.in_scope else None,
        sequence=write.base_sequence + 1,
    )
    return state, outcomes
