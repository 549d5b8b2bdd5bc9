"""The automatic brake's pure parts (webhook.admission.brake): the evidence, the threshold, the quiet period with a
clock given as an argument, the signed record, the approver's release request, and the one judgement while a brake
is engaged (admission holds increases, a registration is clamped, the audit restores a count raised in the window)."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import jsonpatch
import pytest
from kube import EBS, KUBELET, NODE, base_csinode, driver_entry, kubelet_update, review

from webhook.admission.brake import (
    QUIET_PERIOD,
    RaisedNode,
    ReleaseRequest,
    admitted_increases,
    brake_json,
    crosses_threshold,
    decide_brake,
    decode_brakes,
    encode_brakes,
    encode_release_request,
    honour_release,
    next_raised,
    parse_release_request,
    quiet_release_at,
)
from webhook.admission.cluster import AttachError, Brake, StaticClusterView
from webhook.admission.csinode import parse_csinode
from webhook.admission.evaluation import evaluate
from webhook.admission.evaluation.stored import judge_stored
from webhook.admission.policy import BrakeSettings, load_policy
from webhook.admission.review import parse_review
from webhook.admission.state import (
    STATE_ANNOTATION,
    EntryState,
    GuardState,
    Raised,
    StateKeys,
    decode_state,
    encode_state,
)
from webhook.commands.brake import format_brakes

T0 = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)
KEYS = StateKeys([b"brake-test-key-0123456789abcdef0"])
SETTINGS = BrakeSettings(enabled=True, lookback=3600.0, min_nodes=3, min_fraction=0.5, quiet_period=1800.0)
NODES = [f"node-{i}" for i in range(6)]


def raised(nodes: list[str], at: datetime = T0 - timedelta(minutes=10)) -> list[RaisedNode]:
    return [RaisedNode(n, EBS, 20, 30, at) for n in nodes]


def errors_on(failing: dict[str, list[AttachError]]) -> Any:
    def lookup(node: str, driver: str, since: datetime) -> list[AttachError]:
        return [e for e in failing.get(node, []) if driver == EBS and e.time >= since]

    return lookup


def failure(code: int | None, at: datetime = T0 - timedelta(minutes=5), name: str = "csi-va") -> AttachError:
    return AttachError(code=code, time=at, volume_attachment=name, message="attach failed")


def engaged_brake(last_failure: datetime = T0 - timedelta(minutes=5)) -> Brake:
    brake = decide_brake(EBS, SETTINGS, None, raised(NODES), errors_on({n: [failure(8, last_failure)]
                                                                       for n in NODES[:3]}), None, T0)
    assert brake is not None and brake.engaged
    return brake


@pytest.mark.parametrize(
    ("raised_nodes", "failed", "engages"),
    [
        pytest.param(6, 3, True, id="minNodes failed nodes engage it"),
        pytest.param(6, 2, False, id="two of six is neither minNodes nor half"),
        pytest.param(4, 2, True, id="two of four is half: minFraction engages it"),
        pytest.param(5, 2, False, id="two of five is below half"),
        pytest.param(1, 1, False, id="one node is never a fraction"),
        pytest.param(2, 1, False, id="one of two is half, but one failed node is never enough"),
        pytest.param(0, 0, False, id="no increases, no brake"),
    ],
)
def test_the_threshold_is_minnodes_or_a_fraction_of_at_least_two(raised_nodes: int, failed: int,
                                                                  engages: bool) -> None:
    assert crosses_threshold(SETTINGS, raised_nodes, failed) is engages


def test_capacity_failures_after_increases_on_three_of_six_nodes_engage_the_brake() -> None:
    failing = {n: [failure(8, name=f"csi-{n}")] for n in NODES[:3]}
    brake = decide_brake(EBS, SETTINGS, None, raised(NODES), errors_on(failing), None, T0)
    assert brake is not None
    assert brake.engaged and brake.engaged_at == T0
    assert brake.window_start == T0 - timedelta(hours=1)
    assert [e.node for e in brake.evidence] == NODES[:3]
    assert [e.volume_attachment for e in brake.evidence] == [f"csi-{n}" for n in NODES[:3]]
    assert brake.raised_nodes == 6
    assert brake.last_failure_at == T0 - timedelta(minutes=5)


@pytest.mark.parametrize(
    "code",
    [pytest.param(9, id="FailedPrecondition"), pytest.param(4, id="DeadlineExceeded"),
     pytest.param(7, id="PermissionDenied"), pytest.param(None, id="no errorCode")],
)
def test_other_error_classes_engage_nothing(code: int | None) -> None:
    failing = {n: [failure(code)] for n in NODES}
    assert decide_brake(EBS, SETTINGS, None, raised(NODES), errors_on(failing), None, T0) is None


def test_a_failure_before_the_increase_is_not_evidence() -> None:
    failing = {n: [failure(8, T0 - timedelta(minutes=30))] for n in NODES}
    assert decide_brake(EBS, SETTINGS, None, raised(NODES, T0 - timedelta(minutes=10)), errors_on(failing), None,
                        T0) is None


def test_a_disabled_brake_engages_nothing() -> None:
    failing = {n: [failure(8)] for n in NODES}
    settings = replace(SETTINGS, enabled=False)
    assert decide_brake(EBS, settings, None, raised(NODES), errors_on(failing), None, T0) is None


def test_the_quiet_period_counts_from_the_last_capacity_failure_anywhere() -> None:
    brake = engaged_brake(T0 - timedelta(minutes=5))
    none = errors_on({})
    # 29 minutes after the last failure: still engaged.
    at = brake.last_failure_at + timedelta(minutes=29)
    assert decide_brake(EBS, SETTINGS, brake, (), none, None, at) == brake
    # A newer failure (another node) moves the quiet period.
    newer = brake.last_failure_at + timedelta(minutes=20)
    moved = decide_brake(EBS, SETTINGS, brake, (), none, newer, at)
    assert moved is not None and moved.engaged and moved.last_failure_at == newer
    still = decide_brake(EBS, SETTINGS, moved, (), none, newer, newer + timedelta(minutes=29))
    assert still is not None and still.engaged
    # The full quiet period after the last failure: released.
    released = decide_brake(EBS, SETTINGS, moved, (), none, newer, newer + timedelta(minutes=30))
    assert released is not None and not released.engaged
    assert released.released_by == QUIET_PERIOD


def test_the_release_time_shown_is_when_the_quiet_period_releases_the_brake() -> None:
    brake = engaged_brake(T0 - timedelta(minutes=5))
    release = quiet_release_at(brake, SETTINGS)
    assert release == brake.last_failure_at + timedelta(minutes=30)
    # The leader's own decision agrees: engaged a second before, released at that time.
    before = decide_brake(EBS, SETTINGS, brake, (), errors_on({}), None, release - timedelta(seconds=1))
    assert before is not None and before.engaged
    at = decide_brake(EBS, SETTINGS, brake, (), errors_on({}), None, release)
    assert at is not None and not at.engaged
    assert quiet_release_at(at, SETTINGS) is None
    assert quiet_release_at(brake, replace(SETTINGS, enabled=False)) is None  # released at the next pass
    assert brake_json(brake, SETTINGS)["releasesAt"] == "2026-12-04T12:25:00.000Z"
    assert "releasesAt" not in brake_json(brake)  # no policy, no claim


def test_the_brake_table_says_when_it_releases_and_its_columns_fit_a_long_driver_name() -> None:
    long_driver = "a-very-long-vendor-name.block-storage.region-specific.csi.example.com"
    brake = replace(engaged_brake(T0 - timedelta(minutes=5)), driver=long_driver)
    released = replace(engaged_brake(), driver=EBS, released_at=T0, released_by="bob", release_reason="fixed")
    table = format_brakes({long_driver: brake, EBS: released}, T0, True, SETTINGS)
    header, engaged_row, *rest = table.splitlines()
    released_row = next(line for line in rest if line.startswith(EBS))
    for column in ("STATE", "SINCE", "EVIDENCE", "DETAIL"):
        at = header.index(column)
        assert engaged_row[at - 1] == " " and engaged_row[at] != " ", (column, table)
        assert released_row[at - 1] == " " and released_row[at] != " ", (column, table)
    assert engaged_row.startswith(long_driver + "   engaged")
    assert "releases it at 2026-12-04T12:25:00.000Z (in 25m) unless another one comes" in engaged_row
    assert "by bob: fixed" in released_row
    past = format_brakes({EBS: replace(brake, driver=EBS)}, T0 + timedelta(hours=1), True, SETTINGS)
    assert "the leader releases it at its next pass" in past
    assert "releases it" not in format_brakes({EBS: replace(brake, driver=EBS)}, T0, True)


def test_failures_before_a_release_do_not_engage_it_again() -> None:
    failing = {n: [failure(8)] for n in NODES[:3]}
    brake = engaged_brake()
    released = replace(brake, released_at=T0 + timedelta(minutes=40), released_by=QUIET_PERIOD)
    later = T0 + timedelta(minutes=41)
    assert decide_brake(EBS, SETTINGS, released, raised(NODES), errors_on(failing), None, later) == released
    again = {n: [failure(8, T0 + timedelta(minutes=40, seconds=30))] for n in NODES[3:]}
    engaged = decide_brake(EBS, SETTINGS, released, raised(NODES), errors_on(again), None, later)
    assert engaged is not None and engaged.engaged and engaged.engaged_at == later


def test_disabling_the_brake_in_the_policy_releases_an_engaged_one() -> None:
    released = decide_brake(EBS, replace(SETTINGS, enabled=False), engaged_brake(), (), errors_on({}), None, T0)
    assert released is not None and not released.engaged and released.released_by == "policy"


def test_admitted_increases_come_from_the_signed_states_raised_inside_the_lookback() -> None:
    def state(raised_at: datetime, count: int = 30) -> GuardState:
        return GuardState(uid="u", entries={EBS: EntryState(count, raised_at, raised=Raised(raised_at, 20))})

    states = [("a", state(T0 - timedelta(minutes=5))), ("b", state(T0 - timedelta(hours=2))),
              ("c", state(T0 - timedelta(minutes=5), count=20)), ("d", None)]
    found = admitted_increases(states, T0 - timedelta(hours=1))
    assert found == {EBS: [RaisedNode("a", EBS, 20, 30, T0 - timedelta(minutes=5))]}


@pytest.mark.parametrize(
    ("previous", "old", "final", "expected"),
    [
        pytest.param(None, 20, 30, Raised(T0, 20), id="an increase starts one"),
        pytest.param(Raised(T0 - timedelta(minutes=5), 10), 20, 30, Raised(T0 - timedelta(minutes=5), 10),
                     id="a second increase inside the lookback keeps the first one's count"),
        pytest.param(Raised(T0 - timedelta(hours=2), 10), 20, 30, Raised(T0, 20),
                     id="one older than the lookback starts again"),
        pytest.param(Raised(T0 - timedelta(minutes=5), 20), 30, 20, None, id="back at the trusted count clears it"),
        pytest.param(Raised(T0 - timedelta(minutes=5), 20), 30, 25, Raised(T0 - timedelta(minutes=5), 20),
                     id="a decrease above the trusted count keeps it"),
        pytest.param(None, None, 30, None, id="from unbounded there is nothing to restore"),
        pytest.param(None, 20, None, Raised(T0, 20), id="to unbounded is an increase"),
    ],
)
def test_next_raised(previous: Raised | None, old: int | None, final: int | None, expected: Raised | None) -> None:
    assert next_raised(previous, old, final, T0, 3600.0) == expected


def test_the_record_round_trips_and_an_edited_record_is_ignored() -> None:
    brake = engaged_brake()
    value = encode_brakes({EBS: brake}, KEYS)
    assert decode_brakes(value, KEYS) == {EBS: brake}
    doc = json.loads(value)
    doc["brakes"][EBS]["releasedAt"] = "2026-12-04T12:01:00.000Z"
    assert decode_brakes(json.dumps(doc), KEYS) is None
    assert decode_brakes(value, StateKeys([b"another-key-0123456789abcdef0123"])) is None


def test_a_release_request_is_honoured_only_for_the_engagement_it_names() -> None:
    brake = engaged_brake()
    request = ReleaseRequest(EBS, brake.engaged_at, "driver fixed in v1.38.1", "alice")
    assert parse_release_request(encode_release_request(request)) == request
    released = honour_release(brake, request, T0 + timedelta(minutes=1))
    assert released is not None and not released.engaged
    assert (released.released_by, released.release_reason) == ("alice", "driver fixed in v1.38.1")
    assert honour_release(brake, request._replace(engaged_at=T0 - timedelta(days=1)), T0) is None
    assert honour_release(released, request, T0) is None
    assert parse_release_request('{"driver": "x"}') is None


# --- the one judgement while engaged ---------------------------------------------------------------------------

POLICY = load_policy()


def stored(count: int, state: GuardState | None) -> dict[str, Any]:
    obj = base_csinode()
    obj["spec"]["drivers"].append(driver_entry(EBS, count))
    if state is not None:
        obj["metadata"].setdefault("annotations", {})[STATE_ANNOTATION] = encode_state(state, KEYS)
    return obj


def raised_state(uid: str, count: int = 26, before: int = 20, at: datetime = T0 - timedelta(minutes=10)) \
        -> GuardState:
    return GuardState(uid=uid, entries={EBS: EntryState(count, at, raised=Raised(at, before))}, sequence=3)


def cluster(brake: Brake | None) -> StaticClusterView:
    labels = {"node.kubernetes.io/instance-type": "m6i.large"}
    return StaticClusterView(nodes={NODE: {"labels": labels}}, brakes={EBS: brake} if brake else {})


def test_the_audit_restores_a_count_raised_inside_the_window_to_the_count_trusted_before() -> None:
    uid = base_csinode()["metadata"]["uid"]
    node = parse_csinode(stored(26, raised_state(uid)))
    decoded = decode_state(node.annotations[STATE_ANNOTATION], uid, KEYS)
    assert judge_stored(node, POLICY, cluster(None), T0, KEYS, decoded=decoded).allowed(EBS) == 26
    judged = judge_stored(node, POLICY, cluster(engaged_brake()), T0, KEYS, decoded=decoded)
    assert judged.allowed(EBS) == 20
    raised_before_window = parse_csinode(stored(26, raised_state(uid, at=T0 - timedelta(hours=3))))
    assert judge_stored(raised_before_window, POLICY, cluster(engaged_brake()), T0, KEYS).allowed(EBS) == 26


def test_while_engaged_the_kubelets_increase_is_held_at_the_stored_count() -> None:
    uid = base_csinode()["metadata"]["uid"]
    old = stored(20, GuardState(uid=uid, entries={EBS: EntryState(20, T0 - timedelta(hours=5))}, sequence=2))
    new = kubelet_update(old, EBS, 24)
    request = parse_review(json.dumps(review(old, new)))
    free = evaluate(request, POLICY, cluster(None), T0, KEYS)
    assert free.response.allowed and [c.final for c in free.changes] == [24]
    held = evaluate(request, POLICY, cluster(engaged_brake()), T0, KEYS)
    assert held.response.allowed
    assert [c.final for c in held.changes] == [20]
    assert "count-rollback" in held.fired_rules
    assert any("brake" in (w or "") for w in held.response.warnings or ())


def test_while_engaged_a_registration_above_the_last_trusted_count_is_clamped_and_one_below_passes() -> None:
    uid = base_csinode()["metadata"]["uid"]
    old = stored(20, GuardState(uid=uid, entries={EBS: EntryState(20, T0 - timedelta(hours=5))}, sequence=2))
    removed = copy.deepcopy(old)
    removed["spec"]["drivers"] = [d for d in removed["spec"]["drivers"] if d["name"] != EBS]
    for count, final in ((30, 20), (18, 18)):
        registered = kubelet_update(removed, EBS, count)
        decision = evaluate(parse_review(json.dumps(review(removed, registered, user=KUBELET))), POLICY,
                            cluster(engaged_brake()), T0, KEYS)
        assert decision.response.allowed
        assert [c.final for c in decision.changes] == [final]


def test_a_failure_stamped_in_the_second_of_the_increase_is_evidence() -> None:
    """attachError.time has whole seconds; the increase's time has fractions: a failure in the same second counts."""
    increase = T0 - timedelta(minutes=10, microseconds=-496_000)  # 11:50:00.496
    failing = {n: [failure(8, increase.replace(microsecond=0))] for n in NODES[:3]}
    brake = decide_brake(EBS, SETTINGS, None, raised(NODES, increase), errors_on(failing), None, T0)
    assert brake is not None and brake.engaged
    earlier = {n: [failure(8, increase.replace(microsecond=0) - timedelta(seconds=1))] for n in NODES[:3]}
    assert decide_brake(EBS, SETTINGS, None, raised(NODES, increase), errors_on(earlier), None, T0) is None


