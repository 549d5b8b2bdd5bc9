"""Who set a Node label (webhook/admission/label_provenance.py): the signed record, what each write makes of it, and
what a ceiling may then be selected by -- through the pure functions, the evaluation with a cluster view, and the
server's /node-labels endpoint over HTTPS."""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime
from typing import Any

import pytest

from tests.kube import EBS, NODE, base_csinode, kubelet_update, review
from webhook.admission.cluster import StaticClusterView
from webhook.admission.evaluation import evaluate
from webhook.admission.label_provenance import (
    MAX_VOUCHED,
    PROVENANCE_ANNOTATION,
    LabelWrite,
    ceiling_labels,
    decode_provenance,
    encode_provenance,
    provenance_patch,
    record_label_write,
    vouched_labels,
)
from webhook.admission.policy import load_policy
from webhook.admission.review import parse_review
from webhook.admission.state import StateKeys

KEYS = StateKeys([b"k" * 32])
OTHER_KEYS = StateKeys([b"o" * 32])
TYPE = "node.kubernetes.io/instance-type"
SAFE = "node-restriction.kubernetes.io/instance-type"


def write(*, create: bool = False, by_node: bool = False, old: dict[str, str] | None = None,
          new: dict[str, str] | None = None, record: str | None = None, uid: str = "uid-1") -> LabelWrite:
    return LabelWrite("node-a", "" if create else uid, create, by_node, old or {}, new or {}, record)


# --- the record ------------------------------------------------------------------------------------------------


def test_a_record_reads_back_for_its_node_and_uid_only() -> None:
    value = encode_provenance("node-a", "uid-1", {TYPE: "m6i.large"}, KEYS)
    assert decode_provenance(value, "node-a", "uid-1", KEYS) == {TYPE: "m6i.large"}
    assert decode_provenance(value, "node-b", "uid-1", KEYS) == {}, "another node's record is not this node's"
    assert decode_provenance(value, "node-a", "uid-2", KEYS) == {}, "a Node re-created under the name starts empty"
    assert decode_provenance(value, "node-a", "uid-1", OTHER_KEYS) == {}, "signed with another key"


def test_a_record_made_at_create_has_no_uid_yet_and_reads_for_the_node_of_that_name() -> None:
    value = encode_provenance("node-a", "", {TYPE: "m6i.large"}, KEYS)
    assert decode_provenance(value, "node-a", "uid-9", KEYS) == {TYPE: "m6i.large"}


@pytest.mark.parametrize("edit", [
    pytest.param(lambda d: d["labels"].update({TYPE: "c7i.48xlarge"}), id="a raised value"),
    pytest.param(lambda d: d["labels"].update({"extra": "x"}), id="an added label"),
    pytest.param(lambda d: d.update({"node": "node-b"}), id="another node's name"),
    pytest.param(lambda d: d.pop("sig"), id="no signature"),
    pytest.param(lambda d: d.update({"v": 2}), id="another format version"),
    pytest.param(lambda d: d.update({"labels": {TYPE: 3}}), id="a value that is not a string"),
])
def test_an_edited_record_vouches_for_nothing(edit: Any) -> None:
    doc = json.loads(encode_provenance("node-a", "uid-1", {TYPE: "m6i.large"}, KEYS))
    edit(doc)
    assert decode_provenance(json.dumps(doc), "node-a", "uid-1", KEYS) == {}


@pytest.mark.parametrize("value", ["", "not json", "[]", "{" * 5000, "x" * 20000, None])
def test_garbage_vouches_for_nothing_and_raises_nothing(value: str | None) -> None:
    assert decode_provenance(value, "node-a", "uid-1", KEYS) == {}


# --- what a write makes of it -----------------------------------------------------------------------------------


def test_a_node_that_creates_its_own_node_with_an_instance_type_vouches_for_nothing() -> None:
    """Attack 3: the kubelet POSTs its Node with a bigger instance type than it is."""
    assert record_label_write(write(create=True, by_node=True, new={TYPE: "c7i.48xlarge"}), KEYS) == {}


def test_a_label_another_identity_sets_is_vouched_for() -> None:
    """The cloud-controller-manager labels a new Node (after the plugin registered, or before)."""
    assert record_label_write(write(old={}, new={TYPE: "m6i.large"}), KEYS) == {TYPE: "m6i.large"}
    assert record_label_write(write(create=True, new={TYPE: "m6i.large"}), KEYS) == {TYPE: "m6i.large"}


