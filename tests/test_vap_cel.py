"""``policy export --format vap``: the ValidatingAdmissionPolicy floor, evaluated by two CEL implementations.

cel-python (``celpy``) and common-expression-language (``cel``, Rust) run the exported expressions with the
apiserver's ValidatingAdmissionPolicy logic, with the three functions of the apiserver's CEL libraries that the
floor uses to read a justification added as the apiserver defines them (Kubernetes' regex library
``find``/``findAll``, cel-go's strings extension ``split``; RE2 and Python's ``re`` agree on the patterns used):
a ``false`` match condition skips the policy, variables are evaluated in order, every validation must be
``true``; an error anywhere falls under ``failurePolicy: Fail`` and refuses the write, so an error counts as a
refusal here. The real apiserver runs the same objects in tests/k8s/test_vap.py. The floor must never refuse
what the guard admits: a property test sends random kubelet writes through the guard's offline admission chain
(/mutate, patch, /validate) and checks the floor on what the guard stored.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import cel
import celpy
import pytest
import yaml
from celpy.adapter import json_to_cel
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from webhook.admission.cluster import StaticClusterView
from webhook.admission.policy import load_policy, parse_policy
from webhook.admission.state import StateKeys
from webhook.kube.vap import VAP_NAME, build_binding, build_validating_admission_policy, highest_ceiling
from webhook.simulation.chain import admit_write

REPO = Path(__file__).resolve().parents[1]
EBS = "ebs.csi.aws.com"
NODE = "node-a"
KUBELET = (f"system:node:{NODE}", ["system:nodes", "system:authenticated"])
ADMIN = ("admin", ["system:masters", "system:authenticated"])
INT32_MAX = 2147483647

Evaluate = Callable[[str, dict[str, Any]], Any]
ERROR = object()


def k8s_find(text: str, pattern: str) -> str:
    """Kubernetes CEL ``<string>.find(<regex>)``: the first match, or "" when none."""
    found = re.search(pattern, text)
    return found.group(0) if found else ""


def k8s_find_all(text: str, pattern: str) -> list[str]:
    """Kubernetes CEL ``<string>.findAll(<regex>)``: every non-overlapping match."""
    return [m.group(0) for m in re.finditer(pattern, text)]


def _celpy_engine() -> Evaluate:
    env = celpy.Environment()
    programs: dict[str, Any] = {}
    functions = {
        "find": lambda s, p: celpy.celtypes.StringType(k8s_find(str(s), str(p))),
        "findAll": lambda s, p: celpy.celtypes.ListType([celpy.celtypes.StringType(m)
                                                         for m in k8s_find_all(str(s), str(p))]),
        "split": lambda s, sep: celpy.celtypes.ListType([celpy.celtypes.StringType(m) for m in str(s).split(str(sep))]),
    }

    def evaluate(expression: str, activation: dict[str, Any]) -> Any:
        if expression not in programs:
            programs[expression] = env.program(env.compile(expression), functions=functions)
        try:
            result = programs[expression].evaluate({k: json_to_cel(v) for k, v in activation.items()})
        except Exception:  # any failure of the engine is an evaluation error
            return ERROR
        if isinstance(result, celpy.celtypes.BoolType):
            return bool(result)
        return ERROR if isinstance(result, celpy.CELEvalError) else result

    return evaluate


def _cel_rs_engine() -> Evaluate:
    programs: dict[str, Any] = {}

    functions = {"find": k8s_find, "findAll": k8s_find_all, "split": lambda s, sep: s.split(sep)}

    def evaluate(expression: str, activation: dict[str, Any]) -> Any:
        if expression not in programs:
            programs[expression] = cel.compile(expression)
        try:
            return programs[expression].execute(cel.Context(variables=activation, functions=functions))
        except Exception:  # any failure of the engine is an evaluation error
            return ERROR

    return evaluate


ENGINES = {"cel-python": _celpy_engine(), "common-expression-language": _cel_rs_engine()}


def _plain(value: Any) -> Any:
    """celpy values back to JSON-like Python values (for variables reused by the next expression)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, str):
        return str(value)
    return value


