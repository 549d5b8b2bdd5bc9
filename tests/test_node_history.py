"""What the guard trusted about a node outlives its CSINode (webhook/admission/node_history.py): the signed record
kept by node name, and a re-created CSINode judged from it."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from tests.kube import EBS, NODE, base_csinode, kubelet_update, review
from webhook.admission.cluster import RetainedState, StaticClusterView
from webhook.admission.evaluation import evaluate
from webhook.admission.node_history import (
    NAME_PREFIX,
    decode_history,
    encode_history,
    history_object_name,
    retained_guard_state,
)
from webhook.admission.policy import load_policy
from webhook.admission.review import parse_review
from webhook.admission.state import EntryState, GuardState, StateKeys, decode_state, encode_state
from webhook.kube.watch.histories import make_history_parser

KEYS = StateKeys([b"k" * 32])
OTHER_KEYS = StateKeys([b"o" * 32])
NOW = datetime(2026, 12, 4, 19, 0, tzinfo=UTC)


def retained(count: int = 10, uid: str = "old-uid", node: str = NODE, keys: StateKeys = KEYS) -> RetainedState:
    state = GuardState(uid, {EBS: EntryState(count, NOW - timedelta(seconds=5))}, sequence=3)
    return RetainedState(node, uid, "", encode_state(state, keys), NOW)


def test_a_record_reads_back_for_its_node_and_its_state_verifies_for_the_old_uid() -> None:
    value = encode_history(retained(), KEYS)
    back = decode_history(value, NODE, KEYS)
    assert back == retained()
    state = retained_guard_state(back, KEYS)
    assert state is not None and state.entries[EBS].count == 10 and state.sequence == 3


@pytest.mark.parametrize("edit", [
    pytest.param(lambda d: d.update({"node": "node-b"}), id="another node's name"),
    pytest.param(lambda d: d.update({"uid": "x"}), id="another uid"),
    pytest.param(lambda d: d.update({"savedAt": "2030-01-01T00:00:00.000Z"}), id="a later time"),
    pytest.param(lambda d: d.pop("sig"), id="no signature"),
])
def test_an_edited_record_is_not_read(edit: Any) -> None:
    doc = json.loads(encode_history(retained(), KEYS))
    edit(doc)
    assert decode_history(json.dumps(doc), NODE, KEYS) is None


def test_a_record_signed_with_another_key_or_for_another_node_is_not_read() -> None:
    assert decode_history(encode_history(retained(), OTHER_KEYS), NODE, KEYS) is None
    assert decode_history(encode_history(retained(), KEYS), "node-b", KEYS) is None
    assert decode_history("not json", NODE, KEYS) is None


def test_a_record_whose_state_was_signed_with_another_key_yields_no_state() -> None:
    record = retained(keys=OTHER_KEYS)
    assert retained_guard_state(record, KEYS) is None


def test_the_object_name_is_bounded() -> None:
    assert history_object_name("node-a") == NAME_PREFIX + "node-a"
    long = "n" * 253
    assert len(history_object_name(long)) <= 253 and history_object_name(long).startswith(NAME_PREFIX)


def test_the_watch_parser_keeps_only_a_record_under_its_nodes_name() -> None:
    parse = make_history_parser(KEYS)
    value = encode_history(retained(), KEYS)
    good = {"metadata": {"name": history_object_name(NODE)}, "data": {"record": value}}
    moved = {"metadata": {"name": history_object_name("node-b")}, "data": {"record": value}}
    assert parse(good) == retained()
    assert parse(moved) is None, "a record copied under another node's name"
    assert parse({"metadata": {"name": history_object_name(NODE)}, "data": {}}) is None


# --- a re-created CSINode is judged from the node's history ------------------------------------------------------


def _register(cluster: StaticClusterView, count: int, *, operation: str = "UPDATE") -> tuple[int | None, Any]:
    stored = base_csinode()
    stored["metadata"]["uid"] = "new-uid"
    new = kubelet_update(stored, EBS, count)
    request = parse_review(json.dumps(review(stored, new, operation=operation)))
    decision = evaluate(request, load_policy(), cluster, NOW, KEYS)
    [change] = [c for c in decision.changes if c.change.driver == EBS]
    return change.final, decision


def test_a_registration_on_a_recreated_csinode_starts_from_the_retained_count() -> None:
    """The held increase of the node's old CSINode (10) is not lifted by deleting and re-creating it."""
    cluster = StaticClusterView(retained={NODE: retained(10)})
    final, decision = _register(cluster, 26)
    assert final == 10, "paced from the retained count, as a re-registration on the same object is"
    assert decision.response.allowed, "clamped, never refused"


