"""The other direction of a wrong count: nodes the guard holds below what their driver reports. Pure.

A clamp stores less than the node's kubelet asked for (the driver's NodeGetInfo ``max_volumes_per_node``); when the
guard is right, attaches above the stored count would fail, and when it is too conservative, pods stay Pending with
the scheduler's NodeVolumeLimits reason (``node(s) exceed max volume count``) while the nodes could take them. The
signed state records the report a write was held below (``drivers.<name>.reported``, :mod:`webhook.admission.state`);
this module says which stored entries are held below it now, for the ``csinode_guard_held_below_reported_nodes``
metric (:mod:`webhook.kube.watch.view`) and ``csinode-guard status`` (:mod:`webhook.admission.capacity`). Nothing
here raises a count: the operator decides (docs/operations.md, "Held below the driver's report").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from webhook.admission.state import EntryState


def held_below_reported(stored: int | None, entry: EntryState | None) -> int | None:
    """The count the driver reported when the guard stored less, while the object still stores what that write
    stored (``stored`` equals the entry's ``count``); None when the entry is not held below a report (no state, no
    report recorded, unbounded, or the count changed since without the guard)."""
    if entry is None or entry.reported is None or stored is None or entry.count != stored:
        return None
    return entry.reported if entry.reported > stored else None


@dataclass(frozen=True)
class HeldNode:
    """One node held below its driver's report: ``held`` the stored count, ``reported`` what the driver reports."""

    node: str
    held: int
    reported: int


@dataclass(frozen=True)
class HeldBelow:
    """Per driver, the nodes held below the report (sorted by node), and the Pods Pending cluster-wide because of
    volume limits (the scheduler names no node for an unschedulable pod, nor which driver's limit)."""

    drivers: Mapping[str, tuple[HeldNode, ...]] = field(default_factory=dict)
    pending_on_limits: int = 0

    def to_json(self) -> dict[str, object]:
        """``{"drivers": {driver: [{"node", "held", "reported"}]}, "pendingOnVolumeLimits": n}``."""
        return {
            "drivers": {
                driver: [{"node": h.node, "held": h.held, "reported": h.reported} for h in nodes]
                for driver, nodes in sorted(self.drivers.items())
            },
            "pendingOnVolumeLimits": self.pending_on_limits,
        }


def held_by_driver(rows: Iterable[tuple[str, str, int, int]], pending_on_limits: int) -> HeldBelow:
    """:class:`HeldBelow` from ``(node, driver, held, reported)`` rows (any order)."""
    found: dict[str, list[HeldNode]] = {}
    for node, driver, held, reported in rows:
        found.setdefault(driver, []).append(HeldNode(node, held, reported))
    return HeldBelow({d: tuple(sorted(n, key=lambda h: h.node)) for d, n in found.items()}, pending_on_limits)


HINT = (
    "pods wait Pending on volume limits while the guard holds these nodes below what their driver reports: if "
    "the driver is right, raise the ceiling for the node type, or have an approver justify the count "
    "(csinode-guard.io/justification); if the guard is right, fix the driver's report (docs/operations.md)"
)
"""What ``status`` says under the held nodes when pods are Pending on volume limits."""


def format_held(held: HeldBelow, *, limit: int = 10) -> str:
    """The ``status`` section: per driver, the nodes held below the report as ``node held/reported`` (at most
    ``limit`` named, then a count), the Pods Pending on volume limits, and :data:`HINT` when both are there; ""
    when no node is held."""
    if not held.drivers:
        return ""
    lines = [f"Held below the driver's report ({held.pending_on_limits} pods pending on volume limits):"]
    for driver, nodes in sorted(held.drivers.items()):
        named = ", ".join(f"{h.node} {h.held}/{h.reported}" for h in nodes[:limit])
        more = f", and {len(nodes) - limit} more" if len(nodes) > limit else ""
        lines.append(f"  {driver}: {len(nodes)} node(s): {named}{more}")
    if held.pending_on_limits:
        lines.append(f"  hint: {HINT}")
    return "\n".join(lines) + "\n"
