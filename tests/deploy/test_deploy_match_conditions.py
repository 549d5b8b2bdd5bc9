"""The webhooks' matchConditions, evaluated by two independent CEL implementations from PyPI.

cel-python (``celpy``, pure Python) and common-expression-language (``cel``, Rust bindings) both run the
expressions exactly as deploy/base/webhooks.yaml declares them, with kube-apiserver's matching logic: a ``false``
condition skips the webhook; all ``true`` calls it; an error (none ``false``) falls under failurePolicy
``Fail`` and rejects the request. An error is therefore counted as a failure of the expression in every test.

Objects are shaped as the apiserver hands them to CEL: the versioned object converted to unstructured JSON, so
``spec.drivers`` is ``null`` on a CSINode without drivers and unset optional fields are absent.
"""

from __future__ import annotations

import copy
import enum
from collections.abc import Callable, Mapping
from typing import Any

import cel
import celpy
import pytest
from celpy.adapter import json_to_cel
from deploy_helpers import DEPLOY, find, load_yaml_documents
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from webhook.kube import registration

STATE = registration.GUARD_ANNOTATIONS[0]
JUSTIFICATION = registration.GUARD_ANNOTATIONS[1]
MIGRATED = "storage.alpha.kubernetes.io/migrated-plugins"


class Outcome(enum.Enum):
    """What the apiserver does with the request after evaluating the matchConditions."""

    CALL = "call"
    SKIP = "skip"
    ERROR = "error"


Evaluate = Callable[[str, dict[str, Any]], "bool | None"]
"""Evaluates one expression; None means the expression failed (error or non-bool result)."""


def _celpy_engine() -> Evaluate:
    env = celpy.Environment()
    programs: dict[str, celpy.Runner] = {}

    def evaluate(expression: str, activation: dict[str, Any]) -> bool | None:
        if expression not in programs:
            programs[expression] = env.program(env.compile(expression))
        try:
            result = programs[expression].evaluate({k: json_to_cel(v) for k, v in activation.items()})
        except Exception:  # any failure of the engine is an evaluation error
            return None
        return bool(result) if isinstance(result, celpy.celtypes.BoolType) else None

    return evaluate


def _cel_rs_engine() -> Evaluate:
    programs: dict[str, Any] = {}

    def evaluate(expression: str, activation: dict[str, Any]) -> bool | None:
        if expression not in programs:
            programs[expression] = cel.compile(expression)
        try:
            result = programs[expression].execute(activation)
        except Exception:  # any failure of the engine is an evaluation error
            return None
        return result if isinstance(result, bool) else None

    return evaluate


ENGINES = {"cel-python": _celpy_engine(), "common-expression-language": _cel_rs_engine()}


def _deploy_entries(kind: str) -> dict[str, list[dict[str, str]]]:
    """The matchConditions of each webhook entry of one configuration in deploy/base/webhooks.yaml, by name."""
    configuration = find(load_yaml_documents(DEPLOY / "base" / "webhooks.yaml"), kind, registration.CONFIGURATION_NAME)
    return {webhook["name"]: webhook["matchConditions"] for webhook in configuration["webhooks"]}


MUTATING = _deploy_entries("MutatingWebhookConfiguration")
VALIDATING = _deploy_entries("ValidatingWebhookConfiguration")
FAIL_ENTRIES = {registration.MUTATING_WEBHOOK_NAME, registration.VALIDATING_WEBHOOK_NAME}
POLICIES = {
    registration.MUTATING_WEBHOOK_NAME: "fail",
    registration.VALIDATING_WEBHOOK_NAME: "fail",
    registration.MUTATING_NEVER_REFUSED_NAME: "ignore",
    registration.VALIDATING_NEVER_REFUSED_NAME: "ignore",
}


NODE = "ip-10-0-1-23.ec2.internal"
KUBELET: dict[str, Any] = {"username": f"system:node:{NODE}", "groups": ["system:nodes", "system:authenticated"]}
STRANGER: dict[str, Any] = {"username": "mallory", "groups": ["system:authenticated"]}
USERS = {
    "the node's kubelet": KUBELET,
    "a stranger": STRANGER,
    "another node's kubelet": {"username": "system:node:ip-10-0-9-9.ec2.internal", "groups": ["system:nodes"]},
    "the node's name without system:nodes": {"username": f"system:node:{NODE}", "groups": ["system:authenticated"]},
    "no groups at all": {"username": f"system:node:{NODE}"},
}