def test_a_node_that_relabels_itself_loses_the_vouched_value() -> None:
    """Attack 2's first step: the node sets c7i.48xlarge over the cloud's m6i.large."""
    record = encode_provenance("node-a", "uid-1", {TYPE: "m6i.large"}, KEYS)
    after = record_label_write(write(by_node=True, old={TYPE: "m6i.large"}, new={TYPE: "c7i.48xlarge"},
                                     record=record), KEYS)
    assert after == {}


def test_a_node_labelled_before_the_guard_keeps_its_labels_and_its_first_observed_write_adopts_them() -> None:
    """Installing the guard must not drop every existing node to the unknown-type ceiling: a Node with no record
    at all was labelled before the Node entry was registered. Its first observed write starts from its labels;
    a label the node changes in that write is still its own."""
    assert ceiling_labels({TYPE: "m6i.large"}, None, "node-a", "uid-1", KEYS) == {TYPE: "m6i.large"}
    adopted = record_label_write(write(by_node=True, old={TYPE: "m6i.large", "team": "a"},
                                       new={TYPE: "m6i.large", "team": "b"}), KEYS)
    assert adopted == {TYPE: "m6i.large"}
    relabelled = record_label_write(write(by_node=True, old={TYPE: "m6i.large"}, new={TYPE: "c7i.48xlarge"}), KEYS)
    assert relabelled == {}


def test_a_node_with_a_record_gets_only_what_the_record_vouches_for() -> None:
    empty = encode_provenance("node-a", "", {}, KEYS)  # made at the node's own CREATE (attack 3)
    assert ceiling_labels({TYPE: "c7i.48xlarge"}, empty, "node-a", "uid-1", KEYS) == {}
    assert ceiling_labels({TYPE: "c7i.48xlarge"}, "forged", "node-a", "uid-1", KEYS) == {}


def test_an_unchanged_label_keeps_its_vouched_value_whoever_writes() -> None:
    record = encode_provenance("node-a", "uid-1", {TYPE: "m6i.large"}, KEYS)
    labels = {TYPE: "m6i.large", "team": "a"}
    assert record_label_write(write(by_node=True, old=labels, new={**labels, "team": "b"}, record=record),
                              KEYS) == {TYPE: "m6i.large"}


def test_a_record_forged_into_the_new_object_is_never_read() -> None:
    """The writer's own annotation does not count: only the old object's record (and the write itself)."""
    forged = encode_provenance("node-a", "uid-1", {TYPE: "c7i.48xlarge"}, OTHER_KEYS)
    w = write(by_node=True, old={TYPE: "m6i.large"}, new={TYPE: "c7i.48xlarge"}, record=None)
    patch = provenance_patch(w, {PROVENANCE_ANNOTATION: forged}, KEYS)
    [op] = patch
    assert decode_provenance(op["value"], "node-a", "uid-1", KEYS) == {}


def test_labels_the_node_cannot_set_need_no_record_and_count_as_set_by_others() -> None:
    assert record_label_write(write(new={SAFE: "m6i.large"}), KEYS) == {}
    assert vouched_labels({SAFE: "m6i.large", TYPE: "c7i.48xlarge"}, {}) == {SAFE: "m6i.large"}


def test_a_vouched_label_counts_only_with_the_value_recorded() -> None:
    assert vouched_labels({TYPE: "c7i.48xlarge"}, {TYPE: "m6i.large"}) == {}
    assert vouched_labels({TYPE: "m6i.large"}, {TYPE: "m6i.large"}) == {TYPE: "m6i.large"}


def test_the_record_is_bounded() -> None:
    labels = {f"example.com/l{i:03}": "v" for i in range(MAX_VOUCHED + 10)}
    after = record_label_write(write(new=labels), KEYS)
    assert len(after) == MAX_VOUCHED and sorted(after) == sorted(labels)[:MAX_VOUCHED]


def test_a_patch_is_empty_when_the_node_already_carries_the_record() -> None:
    w = write(old={}, new={TYPE: "m6i.large"})
    [op] = provenance_patch(w, None, KEYS)
    assert op["path"] == "/metadata/annotations"
    value = op["value"][PROVENANCE_ANNOTATION]
    assert provenance_patch(w, {PROVENANCE_ANNOTATION: value}, KEYS) == []
    [op] = provenance_patch(w, {"other": "x"}, KEYS)
    assert op == {"op": "add", "path": "/metadata/annotations/csinode-guard.io~1label-provenance", "value": value}


