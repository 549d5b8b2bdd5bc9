"""Never fail open by slowness: past its internal time budget the guard answers with what it knows to be safe.

Issue 32, attack 5: a registration of ebs at 128 among 6,000 other drivers took longer than the webhook's
``timeoutSeconds``; the apiserver applied ``failurePolicy: Ignore`` and 128 was stored. Here the time is a clock
the test controls (a cluster view whose lookups advance it: an injected slow stage), never the wall clock; the
served guard is tested with ``--answer-budget 0`` (every review past its budget). A late answer found only once
it was sent is counted (the check used to run before the audit write and the encoding of the answer).
"""

from __future__ import annotations

import base64
import json
import urllib.request
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import pytest
from kube import apply_response, review
from prometheus_client import REGISTRY

from tests.test_late_answers import records_of
from webhook.admission.cluster import AttachError, StaticClusterView
from webhook.admission.decision import Decision, Mode
from webhook.admission.evaluation import evaluate
from webhook.admission.policy import load_policy
from webhook.admission.review import AdmissionRequest, build_response, parse_review
from webhook.admission.state import STATE_ANNOTATION, StateKeys
from webhook.serving.app import _late_after_sending, answer_budget

KEYS = StateKeys([b"t" * 32])
POLICY = load_policy()
NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
NODE = "node-a"
UID = "3c1f7a52-0000-4000-8000-0000000b0d9e"
EBS = "ebs.csi.aws.com"
CEILING = 27  # the shipped profile's ceiling for an m6i.large
KUBELET = (f"system:node:{NODE}", ["system:nodes", "system:authenticated"])


class SlowView(StaticClusterView):
    """The node is an m6i.large; every attach-error lookup takes ``step`` seconds of the test's clock."""

    def __init__(self, step: float) -> None:
        super().__init__(nodes={NODE: {"labels": {"node.kubernetes.io/instance-type": "m6i.large"}}})
        self.clock = 0.0
        self.step = step
        self.lookups = 0

    def attach_errors(self, node: str, driver: str, since: datetime) -> Sequence[AttachError] | None:
        self.clock += self.step
        self.lookups += 1
        return super().attach_errors(node, driver, since)