def floor_outcome(
    evaluate: Evaluate,
    vap: Mapping[str, Any],
    old: Mapping[str, Any] | None,
    new: Mapping[str, Any] | None,
    *,
    operation: str = "UPDATE",
    user: tuple[str, list[str]] = KUBELET,
) -> str:
    """``skip``, ``allow``, ``error`` or the refusing validation's message, as the apiserver decides."""
    spec = vap["spec"]
    if operation not in spec["matchConstraints"]["resourceRules"][0]["operations"]:
        return "skip"
    request = {
        "operation": operation,
        "name": (new or old or {}).get("metadata", {}).get("name", ""),
        "userInfo": {"username": user[0], "groups": list(user[1])},
    }
    activation: dict[str, Any] = {"object": new, "oldObject": old, "request": request}
    results = [evaluate(c["expression"], activation) for c in spec["matchConditions"]]
    if any(r is False for r in results):
        return "skip"
    if any(r is not True for r in results):
        return "error"
    variables: dict[str, Any] = {}
    for variable in spec["variables"]:
        value = evaluate(variable["expression"], {**activation, "variables": variables})
        if value is ERROR:
            return "error"
        variables[variable["name"]] = _plain(value)
    for validation in spec["validations"]:
        result = evaluate(validation["expression"], {**activation, "variables": variables})
        if result is False:
            return str(validation["message"])
        if result is not True:
            return "error"
    return "allow"


@pytest.fixture(params=list(ENGINES), scope="module")
def engine(request: pytest.FixtureRequest) -> Evaluate:
    evaluate: Evaluate = ENGINES[request.param]
    return evaluate


@pytest.fixture(scope="module")
def vap() -> dict[str, Any]:
    return build_validating_admission_policy(load_policy(REPO / "policies" / "default.yaml"))


def driver(name: str, count: int | None, *, allocatable: bool = True) -> dict[str, Any]:
    """A CSINode driver entry as kubelet writes it (count None: allocatable without count)."""
    entry: dict[str, Any] = {"name": name, "nodeID": "i-0123456789abcdef0", "topologyKeys": None}
    if allocatable:
        entry["allocatable"] = {} if count is None else {"count": count}
    return entry


REQUEST_TIME = "2026-12-01T00:05:00Z"
"""The time the apiserver gives the writer's managedFields entry in :func:`csinode` objects."""


def csinode(
    *drivers: dict[str, Any] | None, annotations: Mapping[str, str] | None = None, times: tuple[str, ...] = ()
) -> dict[str, Any]:
    """A CSINode as the apiserver hands it to CEL; no drivers -> ``spec.drivers: null``; ``times``: the
    ``time`` of each managedFields entry (none: no managedFields)."""
    metadata: dict[str, Any] = {"name": NODE, "uid": "3c9a0b52-0000-4000-8000-000000000001", "resourceVersion": "7"}
    if annotations is not None:
        metadata["annotations"] = dict(annotations)
    if times:
        metadata["managedFields"] = [{"manager": f"m{i}", "operation": "Update", "apiVersion": "storage.k8s.io/v1",
                                      "time": t, "fieldsType": "FieldsV1", "fieldsV1": {}}
                                     for i, t in enumerate(times)]
    listed = [d for d in drivers if d is not None]
    return {"apiVersion": "storage.k8s.io/v1", "kind": "CSINode", "metadata": metadata,
            "spec": {"drivers": listed or None}}


STEP = "an increase larger than the driver's maxStepUp"
CEILING = "above the driver's highest possible ceiling"
CUTOFF = "2147483647 is kubelet's cut-off"
UNBOUNDED = "was removed (unbounded)"
IDENTITY = "[writer-identity]"


