"""Audit records give each evaluation note to the record of the driver the note is about (``Note.driver``), also
where the note's text would mislead a reader of it: a node named like an annotation's prefix, a driver name that
begins with another driver's name. The AdmissionResponse's warnings carry the same notes, in the same order."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

from benchmarks.reviews import BENCH_KEY, NOW
from tests.kube import EBS, KUBELET, NODE, base_csinode, driver_entry, review, with_annotation
from webhook.admission.audit_records import build_records
from webhook.admission.cluster import AttachError, ClusterView, StaticClusterView, UnknownClusterView
from webhook.admission.evaluation import AdmissionDecision, Mode, evaluate
from webhook.admission.justification import JUSTIFICATION_ANNOTATION
from webhook.admission.policy import load_policy
from webhook.admission.review import build_response, clean_warning, parse_review
from webhook.admission.state import StateKeys

POLICY = load_policy(None)
KEYS = StateKeys([BENCH_KEY])


def csinode(name: str, drivers: dict[str, int]) -> dict[str, Any]:
    """kubelet's CSINode for node ``name`` with ``drivers`` (name -> allocatable count), in that order."""
    obj = copy.deepcopy(base_csinode())
    obj["metadata"]["name"] = name
    obj["spec"]["drivers"] = [driver_entry(d, count) for d, count in drivers.items()]
    return obj


def judged(doc: dict[str, Any], cluster: ClusterView) -> tuple[AdmissionDecision, list[dict[str, Any]]]:
    request = parse_review(json.dumps(doc).encode())
    decision = evaluate(request, POLICY, cluster, NOW, KEYS, mode=Mode.MUTATE)
    records = build_records(decision, request, endpoint=Mode.MUTATE, now=NOW, policy_hash=POLICY.hash,
                            policy_generation=1, latency_seconds=0.001)
    return decision, records


Case = tuple[dict[str, Any], ClusterView, str, str, str | None]
"""(AdmissionReview, cluster view, how the note begins, the driver whose record holds it, ``Note.driver``)."""


def annotation_note_on_a_node_named_like_its_prefix() -> Case:
    """An unreadable justification on the node's own CREATE (never refused: not recorded, a note; its kubelet is
    in a justifier group here, as only a justifier's justification is read) of node
    ``csinode-guard.io``, whose second driver is named ``justification``: the note's text begins with
    ``csinode-guard.io/justification``, and it is about the request's annotation, not that driver."""
    new = with_annotation(csinode("csinode-guard.io", {EBS: 25, "justification": 10}), JUSTIFICATION_ANNOTATION,
                          "not: [a, list")
    doc = review(None, new, user="system:node:csinode-guard.io", groups=["system:nodes", "csinode-guard:approvers"],
                 operation="CREATE")
    return doc, UnknownClusterView(), f"{JUSTIFICATION_ANNOTATION} not recorded", EBS, None


def capacity_note_of_a_driver_named_after_another() -> Case:
    """kubelet lowers ``d.example.com: legacy`` from 20 to 2 amid non-capacity attach errors (a note about that
    driver) while ``d.example.com`` goes from 20 to 19: the note's text begins ``<node>/d.example.com: ``."""
    legacy = "d.example.com: legacy"
    old = csinode(NODE, {"d.example.com": 20, legacy: 20})
    new = csinode(NODE, {"d.example.com": 19, legacy: 2})
    cluster = StaticClusterView(attach_error_list={
        (NODE, legacy): [AttachError(code=13, time=NOW - timedelta(minutes=1), volume_attachment="csi-0a1b")],
    })
    return review(old, new, user=KUBELET), cluster, f"{NODE}/{legacy}: 20 -> 2 coincides only", legacy, legacy


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(annotation_note_on_a_node_named_like_its_prefix,
                     id="a note about an annotation goes to the first record, not to a driver named like it"),
        pytest.param(capacity_note_of_a_driver_named_after_another,
                     id="a note about a driver goes to that driver's record, not to the one its name begins with"),
    ],
)
def test_a_note_goes_to_the_record_of_the_driver_it_is_about(case: Callable[[], Case]) -> None:
    doc, cluster, note_start, owner, about = case()
    decision, records = judged(doc, cluster)
    assert decision.response.allowed
    notes = {r["driver"]: r.get("notes", []) for r in records}
    assert len(notes) == 2
    holding = [driver for driver, found in notes.items() if any(n.startswith(note_start) for n in found)]
    assert holding == [owner]
    # The record notes are the decision's notes' texts, as JSON strings; the warnings end with the same texts.
    (note,) = (n for n in decision.notes if n.startswith(note_start))
    assert type(json.loads(json.dumps(notes[owner]))[0]) is str
    warnings = build_response(doc["request"]["uid"], decision.response, allow_patch=True)["response"]["warnings"]
    assert warnings[-len(decision.notes):] == [clean_warning(n) for n in decision.notes]
    assert note.driver == about
