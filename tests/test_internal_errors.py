"""When judging fails with an unexpected error (a bug, a broken cluster view): count increases are refused,
every other write is admitted unjudged with a warning, and both are audited and counted."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from benchmarks.reviews import BENCH_KEY
from tests.kube import EBS, base_csinode, kubelet_update, review
from webhook.admission.cluster import UnknownClusterView
from webhook.admission.state import StateKeys
from webhook.serving.app import Runtime, create_app
from webhook.serving.audit_writer import AuditWriter
from webhook.serving.live_policy import PolicyStore


class BrokenClusterView(UnknownClusterView):
    """A cluster view with a bug: every node-label lookup raises."""

    def node_labels(self, node: str) -> Any:
        raise RuntimeError(f"cache bug while looking up {node}")


@pytest.fixture
def app() -> Iterator[tuple[Any, Path]]:
    directory = Path(tempfile.mkdtemp(prefix="internal-errors-"))
    runtime = Runtime(policies=PolicyStore(None), cluster=BrokenClusterView(), keys=StateKeys([BENCH_KEY]),
                      audit=AuditWriter(str(directory / "audit.log")))
    yield create_app(runtime).test_client(), directory / "audit.log"


def _errors() -> float:
    return REGISTRY.get_sample_value("csinode_guard_internal_errors_total") or 0.0


@pytest.mark.parametrize("path", ["/mutate", "/validate"])
def test_an_increase_is_refused_when_judging_fails(app: tuple[Any, Path], path: str) -> None:
    client, audit = app
    stored = kubelet_update(base_csinode(), EBS, 25)
    before = _errors()
    answer = client.post(path, json=review(stored, kubelet_update(stored, EBS, 39), uid="err-1"))
    assert answer.status_code == 200
    response = answer.get_json()["response"]
    assert response["uid"] == "err-1" and response["allowed"] is False
    assert response["status"]["code"] == 403
    assert "internal error" in response["status"]["message"] and f"{EBS}: 25 -> 39" in response["status"]["message"]
    assert response["auditAnnotations"] == {"decision": "error"}
    assert _errors() == before + 1
    record = json.loads(audit.read_text().splitlines()[-1])
    assert record["uid"] == "err-1" and record["allowed"] is False and record["decision"] == "deny"


def test_an_unbounded_count_counts_as_an_increase(app: tuple[Any, Path]) -> None:
    client, _ = app
    stored = kubelet_update(base_csinode(), EBS, 25)
    response = client.post("/mutate", json=review(stored, kubelet_update(stored, EBS, None))).get_json()["response"]
    assert response["allowed"] is False and "25 -> unbounded" in response["status"]["message"]


def test_a_decrease_is_admitted_unjudged_with_a_warning(app: tuple[Any, Path]) -> None:
    client, audit = app
    stored = kubelet_update(base_csinode(), EBS, 25)
    response = client.post("/mutate", json=review(stored, kubelet_update(stored, EBS, 23), uid="err-2")).get_json()
    body = response["response"]
    assert body["allowed"] is True and "patch" not in body
    assert body["warnings"] == ["csinode-guard could not judge this write (internal error); it raises no count and "
                                "was admitted unjudged"]
    record = json.loads(audit.read_text().splitlines()[-1])
    assert record["uid"] == "err-2" and record["allowed"] is True and record["decision"] == "skip"


@pytest.mark.parametrize(("user", "allowed"), [("system:node:ip-10-0-1-23.ec2.internal", True), ("mallory", False)])
def test_a_delete_that_cannot_be_judged_passes_for_the_node_only(app: tuple[Any, Path], user: str,
                                                                allowed: bool) -> None:
    client, _ = app
    stored = kubelet_update(base_csinode(), EBS, 25)
    body = review(stored, None, operation="DELETE", user=user,
                  groups=["system:nodes"] if user.startswith("system:node:") else ["system:authenticated"])
    response = client.post("/mutate", json=body).get_json()["response"]
    assert response["allowed"] is allowed
    assert response["auditAnnotations"] == {"decision": "error"}