def outcome(
    evaluate: Evaluate,
    conditions: list[dict[str, str]],
    old: Mapping[str, Any] | None,
    new: Mapping[str, Any] | None,
    operation: str = "UPDATE",
    user: Mapping[str, Any] = KUBELET,
) -> Outcome:
    """kube-apiserver's matchConditions logic for one webhook."""
    request = {
        "operation": operation,
        "name": (new or old or {}).get("metadata", {}).get("name", ""),
        "resource": {"group": "storage.k8s.io", "version": "v1", "resource": "csinodes"},
        "userInfo": dict(user),
    }
    activation = {"object": new, "oldObject": old, "request": request}
    results = [evaluate(c["expression"], activation) for c in conditions]
    if any(r is False for r in results):
        return Outcome.SKIP
    if any(r is None for r in results):
        return Outcome.ERROR
    return Outcome.CALL


def driver(name: str, count: int | None = 25, *, allocatable: bool = True) -> dict[str, Any]:
    """A CSINode driver entry as kubelet writes it."""
    entry: dict[str, Any] = {
        "name": name,
        "nodeID": "i-0123456789abcdef0",
        "topologyKeys": ["topology.ebs.csi.aws.com/zone", "topology.kubernetes.io/zone"],
    }
    if allocatable:
        entry["allocatable"] = {} if count is None else {"count": count}
    return entry


