"""RFC 6902 JSON Patch operations with RFC 6901 pointer escaping, for /mutate responses.

Only the operations the guard needs: set a driver's ``allocatable.count``, restore ``spec.drivers`` or
``metadata.managedFields``, and set or restore an annotation. Pointers escape ``~`` as ``~0`` and ``/`` as
``~1`` (RFC 6901 section 3), so the annotation ``csinode-guard.io/state`` is
``/metadata/annotations/csinode-guard.io~1state``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

Operation = dict[str, Any]


def escape_token(token: str) -> str:
    """Escape one reference token for a JSON Pointer (RFC 6901): ``~`` -> ``~0`` then ``/`` -> ``~1``."""
    return token.replace("~", "~0").replace("/", "~1")


def pointer(*tokens: str | int) -> str:
    """Build a JSON Pointer from raw tokens, e.g. ``pointer("metadata", "annotations", "a/b")``."""
    return "".join("/" + escape_token(str(t)) for t in tokens)


def set_count(index: int, count: int, has_allocatable: bool) -> Operation:
    """Operation setting ``spec.drivers[index].allocatable.count`` to ``count``.

    When the entry has no ``allocatable`` object (unbounded), the whole object is added instead.
    """
    if has_allocatable:
        return {"op": "add", "path": f"/spec/drivers/{index}/allocatable/count", "value": count}
    return {"op": "add", "path": f"/spec/drivers/{index}/allocatable", "value": {"count": count}}


def replace_drivers(drivers: Sequence[Any]) -> Operation:
    """Operation replacing ``spec.drivers`` wholesale (used to restore the stored order byte for byte)."""
    return {"op": "replace", "path": pointer("spec", "drivers"), "value": list(drivers)}


def restore_managed_fields(stored: Sequence[Any] | None) -> Operation:
    """Operation putting ``metadata.managedFields`` back to the stored list (removing it when none was stored).

    The apiserver records a write's managed fields from the object as its writer sent it, before mutating
    admission: a clamp back to the stored count would otherwise still change kubelet's entry (for example
    ``f:allocatable`` dropped when kubelet reported no count) and make a PUT that changes nothing a new revision.
    """
    if stored is None:
        return {"op": "remove", "path": "/metadata/managedFields"}
    return {"op": "add", "path": "/metadata/managedFields", "value": list(stored)}


@functools.lru_cache(maxsize=64)
def annotation_pointer(key: str) -> str:
    """``/metadata/annotations/<key>`` with ``key`` escaped (remembered: the guard uses a few keys)."""
    return pointer("metadata", "annotations", key)


def set_annotation(key: str, value: str, annotations_exist: bool) -> list[Operation]:
    """Operations setting annotation ``key`` to ``value``; creates ``metadata.annotations`` when absent."""
    if not annotations_exist:
        return [{"op": "add", "path": "/metadata/annotations", "value": {key: value}}]
    return [{"op": "add", "path": annotation_pointer(key), "value": value}]


def remove_annotation(key: str) -> Operation:
    """Operation removing annotation ``key`` (which must exist)."""
    return {"op": "remove", "path": annotation_pointer(key)}