@pytest.mark.parametrize(
    ("old", "new", "user", "expected"),
    [
        pytest.param(csinode(driver(EBS, 25)), csinode(driver(EBS, 20)), KUBELET, "allow",
                     id="a kubelet decrease passes"),
        pytest.param(csinode(driver(EBS, 25)), csinode(driver(EBS, 0)), KUBELET, "allow",
                     id="a kubelet drop to zero passes (the guard only warns)"),
        pytest.param(csinode(driver(EBS, 25)), csinode(driver(EBS, 41)), KUBELET, "allow",
                     id="an increase of exactly maxStepUp passes"),
        pytest.param(csinode(driver(EBS, 25)), csinode(driver(EBS, 42)), KUBELET, STEP,
                     id="an increase of maxStepUp plus one is refused"),
        pytest.param(csinode(driver(EBS, 120)), csinode(driver(EBS, 128)), KUBELET, "allow",
                     id="an increase to the highest ebs ceiling passes"),
        pytest.param(csinode(driver(EBS, 120)), csinode(driver(EBS, 129)), KUBELET, CEILING,
                     id="an increase above the highest ebs ceiling is refused"),
        pytest.param(csinode(driver(EBS, 140)), csinode(driver(EBS, 135)), KUBELET, "allow",
                     id="a decrease that stays above the ceiling passes (the guard only warns)"),
        pytest.param(csinode(driver(EBS, 25)), csinode(driver(EBS, INT32_MAX)), KUBELET, CUTOFF,
                     id="an increase to int32 max is refused"),
        pytest.param(csinode(driver("example.csi.io", 25)), csinode(driver("example.csi.io", 40)), KUBELET, "allow",
                     id="an unnamed driver within the default step passes"),
        pytest.param(csinode(driver("example.csi.io", 25)), csinode(driver("example.csi.io", INT32_MAX)), KUBELET,
                     CUTOFF, id="an unnamed driver to int32 max is refused"),
        pytest.param(csinode(driver(EBS, 25)), csinode(driver(EBS, None, allocatable=False)), KUBELET, UNBOUNDED,
                     id="allocatable removed is refused"),
        pytest.param(csinode(driver(EBS, 25)), csinode(driver(EBS, None)), KUBELET, UNBOUNDED,
                     id="count removed from allocatable is refused"),
        pytest.param(csinode(driver(EBS, None, allocatable=False)), csinode(driver(EBS, 25)), KUBELET, "allow",
                     id="unbounded to bounded passes"),
        pytest.param(csinode(driver(EBS, 25)), csinode(driver(EBS, 20)), ADMIN, IDENTITY,
                     id="a count change by anyone else is refused"),
        pytest.param(csinode(driver(EBS, 25)), csinode(driver(EBS, 20)),
                     ("system:node:node-b", ["system:nodes"]), IDENTITY,
                     id="another node's kubelet is refused"),
        pytest.param(csinode(driver(EBS, 25)), csinode(driver(EBS, 20)), (f"system:node:{NODE}", []), IDENTITY,
                     id="the node's name without the group system:nodes is refused"),
        pytest.param(csinode(driver(EBS, 25)), csinode(driver(EBS, 20)),
                     ("carol", ["csinode-guard:break-glass"]), "skip", id="an exempt principal skips the floor"),
    ],
)
def test_the_floor_decides(
    engine: Evaluate, vap: dict[str, Any], old: dict[str, Any], new: dict[str, Any],
    user: tuple[str, list[str]], expected: str,
) -> None:
    outcome = floor_outcome(engine, vap, old, new, user=user)
    assert outcome == expected if expected in ("allow", "skip") else expected in outcome, outcome


JUSTIFICATION = "csinode-guard.io/justification"
STATE = "csinode-guard.io/state"


def justification(*entries: Mapping[str, Any]) -> str:
    """The annotation's value: a JSON list of entries over the defaults (ebs, 30-60, expiring after the request)."""
    base = {"driver": EBS, "reason": "new ENI layout", "minCount": 30, "maxCount": 60,
            "expires": "2026-12-01T01:00:00Z", "ticket": "OPS-1"}
    return json.dumps([{**base, **e} for e in entries])