# --- the ceiling a registration is judged by --------------------------------------------------------------------


@pytest.fixture(scope="module")
def ebs_policy() -> Any:
    return load_policy()  # the bundled policy: EBS by instance type, 27 for an unknown type


def _registration(cluster: StaticClusterView, policy: Any, count: int) -> int | None:
    stored = base_csinode()
    request = parse_review(json.dumps(review(stored, kubelet_update(stored, EBS, count))))
    decision = evaluate(request, policy, cluster, datetime(2026, 12, 1, tzinfo=UTC), KEYS)
    [change] = [c for c in decision.changes if c.change.driver == EBS]
    return change.final


def test_a_registration_on_a_node_that_labelled_itself_is_held_to_the_unknown_type_ceiling(ebs_policy: Any) -> None:
    self_labelled = StaticClusterView(nodes={NODE: {"labels": {TYPE: "c7i.48xlarge"}, "vouchedLabels": {}}})
    cloud_labelled = StaticClusterView(nodes={NODE: {"labels": {TYPE: "c7i.48xlarge"}}})
    assert _registration(self_labelled, ebs_policy, 128) == 27
    assert _registration(cloud_labelled, ebs_policy, 128) == 128


# --- over HTTPS -------------------------------------------------------------------------------------------------


def _node_review(operation: str, user: str, new: dict[str, str], old: dict[str, str] | None,
                 old_annotations: dict[str, str] | None = None) -> dict[str, Any]:
    def node(labels: dict[str, str], annotations: dict[str, str] | None, uid: str | None) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": "node-a", "labels": labels}
        if uid:
            meta["uid"] = uid
        if annotations:
            meta["annotations"] = annotations
        return {"apiVersion": "v1", "kind": "Node", "metadata": meta}

    groups = ["system:nodes", "system:authenticated"] if user.startswith("system:node:") else ["system:authenticated"]
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": "r-1", "operation": operation, "name": "node-a",
        "kind": {"group": "", "version": "v1", "kind": "Node"},
        "resource": {"group": "", "version": "v1", "resource": "nodes"},
        "userInfo": {"username": user, "groups": groups},
        "object": node(new, None, None if operation == "CREATE" else "uid-1"),
        "oldObject": None if old is None else node(old, old_annotations, "uid-1"),
        "dryRun": False}}


def _recorded(answer: dict[str, Any]) -> dict[str, str]:
    ops = json.loads(base64.b64decode(answer["patch"]))
    [op] = ops
    value = op["value"][PROVENANCE_ANNOTATION] if isinstance(op["value"], dict) else op["value"]
    labels: dict[str, str] = json.loads(value)["labels"]
    return labels


def test_the_endpoint_records_who_set_the_label_and_never_refuses(server_factory: Any) -> None:
    server = server_factory()
    ccm = "system:serviceaccount:kube-system:cloud-node-manager"
    answer = json.loads(server.post("/node-labels", _node_review("CREATE", "system:node:node-a",
                                                                 {TYPE: "c7i.48xlarge"}, None)).data)["response"]
    assert answer["allowed"] is True and answer["uid"] == "r-1"
    assert _recorded(answer) == {}, "the node's own label is not vouched for"
    answer = json.loads(server.post("/node-labels", _node_review("UPDATE", ccm, {TYPE: "m6i.large"},
                                                                 {TYPE: "c7i.48xlarge"})).data)["response"]
    assert answer["allowed"] is True and _recorded(answer) == {TYPE: "m6i.large"}
    stale = json.dumps({"v": 1, "node": "node-a", "uid": "uid-1", "labels": {TYPE: "c7i.48xlarge"}, "sig": "AAAA"})
    answer = json.loads(server.post("/node-labels", _node_review(
        "UPDATE", "system:node:node-a", {TYPE: "c7i.48xlarge"}, {TYPE: "c7i.48xlarge"},
        {PROVENANCE_ANNOTATION: stale})).data)["response"]
    assert answer["allowed"] is True and _recorded(answer) == {}, "a record the guard did not sign vouches nothing"
    assert server.post("/node-labels", b"{not json").status == 400
