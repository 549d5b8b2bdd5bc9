"""Driver names come from the request: invented ones must not create Prometheus series. Through the real server:
only drivers the policy names (or the cluster has a CSIDriver for) label a series; the rest count as ``other``."""

from __future__ import annotations

import json
import time
import urllib.request
import uuid
from typing import Any

import pytest

from tests.kube import EBS, base_csinode, kubelet_update, review

pytestmark = pytest.mark.slow


def test_invented_driver_names_count_under_other_and_add_no_series(server_factory: Any) -> None:
    server = server_factory()
    names = [f"{uuid.uuid4().hex[:12]}.csi.invented.example" for _ in range(150)] + [EBS]
    for name in names:  # kubelet reports int32 max: clamped back to the stored count, a persistent disagreement
        stored = kubelet_update(base_csinode(), name, 10)
        answer = server.post("/mutate", review(stored, kubelet_update(stored, name, 2147483647)))
        assert answer.status == 200 and json.loads(answer.data)["response"]["allowed"]
    time.sleep(1.5)  # metric batches
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    series = [line for line in text.splitlines() if line.startswith("csinode_guard_persistent_disagreement_total")]
    assert sorted(series) == sorted([
        'csinode_guard_persistent_disagreement_total{driver="ebs.csi.aws.com",rule="count-ceiling"} 1.0',
        'csinode_guard_persistent_disagreement_total{driver="other",rule="count-ceiling"} 150.0',
    ]), series
    assert not any("invented" in line for line in text.splitlines())


def test_even_known_drivers_label_at_most_a_bounded_number_of_series(monkeypatch: pytest.MonkeyPatch) -> None:
    from webhook.serving import metrics  # noqa: PLC0415 - the test process's own registry

    # This process's label set, filled to its bound here, is put back afterwards: the other metric tests of this
    # process expect their drivers to get labels of their own.
    monkeypatch.setattr(metrics, "_driver_labels", set(metrics._driver_labels))
    names = [f"known-{n}.example" for n in range(2 * metrics.MAX_DRIVER_LABELS)]
    labels = {metrics.driver_label(name, lambda _name: True) for name in names}
    assert len(labels) <= metrics.MAX_DRIVER_LABELS + 1 and metrics.OTHER_DRIVER in labels
    assert metrics.driver_label("unknown.example", lambda _name: False) == metrics.OTHER_DRIVER