def justified(value: str, *, count: int = 40, before: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(old, new): ebs 25 -> ``count`` (40: within maxStepUp) with the justification ``value`` already on the
    object (``before``: the old object's value, default the same, i.e. set by an earlier write)."""
    old = csinode(driver(EBS, 25), annotations={JUSTIFICATION: value if before is None else before},
                  times=("2026-11-30T10:00:00Z",))
    new = csinode(driver(EBS, count), annotations={JUSTIFICATION: value}, times=("2026-11-30T10:00:00Z", REQUEST_TIME))
    return old, new


APPROVER = ("alice@example.com", ["csinode-guard:approvers", "system:authenticated"])


@pytest.mark.parametrize(
    ("case", "user", "expected"),
    [
        pytest.param(justified(justification({})), ADMIN, "allow",
                     id="an unexpired justification covering the count lifts writer identity and the step"),
        pytest.param(justified(justification({}), count=60), KUBELET, "allow", id="it lifts the kubelet's step too"),
        pytest.param(justified(justification({}), count=INT32_MAX), KUBELET, CUTOFF,
                     id="it never lifts int32 max"),
        pytest.param(justified(justification({"maxCount": 200}), count=129), KUBELET, CEILING,
                     id="it never lifts the highest ceiling"),
        pytest.param(justified(justification({"expires": "2026-12-01T00:04:59Z"})), ADMIN, IDENTITY,
                     id="an expired justification lifts nothing"),
        pytest.param(justified(justification({"expires": "2026-12-01T02:04:59+02:00"})), ADMIN, IDENTITY,
                     id="expiry compared as a time, not as text (an offset)"),
        pytest.param(justified(justification({"expires": "2026-12-01T00:05:00.5Z"})), ADMIN, "allow",
                     id="fractional seconds"),
        pytest.param(justified(justification({"maxCount": 39})), ADMIN, IDENTITY,
                     id="a range below the new count lifts nothing"),
        pytest.param(justified(justification({"minCount": 61, "maxCount": 90}), count=60), KUBELET, STEP,
                     id="a range above the new count lifts nothing"),
        pytest.param(justified(justification({"driver": "pd.csi.storage.gke.io"})), ADMIN, IDENTITY,
                     id="another driver's justification lifts nothing"),
        pytest.param(justified(justification({"reason": 'see {x} "maxCount": 90, }', "maxCount": 35})),
                     ADMIN, IDENTITY, id="a key quoted inside a string forges nothing"),
        pytest.param(justified(justification({"reason": 'new {eni} "layout" \\', "ticket": "}{"})),
                     ADMIN, "allow", id="braces, quotes and backslashes inside strings do not split the entry"),
        pytest.param(justified(justification({"maxCount": 10}, {})), ADMIN, "allow",
                     id="any covering entry of the list"),
        pytest.param(justified(json.dumps({"driver": EBS, "reason": "r", "minCount": 0, "maxCount": 90,
                                           "expires": "2026-12-01T01:00:00Z"}, indent=2)), ADMIN, "allow",
                     id="a single object, indented"),
        pytest.param(justified(justification({"expires": "2026-02-30T00:00:00Z"})), ADMIN, IDENTITY,
                     id="an impossible date lifts nothing and fails no expression"),
        pytest.param(justified(justification({"expires": "tomorrow"})), ADMIN, IDENTITY,
                     id="a time that is not RFC 3339 lifts nothing"),
        pytest.param(justified('[{"driver": "ebs.csi.aws.com", "maxCount": 90, "maxCount": 90, "minCount": 0, '
                               '"expires": "2026-12-01T01:00:00Z", "reason": "r"}]'), ADMIN, IDENTITY,
                     id="a key given twice lifts nothing"),
        pytest.param(justified("not json"), ADMIN, IDENTITY, id="not JSON: nothing"),
        pytest.param(justified(justification({"ticket": "x" * 16300})), ADMIN, IDENTITY,
                     id="an annotation over 16 KiB lifts nothing (the apiserver's CEL cost limit)"),
        pytest.param(justified(justification({"ticket": "x" * 16000})), ADMIN, "allow",
                     id="one just under 16 KiB is read"),
        pytest.param((csinode(driver(EBS, 25), annotations={STATE: '{"approvals": [{"approvedBy": "alice"}]}'}),
                      csinode(driver(EBS, 40), annotations={STATE: '{"approvals": [{"approvedBy": "alice"}]}'},
                              times=(REQUEST_TIME,))),
                     ADMIN, IDENTITY, id="an approval recorded in the state lifts nothing"),
        pytest.param(justified(justification({}), before=justification({"maxCount": 30})), ADMIN,
                     "only a justifier the policy lists", id="a justification set by a non-justifier is refused"),
        pytest.param(justified(justification({}), before=justification({"maxCount": 30})), KUBELET,
                     "only a justifier the policy lists", id="the node's own justification is refused"),
        pytest.param(justified(justification({}), before=justification({"maxCount": 30})), APPROVER, "allow",
                     id="a justifier sets a justification and the count it covers in one write"),
        pytest.param((csinode(driver(EBS, 25)), csinode(driver(EBS, 25), annotations={JUSTIFICATION: "[]"})),
                     KUBELET, "only a justifier the policy lists",
                     id="a justification added without a count change is judged too"),
        pytest.param((csinode(driver(EBS, 25), annotations={JUSTIFICATION: "[]"}), csinode(driver(EBS, 25))),
                     KUBELET, "skip", id="a justification removed is not judged"),
        pytest.param((csinode(driver(EBS, 25), annotations={JUSTIFICATION: justification({})}),
                      csinode(driver(EBS, 40), annotations={JUSTIFICATION: justification({})})),
                     ADMIN, IDENTITY, id="no managedFields time: the request time is unknown and nothing lifts"),
    ],
)
def test_a_justification_lifts_the_floor_only_while_unexpired_and_covering_the_count(
    engine: Evaluate, vap: dict[str, Any], case: tuple[dict[str, Any], dict[str, Any]],
    user: tuple[str, list[str]], expected: str,
) -> None:
    old, new = case
    outcome = floor_outcome(engine, vap, old, new, user=user)
    assert outcome == expected if expected in ("allow", "skip") else expected in outcome, outcome


@pytest.mark.parametrize(
    ("old", "new", "operation"),
    [
        pytest.param(None, csinode(), "CREATE", id="CREATE with spec.drivers null"),
        pytest.param(None, csinode(driver(EBS, INT32_MAX)), "CREATE", id="CREATE carrying int32 max"),
        pytest.param(csinode(driver(EBS, 25)), None, "DELETE", id="DELETE"),
        pytest.param(csinode(), csinode(driver(EBS, INT32_MAX)), "UPDATE",
                     id="a registration into spec.drivers null, even with int32 max"),
        pytest.param(csinode(driver("efs.csi.aws.com", None, allocatable=False)),
                     csinode(driver("efs.csi.aws.com", None, allocatable=False), driver(EBS, None, allocatable=False)),
                     "UPDATE", id="an unbounded registration next to another driver"),
        pytest.param(csinode(driver(EBS, 25)), csinode(), "UPDATE", id="the last driver's removal"),
        pytest.param(csinode(driver(EBS, 25)), csinode({**driver(EBS, 100), "nodeID": "i-0fedcba9876543210"}),
                     "UPDATE", id="a re-registration with another nodeID (the webhooks' boundary: a registration)"),
        pytest.param(csinode(driver(EBS, 25)), csinode({**driver(EBS, None, allocatable=False),
                                                        "topologyKeys": ["topology.ebs.csi.aws.com/zone"]}),
                     "UPDATE", id="a re-registration with other topologyKeys, unbounded"),
        pytest.param(csinode(driver(EBS, 25), driver("efs.csi.aws.com", 5)),
                     csinode(driver("efs.csi.aws.com", 5), driver(EBS, 25)), "UPDATE",
                     id="kubelet re-appending an unchanged driver (matched by name, not index)"),
        pytest.param(csinode(driver(EBS, 25)), csinode(driver(EBS, 25), annotations={"x": "y"}), "UPDATE",
                     id="an annotation edit"),
    ],
)
def test_the_floor_never_judges_create_delete_registration_or_removal(
    engine: Evaluate, vap: dict[str, Any], old: dict[str, Any] | None, new: dict[str, Any] | None, operation: str,
) -> None:
    assert floor_outcome(engine, vap, old, new, operation=operation, user=ADMIN) == "skip"


def test_drivers_are_matched_by_name_when_kubelet_reorders_them(engine: Evaluate, vap: dict[str, Any]) -> None:
    old = csinode(driver(EBS, 25), driver("efs.csi.aws.com", 100))
    new = csinode(driver("efs.csi.aws.com", 100), driver(EBS, INT32_MAX))
    assert CUTOFF in floor_outcome(engine, vap, old, new)
    lowered = csinode(driver("efs.csi.aws.com", 100), driver(EBS, 24))
    assert floor_outcome(engine, vap, old, lowered) == "allow"


def test_rules_the_policy_does_not_enforce_are_left_out(engine: Evaluate) -> None:
    doc = yaml.safe_load((REPO / "policies" / "default.yaml").read_text("utf-8"))
    doc["spec"]["rules"]["count-ceiling"]["enforcementAction"] = "warn"
    doc["spec"]["rules"]["writer-identity"]["enforcementAction"] = "dryrun"
    doc["spec"]["drivers"]["disk.csi.azure.com"]["rules"] = {"count-ceiling": {"enforcementAction": "deny"}}
    relaxed = build_validating_admission_policy(parse_policy(doc, "relaxed.yaml", REPO / "policies"))
    old, new = csinode(driver(EBS, 25)), csinode(driver(EBS, INT32_MAX))
    assert floor_outcome(engine, relaxed, old, new, user=ADMIN) == "allow"
    azure_old = csinode(driver("disk.csi.azure.com", 8))
    assert STEP in floor_outcome(engine, relaxed, azure_old, csinode(driver("disk.csi.azure.com", 30)))
    assert CEILING in floor_outcome(engine, relaxed, csinode(driver("disk.csi.azure.com", 60)),
                                    csinode(driver("disk.csi.azure.com", 65)))


def test_the_policys_writers_may_change_counts(engine: Evaluate) -> None:
    doc = yaml.safe_load((REPO / "policies" / "default.yaml").read_text("utf-8"))
    doc["spec"]["writers"] = {"users": ["alice"], "groups": ["storage-admins"],
                              "serviceAccounts": ["kube-system/fixer"]}
    with_writers = build_validating_admission_policy(parse_policy(doc, "writers.yaml", REPO / "policies"))
    old, new = csinode(driver(EBS, 25)), csinode(driver(EBS, 20))
    for user in (("alice", []), ("bob", ["storage-admins"]), ("system:serviceaccount:kube-system:fixer", [])):
        assert floor_outcome(engine, with_writers, old, new, user=user) == "allow", user
    assert IDENTITY in floor_outcome(engine, with_writers, old, new, user=("mallory", ["dev"]))


def test_a_scoped_policy_only_warns_and_audits() -> None:
    doc = yaml.safe_load((REPO / "policies" / "default.yaml").read_text("utf-8"))
    doc["spec"]["enforcementScope"] = {"nodeSelector": {"matchLabels": {"csinode-guard.io/enforce": "true"}}}
    scoped = parse_policy(doc, "scoped.yaml", REPO / "policies")
    assert build_binding(scoped)["spec"]["validationActions"] == ["Warn", "Audit"]
    assert build_binding(load_policy())["spec"] == {"policyName": VAP_NAME, "validationActions": ["Deny"]}


def test_the_highest_ceiling_covers_every_node_a_ceiling_can_resolve_to() -> None:
    policy = load_policy()
    assert highest_ceiling(policy.for_driver(EBS).ceiling) == 128
    assert highest_ceiling(policy.for_driver("disk.csi.azure.com").ceiling) == 64
    assert highest_ceiling(policy.for_driver("example.csi.io").ceiling) is None
    doc = yaml.safe_load((REPO / "policies" / "default.yaml").read_text("utf-8"))
    doc["spec"]["drivers"]["x.csi.io"] = {"ceiling": {"nodeLabel": "size", "values": {"a": 10, "b": 30}}}
    doc["spec"]["drivers"]["y.csi.io"] = {"ceiling": {"nodeLabel": "size", "values": {"a": 10}, "unknown": 12}}
    parsed = parse_policy(doc, "labels.yaml", REPO / "policies")
    assert highest_ceiling(parsed.for_driver("x.csi.io").ceiling) is None  # an unlisted size has no ceiling
    assert highest_ceiling(parsed.for_driver("y.csi.io").ceiling) == 12
    for node_labels in ({"size": "a"}, {"size": "b"}, {"size": "zzz"}, {}, None):
        resolved, _ = parsed.for_driver("y.csi.io").ceiling.resolve(node_labels)
        assert resolved is not None and resolved <= 12


# --- never an error, and never stricter than the guard -------------------------------------------------------

NAMES = st.sampled_from([EBS, "disk.csi.azure.com", "example.csi.io"])
COUNTS = st.one_of(st.integers(0, 200), st.sampled_from([INT32_MAX, INT32_MAX - 1]), st.none())


@st.composite
def entries(draw: st.DrawFn) -> list[dict[str, Any]]:
    names = draw(st.lists(NAMES, unique=True, max_size=3))
    out = []
    for name in names:
        count = draw(COUNTS)
        out.append(driver(name, count, allocatable=count is not None or draw(st.booleans())))
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(old=entries(), new=entries(), writer=st.sampled_from([KUBELET, ADMIN]),
       annotated=st.booleans(), operation=st.sampled_from(["UPDATE", "UPDATE", "CREATE", "DELETE"]))
def test_no_object_the_apiserver_can_produce_makes_an_expression_fail(
    vap: dict[str, Any], old: list[dict[str, Any]], new: list[dict[str, Any]], writer: tuple[str, list[str]],
    annotated: bool, operation: str,
) -> None:
    old_obj = None if operation == "CREATE" else csinode(*old)
    new_obj = None if operation == "DELETE" else csinode(*new, annotations={"a": "b"} if annotated else None)
    if new_obj is not None and not annotated:
        del new_obj["metadata"]["resourceVersion"]
    for evaluate in ENGINES.values():
        assert floor_outcome(evaluate, vap, old_obj, new_obj, operation=operation, user=writer) != "error"


FRAGMENTS = st.sampled_from(['{', '}', '"', '\\', '"driver"', ':', ',', '"ebs.csi.aws.com"', '"minCount"',
                             '"maxCount"', '"expires"', '0', '40', '99999999999', '"2026-12-01T01:00:00Z"',
                             '"2026-02-29T00:00:00Z"', '"9999-12-31T23:59:59-23:59"', ' ', '[', ']'])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=st.one_of(st.text(max_size=80), st.lists(FRAGMENTS, max_size=30).map("".join)),
       writer=st.sampled_from([KUBELET, ADMIN, APPROVER]))
def test_no_justification_annotation_makes_an_expression_fail(
    vap: dict[str, Any], value: str, writer: tuple[str, list[str]]
) -> None:
    for before in (None, "[]"):
        old, new = justified(value, before=before)
        for evaluate in ENGINES.values():
            assert floor_outcome(evaluate, vap, old, new, user=writer) != "error", value


KEYS = StateKeys([b"k" * 32])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(st.tuples(NAMES, COUNTS, st.sampled_from(["kubelet", "kubelet", "admin", "remove"])),
                      min_size=1, max_size=8))
