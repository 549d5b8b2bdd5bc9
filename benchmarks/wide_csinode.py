"""Judging a CSINode with many drivers: cost per driver, and work that must not grow faster than the drivers.

    python -m benchmarks.wide_csinode [--drivers 1000,2000,4000,8000] [--approvals]

Every driver of a kubelet write changes its count (10 -> 12). ``--approvals`` also gives the object a signed
state with one recorded approval per driver (what a justifier may accumulate), which the judging used to scan
in full for every driver. Prints, per size, the best of five runs in process CPU time (microseconds per driver)
for decoding the AdmissionReview, judging it, and building and encoding its audit records, and how many times
an approval was checked. In-process only; no network.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import UTC, datetime, timedelta
from typing import Any

from benchmarks.reviews import BENCH_KEY
from webhook.admission import state as state_module
from webhook.admission.audit_records import build_records, encode_record
from webhook.admission.cluster import UnknownClusterView
from webhook.admission.evaluation import Mode, evaluate
from webhook.admission.policy import load_policy
from webhook.admission.review import build_response, parse_review
from webhook.admission.state import STATE_ANNOTATION, Approval, GuardState, StateKeys, encode_state
from webhook.serving.gctuning import settle_for_requests

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
UID = "5f0c9c1e-0000-4000-8000-00000000wide"


def wide_review(drivers: int, approvals: bool, keys: StateKeys) -> bytes:
    """A kubelet UPDATE of a CSINode with ``drivers`` drivers, each 10 -> 12."""
    entries = [{"name": f"d{i}.csi.example.com", "nodeID": f"node-{i}", "topologyKeys": [],
                "allocatable": {"count": 10}} for i in range(drivers)]
    old: dict[str, Any] = {"apiVersion": "storage.k8s.io/v1", "kind": "CSINode",
                           "metadata": {"name": "wide-node", "uid": UID, "annotations": {}},
                           "spec": {"drivers": entries}}
    if approvals:
        recorded = tuple(Approval(f"d{i}.csi.example.com", "bench", 0, 5, NOW + timedelta(days=1), "T-1",
                                  "approver", NOW - timedelta(hours=1)) for i in range(drivers))
        old["metadata"]["annotations"][STATE_ANNOTATION] = encode_state(GuardState(UID, {}, recorded), keys)
    new = json.loads(json.dumps(old))
    for entry in new["spec"]["drivers"]:
        entry["allocatable"]["count"] = 12
    request = {"uid": "wide", "kind": {"group": "storage.k8s.io", "version": "v1", "kind": "CSINode"},
               "resource": {"group": "storage.k8s.io", "version": "v1", "resource": "csinodes"},
               "name": "wide-node", "operation": "UPDATE",
               "userInfo": {"username": "system:node:wide-node", "groups": ["system:nodes", "system:authenticated"]},
               "object": new, "oldObject": old, "dryRun": False}
    return json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}).encode()


def measure(drivers: int, approvals: bool) -> dict[str, Any]:
    """Best-of-five CPU time per driver (µs) for decode, judge, audit; approval checks per driver."""
    keys = StateKeys([BENCH_KEY])
    policy = load_policy(None)
    body = wide_review(drivers, approvals, keys)
    checks = [0]
    original = state_module.Approval.covers

    def counting(self: Approval, driver: str, count: int | None, now: datetime) -> bool:
        checks[0] += 1
        return original(self, driver, count, now)

    best: dict[str, float] = {}
    state_module.Approval.covers = counting  # type: ignore[method-assign]
    try:
        for _ in range(5):
            checks[0] = 0
            t0 = time.process_time()
            review = parse_review(body)
            t1 = time.process_time()
            decision = evaluate(review, policy, UnknownClusterView(), NOW, keys, mode=Mode.MUTATE)
            build_response(review.uid, decision.response, allow_patch=True)
            t2 = time.process_time()
            for record in build_records(decision, review, endpoint=Mode.MUTATE, now=NOW, policy_hash="bench",
                                        policy_generation=1, latency_seconds=0.0):
                encode_record(record)
            t3 = time.process_time()
            for name, seconds in (("decode", t1 - t0), ("judge", t2 - t1), ("audit", t3 - t2)):
                best[name] = min(best.get(name, float("inf")), seconds)
    finally:
        state_module.Approval.covers = original  # type: ignore[method-assign]
    return {"drivers": drivers, "approvals": drivers if approvals else 0, "body_kib": len(body) // 1024,
            "decision": decision.decision.value,
            **{f"{k}_us_per_driver": round(v * 1e6 / drivers, 1) for k, v in best.items()},
            "total_ms": round(sum(best.values()) * 1000, 1), "approval_checks_per_driver": checks[0] / drivers}


def main() -> None:
    """Print one JSON line per size."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drivers", default="1000,2000,4000,8000")
    parser.add_argument("--approvals", action="store_true")
    args = parser.parse_args()
    settle_for_requests()
    for n in (int(x) for x in args.drivers.split(",")):
        print(json.dumps(measure(n, args.approvals)))


if __name__ == "__main__":
    main()