def csinode(counts: Mapping[str, int], annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {"apiVersion": "storage.k8s.io/v1", "kind": "CSINode",
            "metadata": {"name": NODE, "uid": UID, "annotations": dict(annotations or {})},
            "spec": {"drivers": [{"name": n, "nodeID": NODE, "topologyKeys": [], "allocatable": {"count": c}}
                                 for n, c in counts.items()]}}


def attack5(others: int) -> dict[str, int]:
    """ebs at 128 among ``others`` invented drivers (at 10)."""
    return {EBS: 128, **{f"plugin-{i:05d}.csi.example.com": 10 for i in range(others)}}


def judge(old: dict[str, Any], new: dict[str, Any], view: SlowView, budget: float | None, *,
          user: tuple[str, list[str]] = KUBELET, mode: Mode = Mode.MUTATE) -> tuple[Any, dict[str, Any]]:
    request: AdmissionRequest = parse_review(json.dumps(review(old, new, user=user[0], groups=user[1])))
    deadline = None if budget is None else (lambda: view.clock > budget)
    decision = evaluate(request, POLICY, view, NOW, KEYS, mode=mode, deadline=deadline, budget_seconds=budget)
    final = new
    if decision.response.allowed and mode is Mode.MUTATE:
        final = apply_response(new, build_response(request.uid, decision.response, allow_patch=True))
    return decision, final


def counts_of(obj: dict[str, Any]) -> dict[str, int]:
    return {d["name"]: d["allocatable"]["count"] for d in obj["spec"]["drivers"]}


def test_a_registration_judged_past_its_budget_is_clamped_to_the_ceilings() -> None:
    view = SlowView(step=0.01)  # 10 ms per driver: a 2,001-driver registration would take 20 s
    decision, final = judge(csinode({}), csinode(attack5(2000)), view, budget=1.0)
    assert decision.response.audit_annotations["hurried"] == "true"
    assert decision.decision is Decision.CLAMP
    assert counts_of(final)[EBS] == CEILING
    assert all(c == 10 for n, c in counts_of(final).items() if n != EBS)
    assert STATE_ANNOTATION not in final["metadata"]["annotations"]  # nothing recorded unjudged
    assert view.lookups < 200, view.lookups  # it stopped judging soon after the budget, not at the end


def test_within_its_budget_the_same_registration_is_judged_in_full() -> None:
    view = SlowView(step=0.0001)
    decision, final = judge(csinode({}), csinode(attack5(300)), view, budget=1.0)
    assert "hurried" not in decision.response.audit_annotations
    assert counts_of(final)[EBS] == CEILING
    assert STATE_ANNOTATION in final["metadata"]["annotations"]
    assert view.lookups == 301


def test_an_increase_past_the_budget_is_held_at_the_stored_count() -> None:
    stored = csinode({EBS: 20, "other.csi.example.com": 30})
    new = csinode({EBS: 25, "other.csi.example.com": 12})
    decision, final = judge(stored, new, SlowView(step=1.0), budget=0.5)
    assert decision.response.allowed and decision.response.audit_annotations["hurried"] == "true"
    assert counts_of(final) == {EBS: 20, "other.csi.example.com": 12}  # held; the decrease goes through


@pytest.mark.parametrize("mode", [Mode.MUTATE, Mode.VALIDATE])
def test_a_strangers_increase_past_the_budget_is_refused(mode: Mode) -> None:
    stored = csinode({EBS: 20})
    decision, _ = judge(stored, csinode({EBS: 25}), SlowView(step=1.0), budget=0.5,
                        user=("mallory", ["system:authenticated"]), mode=mode)
    assert not decision.response.allowed and decision.response.status_code == 403
    assert "time budget" in (decision.response.message or "")


def test_a_justification_set_in_a_hurried_write_is_put_back() -> None:
    """Nothing is recorded past the budget: the guard's annotations a write changed are restored as stored."""
    stored = csinode({EBS: 20})
    new = csinode({EBS: 19}, annotations={"csinode-guard.io/justification": "[]"})
    _, final = judge(stored, new, SlowView(step=1.0), budget=0.5)
    assert "csinode-guard.io/justification" not in final["metadata"]["annotations"]


def test_the_budget_is_at_most_40_percent_of_the_apiservers_timeout() -> None:
    assert answer_budget(1.0, 5.0) == 1.0
    assert answer_budget(2.0, 5.0) == 2.0
    assert answer_budget(3.0, 5.0) == 2.0
    assert answer_budget(1.0, 2.0) == 0.8
    assert answer_budget(3.0, None) == 3.0


def _late_total(endpoint: str) -> float:
    return REGISTRY.get_sample_value("csinode_guard_late_answers_total", {"endpoint": endpoint}) or 0.0


def test_an_answer_that_left_after_the_timeout_is_counted_late_once_sent() -> None:
    """The check before the audit write saw the answer on time; sending it took the rest: counted after all."""
    request = parse_review(json.dumps(review(csinode({EBS: 20}), csinode({EBS: 19}))))
    before = _late_total("mutate")
    assert _late_after_sending(Mode.MUTATE, request, started=100.0, timeout=5.0, now=104.9) is False
    assert _late_total("mutate") == before
    assert _late_after_sending(Mode.MUTATE, request, started=100.0, timeout=5.0, now=105.2) is True
    assert _late_total("mutate") == before + 1


@pytest.mark.slow
def test_the_served_guard_answers_past_its_budget_with_the_ceilings(server_factory: Any) -> None:
    """Through the real HTTPS endpoint (CA-verified client): with ``--answer-budget 0`` every review is past its
    budget. ebs at 128 among 2,000 drivers is clamped to the ceiling of an unknown instance type (offline), the
    answer is marked in its audit record and counted."""
    server = server_factory("--answer-budget", "0", workers=1)
    body = review(csinode({}), csinode(attack5(2000)), user=KUBELET[0], groups=KUBELET[1], uid="hurried-128")
    answer = json.loads(server.post("/mutate", body).data)
    assert answer["response"]["allowed"] is True
    ops = json.loads(base64.b64decode(answer["response"]["patch"]))
    ebs_ops = [op for op in ops if op["path"] == "/spec/drivers/0/allocatable/count"]
    assert len(ebs_ops) == 1 and ebs_ops[0]["value"] < 128, ops
    assert not any(STATE_ANNOTATION.replace("/", "~1") in op["path"] for op in ops)
    records = records_of(server, "hurried-128")
    assert any("past its time budget" in note for r in records for note in r.get("notes", ())), records[:2]
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    assert 'csinode_guard_hurried_answers_total{endpoint="mutate"} 1.0' in text
