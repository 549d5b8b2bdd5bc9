"""A driver whose node plugin restarts is removed and registered again by kubelet; its history survives.

Registrations and removals are never judged (kubelet marks the node NotReady when it cannot register), and the
apiserver does not even call the guard for them (matchConditions). The guard's state keeps the entry of a removed
driver, so a freeze or a correction still applies to the first change after the driver comes back.
"""

from __future__ import annotations

import copy
import json
from datetime import UTC, datetime, timedelta
from typing import Any

from tests.kube import EBS, apply_response, base_csinode, kubelet_update, review, with_annotation
from webhook.cluster import StaticClusterView
from webhook.evaluation import Decision, Mode, evaluate
from webhook.policy import load_policy
from webhook.review import build_response, parse_review
from webhook.state import STATE_ANNOTATION, StateKeys

KEYS = StateKeys([b"r" * 32])
POLICY = load_policy()
T0 = datetime(2026, 11, 30, 3, 0, tzinfo=UTC)
VERSIONS = "csinode-guard.io/driver-versions"


def put(stored: dict[str, Any], new: dict[str, Any], at: datetime) -> tuple[Decision, dict[str, Any]]:
    request = parse_review(json.dumps(review(stored, new)))
    decision = evaluate(request, POLICY, StaticClusterView(), at, KEYS, mode=Mode.MUTATE)
    document = build_response(request.uid, decision.response, allow_patch=True)
    return decision.decision, (apply_response(new, document) if decision.response.allowed else stored)


def test_a_freeze_survives_the_driver_being_removed_and_registered_again() -> None:
    stored = with_annotation(kubelet_update(base_csinode(), EBS, 25), VERSIONS, json.dumps({EBS: "v1.37.0"}))
    _, stored = put(stored, kubelet_update(stored, EBS, 24), T0)
    rolled_back = with_annotation(kubelet_update(stored, EBS, 20), VERSIONS, json.dumps({EBS: "v1.30.0"}))
    decision, stored = put(stored, rolled_back, T0 + timedelta(minutes=5))
    assert decision is Decision.WARN  # a decrease from a rolled-back driver: admitted, and increases freeze

    removed = copy.deepcopy(stored)
    removed["spec"]["drivers"] = [d for d in removed["spec"]["drivers"] if d["name"] != EBS]
    reregistered = kubelet_update(removed, EBS, 20)  # not judged: the apiserver does not call the guard
    assert STATE_ANNOTATION in reregistered["metadata"]["annotations"]

    decision, _ = put(reregistered, kubelet_update(reregistered, EBS, 22), T0 + timedelta(minutes=30))
    assert decision is Decision.DENY