def csinode(drivers: list[dict[str, Any]] | None, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    """A CSINode as the apiserver converts it for CEL (``drivers: null`` when there are none)."""
    metadata: dict[str, Any] = {
        "name": "ip-10-0-1-23.ec2.internal",
        "uid": "5f0c6d3e-6f5b-4c43-9d0e-0f8a3b1c2d4e",
        "resourceVersion": "48121",
        "creationTimestamp": "2026-11-30T01:02:03Z",
        "ownerReferences": [
            {"apiVersion": "v1", "kind": "Node", "name": "ip-10-0-1-23.ec2.internal", "uid": "0b9c0f3c-1111"}
        ],
        "managedFields": [{"manager": "kubelet", "operation": "Update", "apiVersion": "storage.k8s.io/v1"}],
    }
    if annotations is not None:
        metadata["annotations"] = annotations
    return {"apiVersion": "storage.k8s.io/v1", "kind": "CSINode", "metadata": metadata, "spec": {"drivers": drivers}}


EBS = "ebs.csi.aws.com"
EFS = "efs.csi.aws.com"
BASE_ANNOTATIONS = {MIGRATED: "kubernetes.io/aws-ebs"}


def _with(node: dict[str, Any], **changes: Any) -> dict[str, Any]:
    changed = copy.deepcopy(node)
    for key, value in changes.items():
        if key == "annotations" and value is None:  # omitempty: no annotations means no key at all
            changed["metadata"].pop("annotations", None)
        elif key == "annotations":
            changed["metadata"]["annotations"] = value
        elif key == "labels":
            changed["metadata"]["labels"] = value
        elif key == "drivers":
            changed["spec"]["drivers"] = value
    return changed


OLD = csinode([driver(EBS, 25), driver(EFS, None, allocatable=False)], dict(BASE_ANNOTATIONS))
EFS_ENTRY = OLD["spec"]["drivers"][1]
VERSIONS = "csinode-guard.io/driver-versions"


def moved(entry: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """``entry`` as kubelet's InstallCSIDriver rewrites it for a plugin on a changed instance."""
    return {**copy.deepcopy(entry), **fields}


FAIL = [
    pytest.param(OLD, _with(OLD, drivers=[driver(EBS, 27), EFS_ENTRY]), id="a count increase"),
    pytest.param(OLD, _with(OLD, drivers=[EFS_ENTRY, driver(EBS, 26)]),
                 id="an increase of a driver kubelet re-appended at the end"),
    pytest.param(OLD, _with(OLD, drivers=[driver(EBS, None), EFS_ENTRY]),
                 id="a count removed (allocatable kept, count gone)"),
    pytest.param(OLD, _with(OLD, drivers=[driver(EBS, allocatable=False), EFS_ENTRY]),
                 id="allocatable removed (NodeGetInfo max_volumes_per_node 0)"),
    pytest.param(OLD, _with(OLD, drivers=[driver(EBS, 30), EFS_ENTRY, driver("pd.csi.storage.gke.io")]),
                 id="an increase next to a registration"),
    pytest.param(OLD, _with(OLD, annotations={**BASE_ANNOTATIONS, STATE: "{}"}), id="the state annotation appears"),
    pytest.param(
        _with(OLD, annotations={**BASE_ANNOTATIONS, STATE: '{"v":1}'}),
        _with(OLD, annotations={**BASE_ANNOTATIONS, STATE: '{"v":2}'}),
        id="the state annotation changes",
    ),
    pytest.param(_with(OLD, annotations={**BASE_ANNOTATIONS, STATE: '{"v":1}'}), OLD,
                 id="the state annotation disappears"),
    pytest.param(_with(OLD, annotations=None), _with(OLD, annotations={JUSTIFICATION: "[]"}),
                 id="a justification on an object with no annotations at all"),
    pytest.param(_with(OLD, annotations={JUSTIFICATION: "[]"}), _with(OLD, annotations={JUSTIFICATION: ""}),
                 id="a justification changed to the empty string"),
    pytest.param(_with(OLD, annotations={JUSTIFICATION: "[]"}), _with(OLD, annotations={}),
                 id="a justification removed"),
    pytest.param(OLD, _with(OLD, annotations={**BASE_ANNOTATIONS, VERSIONS: '{"ebs.csi.aws.com":"v9.9.9"}'}),
                 id="driver versions declared"),
    pytest.param(OLD, _with(OLD, drivers=[driver(EBS, 20), EFS_ENTRY],
                            annotations={**BASE_ANNOTATIONS, VERSIONS: '{"ebs.csi.aws.com":"v9.9.9"}'}),
                 id="driver versions declared with a decrease"),
]

NEVER_REFUSED = [
    pytest.param(OLD, _with(OLD, drivers=[driver(EBS, 23), EFS_ENTRY]), id="a count decrease"),
    pytest.param(OLD, _with(OLD, drivers=[driver(EBS, 25), driver(EFS, 8)]),
                 id="a count appears where there was none (unbounded -> bounded)"),
    pytest.param(
        _with(OLD, drivers=[driver(EBS, None), driver(EFS, allocatable=False)]),
        _with(OLD, drivers=[driver(EBS, 0), driver(EFS, allocatable=False)]),
        id="a count set on an empty allocatable",
    ),
    pytest.param(csinode(None), csinode([driver(EBS, 25)]), id="the first registration into an empty CSINode"),
    pytest.param(csinode([]), csinode([driver(EBS, 1)]), id="a registration into an explicitly empty list"),
    pytest.param(OLD, _with(OLD, drivers=[*OLD["spec"]["drivers"], driver("pd.csi.storage.gke.io", 128)]),
                 id="a registration"),
    pytest.param(_with(OLD, drivers=[EFS_ENTRY]), OLD, id="a re-registration right after a removal"),
    pytest.param(_with(OLD, drivers=[EFS_ENTRY]), _with(OLD, drivers=[EFS_ENTRY, driver(EBS, allocatable=False)]),
                 id="a re-registration without allocatable"),
    pytest.param(OLD, _with(OLD, drivers=[EFS_ENTRY]), id="a removal"),
    pytest.param(csinode([driver(EBS, 25)]), csinode(None), id="the removal of the last driver"),
    pytest.param(OLD, _with(OLD, drivers=[driver("ebs-renamed.csi.aws.com", 30), EFS_ENTRY]),
                 id="a removal and a registration with another count"),
    pytest.param(OLD, _with(OLD, drivers=[moved(driver(EBS, 27), nodeID="i-0fedcba9876543210"), EFS_ENTRY]),
                 id="a higher count with a new nodeID (InstallCSIDriver on a changed instance)"),
    pytest.param(OLD, _with(OLD, drivers=[moved(driver(EBS, 27), topologyKeys=None), EFS_ENTRY]),
                 id="a higher count with other topologyKeys"),
    pytest.param(_with(OLD, drivers=[EFS_ENTRY]),
                 _with(OLD, drivers=[EFS_ENTRY, driver(EBS, 39)],
                       annotations={**BASE_ANNOTATIONS, VERSIONS: '{"ebs.csi.aws.com":"v9.9.9"}'}),
                 id="a re-registration that forges driver versions (the guard puts them back)"),
]

STATE_WITH_A_DECREASE = (
    _with(OLD, annotations={**BASE_ANNOTATIONS, STATE: '{"v":1}'}),
    _with(OLD, drivers=[driver(EBS, 20), EFS_ENTRY], annotations={**BASE_ANNOTATIONS, STATE: '{"v":2}'}),
)
"""A decrease with another state: what /validate sees after /mutate wrote its state (the Ignore entry); to /mutate
the node itself changed the state (the Fail entry: only the guard's own patch writes it)."""

SKIPPED = [
    pytest.param(OLD, _with(OLD, labels={"team": "storage"}), id="a label-only change"),
    pytest.param(
        OLD,
        _with(OLD, annotations={MIGRATED: "kubernetes.io/aws-ebs,kubernetes.io/cinder"}),
        id="kubelet's migrated-plugins annotation changes",
    ),
    pytest.param(OLD, _with(OLD, annotations={}), id="kubelet's migrated-plugins annotation disappears"),
    pytest.param(OLD, _with(OLD, annotations={**BASE_ANNOTATIONS, "csinode-guard.io/other": "x"}),
                 id="another csinode-guard.io annotation changes"),
    pytest.param(OLD, copy.deepcopy(OLD), id="a resync that changes nothing"),
    pytest.param(OLD, _with(OLD, drivers=[EFS_ENTRY, OLD["spec"]["drivers"][0]]),
                 id="drivers reordered with the same counts"),
    pytest.param(csinode(None), csinode(None), id="an empty CSINode touched"),
]


@pytest.fixture(params=sorted(ENGINES))
def evaluate(request: pytest.FixtureRequest) -> Evaluate:
    return ENGINES[request.param]


@pytest.fixture(params=["mutating", "validating"])
def entries(request: pytest.FixtureRequest) -> dict[str, list[dict[str, str]]]:
    return MUTATING if request.param == "mutating" else VALIDATING


def python_entry(entries: dict[str, list[dict[str, str]]], old: Mapping[str, Any] | None,
                 new: Mapping[str, Any] | None, operation: str = "UPDATE",
                 user: Mapping[str, Any] = KUBELET) -> str | None:
    """:func:`registration.webhook_entry` for the configuration ``entries`` belongs to."""
    return registration.webhook_entry(operation, old, new, username=user["username"],
                                      groups=tuple(user.get("groups", ())), name=NODE,
                                      mutating=entries is MUTATING)


def route(
    evaluate: Evaluate,
    entries: dict[str, list[dict[str, str]]],
    old: Mapping[str, Any] | None,
    new: Mapping[str, Any] | None,
    operation: str = "UPDATE",
    user: Mapping[str, Any] = KUBELET,
) -> str | None:
    """The failurePolicy of the one entry the apiserver calls (None: neither); fails on an error or two calls."""
    called = []
    for name, conditions in entries.items():
        result = outcome(evaluate, conditions, old, new, operation, user)
        assert result is not Outcome.ERROR, f"{name} errors"
        if result is Outcome.CALL:
            called.append(POLICIES[name])
    assert len(called) <= 1, f"both entries called: {called}"
    return called[0] if called else None


def test_both_configurations_carry_the_python_built_conditions() -> None:
    for entries, mutating in ((MUTATING, True), (VALIDATING, False)):
        fail = [dict(c) for c in registration.match_conditions(mutating=mutating, never_refused=False)]
        ignore = [dict(c) for c in registration.match_conditions(mutating=mutating, never_refused=True)]
        assert sorted(entries.values(), key=str) == sorted([fail, ignore], key=str)
        for name, conditions in entries.items():
            assert conditions == (fail if name in FAIL_ENTRIES else ignore)


@pytest.mark.parametrize(("old", "new"), FAIL)
def test_increases_and_trust_go_to_the_fail_entry(
    evaluate: Evaluate, entries: dict[str, list[dict[str, str]]], old: dict[str, Any], new: dict[str, Any]
) -> None:
    assert route(evaluate, entries, old, new) == "fail"
    assert python_entry(entries, old, new) == "fail"


@pytest.mark.parametrize(("old", "new"), NEVER_REFUSED)
def test_registrations_removals_and_decreases_go_to_the_ignore_entry(
    evaluate: Evaluate, entries: dict[str, list[dict[str, str]]], old: dict[str, Any], new: dict[str, Any]
) -> None:
    assert route(evaluate, entries, old, new) == "ignore"
    assert python_entry(entries, old, new) == "ignore"


@pytest.mark.parametrize(("old", "new"), NEVER_REFUSED)
@pytest.mark.parametrize("user", ["a stranger", "another node's kubelet", "the node's name without system:nodes"])
def test_the_same_writes_by_anyone_but_the_nodes_kubelet_go_to_the_fail_entry(
    evaluate: Evaluate, entries: dict[str, list[dict[str, str]]], old: dict[str, Any], new: dict[str, Any],
    user: str,
) -> None:
    assert route(evaluate, entries, old, new, user=USERS[user]) == "fail"
    assert python_entry(entries, old, new, user=USERS[user]) == "fail"


def test_a_state_change_goes_to_the_fail_entry_of_the_mutating_configuration(evaluate: Evaluate) -> None:
    old, new = STATE_WITH_A_DECREASE
    assert route(evaluate, MUTATING, old, new) == "fail"
    assert route(evaluate, VALIDATING, old, new) == "ignore"
    assert python_entry(MUTATING, old, new) == "fail"
    assert python_entry(VALIDATING, old, new) == "ignore"
    stripped = _with(OLD, drivers=[EFS_ENTRY], annotations=BASE_ANNOTATIONS)
    assert route(evaluate, MUTATING, old, stripped) == "fail"  # a removal that deletes the state (attack 7)


@pytest.mark.parametrize(("old", "new"), SKIPPED)
def test_the_guard_is_not_called(
    evaluate: Evaluate, entries: dict[str, list[dict[str, str]]], old: dict[str, Any], new: dict[str, Any]
) -> None:
    assert route(evaluate, entries, old, new) is None
    assert python_entry(entries, old, new) is None


@pytest.mark.parametrize(
    "new",
    [
        pytest.param(csinode(None), id="CREATE of an empty CSINode"),
        pytest.param(csinode([driver(EBS, 128)]), id="CREATE with a driver"),
        pytest.param(csinode([driver(EBS, 128)], {STATE: "{}", VERSIONS: "{}"}), id="CREATE with copied annotations"),
    ],
)
def test_create_goes_to_the_ignore_entry_although_old_object_is_null(
    evaluate: Evaluate, entries: dict[str, list[dict[str, str]]], new: dict[str, Any]
) -> None:
    assert route(evaluate, entries, None, new, "CREATE") == "ignore"
    assert route(evaluate, entries, None, new, "CREATE", STRANGER) == "fail"
    assert python_entry(entries, None, new, "CREATE") == "ignore"
    assert python_entry(entries, None, new, "CREATE", STRANGER) == "fail"


@pytest.mark.parametrize("old", [pytest.param(OLD, id="with drivers"), pytest.param(csinode(None), id="no drivers")])
def test_delete_goes_to_the_ignore_entry_for_the_node_and_to_the_fail_entry_for_anyone_else(
    evaluate: Evaluate, entries: dict[str, list[dict[str, str]]], old: dict[str, Any]
) -> None:
    """``object`` is null on DELETE: the conditions read only ``request`` then, and never error."""
    assert route(evaluate, entries, old, None, "DELETE") == "ignore"
    assert python_entry(entries, old, None, "DELETE") == "ignore"
    for user in ("a stranger", "another node's kubelet", "the node's name without system:nodes"):
        assert route(evaluate, entries, old, None, "DELETE", USERS[user]) == "fail", user
        assert python_entry(entries, old, None, "DELETE", USERS[user]) == "fail", user


def test_connect_is_skipped_even_if_the_rules_were_widened(
    evaluate: Evaluate, entries: dict[str, list[dict[str, str]]]
) -> None:
    assert route(evaluate, entries, OLD, None, "CONNECT", STRANGER) is None


_names = st.sampled_from([EBS, EFS, "pd.csi.storage.gke.io", "disk.csi.azure.com"])
_driver = st.builds(
    lambda name, count, mode, node_id, topology: {
        **(driver(name, count, allocatable=mode != "absent") if mode != "empty" else driver(name, None)),
        "nodeID": node_id,
        "topologyKeys": topology,
    },
    _names,
    st.integers(min_value=0, max_value=130) | st.just(2147483647),
    st.sampled_from(["count", "count", "empty", "absent"]),
    st.sampled_from(["i-0123456789abcdef0", "i-0123456789abcdef0", "i-0fedcba9876543210"]),
    st.sampled_from([None, ["topology.kubernetes.io/zone"], ["topology.kubernetes.io/zone"], []]),
)
_drivers = st.none() | st.lists(_driver, max_size=4, unique_by=lambda d: d["name"])
_annotations = st.none() | st.dictionaries(
    st.sampled_from([STATE, JUSTIFICATION, VERSIONS, MIGRATED, "example.com/other"]),
    st.sampled_from(["", "a", "b", "[]"]),
    max_size=4,
)
_csinodes = st.builds(csinode, _drivers, _annotations)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(old=_csinodes, new=_csinodes, user=st.sampled_from(sorted(USERS)))
@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_the_conditions_match_the_python_reading_never_error_and_never_overlap(
    engine: str, old: dict[str, Any], new: dict[str, Any], user: str
) -> None:
    for entries in (MUTATING, VALIDATING):
        expected = python_entry(entries, old, new, user=USERS[user])
        assert route(ENGINES[engine], entries, old, new, user=USERS[user]) == expected


def test_an_erroring_condition_would_be_noticed() -> None:
    """The harness itself: ``exists`` on a null drivers list is an error in both engines, as in cel-go."""
    broken = [{"name": "naive", "expression": "object.spec.drivers.exists(d, has(d.allocatable))"}]
    for evaluate in ENGINES.values():
        assert outcome(evaluate, broken, csinode(None), csinode(None)) is Outcome.ERROR


def _wide(count: int, extra: int = 0) -> dict[str, Any]:
    return csinode([driver(f"plugin-{i:04d}.csi.example.com", 10) for i in range(registration.WIDE_DRIVERS + 1)]
                   + [driver(EBS, count)] + [driver(f"late-{i}.csi.example.com", 5) for i in range(extra)])


@pytest.mark.parametrize(("old", "new"), [
    pytest.param(_wide(20), _wide(25), id="an increase on a wide node"),
    pytest.param(_wide(20), _wide(19), id="a decrease on a wide node"),
    pytest.param(_wide(20), _wide(20, extra=1), id="a registration on a wide node"),
    pytest.param(csinode([driver(EBS, 20)]), _wide(20), id="a registration that makes the node wide"),
])
def test_a_wide_write_is_routed_by_its_writer_alone(
    entries: dict[str, list[dict[str, str]]], old: dict[str, Any], new: dict[str, Any]
) -> None:
    """Pairing entries costs the square of the drivers; past the apiserver's CEL cost limit the expression fails and
    the Fail entry refuses (measured on v1.36.2 at 2,001 drivers). A wide write skips the pairing: the node's own
    kubelet to the Ignore entry (never refused by an unreachable guard), anyone else to the Fail entry.

    Evaluated by the Rust engine only: cel-python evaluates both sides of ``||`` and ``&&`` (the apiserver's cel-go
    does not), which takes minutes for the pairing of 66 drivers; the apiserver's own evaluation of a 2,001-driver
    write is tests/k8s/test_size_bounds.py."""
    evaluate = ENGINES["common-expression-language"]
    assert route(evaluate, entries, old, new) == "ignore"
    assert python_entry(entries, old, new) == "ignore"
    assert route(evaluate, entries, old, new, user=USERS["a stranger"]) == "fail"
    assert python_entry(entries, old, new, user=USERS["a stranger"]) == "fail"
