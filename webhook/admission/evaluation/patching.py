"""The JSON patch of an admitted write (/mutate): clamped counts, annotations put back, the next signed state.

Copy-on-write: only the driver entries a clamp rewrites are copied (the request's objects stay as sent). When
the clamped drivers equal the stored ones, the stored order is restored (kubelet re-appended the driver) and,
when nothing else changes, kubelet's stored managed fields, so that the PUT is a no-op for the apiserver.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from webhook.admission.csinode import CountChange, CSINode
from webhook.admission.patch import (
    Operation,
    remove_annotation,
    replace_drivers,
    restore_managed_fields,
    set_annotation,
    set_count,
)
from webhook.admission.review import AdmissionRequest
from webhook.admission.state import STATE_ANNOTATION, GuardState, StateKeys, encode_state

_BOOKKEEPING = ("resourceVersion", "managedFields", "generation")
"""``metadata`` fields the apiserver maintains itself: compared apart when a write is checked for being a no-op."""


def _restore_stored_managed_fields(obj: Mapping[str, Any] | None, old: Mapping[str, Any] | None) -> list[Operation]:
    """The operation restoring the stored ``metadata.managedFields`` when ``obj`` (with the stored drivers
    restored) differs from ``old`` in nothing else but what the apiserver maintains; else no operation.

    The apiserver computes managed fields from the object its writer sent, before mutating admission (kube-
    apiserver's update handler); a kubelet that reported no count gives up ``f:allocatable`` there although the
    clamp kept the count. Restoring them makes the stored object byte-identical, so etcd is not written.
    """
    if not isinstance(obj, Mapping) or not isinstance(old, Mapping):
        return []
    meta, old_meta = obj.get("metadata"), old.get("metadata")
    if not isinstance(meta, Mapping) or not isinstance(old_meta, Mapping):
        return []
    if meta.get("managedFields") == old_meta.get("managedFields"):
        return []
    rest = {k: v for k, v in meta.items() if k not in _BOOKKEEPING}
    old_rest = {k: v for k, v in old_meta.items() if k not in _BOOKKEEPING}
    spec, old_spec = obj.get("spec") or {}, old.get("spec") or {}
    if rest != old_rest or not isinstance(spec, Mapping) or not isinstance(old_spec, Mapping):
        return []
    if {k: v for k, v in spec.items() if k != "drivers"} != {k: v for k, v in old_spec.items() if k != "drivers"}:
        return []
    others = {k: v for k, v in obj.items() if k not in ("metadata", "spec")}
    if others != {k: v for k, v in old.items() if k not in ("metadata", "spec")}:
        return []
    stored = old_meta.get("managedFields")
    return [restore_managed_fields(stored if isinstance(stored, list) else None)]


def _raw_drivers(obj: Mapping[str, Any] | None) -> list[Any]:
    """``spec.drivers`` of a raw object that ``parse_csinode`` accepted (a falsy spec or list means none)."""
    spec = (obj or {}).get("spec") or {}
    return list(spec.get("drivers") or [])



def patch_operations(
    request: AdmissionRequest,
    old: CSINode,
    new: CSINode,
    changes: Sequence[CountChange],
    finals: Mapping[str, int | None],
    restore: Sequence[str],
    new_state: GuardState | None,
    keys: StateKeys,
) -> list[Operation]:
    """The operations turning ``request.object`` into what is admitted: each change's final count, the
    annotations in ``restore`` put back as ``old`` has them, ``new_state`` signed with ``keys`` (or, without
    one, the state annotation as stored)."""
    ops: list[Operation] = []
    restore_bookkeeping = False
    clamped = [c for c in changes if finals[c.driver] != c.new]
    if clamped:
        raw_new = _raw_drivers(request.object)
        raw_old = _raw_drivers(request.old_object)
        # Copy-on-write: only the entries a clamp rewrites are copied (the request's objects stay as sent).
        final_drivers = list(raw_new)
        for c in clamped:
            final = finals[c.driver]
            if final is None:  # pragma: no cover - a clamp target is always a count
                continue
            entry = dict(final_drivers[c.position])
            final_drivers[c.position] = entry
            allocatable = entry.get("allocatable")
            ops.append(set_count(c.position, final, isinstance(allocatable, dict)))
            if isinstance(allocatable, dict):
                entry["allocatable"] = {**allocatable, "count": final}
            else:
                entry["allocatable"] = {"count": final}
        by_name = {d.get("name"): d for d in final_drivers if isinstance(d, dict)}
        old_by_name = {d.get("name"): d for d in raw_old if isinstance(d, dict)}
        if by_name == old_by_name:
            # The clamped result equals the stored drivers: restore their stored order (kubelet re-appended
            # the driver) and, when nothing else changes, kubelet's stored managed fields, so that the PUT
            # is a no-op for the apiserver (nothing written to etcd, no new resourceVersion).
            if final_drivers != raw_old:
                ops = [replace_drivers(raw_old)]
            restore_bookkeeping = True
    exists = new.has_annotations
    for key in dict.fromkeys(restore):
        # A stranger's annotation on a write that is never refused: put back, not refused.
        before = old.annotations.get(key)
        if before is None:
            ops.append(remove_annotation(key))
        else:
            ops.extend(set_annotation(key, before, exists))
            exists = True
    old_value = old.annotations.get(STATE_ANNOTATION)
    new_value = new.annotations.get(STATE_ANNOTATION)
    if new_state is not None:
        ops.extend(set_annotation(STATE_ANNOTATION, encode_state(new_state, keys), exists))
    elif new_value != old_value:
        # Whatever a request itself puts in the state annotation is replaced (at CREATE: removed, as it was
        # recorded for another object).
        if old_value is None:
            ops.append(remove_annotation(STATE_ANNOTATION))
        else:
            ops.extend(set_annotation(STATE_ANNOTATION, old_value, exists))
    if restore_bookkeeping and not any(op["path"].startswith("/metadata") for op in ops):
        ops.extend(_restore_stored_managed_fields(request.object, request.old_object))
    return ops
