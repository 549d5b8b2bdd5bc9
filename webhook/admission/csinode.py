"""CSINode and CSINodeDriver values and the diff of two CSINode versions into count changes.

Facts from kubelet (pkg/volume/csi/nodeinfomanager): kubelet writes CSINode with GET then PUT, removes the
driver it updates and re-appends it at the end of ``spec.drivers``, so entries are matched by ``name``, never
by index. ``allocatable`` or ``allocatable.count`` absent means unbounded (NodeGetInfo ``max_volumes_per_node
== 0``); kubelet cuts values above int32 to 2147483647. A driver entry that appears is a registration, one that
disappears a removal. kubelet's ``InstallCSIDriver`` also rewrites an entry that is still there when its
``nodeID`` or ``topologyKeys`` differ (a plugin registering again on a node whose instance changed): that is a
registration too. Registrations are judged but never refused (kubelet marks the node NotReady, and finally exits,
when it cannot register); removals are never judged.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any, NamedTuple, TypeGuard

INT32_MAX = 2147483647


class CSINodeError(ValueError):
    """An object in the AdmissionRequest is not a usable CSINode (message says which field)."""


class CSINodeDriver(NamedTuple):
    """One ``spec.drivers[]`` entry. ``allocatable_count`` is None for unbounded; ``position`` its index.

    Immutable values (a named tuple: built a few times per review, where a frozen dataclass costs twice as much).
    """

    name: str
    node_id: str
    allocatable_count: int | None
    position: int
    topology_keys: tuple[str, ...] = ()


class CSINode(NamedTuple):
    """The parts of a CSINode the guard reads (an immutable named tuple). ``drivers`` maps driver name -> entry.

    ``name`` is the node name (a CSINode is named after its Node), ``uid`` is ``metadata.uid``,
    ``annotations`` is ``metadata.annotations`` (empty when absent), ``resource_version`` is
    ``metadata.resourceVersion`` ("" when absent or not a string).
    """

    name: str
    uid: str
    annotations: Mapping[str, str]
    drivers: Mapping[str, CSINodeDriver]
    has_annotations: bool
    resource_version: str = ""


_new_tuple = tuple.__new__


def _is_mapping(value: Any) -> TypeGuard[Mapping[str, Any]]:
    """``isinstance(value, Mapping)`` with a fast path for the dicts JSON decoding gives."""
    return type(value) is dict or isinstance(value, Mapping)


def parse_csinode(obj: Mapping[str, Any], where: str = "object") -> CSINode:
    """Read a CSINode JSON object (storage.k8s.io/v1) into a :class:`CSINode`.

    Raises :class:`CSINodeError` when ``spec.drivers`` is not a list of objects with a string ``name``, when a
    driver name repeats, or when ``allocatable.count`` is neither absent, null nor an integer from 0 to 2147483647
    (the API field is an int32).
    """
    # The checks are written out (no helper calls, no generators) where JSON decoding gives plain dicts and
    # lists: this runs twice per review. Anything else goes the slow way, with the same errors.
    metadata = obj.get("metadata") or {}
    if type(metadata) is not dict and not isinstance(metadata, Mapping):
        raise CSINodeError(f"{where}.metadata must be an object")
    raw_annotations = metadata.get("annotations")
    annotations: Mapping[str, str] = {}
    has_annotations = False
    if type(raw_annotations) is dict or isinstance(raw_annotations, Mapping):
        has_annotations = True
        annotations = raw_annotations  # JSON gives string keys
        for value in raw_annotations.values():  # ObjectMeta.annotations: map[string]string
            if type(value) is not str:
                raise CSINodeError(f"{where}.metadata.annotations values must be strings")
    elif raw_annotations is not None:
        raise CSINodeError(f"{where}.metadata.annotations must be an object")
    spec = obj.get("spec") or {}
    if type(spec) is not dict and not isinstance(spec, Mapping):
        raise CSINodeError(f"{where}.spec must be an object")
    raw_drivers = spec.get("drivers") or []
    if type(raw_drivers) is not list:
        raise CSINodeError(f"{where}.spec.drivers must be a list")
    drivers: dict[str, CSINodeDriver] = {}
    for i, entry in enumerate(raw_drivers):
        name = entry.get("name") if type(entry) is dict or isinstance(entry, Mapping) else None
        if type(name) is not str or not name:
            raise CSINodeError(f"{where}.spec.drivers[{i}] must be an object with a name")
        if name in drivers:
            raise CSINodeError(f"{where}.spec.drivers has driver {name!r} twice")
        node_id = entry.get("nodeID") or ""
        if type(node_id) is not str:
            raise CSINodeError(f"{where}.spec.drivers[{i}].nodeID must be a string")
        topology = entry.get("topologyKeys") or ()
        if topology:
            if type(topology) is not list:
                raise CSINodeError(f"{where}.spec.drivers[{i}].topologyKeys must be a list of strings")
            for key in topology:
                if type(key) is not str:
                    raise CSINodeError(f"{where}.spec.drivers[{i}].topologyKeys must be a list of strings")
        allocatable = entry.get("allocatable")
        if allocatable is None:
            count = None
        elif type(allocatable) is dict and (
            (count := allocatable.get("count")) is None or (type(count) is int and 0 <= count <= INT32_MAX)
        ):
            pass
        else:
            count = _read_count(allocatable, where, i)
        # tuple.__new__ builds the named tuple without the Python-level __new__ of namedtuple (a frame less)
        drivers[name] = _new_tuple(CSINodeDriver, (name, node_id, count, i, tuple(topology)))
    name = metadata.get("name") or ""
    uid = metadata.get("uid") or ""
    if type(name) is not str or type(uid) is not str:
        raise CSINodeError(f"{where}.metadata.name and .uid must be strings")
    resource_version = metadata.get("resourceVersion")
    return CSINode(
        name,
        uid,
        annotations,
        drivers,
        has_annotations,
        resource_version if type(resource_version) is str else "",
    )


def _read_count(allocatable: Any, where: str, index: int) -> int | None:
    if allocatable is None:
        return None
    if not _is_mapping(allocatable):
        raise CSINodeError(f"{where}.spec.drivers[{index}].allocatable must be an object")
    count = allocatable.get("count")
    if count is None or (type(count) is int and 0 <= count <= INT32_MAX):
        return count
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= INT32_MAX:
        # CSINodeDriver.allocatable.count is an int32 (storage.k8s.io/v1): the apiserver cannot hold more.
        raise CSINodeError(
            f"{where}.spec.drivers[{index}].allocatable.count must be an integer from 0 to {INT32_MAX} (int32)"
        )
    return int(count)


class ChangeKind(enum.StrEnum):
    """How a (node, driver) allocatable count changed between oldObject and object.

    ``registration``: a driver entry registered with no count before it (it appears, or kubelet rewrote it, and
    the guard retained no count for it): neither an increase nor a decrease, there is nothing to compare with.
    """

    INCREASE = "increase"
    DECREASE = "decrease"
    TO_UNBOUNDED = "bounded-to-unbounded"
    TO_BOUNDED = "unbounded-to-bounded"
    REGISTRATION = "registration"


class CountChange(NamedTuple):
    """A change of one driver entry's allocatable count (an immutable named tuple). ``None`` counts mean
    unbounded (+infinity). ``position`` is the entry's index in the new object's ``spec.drivers`` (for patches).

    ``registration`` marks a driver entry that appears (also right after its removal, and every entry of a
    CREATE) or that kubelet rewrote with another ``nodeID``/``topologyKeys``. Its ``old`` is the count the
    entry had before (None when it had none: unbounded, or no history; :func:`diff_drivers` gives None for an
    entry that appears, the evaluation puts in the count its state retained).
    """

    node: str
    driver: str
    old: int | None
    new: int | None
    position: int
    registration: bool = False

    @property
    def kind(self) -> ChangeKind:
        """The :class:`ChangeKind`: unbounded counts as +infinity; a registration without an earlier count is
        :attr:`ChangeKind.REGISTRATION`."""
        if self.is_first_registration:
            return ChangeKind.REGISTRATION
        if self.new is None:
            return ChangeKind.TO_UNBOUNDED
        if self.old is None:
            return ChangeKind.TO_BOUNDED
        return ChangeKind.INCREASE if self.new > self.old else ChangeKind.DECREASE

    @property
    def is_first_registration(self) -> bool:
        """A registration with no count before it (``old`` None): no earlier count to compare with."""
        return self.registration and self.old is None

    @property
    def is_increase(self) -> bool:
        """True for an increase or bounded -> unbounded (the unsafe direction)."""
        return self.new is None or (self.old is not None and self.new > self.old)


def format_count(count: int | None) -> str:
    """Render a count for messages: ``unbounded`` for None."""
    return "unbounded" if count is None else str(count)


def is_reregistered(before: CSINodeDriver, after: CSINodeDriver) -> bool:
    """True when kubelet's ``InstallCSIDriver`` rewrote the entry: same name, another ``nodeID`` or
    ``topologyKeys`` (pkg/volume/csi/nodeinfomanager ``installDriverToCSINode``)."""
    return before.node_id != after.node_id or before.topology_keys != after.topology_keys


def removed_drivers(old: CSINode, new: CSINode) -> list[str]:
    """Names of the driver entries in ``old`` that ``new`` no longer has (removals; never judged)."""
    return [name for name in old.drivers if name not in new.drivers]


def diff_drivers(old: CSINode, new: CSINode, *, registrations: bool = False) -> list[CountChange]:
    """The count changes from ``old`` to ``new``, matched by driver name, in the new object's order.

    Removals (only in ``old``) are never changes. Registrations (only in ``new``, or rewritten with another
    ``nodeID``/``topologyKeys``) are listed as changes with ``registration=True`` when ``registrations`` is
    set (an entry that appears gets ``old=None``), and left out otherwise.
    """
    changes: list[CountChange] = []
    node = new.name or old.name
    for name, entry in new.drivers.items():  # in position order: parse_csinode fills drivers in list order
        before = old.drivers.get(name)
        if before is None or is_reregistered(before, entry):
            if registrations:
                changes.append(
                    CountChange(
                        node=node,
                        driver=name,
                        old=before.allocatable_count if before is not None else None,
                        new=entry.allocatable_count,
                        position=entry.position,
                        registration=True,
                    )
                )
            continue
        if before.allocatable_count == entry.allocatable_count:
            continue
        changes.append(
            CountChange(
                node=node,
                driver=name,
                old=before.allocatable_count,
                new=entry.allocatable_count,
                position=entry.position,
            )
        )
    return changes
