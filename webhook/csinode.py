"""CSINode and CSINodeDriver values and the diff of two CSINode versions into count changes.

Facts from kubelet (pkg/volume/csi/nodeinfomanager): kubelet writes CSINode with GET then PUT, removes the
driver it updates and re-appends it at the end of ``spec.drivers``, so entries are matched by ``name``, never
by index. ``allocatable`` or ``allocatable.count`` absent means unbounded (NodeGetInfo ``max_volumes_per_node
== 0``); kubelet cuts values above int32 to 2147483647. A driver entry that appears is a registration, one that
disappears a removal: neither is a change (kubelet marks the node NotReady when it cannot register).
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

INT32_MAX = 2147483647


class CSINodeError(ValueError):
    """An object in the AdmissionRequest is not a usable CSINode (message says which field)."""


@dataclass(frozen=True)
class CSINodeDriver:
    """One ``spec.drivers[]`` entry. ``allocatable_count`` is None for unbounded; ``index`` is its position."""

    name: str
    node_id: str
    allocatable_count: int | None
    index: int


@dataclass(frozen=True)
class CSINode:
    """The parts of a CSINode the guard reads. ``drivers`` maps driver name -> entry.

    ``name`` is the node name (a CSINode is named after its Node), ``uid`` is ``metadata.uid``,
    ``annotations`` is ``metadata.annotations`` (empty when absent).
    """

    name: str
    uid: str
    annotations: Mapping[str, str]
    drivers: Mapping[str, CSINodeDriver]
    has_annotations: bool


def _is_mapping(value: Any) -> bool:
    """``isinstance(value, Mapping)`` with a fast path for the dicts JSON decoding gives."""
    return isinstance(value, (dict, Mapping))


def parse_csinode(obj: Mapping[str, Any], where: str = "object") -> CSINode:
    """Read a CSINode JSON object (storage.k8s.io/v1) into a :class:`CSINode`.

    Raises :class:`CSINodeError` when ``spec.drivers`` is not a list of objects with a string ``name``, when a
    driver name repeats, or when ``allocatable.count`` is neither absent, null nor a non-negative integer.
    """
    metadata = obj.get("metadata") or {}
    if not _is_mapping(metadata):
        raise CSINodeError(f"{where}.metadata must be an object")
    raw_annotations = metadata.get("annotations")
    annotations: dict[str, str] = {}
    has_annotations = _is_mapping(raw_annotations)
    if has_annotations:
        annotations = {str(k): str(v) for k, v in (raw_annotations or {}).items()}
    elif raw_annotations is not None:
        raise CSINodeError(f"{where}.metadata.annotations must be an object")
    spec = obj.get("spec") or {}
    if not _is_mapping(spec):
        raise CSINodeError(f"{where}.spec must be an object")
    raw_drivers = spec.get("drivers") or []
    if not isinstance(raw_drivers, list):
        raise CSINodeError(f"{where}.spec.drivers must be a list")
    drivers: dict[str, CSINodeDriver] = {}
    for i, entry in enumerate(raw_drivers):
        if not _is_mapping(entry) or not isinstance(entry.get("name"), str) or not entry["name"]:
            raise CSINodeError(f"{where}.spec.drivers[{i}] must be an object with a name")
        name = entry["name"]
        if name in drivers:
            raise CSINodeError(f"{where}.spec.drivers has driver {name!r} twice")
        drivers[name] = CSINodeDriver(
            name=name,
            node_id=str(entry.get("nodeID") or ""),
            allocatable_count=_read_count(entry.get("allocatable"), f"{where}.spec.drivers[{i}]"),
            index=i,
        )
    return CSINode(
        name=str(metadata.get("name") or ""),
        uid=str(metadata.get("uid") or ""),
        annotations=annotations,
        drivers=drivers,
        has_annotations=has_annotations,
    )


def _read_count(allocatable: Any, where: str) -> int | None:
    if allocatable is None:
        return None
    if not _is_mapping(allocatable):
        raise CSINodeError(f"{where}.allocatable must be an object")
    count = allocatable.get("count")
    if count is None:
        return None
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise CSINodeError(f"{where}.allocatable.count must be a non-negative integer")
    return count


class ChangeKind(enum.StrEnum):
    """How a (node, driver) allocatable count changed between oldObject and object."""

    INCREASE = "increase"
    DECREASE = "decrease"
    TO_UNBOUNDED = "bounded-to-unbounded"
    TO_BOUNDED = "unbounded-to-bounded"


@dataclass(frozen=True)
class CountChange:
    """A change of one driver entry's allocatable count. ``None`` counts mean unbounded (+infinity).

    ``index`` is the entry's position in the new object's ``spec.drivers`` (for patches).
    """

    node: str
    driver: str
    old: int | None
    new: int | None
    index: int

    @functools.cached_property
    def kind(self) -> ChangeKind:
        """The :class:`ChangeKind`: unbounded counts as +infinity (computed once; the rules ask often)."""
        if self.new is None:
            return ChangeKind.TO_UNBOUNDED
        if self.old is None:
            return ChangeKind.TO_BOUNDED
        return ChangeKind.INCREASE if self.new > self.old else ChangeKind.DECREASE

    @functools.cached_property
    def is_increase(self) -> bool:
        """True for an increase or bounded -> unbounded (the unsafe direction)."""
        return self.kind in (ChangeKind.INCREASE, ChangeKind.TO_UNBOUNDED)


def format_count(count: int | None) -> str:
    """Render a count for messages: ``unbounded`` for None."""
    return "unbounded" if count is None else str(count)


def diff_drivers(old: CSINode, new: CSINode) -> list[CountChange]:
    """The count changes from ``old`` to ``new``, matched by driver name, in the new object's order.

    Registrations (only in ``new``) and removals (only in ``old``) are not changes.
    """
    changes: list[CountChange] = []
    for name, entry in sorted(new.drivers.items(), key=lambda kv: kv[1].index):
        before = old.drivers.get(name)
        if before is None or before.allocatable_count == entry.allocatable_count:
            continue
        changes.append(
            CountChange(
                node=new.name or old.name,
                driver=name,
                old=before.allocatable_count,
                new=entry.allocatable_count,
                index=entry.index,
            )
        )
    return changes
