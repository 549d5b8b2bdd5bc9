"""The guard's state is bounded: its own patch never pushes a CSINode's annotations past the apiserver's 256 KiB.

Issue 32, attack 6: between 1,500 and 2,000 drivers the guard's signed state made the object's annotations "Too
long" and the apiserver refused the kubelet's registration (an outage the guard caused). Each write here goes
through /mutate, its patch and /validate under the shipped policy, as the apiserver does it; the size counted is
apimachinery's ``ValidateAnnotationsSize`` (sum of len(key) + len(value), 262,144 bytes at most). The same 2,000-
driver registration through the real apiserver: tests/k8s/test_size_bounds.py.
"""

from __future__ import annotations

import copy
import json
from datetime import UTC, datetime, timedelta
from typing import Any

from kube import apply_response, review

from webhook.admission.cluster import StaticClusterView
from webhook.admission.evaluation import AdmissionDecision, Mode, evaluate
from webhook.admission.policy import load_policy
from webhook.admission.review import build_response, parse_review
from webhook.admission.state import (
    STATE_ANNOTATION,
    Correction,
    EntryState,
    GuardState,
    PinnedLabel,
    StateKeys,
    decode_state,
)
from webhook.admission.state_bounds import (
    ANNOTATION_LIMIT_BYTES,
    MAX_ENTRIES,
    REMOVED_RETENTION,
    annotation_bytes,
    bound_state,
)

KEYS = StateKeys([b"b" * 32])
POLICY = load_policy()
T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
NODE = "node-wide"
UID = "7d2a8d4e-0000-4000-8000-00000000b0d5"
KUBELET = f"system:node:{NODE}"
GROUPS = ["system:nodes", "system:authenticated"]
VIEW = StaticClusterView(nodes={NODE: {"labels": {"node.kubernetes.io/instance-type": "m6i.large"}}})


