"""The attach headroom histogram is fed where a count is admitted, /mutate, whichever ``register --validation``
is used: with ``cel`` the apiserver calls /validate only where CEL cannot decide, so /validate never observes.

The Flask app of a worker is driven with real AdmissionReviews; ``observe_count`` records what it is given."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.reviews import BENCH_KEY
from tests.kube import EBS, apply_response, base_csinode, driver_entry, kubelet_update, review
from webhook.admission.cluster import UnknownClusterView
from webhook.admission.state import StateKeys
from webhook.serving.app import Runtime, create_app
from webhook.serving.audit_writer import AuditWriter
from webhook.serving.live_policy import PolicyStore


def _client(tmp_path: Path, seen: list[tuple[str, int | None]]) -> Any:
    def observe(driver: str, count: int | None, node: str, label: str | None = None) -> None:
        seen.append((driver, count))

    runtime = Runtime(policies=PolicyStore(None), cluster=UnknownClusterView(), keys=StateKeys([BENCH_KEY]),
                      audit=AuditWriter(str(tmp_path / "audit.log")), observe_count=observe)
    return create_app(runtime).test_client()


def _post(client: Any, path: str, body: dict[str, Any]) -> dict[str, Any]:
    answer = client.post(path, data=json.dumps(body), content_type="application/json")
    assert answer.status_code == 200
    result: dict[str, Any] = answer.get_json()["response"]
    return result


def test_an_admitted_count_is_observed_once_at_mutate_and_never_at_validate(tmp_path: Path) -> None:
    seen: list[tuple[str, int | None]] = []
    client = _client(tmp_path, seen)
    stored = base_csinode()
    stored["spec"]["drivers"].append(driver_entry(EBS, 25))
    lower = kubelet_update(stored, EBS, 23)
    mutated = _post(client, "/mutate", review(stored, lower))
    assert mutated["allowed"]
    assert seen == [(EBS, 23)]
    assert _post(client, "/validate", review(stored, apply_response(lower, {"response": mutated})))["allowed"]
    assert seen == [(EBS, 23)]


def test_a_clamp_back_to_the_stored_count_stores_nothing_and_is_not_observed(tmp_path: Path) -> None:
    seen: list[tuple[str, int | None]] = []
    client = _client(tmp_path, seen)
    stored = base_csinode()
    stored["spec"]["drivers"].append(driver_entry(EBS, 25))
    answer = _post(client, "/mutate", review(stored, kubelet_update(stored, EBS, None)))  # unbounded: clamped
    assert answer["allowed"] and answer.get("patch")
    assert seen == []