def test_the_floor_never_refuses_what_the_guard_admits(
    vap: dict[str, Any], steps: list[tuple[str, int | None, str]],
) -> None:
    policy = load_policy()
    cluster = StaticClusterView(nodes={NODE: {"labels": {"node.kubernetes.io/instance-type": "m5.large"},
                                              "kubeletVersion": "v1.36.2"}})
    now = datetime(2026, 12, 1, tzinfo=UTC)
    stored: dict[str, Any] = csinode()
    for name, count, who in steps:
        now += timedelta(minutes=5)
        new = copy.deepcopy(stored)
        drivers = [d for d in (new["spec"]["drivers"] or []) if d["name"] != name]
        if who != "remove":
            drivers.append(driver(name, count, allocatable=count is not None))
        new["spec"]["drivers"] = drivers or None
        user = ADMIN if who == "admin" else KUBELET
        outcome = admit_write(stored, new, policy=policy, cluster=cluster, keys=KEYS, now=now,
                              uid=stored["metadata"]["uid"], username=user[0], groups=user[1])
        if not outcome.allowed or outcome.stored is None:
            continue
        for label, evaluate in ENGINES.items():
            floor = floor_outcome(evaluate, vap, stored, outcome.stored, user=user)
            assert floor in ("allow", "skip"), (label, stored["spec"], outcome.stored["spec"], user, floor)
        stored = outcome.stored