def test_without_history_the_same_registration_is_a_first_registration() -> None:
    final, _ = _register(StaticClusterView(), 26)
    assert final == 26


def test_kubelets_own_recreation_with_the_same_count_passes_unchanged() -> None:
    final, decision = _register(StaticClusterView(retained={NODE: retained(10)}), 10)
    assert final == 10 and decision.response.allowed


def test_the_state_written_on_the_new_object_carries_the_retained_history_forward() -> None:
    _, decision = _register(StaticClusterView(retained={NODE: retained(10)}), 10)
    states = [op["value"] for op in decision.response.patch if "state" in op["path"]]
    if states:  # a state is written only when there is something to record
        state = decode_state(states[-1], "new-uid", KEYS).state
        assert state is not None and state.entries[EBS].count == 10


# --- the leader's writer, against the API-wire test server --------------------------------------------------------


def _record(node: str, uid: str, count: int) -> Any:
    from webhook.admission.csinode import parse_csinode  # noqa: PLC0415
    from webhook.admission.state import STATE_ANNOTATION  # noqa: PLC0415
    from webhook.kube.watch.csinodes import make_parser  # noqa: PLC0415

    state = GuardState(uid, {EBS: EntryState(count, NOW)}, sequence=1)
    obj = base_csinode()
    obj["metadata"].update({"name": node, "uid": uid, "resourceVersion": "1",
                            "annotations": {STATE_ANNOTATION: encode_state(state, KEYS)}})
    parsed = make_parser(KEYS)(obj)
    assert parsed is not None and parsed.decoded.state is not None, parse_csinode(obj)
    return parsed


def test_the_leader_writes_a_record_once_and_deletes_old_records_of_gone_nodes(kubeconfig: str, apiserver: Any) -> None:
    from webhook.admission.node_history import RETENTION_SECONDS  # noqa: PLC0415
    from webhook.kube.kubeapi import KubeClient, load_api_client  # noqa: PLC0415
    from webhook.kube.node_history import HistoryWriter  # noqa: PLC0415

    held: dict[str, RetainedState] = {}
    writer = HistoryWriter(KubeClient(load_api_client(kubeconfig)), "csinode-guard", KEYS, held.get)
    assert writer.sync([_record("node-a", "uid-a", 10)], NOW) == 1
    stored = apiserver.get("configmaps", history_object_name("node-a"), "csinode-guard")
    back = make_history_parser(KEYS)(stored)
    assert back is not None and back.uid == "uid-a" and retained_guard_state(back, KEYS).entries[EBS].count == 10
    held["node-a"] = back
    assert writer.sync([_record("node-a", "uid-a", 10)], NOW) == 0, "nothing new: no write"
    assert writer.sync([_record("node-a", "uid-b", 10)], NOW) == 1, "a re-created CSINode's state: written"

    old = RetainedState("gone", "uid-g", "", retained(uid="uid-g", node="gone").state,
                        NOW - timedelta(seconds=RETENTION_SECONDS + 1))
    recent = RetainedState("away", "uid-w", "", retained(uid="uid-w", node="away").state, NOW - timedelta(days=1))
    for held_record in (old, recent):
        apiserver.create("configmaps", {"metadata": {"name": history_object_name(held_record.node),
                                                     "namespace": "csinode-guard"},
                                        "data": {"record": encode_history(held_record, KEYS)}}, "csinode-guard")
    writer.sync([_record("node-a", "uid-b", 10)], NOW, [old, recent])
    assert apiserver.get("configmaps", history_object_name("gone"), "csinode-guard") is None
    assert apiserver.get("configmaps", history_object_name("away"), "csinode-guard") is not None
