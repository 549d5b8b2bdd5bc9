"""What a request can grow stays bounded (the short version of ``python -m benchmarks.adversarial_memory``, which
measures the served workers' RSS): the metric children and the remembered values do not grow with the number of
invented names, versions or annotations. Through the Flask app of a worker; not timed."""

from __future__ import annotations

import random
from typing import Any

from benchmarks.adversarial_memory import adversarial_review
from benchmarks.reviews import BENCH_KEY
from webhook.admission import evaluation, versions
from webhook.admission.cluster import UnknownClusterView
from webhook.admission.state import StateKeys
from webhook.serving import metrics
from webhook.serving.app import Runtime, create_app
from webhook.serving.audit_writer import AuditWriter
from webhook.serving.live_policy import PolicyStore


def test_invented_names_and_values_do_not_grow_what_a_worker_keeps(tmp_path: Any) -> None:
    runtime = Runtime(policies=PolicyStore(None), cluster=UnknownClusterView(), keys=StateKeys([BENCH_KEY]),
                      audit=AuditWriter(str(tmp_path / "audit.log")))
    client = create_app(runtime).test_client()
    rng = random.Random(7)

    def burst(n: int) -> None:
        for _ in range(n):
            client.post(rng.choice(["/mutate", "/validate"]), data=adversarial_review(rng),
                        content_type="application/json")

    burst(1600)  # 1,600 invented drivers, nodes, writers and versions at least
    values = {value for _, labels in metrics._children for value in labels}
    assert not any("invented" in v or v.startswith("node-") for v in values), sorted(values)
    # Only label values from fixed sets: endpoints, decisions, rules, results, actions, codes, reasons.
    assert len(metrics._children) <= 200, len(metrics._children)
    assert len(metrics._driver_labels) <= metrics.MAX_DRIVER_LABELS
    assert not any("invented" in label for label in metrics._driver_labels)
    assert evaluation._published_versions.cache_info().currsize <= 1024
    assert versions._compare_versions.cache_info().currsize <= 4096
