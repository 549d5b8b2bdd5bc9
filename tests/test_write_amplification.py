"""Persistent disagreement costs one request per period, not four (DESIGN.md, write amplification).

When the driver keeps reporting a count the policy refuses (39 on a node whose ceiling is 27), kubelet sends its
PUT again every period. A clamp back to the stored count answers it once and leaves the object byte-identical,
so the apiserver writes nothing; a denial would cost kubelet's four quick retries.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest

from tests.kube import EBS, apply_response, base_csinode, kubelet_update, review
from webhook.admission.cluster import StaticClusterView
from webhook.admission.evaluation import Decision, Mode, evaluate
from webhook.admission.policy import load_policy
from webhook.admission.review import build_response, parse_review
from webhook.admission.state import StateKeys

KEYS = StateKeys([b"w" * 32])
POLICY = load_policy()
T0 = datetime(2026, 11, 30, 3, 0, tzinfo=UTC)


def put(stored: dict[str, object], new: dict[str, object], at: datetime) -> tuple[Decision, dict[str, object]]:
    request = parse_review(json.dumps(review(stored, new)))
    decision = evaluate(request, POLICY, StaticClusterView(), at, KEYS, mode=Mode.MUTATE)
    document = build_response(request.uid, decision.response, allow_patch=True)
    result = apply_response(new, document) if decision.response.allowed else stored
    return decision.decision, result


@pytest.mark.parametrize(
    "seconds_later",
    [
        pytest.param(5, id="inside the change-rate interval the repeat is still only a clamp"),
        pytest.param(120, id="after the interval the repeat is a clamp"),
    ],
)
def test_a_repeated_refused_report_is_clamped_to_a_byte_identical_no_op(seconds_later: int) -> None:
    stored = kubelet_update(base_csinode(), EBS, 23)
    stored["spec"]["drivers"].append({"name": "efs.csi.aws.com.extra", "nodeID": "x", "topologyKeys": None})
    decision, stored = put(stored, kubelet_update(stored, EBS, 39), T0)
    assert decision is Decision.CLAMP
    assert [d.get("allocatable", {}).get("count") for d in stored["spec"]["drivers"] if d["name"] == EBS] == [27]
    before = json.dumps(stored)
    decision, after = put(stored, kubelet_update(stored, EBS, 39), T0 + timedelta(seconds=seconds_later))
    assert decision is Decision.CLAMP
    assert json.dumps(after) == before


def test_a_real_increase_inside_the_interval_is_held_at_the_stored_count_as_a_byte_identical_no_op() -> None:
    """change-rate's deny acts as a clamp for the node's own kubelet: one request, the object unchanged (a
    kubelet re-registering after its own restart writes the same PUT, and must not fail)."""
    stored = kubelet_update(base_csinode(), EBS, 20)
    _, stored = put(stored, kubelet_update(stored, EBS, 22), T0)
    before = json.dumps(stored)
    decision, after = put(stored, kubelet_update(stored, EBS, 24), T0 + timedelta(seconds=5))
    assert decision is Decision.CLAMP
    assert json.dumps(after) == before