def _stamped(obj: dict[str, Any], when: datetime) -> dict[str, Any]:
    """``obj`` with the managedFields time the apiserver gives the writer's entry before admission."""
    stamped = copy.deepcopy(obj)
    stamped["metadata"]["managedFields"] = [{"manager": "writer", "operation": "Update", "time":
                                             when.strftime("%Y-%m-%dT%H:%M:%SZ"), "fieldsType": "FieldsV1",
                                             "fieldsV1": {}}]
    return stamped


@pytest.mark.parametrize("writer", [pytest.param(APPROVER, id="the approver in one write (as restore does)"),
                                    pytest.param(KUBELET, id="the node's kubelet after the approval")])
def test_the_floor_lets_through_a_justified_jump_the_guard_admits(
    engine: Evaluate, vap: dict[str, Any], writer: tuple[str, list[str]]
) -> None:
    policy = load_policy()
    cluster = StaticClusterView(nodes={NODE: {"labels": {"node.kubernetes.io/instance-type": "m7i.48xlarge"},
                                              "kubeletVersion": "v1.36.2"}})
    now = datetime(2026, 12, 1, tzinfo=UTC)
    kwargs: dict[str, Any] = {"policy": policy, "cluster": cluster, "keys": KEYS, "uid": csinode()["metadata"]["uid"]}
    first = admit_write(csinode(), csinode(driver(EBS, 25)), now=now, username=KUBELET[0], groups=KUBELET[1],
                        **kwargs)
    assert first.stored is not None
    stored = first.stored
    value = justification({"expires": (now + timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ")})
    if writer == KUBELET:  # the approver sets the justification first, with no count change
        approved = copy.deepcopy(stored)
        approved["metadata"].setdefault("annotations", {})[JUSTIFICATION] = value
        outcome = admit_write(stored, approved, now=now, username=APPROVER[0], groups=APPROVER[1], **kwargs)
        assert outcome.allowed and outcome.stored is not None
        stored = outcome.stored
    now += timedelta(minutes=5)
    jump = copy.deepcopy(stored)
    jump["spec"]["drivers"][0]["allocatable"]["count"] = 60  # 25 -> 60: above maxStepUp 16, justified
    jump["metadata"].setdefault("annotations", {})[JUSTIFICATION] = value
    outcome = admit_write(stored, jump, now=now, username=writer[0], groups=writer[1], **kwargs)
    assert outcome.allowed and outcome.stored is not None
    assert outcome.stored["spec"]["drivers"][0]["allocatable"]["count"] == 60
    floor = floor_outcome(engine, vap, _stamped(stored, now), _stamped(outcome.stored, now), user=writer)
    assert floor == "allow", floor


def test_the_cli_prints_the_comment_and_both_objects(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "webhook", "policy", "export", "--format", "vap"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    head = [line for line in out.splitlines() if line.startswith("#")]
    assert any("ebs.csi.aws.com:" in line and "at most 128" in line for line in head)
    assert any("count-rollback" in line for line in head) and any("change-rate" in line for line in head)
    docs = list(yaml.safe_load_all(out))
    assert [d["kind"] for d in docs] == ["ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]
    target = tmp_path / "floor.yaml"
    subprocess.run([sys.executable, "-m", "webhook", "policy", "export", "--format", "vap", "--output-file",
                    str(target)], capture_output=True, text=True, timeout=60, check=True)
    assert target.read_text("utf-8") == out
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: GuardPolicy\n", "utf-8")
    failed = subprocess.run([sys.executable, "-m", "webhook", "policy", "export", "--format", "vap",
                             "-f", str(bad)], capture_output=True, text=True, timeout=60, check=False)
    assert failed.returncode == 1 and "bad.yaml" in failed.stderr and not failed.stdout