def csinode(names: list[str], count: int = 10, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {"apiVersion": "storage.k8s.io/v1", "kind": "CSINode",
            "metadata": {"name": NODE, "uid": UID, "annotations": dict(annotations or {})},
            "spec": {"drivers": [{"name": n, "nodeID": NODE, "topologyKeys": [], "allocatable": {"count": count}}
                                 for n in names]}}


def invented(n: int, start: int = 0) -> list[str]:
    return [f"plugin-{i:05d}.csi.example.com" for i in range(start, start + n)]


class Stored:
    """One stored CSINode; :meth:`put` is the apiserver: /mutate, the patch, /validate, stored (and its limit)."""

    def __init__(self, obj: dict[str, Any]) -> None:
        self.obj = obj

    def put(self, new: dict[str, Any], at: timedelta) -> AdmissionDecision:
        body = json.dumps(review(self.obj, new, user=KUBELET, groups=GROUPS))
        request = parse_review(body)
        decision = evaluate(request, POLICY, VIEW, T0 + at, KEYS, mode=Mode.MUTATE)
        assert decision.response.allowed, decision.response.message
        final = apply_response(new, build_response(request.uid, decision.response, allow_patch=True))
        validated = evaluate(parse_review(json.dumps(review(self.obj, final, user=KUBELET,
                                                            groups=["system:nodes", "system:authenticated"]))),
                             POLICY, VIEW, T0 + at, KEYS, mode=Mode.VALIDATE)
        assert validated.response.allowed, validated.response.message
        # What kube-apiserver's validation of the stored object checks (apimachinery ValidateAnnotationsSize).
        assert annotation_bytes(final["metadata"].get("annotations") or {}) <= ANNOTATION_LIMIT_BYTES
        self.obj = final
        return decision

    def kubelet(self, names: list[str], count: int) -> dict[str, Any]:
        """What the node's kubelet PUTs: the stored object (annotations kept) with these drivers at ``count``."""
        new = copy.deepcopy(self.obj)
        new["spec"] = csinode(names, count)["spec"]
        return new

    @property
    def state(self) -> GuardState:
        found = decode_state(self.obj["metadata"]["annotations"].get(STATE_ANNOTATION), UID, KEYS)
        assert found.state is not None, found
        return found.state


def test_a_registration_of_2000_drivers_is_admitted_within_the_annotation_limit() -> None:
    node = Stored(csinode([]))
    decision = node.put(node.kubelet(invented(2000), 10), timedelta(0))
    assert len(node.state.entries) == MAX_ENTRIES
    assert any("keeps 512 of 2000 entries" in w for w in decision.response.warnings), decision.response.warnings


def test_the_state_shrinks_to_what_other_annotations_leave() -> None:
    """An operator's (or a stranger's) 200 KiB of annotations leave the state the rest; the write still fits."""
    big = {"example.com/inventory": "x" * (200 * 1024)}
    node = Stored(csinode([], annotations=big))
    node.put(node.kubelet(invented(2000), 10), timedelta(0))
    assert 0 < len(node.state.entries) < MAX_ENTRIES


def test_with_no_room_at_all_the_stored_state_stays_as_it_is() -> None:
    """Other annotations that fill the object leave no room: the write goes through and the guard adds nothing."""
    node = Stored(csinode(invented(3)))
    node.put(node.kubelet(invented(3), 9), timedelta(0))  # a state for the three entries
    assert len(node.state.entries) == 3
    crowded = node.kubelet(invented(3), 8)
    crowded["metadata"]["annotations"]["example.com/inventory"] = "x" * (ANNOTATION_LIMIT_BYTES - 2048)
    decision = node.put(crowded, timedelta(minutes=1))
    assert {name: e.count for name, e in node.state.entries.items()} == dict.fromkeys(invented(3), 9)
    assert any("stored state is not updated" in w for w in decision.response.warnings), decision.response.warnings


def test_an_update_of_a_wide_node_keeps_the_changed_entry() -> None:
    """One count change on a node whose state is full: the changed entry is the most recently changed one."""
    node = Stored(csinode([]))
    node.put(node.kubelet(invented(1000), 10), timedelta(0))
    outside = next(n for n in invented(1000) if n not in node.state.entries)
    changed = copy.deepcopy(node.obj)
    for d in changed["spec"]["drivers"]:
        if d["name"] == outside:
            d["allocatable"]["count"] = 7
    node.put(changed, timedelta(minutes=5))
    assert node.state.entries[outside].count == 7
    assert len(node.state.entries) == MAX_ENTRIES


def test_a_removed_drivers_history_is_kept_for_the_retention_then_dropped() -> None:
    a, b = invented(2)
    node = Stored(csinode([a, b]))
    node.put(node.kubelet([a, b], 9), timedelta(0))
    node.put(node.kubelet([a], 8), timedelta(hours=1))  # b removed; a's decrease writes the state
    assert node.state.entries[b].removed_at == T0 + timedelta(hours=1)
    assert node.state.entries[b].count == 9
    node.put(node.kubelet([a], 7), REMOVED_RETENTION)  # within the retention: kept, removal time unchanged
    assert node.state.entries[b].removed_at == T0 + timedelta(hours=1)
    node.put(node.kubelet([a], 6), REMOVED_RETENTION + timedelta(hours=2))
    assert b not in node.state.entries


def test_a_driver_that_comes_back_forgets_its_removal_time() -> None:
    """Else a driver removed, back (as it was: no new state) and removed again would lose its history at once."""
    a, b = invented(2)
    node = Stored(csinode([a, b]))
    node.put(node.kubelet([a, b], 9), timedelta(0))
    node.put(node.kubelet([a], 8), timedelta(hours=1))
    back = node.kubelet([a], 8)
    back["spec"]["drivers"].append({"name": b, "nodeID": NODE, "topologyKeys": [], "allocatable": {"count": 9}})
    node.put(back, timedelta(hours=2))
    assert node.state.entries[b].removed_at is None
    assert node.state.entries[b].count == 9


def entry(at: datetime, **kwargs: Any) -> EntryState:
    return EntryState(count=10, changed_at=at, **kwargs)


def test_entries_that_protect_something_are_kept_first_then_the_most_recently_changed() -> None:
    old = T0 - timedelta(days=300)
    entries = {f"new-{i:04d}": entry(T0 - timedelta(seconds=i)) for i in range(MAX_ENTRIES + 100)}
    entries["pinned"] = entry(old, pinned=PinnedLabel("node.kubernetes.io/instance-type", "m6i.large"))
    entries["corrected"] = entry(old, correction=Correction(old, 12, 10, "resource-exhausted"))
    entries["frozen"] = entry(old, frozen_until=T0 + timedelta(hours=1))
    entries["thawed"] = entry(old, frozen_until=T0 - timedelta(hours=1))
    bounded = bound_state(GuardState(UID, entries), T0, room=10**9)
    assert bounded.state is not None
    kept = set(bounded.state.entries)
    assert {"pinned", "corrected", "frozen"} <= kept and "thawed" not in kept
    assert len(kept) == MAX_ENTRIES
    assert f"new-{MAX_ENTRIES - 4:04d}" in kept and f"new-{MAX_ENTRIES - 3:04d}" not in kept
    assert set(bounded.dropped) == set(entries) - kept
