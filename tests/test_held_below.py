"""The other direction of a wrong count (issue 35, item 4): the state records what the node's kubelet asked for when
the guard stored less (``reported``), and ``status`` shows the nodes held below it next to the Pods Pending on
volume limits. Through the whole admission chain (evaluate, the patch applied) and the pure status report."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from tests.kube import EBS, apply_response, base_csinode, kubelet_update, review
from webhook.admission.capacity import build_report, format_table, report_json
from webhook.admission.cluster import StaticClusterView
from webhook.admission.evaluation import Decision, Mode, evaluate
from webhook.admission.evaluation.next_state import held_below
from webhook.admission.held_below import HINT, held_below_reported
from webhook.admission.policy import load_policy
from webhook.admission.review import build_response, parse_review
from webhook.admission.state import STATE_ANNOTATION, EntryState, StateKeys, decode_state, encode_state

KEYS = StateKeys([b"h" * 32])
POLICY = load_policy()
T0 = datetime(2026, 11, 30, 3, 0, tzinfo=UTC)
VOLUME_LIMITS = "0/3 nodes are available: 1 node(s) exceed max volume count, 2 node(s) didn't match selector."


def put(stored: dict[str, Any], new: dict[str, Any], at: datetime) -> tuple[Decision, dict[str, Any]]:
    """The node's kubelet PUTs ``new`` over ``stored`` at ``at``: the stored object afterwards."""
    request = parse_review(json.dumps(review(stored, new)))
    decision = evaluate(request, POLICY, StaticClusterView(), at, KEYS, mode=Mode.MUTATE)
    document = build_response(request.uid, decision.response, allow_patch=True)
    result = apply_response(new, document) if decision.response.allowed else stored
    return decision.decision, result


def entry(obj: dict[str, Any]) -> EntryState:
    state = decode_state(obj["metadata"]["annotations"][STATE_ANNOTATION], obj["metadata"]["uid"], KEYS).state
    assert state is not None
    return state.entries[EBS]


def test_a_clamp_records_what_the_kubelet_asked_for_and_an_admitted_count_clears_it() -> None:
    stored = kubelet_update(base_csinode(), EBS, 23)
    decision, stored = put(stored, kubelet_update(stored, EBS, 39), T0)  # the default ceiling for m6i.large: 27
    assert decision is Decision.CLAMP
    assert (entry(stored).count, entry(stored).reported) == (27, 39)
    assert held_below_reported(27, entry(stored)) == 39

    before = json.dumps(stored)
    decision, again = put(stored, kubelet_update(stored, EBS, 39), T0 + timedelta(minutes=2))
    assert decision is Decision.CLAMP and json.dumps(again) == before, "a repeated report stays a byte-identical no-op"

    decision, lowered = put(stored, kubelet_update(stored, EBS, 25), T0 + timedelta(minutes=4))
    assert decision is Decision.ALLOW
    assert (entry(lowered).count, entry(lowered).reported) == (25, None)
    assert held_below_reported(25, entry(lowered)) is None


@pytest.mark.parametrize(
    ("asked", "final", "prev", "kubelet", "expected"),
    [
        pytest.param(39, 27, None, True, 39, id="the kubelet asked for more than the guard stored"),
        pytest.param(27, 27, None, True, None, id="stored what it asked for"),
        pytest.param(2147483647, 27, None, True, None, id="the int32 cut-off is no count a driver reports"),
        pytest.param(None, 27, None, True, None, id="unbounded is no count a driver reports"),
        pytest.param(39, None, None, True, None, id="nothing is held below when the count is unbounded"),
        pytest.param(20, 20, EntryState(27, T0, reported=39), False, 39, id="another writer keeps the last report"),
        pytest.param(40, 40, EntryState(27, T0, reported=39), False, None, id="unless it stores as much or more"),
    ],
)
def test_which_report_a_written_entry_records(
    asked: int | None, final: int | None, prev: EntryState | None, kubelet: bool, expected: int | None
) -> None:
    assert held_below(asked, final, prev, kubelet=kubelet) == expected


@pytest.mark.parametrize(
    ("stored", "state", "expected"),
    [
        pytest.param(27, EntryState(27, T0, reported=39), 39, id="held at the count the clamp stored"),
        pytest.param(30, EntryState(27, T0, reported=39), None, id="the count changed since without the guard"),
        pytest.param(27, EntryState(27, T0), None, id="nothing reported"),
        pytest.param(None, EntryState(None, T0, reported=39), None, id="unbounded"),
        pytest.param(27, None, None, id="no state"),
    ],
)
def test_held_below_reported(stored: int | None, state: EntryState | None, expected: int | None) -> None:
    assert held_below_reported(stored, state) == expected


def csinode(name: str, count: int, state: EntryState) -> dict[str, Any]:
    from webhook.admission.state import GuardState  # noqa: PLC0415

    value = encode_state(GuardState(uid=f"uid-{name}", entries={EBS: state}), KEYS)
    return {
        "metadata": {"name": name, "uid": f"uid-{name}", "annotations": {STATE_ANNOTATION: value}},
        "spec": {"drivers": [{"name": EBS, "nodeID": f"i-{name}", "allocatable": {"count": count}}]},
    }


def pending(message: str) -> dict[str, Any]:
    return {
        "metadata": {"name": "p"},
        "status": {
            "phase": "Pending",
            "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}],
        },
    }


def test_status_lists_the_nodes_held_below_the_report_per_driver_with_the_pending_pods() -> None:
    csinodes = [csinode("a", 27, EntryState(27, T0, reported=39)), csinode("b", 25, EntryState(25, T0))]
    report = build_report(
        csinodes,
        [],
        [],
        [pending(VOLUME_LIMITS), pending("0/3 nodes: insufficient cpu")],
        policy=POLICY,
        now=T0,
        keys=KEYS,
    )
    text = format_table(report, T0)
    assert "held 27/39 reported" in text
    assert (
        "Held below the driver's report (1 pods pending on volume limits):\n  ebs.csi.aws.com: 1 node(s): a 27/39\n"
        in text
    )
    assert f"  hint: {HINT}\n" in text
    assert report_json(report)["heldBelowReported"] == {
        "drivers": {EBS: [{"node": "a", "held": 27, "reported": 39}]},
        "pendingOnVolumeLimits": 1,
    }


def test_status_says_nothing_of_held_nodes_when_none_is_held() -> None:
    report = build_report(
        [csinode("b", 25, EntryState(25, T0))], [], [], [pending(VOLUME_LIMITS)], policy=POLICY, now=T0, keys=KEYS
    )
    assert "Held below" not in format_table(report, T0)
    assert report_json(report)["heldBelowReported"] == {"drivers": {}, "pendingOnVolumeLimits": 1}
