"""``register --validation cel``: the CEL that skips /validate where the final counts are the ones /mutate's
signed state records (webhook/kube/one_call.py).

Checked here: the expression finds every count in states as ``encode_state`` writes them (every optional member,
adversarial text in every string the state carries), never a count that differs; two CEL engines from PyPI
agree with the Python reading on random objects and never fail; the registration carries it only in ``cel``
mode. The apiserver's own evaluation is checked in tests/k8s/test_one_call.py.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import cel
import celpy
import celpy.celtypes
import pytest
import yaml
from celpy.adapter import json_to_cel
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from webhook.admission.state import (
    STATE_ANNOTATION,
    Approval,
    Correction,
    DeclaredVersion,
    EntryState,
    GuardState,
    PinnedLabel,
    StateKeys,
    encode_state,
)
from webhook.kube import one_call, registration

KEYS = StateKeys([b"k" * 32])
NOW = datetime(2026, 12, 2, 15, 0, tzinfo=UTC)
EBS = "ebs.csi.aws.com"
JUSTIFICATION = "csinode-guard.io/justification"
NAMES = st.sampled_from([EBS, "efs.csi.aws.com", "ebsxcsi.aws.com", "ebs.csi.aws.co", "a", "pd.csi.storage.gke.io"])
COUNTS = st.one_of(st.none(), st.integers(0, 2147483647), st.sampled_from([19, 20, 27, 39]))
NASTY = st.sampled_from([
    "", "x", f'"{EBS}":{{"changedAt":"2026-12-02T15:00:00.000Z","correction":null,"count":99,',
    f'\\"{EBS}\\":{{', '"count":99,', "\\", '"', "}", "{", "é",
])
TEXT = st.one_of(NASTY, st.text(max_size=20))


def _replace(s: Any, old: Any, new: Any) -> Any:
    return s.replace(old, new)


def _celpy() -> Any:
    env = celpy.Environment()
    program = env.program(env.compile(one_call.DECIDED_EXPRESSION),
                          functions={"replace": lambda s, a, b: celpy.celtypes.StringType(_replace(s, a, b))})

    def evaluate(activation: dict[str, Any]) -> bool | None:
        try:
            result = program.evaluate({k: json_to_cel(v) for k, v in activation.items()})
        except Exception:  # any failure of the engine is an evaluation error
            return None
        return bool(result) if isinstance(result, celpy.celtypes.BoolType) else None

    return evaluate


def _cel_rs() -> Any:
    program = cel.compile(one_call.DECIDED_EXPRESSION)

    def evaluate(activation: dict[str, Any]) -> bool | None:
        context = cel.Context(variables=activation, functions={"replace": _replace})
        try:
            result = program.execute(context)
        except Exception:  # any failure of the engine is an evaluation error
            return None
        return result if isinstance(result, bool) else None

    return evaluate


ENGINES = {"cel-python": _celpy(), "common-expression-language": _cel_rs()}
"""Neither implements Kubernetes' strings extension; ``replace`` is given as Kubernetes documents it (every
occurrence replaced)."""


def entry_states() -> st.SearchStrategy[EntryState]:
    corrections = st.one_of(st.none(), st.builds(
        Correction, st.just(NOW), COUNTS, COUNTS, st.sampled_from(["resource-exhausted", "justification"])))
    return st.builds(
        EntryState, COUNTS, st.just(NOW), st.one_of(st.none(), TEXT),
        st.one_of(st.none(), st.just(NOW + timedelta(minutes=5))), corrections,
        st.one_of(st.none(), st.builds(PinnedLabel, st.just("node.kubernetes.io/instance-type"), TEXT)),
    )


def states() -> st.SearchStrategy[GuardState]:
    approvals = st.lists(st.builds(
        Approval, NAMES, TEXT, st.just(0), st.just(40), st.just(NOW + timedelta(hours=1)), TEXT, TEXT, st.just(NOW)),
        max_size=2)
    declared = st.dictionaries(NAMES, st.builds(DeclaredVersion, TEXT, TEXT, st.just(NOW)), max_size=2)
    return st.builds(
        lambda entries, a, d, scope, seq: GuardState("uid-1", entries, tuple(a), d, scope=scope, sequence=seq),
        st.dictionaries(NAMES, entry_states(), max_size=4), approvals, declared, st.one_of(st.none(), TEXT),
        st.integers(0, 5),
    )


def csinode(drivers: list[dict[str, Any]] | None, annotations: dict[str, str] | None) -> dict[str, Any]:
    """A CSINode as the apiserver converts it for CEL (``drivers: null`` when there are none)."""
    metadata: dict[str, Any] = {"name": "node-a", "uid": "uid-1", "resourceVersion": "7"}
    if annotations is not None:
        metadata["annotations"] = annotations
    return {"apiVersion": "storage.k8s.io/v1", "kind": "CSINode", "metadata": metadata, "spec": {"drivers": drivers}}


def entry(name: str, count: int | None, *, allocatable: bool = True) -> dict[str, Any]:
    d: dict[str, Any] = {"name": name, "nodeID": "i-1", "topologyKeys": None}
    if allocatable:
        d["allocatable"] = {} if count is None else {"count": count}
    return d


def activation(operation: str, old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    return {"object": new, "oldObject": old, "request": {"operation": operation, "name": "node-a"}}


def judged(operation: str, old: dict[str, Any] | None, new: dict[str, Any]) -> bool:
    """The Python reading, after checking both engines give the same and none fails."""
    expected = one_call.decided(operation, old, new)
    for name, evaluate in ENGINES.items():
        assert evaluate(activation(operation, old, new)) is expected, name
    return expected


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(state=states(), data=st.data())
def test_the_counts_a_state_records_are_found_and_no_other(state: GuardState, data: st.DataObject) -> None:
    encoded = encode_state(state, KEYS)
    annotations = {STATE_ANNOTATION: encoded}
    names = data.draw(st.lists(st.sampled_from(sorted(state.entries)), unique=True) if state.entries else st.just([]))
    drivers = [entry(n, state.entries[n].count, allocatable=data.draw(st.booleans()) or
                     state.entries[n].count is not None) for n in names]
    old = csinode(drivers or None, dict(annotations))
    new = csinode(copy.deepcopy(drivers) or None, dict(annotations))
    assert judged("UPDATE", old, new)
    assert not judged("CREATE", None, new)
    if drivers:  # any one count other than recorded: /validate is called
        i = data.draw(st.integers(0, len(drivers) - 1))
        recorded = state.entries[names[i]].count
        other = data.draw(COUNTS.filter(lambda c: c != recorded))
        new["spec"]["drivers"][i] = entry(names[i], other)
        assert not judged("UPDATE", old, new)
    unknown = data.draw(NAMES.filter(lambda n: n not in state.entries))  # an entry the state has nothing for
    new = csinode([*copy.deepcopy(drivers), entry(unknown, 20)], dict(annotations))
    assert not judged("UPDATE", old, new)


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(
    state=states(),
    drivers=st.one_of(st.none(), st.lists(st.builds(entry, NAMES, COUNTS), max_size=3,
                                          unique_by=lambda d: d["name"])),
    annotations=st.one_of(st.none(), st.dictionaries(st.sampled_from([JUSTIFICATION, "other"]), TEXT, max_size=2)),
    old_annotations=st.one_of(st.none(), st.dictionaries(st.sampled_from([JUSTIFICATION, "other"]), TEXT,
                                                         max_size=2)),
    with_state=st.booleans(),
    operation=st.sampled_from(["UPDATE", "CREATE"]),
)
def test_both_engines_agree_with_the_python_reading_and_never_fail(
    state: GuardState, drivers: list[dict[str, Any]] | None, annotations: dict[str, str] | None,
    old_annotations: dict[str, str] | None, with_state: bool, operation: str,
) -> None:
    if with_state:
        annotations = {**(annotations or {}), STATE_ANNOTATION: encode_state(state, KEYS)}
    old = None if operation == "CREATE" else csinode(drivers, old_annotations)
    judged(operation, old, csinode(drivers, annotations))


def test_a_changed_justification_is_left_to_validate() -> None:
    state = GuardState("uid-1", {EBS: EntryState(20, NOW)})
    annotations = {STATE_ANNOTATION: encode_state(state, KEYS)}
    old = csinode([entry(EBS, 20)], dict(annotations))
    assert judged("UPDATE", old, csinode([entry(EBS, 20)], dict(annotations)))
    assert not judged("UPDATE", old, csinode([entry(EBS, 20)], {**annotations, JUSTIFICATION: "{}"}))
    assert not judged("UPDATE", old, csinode([entry(EBS, 20)], None))


def test_a_name_that_is_not_a_csi_driver_name_is_never_put_into_a_pattern() -> None:
    state = GuardState("uid-1", {EBS: EntryState(20, NOW)})
    annotations = {STATE_ANNOTATION: encode_state(state, KEYS)}
    old = csinode([entry(EBS, 20)], dict(annotations))
    for name in ("ebs(", "[", "ebs.csi.aws.com\n", "a*", ""):
        assert not judged("UPDATE", old, csinode([entry(name, 20)], dict(annotations)))


def test_only_cel_validation_adds_the_condition_to_both_validating_entries() -> None:
    webhook = registration.build_webhook_configurations()
    celled = registration.build_webhook_configurations(validation=one_call.VALIDATION_CEL)
    assert celled[0] == webhook[0]  # the mutating configuration is the same
    for plain, extra in zip(webhook[1]["webhooks"], celled[1]["webhooks"], strict=True):
        assert extra["matchConditions"] == [*plain["matchConditions"], dict(one_call.NOT_DECIDED_CONDITION)]
        assert {k: v for k, v in extra.items() if k != "matchConditions"} == {
            k: v for k, v in plain.items() if k != "matchConditions"}
    with pytest.raises(ValueError, match="validation must be one of"):
        registration.build_webhook_configurations(validation="vap")


def test_register_dry_run_prints_the_cel_mode(tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    subprocess.run([sys.executable, "-m", "webhook", "certs", "generate", "--cert-dir", str(certs)],
                   check=True, capture_output=True)
    out = subprocess.run(
        [sys.executable, "-m", "webhook", "register", "--cert-dir", str(certs), "--dry-run=client",
         "--validation", "cel"],
        check=True, capture_output=True, text=True,
    ).stdout
    validating = next(d for d in yaml.safe_load_all(out) if d["kind"] == "ValidatingWebhookConfiguration")
    for webhook in validating["webhooks"]:
        assert webhook["matchConditions"][-1] == dict(one_call.NOT_DECIDED_CONDITION)
    refused = subprocess.run(
        [sys.executable, "-m", "webhook", "register", "--cert-dir", str(certs), "--dry-run=client",
         "--validation", "vap"],
        check=False, capture_output=True, text=True,
    )
    assert refused.returncode == 2 and "--validation" in refused.stderr


def test_past_its_cost_bounds_cel_does_not_decide() -> None:
    names = [f"d{i}.csi.example.com" for i in range(one_call.MAX_DRIVERS + 1)]
    state = GuardState("uid-1", {n: EntryState(20, NOW) for n in names})
    encoded = encode_state(state, KEYS)
    old = csinode([entry(n, 20) for n in names[:-1]], {STATE_ANNOTATION: encoded})
    assert judged("UPDATE", old, copy.deepcopy(old))  # MAX_DRIVERS entries
    assert not judged("UPDATE", old, csinode([entry(n, 20) for n in names], {STATE_ANNOTATION: encoded}))
    padded = encoded[:-1] + " " * (one_call.MAX_STATE_BYTES - len(encoded)) + "}"
    assert len(padded) == one_call.MAX_STATE_BYTES
    assert judged("UPDATE", old, csinode([entry(n, 20) for n in names[:-1]], {STATE_ANNOTATION: padded}))
    assert not judged("UPDATE", old, csinode([entry(n, 20) for n in names[:-1]], {STATE_ANNOTATION: padded + " "}))
