"""The ceiling a node label selects, pinned per CSINode entry so that the node cannot raise it.

Under NodeRestriction a kubelet may set ``node.kubernetes.io/instance-type``, the topology labels and any label
outside ``kubernetes.io``/``k8s.io`` on its own Node (plugin/pkg/admission/noderestriction). A ceiling chosen by
such a label (``ceiling.nodeLabel``, a driver profile) would let the node pick its own limit. So the guard records
in its signed state (:class:`webhook.admission.state.PinnedLabel`) the label value that selected the entry's
ceiling the first time a label-selected ceiling applied, and from then on judges with the lower of the ceilings
of the pinned value and of the current one: a later label change by the node can lower the ceiling (the pin
moves to the lower value), never raise it, until an approver's justification covers the higher count (the pin
then moves up to what the approval's ``maxCount`` allows). ``restore`` adds a justification for exactly the
trusted count, so it never lifts a pin above that count.

Why the signed state and not the Node's managedFields: the webhook sees the Node only through the watch cache, and
the field manager name in managedFields is whatever the writer sent (``fieldManager``): the node can write its
label under the cloud-controller-manager's name. The state is written only by the guard.

A new Node has no instance-type label until the cloud-controller-manager initialises it, possibly after the node
plugin registered: while the label is unset nothing is pinned (the ``unknown`` ceiling applies), so the first
label-selected ceiling lifts the entry from the unknown-type value. The labels given here are the vouched ones
(:mod:`webhook.admission.label_provenance`): a value the node set itself never selects a ceiling, at first sight
either; it reads as unset. Labels unknown (Node missing, cache not synced): the pinned
value's ceiling applies and the pin stays. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import NamedTuple

from webhook.admission.policy import Ceiling
from webhook.admission.state import Approval, PinnedLabel


class PinnedCeiling(NamedTuple):
    """The ceiling to judge with (``ceiling``, None = none; and why) and the pin to record with the entry."""

    ceiling: int | None
    why: str
    pin: PinnedLabel | None


def _lower(a: int | None, b: int | None) -> int | None:
    if a is None:
        return b
    if b is None:
        return a
    return min(a, b)


def pin_ceiling(
    ceiling: Ceiling,
    labels: Mapping[str, str] | None,
    pinned: PinnedLabel | None,
    approvals: Sequence[Approval] = (),
    *,
    driver: str = "",
    count: int | None = None,
    now: datetime | None = None,
) -> PinnedCeiling:
    """The ceiling for a node with ``labels`` (None = unknown) given the entry's ``pinned`` label value.

    ``approvals`` are the recorded approvals of the driver: one that covers (``driver``, ``count``) at ``now``
    lifts the pin up to its ``maxCount``. A pin for another label than the ceiling's (the policy changed) is
    ignored. Never raises.
    """
    label = ceiling.label
    resolved, why = ceiling.resolve(labels)
    if label is None:
        return PinnedCeiling(resolved, why, None)
    if pinned is not None and pinned.label != label:
        pinned = None
    if labels is None:
        if pinned is None:
            return PinnedCeiling(resolved, why, None)
        held, held_why = ceiling.resolve({label: pinned.value})
        return PinnedCeiling(held, f"{held_why}, pinned; node labels unknown", pinned)
    value = labels.get(label)
    if pinned is None:
        # Nothing pinned yet: the first ceiling a label selects is taken (a cloud-controller-manager's first label).
        return PinnedCeiling(resolved, why, PinnedLabel(label, value) if value is not None else None)
    if value == pinned.value:
        return PinnedCeiling(resolved, why, pinned)
    held, held_why = ceiling.resolve({label: pinned.value})
    lifts = [a.max_count for a in approvals if now is not None and a.covers(driver, count, now)]
    allowed = held
    if lifts and held is not None:
        allowed = max(held, *lifts)
    if resolved is not None and (allowed is None or resolved <= allowed):
        # Lower (or approved): the pin moves to the current value.
        return PinnedCeiling(resolved, why, PinnedLabel(label, value) if value is not None else pinned)
    effective = _lower(resolved, held)
    return PinnedCeiling(
        effective,
        f"{held_why}, pinned for this node; {label}={value or '(unset)'} would raise it: a label the node can set "
        "raises no ceiling without an approver's justification",
        pinned,
    )
