"""Per-request metric updates held in memory (webhook.serving.metrics.PendingUpdates) and what a flush writes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from benchmarks.reviews import BENCH_KEY, NOW
from webhook.admission.cluster import UnknownClusterView
from webhook.admission.evaluation import AdmissionDecision, Mode, evaluate
from webhook.admission.policy import load_policy
from webhook.admission.review import parse_review
from webhook.admission.state import StateKeys
from webhook.serving import metrics

DATA = Path(__file__).parent / "data"


def _decision(name: str) -> AdmissionDecision:
    request = parse_review((DATA / f"review-{name}.json").read_bytes())
    return evaluate(request, load_policy(None), UnknownClusterView(), NOW, StateKeys([BENCH_KEY]), mode=Mode.MUTATE)


def _value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture
def pending() -> Iterator[metrics.PendingUpdates]:
    batch = metrics.PendingUpdates(interval=3600)  # flushed by the test only
    metrics._PENDING.append(batch)
    try:
        yield batch
    finally:
        metrics._PENDING.remove(batch)


def test_batched_updates_reach_the_metrics_at_flush_and_add_up_exactly(pending: metrics.PendingUpdates) -> None:
    clamp = _decision("report-39")
    assert clamp.decision.value == "clamp"
    requests = {"endpoint": "mutate", "decision": "clamp", "dry_run": "false"}
    ceiling = {"rule": "count-ceiling", "result": "violation", "enforcement": "clamp"}
    before = (_value("csinode_guard_requests_total", **requests), _value("csinode_guard_rule_results_total", **ceiling),
              _value("csinode_guard_request_duration_seconds_count", endpoint="mutate"),
              _value("csinode_guard_request_duration_seconds_sum", endpoint="mutate"))
    for _ in range(3):
        metrics.observe_decision("mutate", clamp, False, 0.002)
    assert _value("csinode_guard_requests_total", **requests) == before[0]  # held, not written yet
    pending.flush()
    assert _value("csinode_guard_requests_total", **requests) == before[0] + 3
    assert _value("csinode_guard_rule_results_total", **ceiling) == before[1] + 3
    assert _value("csinode_guard_request_duration_seconds_count", endpoint="mutate") == before[2] + 3
    assert _value("csinode_guard_request_duration_seconds_sum", endpoint="mutate") == pytest.approx(before[3] + 0.006)
    assert _value("csinode_guard_request_duration_seconds_bucket", endpoint="mutate", le="0.0025") >= 3
    pending.flush()  # nothing pending: nothing written twice
    assert _value("csinode_guard_requests_total", **requests) == before[0] + 3


def test_stop_writes_what_is_pending(pending: metrics.PendingUpdates) -> None:
    allow = _decision("eni-25-to-23")
    labels = {"endpoint": "validate", "decision": allow.decision.value, "dry_run": "true"}
    before = _value("csinode_guard_requests_total", **labels)
    metrics.observe_decision("validate", allow, True, 0.001)
    pending.stop()
    assert _value("csinode_guard_requests_total", **labels) == before + 1


def test_without_a_batch_every_update_is_written_at_once() -> None:
    assert not metrics._PENDING
    deny = _decision("other-node")
    labels = {"endpoint": "validate", "decision": deny.decision.value, "dry_run": "false"}
    before = _value("csinode_guard_requests_total", **labels)
    metrics.observe_decision("validate", deny, False, 0.001)
    assert _value("csinode_guard_requests_total", **labels) == before + 1


def test_violations_are_counted_per_rule_driver_and_effective_action() -> None:
    clamp = _decision("report-39")
    violations = [o for o in clamp.outcomes if o.result == "violation" and o.driver is not None]
    assert violations, "report-39 violates count-ceiling"
    labels = [{"rule": o.rule, "driver": o.driver or "", "enforcement": (o.effective.value if o.effective else "none")}
              for o in violations]
    before = [_value("csinode_guard_violations_total", **lab) for lab in labels]
    metrics.observe_decision("mutate", clamp, False, 0.001, known_driver=lambda name: name == labels[0]["driver"])
    assert [_value("csinode_guard_violations_total", **lab) for lab in labels] == [b + 1 for b in before]