def test_the_audits_restore_is_recorded_in_the_state_and_clears_raised() -> None:
    """The leader's restore (26 -> 20, the count trusted before the increase) is no change to judge under the brake,
    yet the state must say what etcd holds: recorded at 20, ``raised`` cleared."""
    uid = base_csinode()["metadata"]["uid"]
    old = stored(26, raised_state(uid))
    restored = copy.deepcopy(old)
    for entry in restored["spec"]["drivers"]:
        if entry["name"] == EBS:
            entry["allocatable"] = {"count": 20}
    guard = "system:serviceaccount:csinode-guard:csinode-guard"  # a writer the bundled policy lists
    doc = review(old, restored, user=guard, groups=["system:serviceaccounts", "system:authenticated"])
    decision = evaluate(parse_review(json.dumps(doc)), POLICY, cluster(engaged_brake()), T0, KEYS)
    assert decision.response.allowed
    final = jsonpatch.apply_patch(restored, list(decision.response.patch))
    state = decode_state(final["metadata"]["annotations"][STATE_ANNOTATION], uid, KEYS).state
    assert state is not None
    assert (state.entries[EBS].count, state.entries[EBS].raised) == (20, None)


def test_while_engaged_a_first_registration_is_clamped_to_the_count_trusted_before_the_failed_increases() -> None:
    """A node that joins during the incident has no count of its own to hold: it registers at most the counts
    trusted before the increases whose attaches failed (20 here), never what the driver now reports."""
    fresh = base_csinode()  # no state, no history: a new node
    fresh["spec"]["drivers"] = [d for d in fresh["spec"]["drivers"] if d["name"] != EBS]
    for count, final in ((40, 20), (12, 12)):
        registered = kubelet_update(fresh, EBS, count)
        doc = review(fresh, registered, user=KUBELET)
        held = evaluate(parse_review(json.dumps(doc)), POLICY, cluster(engaged_brake()), T0, KEYS)
        assert held.response.allowed
        assert [c.final for c in held.changes] == [final]
    free = evaluate(parse_review(json.dumps(review(fresh, kubelet_update(fresh, EBS, 25), user=KUBELET))), POLICY,
                    cluster(None), T0, KEYS)
    assert [c.final for c in free.changes] == [25]
