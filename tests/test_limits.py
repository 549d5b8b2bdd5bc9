"""Input at Python's own limits: integers beyond the 4300-digit conversion limit, counts beyond int32, nesting
past the recursion limit, and CSINodes with thousands of drivers. Each is refused cleanly or judged; none may
escape as an internal error (which admits the write unjudged), and no answer or audit record may grow with the
square of the input.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from benchmarks.reviews import BENCH_KEY, NOW
from tests.conftest import REPO
from tests.kube import EBS, base_csinode, driver_entry, kubelet_update, review, with_annotation
from webhook.admission.audit_records import build_records, encode_record
from webhook.admission.cluster import UnknownClusterView
from webhook.admission.evaluation import Decision, Mode, evaluate
from webhook.admission.policy import PolicyError, load_policy
from webhook.admission.review import ReviewError, build_response, parse_review
from webhook.admission.state import STATE_ANNOTATION, StateKeys, StateProblem
from webhook.serving.app import review_error_status

POLICY = load_policy(None)
KEYS = StateKeys([BENCH_KEY])
HUGE = "9" * 5000  # beyond int("...")'s default limit of 4300 digits: json.loads raises ValueError
VERSIONS = "csinode-guard.io/driver-versions"
OTHER_WRITER = "system:serviceaccount:kube-system:something"


def judge(doc: dict[str, Any], mode: Mode = Mode.MUTATE) -> Any:
    request = parse_review(json.dumps(doc).encode())
    return evaluate(request, POLICY, UnknownClusterView(), NOW, KEYS, mode=mode)


def stored() -> dict[str, Any]:
    return kubelet_update(base_csinode(), EBS, 25)


@pytest.mark.parametrize("mode", [Mode.MUTATE, Mode.VALIDATE])
def test_a_huge_integer_in_the_driver_versions_annotation_does_not_let_a_write_through_unjudged(mode: Mode) -> None:
    old = with_annotation(stored(), VERSIONS, f'{{"x": {HUGE}}}')
    new = with_annotation(kubelet_update(old, EBS, 39), VERSIONS, f'{{"x": {HUGE}}}')
    judged = judge(review(old, new), mode)
    assert judged.decision in (Decision.CLAMP, Decision.DENY)  # 39 is above the default ceiling of 27
    assert "count-ceiling" in judged.fired_rules
    other = judge(review(old, new, user=OTHER_WRITER), mode)
    assert other.decision is Decision.DENY and "writer-identity" in other.fired_rules


def test_a_huge_integer_in_the_state_annotation_is_a_malformed_state() -> None:
    old = with_annotation(stored(), STATE_ANNOTATION, f'{{"v": {HUGE}}}')
    judged = judge(review(old, kubelet_update(old, EBS, 23)))
    assert judged.state_problem is StateProblem.MALFORMED
    assert judged.decision is Decision.ALLOW  # a decrease by the node's kubelet, judged as new


def test_a_huge_integer_in_a_justification_is_refused_as_invalid() -> None:
    old = stored()
    new = with_annotation(kubelet_update(old, EBS, 39), "csinode-guard.io/justification", f'{{"minCount": {HUGE}}}')
    judged = judge(review(old, new, user="system:admin", groups=["system:masters"]))
    assert judged.decision in (Decision.INVALID, Decision.DENY)
    assert not judged.response.allowed


def test_a_huge_integer_anywhere_in_the_body_is_a_400_not_json() -> None:
    doc = review(stored(), kubelet_update(stored(), EBS, 23))
    doc["request"]["options"]["anything"] = int(HUGE[:4000])  # json.dumps writes it; the limit is on reading
    text = json.dumps(doc).replace(HUGE[:4000], HUGE)
    with pytest.raises(ReviewError, match="body is not JSON") as caught:
        parse_review(text.encode())
    assert review_error_status(caught.value) == 400


@pytest.mark.parametrize("digits", [20, 300, 400, 4000])
def test_a_count_beyond_int32_is_refused_whatever_its_size(digits: int) -> None:
    doc = review(stored(), kubelet_update(stored(), EBS, 23))
    doc["request"]["object"]["spec"]["drivers"][-1]["allocatable"]["count"] = int("9" * digits)
    judged = judge(doc)
    assert judged.decision is Decision.INVALID and judged.response.status_code == 400
    assert "allocatable.count must be an integer from 0 to 2147483647 (int32)" in judged.response.message


def test_kubelets_int32_cut_off_is_still_judged_by_count_ceiling() -> None:
    judged = judge(review(stored(), kubelet_update(stored(), EBS, 2147483647)))
    assert judged.decision is Decision.CLAMP and "count-ceiling" in judged.fired_rules


def _many(count: int, value: int) -> dict[str, Any]:
    obj = base_csinode()
    obj["spec"]["drivers"] = [driver_entry(f"d{i}.example.com", value) for i in range(count)]
    return obj


@pytest.mark.parametrize("mode", [Mode.MUTATE, Mode.VALIDATE])
def test_thousands_of_changed_drivers_give_answers_and_audit_records_linear_in_their_number(mode: Mode) -> None:
    sizes = {}
    for n in (200, 800):
        doc = review(_many(n, 10), _many(n, 11), user=OTHER_WRITER)  # every change violates writer-identity
        request = parse_review(json.dumps(doc).encode())
        judged = evaluate(request, POLICY, UnknownClusterView(), NOW, KEYS, mode=mode)
        assert judged.decision is Decision.DENY and len(judged.changes) == n
        answer = json.dumps(build_response(request.uid, judged.response, allow_patch=mode is Mode.MUTATE))
        records = build_records(judged, request, endpoint=mode, now=NOW, policy_hash=POLICY.hash,
                                policy_generation=1, latency_seconds=0.001)
        assert len(records) == n
        sizes[n] = (len(answer), sum(len(encode_record(r)) for r in records))
        own = [r for r in records if r["driver"] == "d7.example.com"]
        assert "d7.example.com" in own[0]["message"] and "d8.example.com" not in own[0]["message"]
    assert sizes[800][0] < 1.2 * sizes[200][0]  # the denial message keeps its first lines and counts the rest
    assert sizes[800][1] < 4 * 1.2 * sizes[200][1]  # 4x the changes: about 4x the audit bytes, not 16x


def test_a_change_refused_because_of_another_drivers_violation_says_so_in_its_record(tmp_path: Path) -> None:
    doc = yaml.safe_load((REPO / "policies" / "default.yaml").read_text())
    doc["spec"]["rules"]["count-ceiling"]["enforcementAction"] = "deny"
    # A listed writer: its denials stay denials (for the node's own kubelet a count rule's deny acts as a clamp).
    doc["spec"]["writers"] = {"users": ["count-operator"]}
    (tmp_path / "policy.yaml").write_text(yaml.safe_dump(doc))
    policy = load_policy(tmp_path / "policy.yaml")
    old = _many(3, 10)
    new = _many(3, 10)
    new["spec"]["drivers"][0]["allocatable"]["count"] = 9  # d0: a decrease, which passes every rule
    del new["spec"]["drivers"][1]["allocatable"]  # d1: 10 -> unbounded, denied by count-ceiling
    request = parse_review(json.dumps(review(old, new, user="count-operator")).encode())
    judged = evaluate(request, policy, UnknownClusterView(), NOW, KEYS, mode=Mode.MUTATE)
    assert judged.decision is Decision.DENY
    records = {r["driver"]: r for r in build_records(judged, request, endpoint=Mode.MUTATE, now=NOW,
                                                     policy_hash=policy.hash, policy_generation=1,
                                                     latency_seconds=0.001)}
    assert records["d1.example.com"]["message"] == judged.response.message  # its own line, the only one
    assert records["d0.example.com"]["message"] == (
        "refused with the request's other changes: a deny rule fired for d1.example.com"
    )
    assert records["d0.example.com"]["final"] == 10 and records["d0.example.com"]["allowed"] is False


@pytest.mark.parametrize(
    "text",
    [
        pytest.param(f"apiVersion: csinode-guard.io/v1alpha1\nkind: GuardPolicy\nmetadata: {{name: {HUGE}}}\n",
                     id="an integer of 5000 digits"),
        pytest.param("a: " + "[" * 5000 + "]" * 5000 + "\n", id="nesting of 5000 levels"),
    ],
)
def test_a_policy_at_pythons_limits_is_refused_with_policy_error(tmp_path: Path, text: str) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    with pytest.raises(PolicyError):
        load_policy(path)
    validate = subprocess.run([sys.executable, "-m", "webhook", "policy", "validate", str(path)],
                              check=False, capture_output=True, text=True, timeout=60)
    assert validate.returncode == 1, validate.stderr
    assert "Traceback" not in validate.stderr + validate.stdout
    serve = subprocess.run([sys.executable, "-m", "webhook", "serve", "--policy", str(path), "--offline",
                            "--cert-dir", str(tmp_path / "certs"), "--port", "0", "--metrics-port", "0"],
                           check=False, capture_output=True, text=True, timeout=60)
    assert serve.returncode == 2 and "Traceback" not in serve.stderr


def test_evaluate_cli_refuses_a_review_at_the_int_limit_as_unusable_input(tmp_path: Path) -> None:
    doc = review(stored(), kubelet_update(stored(), EBS, 23))
    path = tmp_path / "review.json"
    path.write_text(json.dumps(doc).replace('"dryRun": false', f'"dryRun": false, "x": {HUGE}'))
    result = subprocess.run([sys.executable, "-m", "webhook", "evaluate", "--review", str(path)],
                            check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "body is not JSON" in result.stderr and "Traceback" not in result.stderr


DEEP = "[" * 1010 + "]" * 1010  # within orjson's 1024 levels, beyond what str() or json's encoder can recurse


@pytest.mark.parametrize("mode", [Mode.MUTATE, Mode.VALIDATE])
@pytest.mark.parametrize("where", ["annotation", "uid", "nodeID"])
def test_deeply_nested_values_in_the_objects_are_refused_not_admitted(mode: Mode, where: str) -> None:
    old, new = stored(), kubelet_update(stored(), EBS, 2000)
    text = json.dumps(review(old, new, user=OTHER_WRITER))
    doc = json.loads(text)
    for side in ("object", "oldObject"):
        obj = doc["request"][side]
        if where == "annotation":
            obj["metadata"].setdefault("annotations", {})["x"] = "DEEP"
        elif where == "uid":
            obj["metadata"]["uid"] = "DEEP"
        else:
            obj["spec"]["drivers"][-1]["nodeID"] = "DEEP"
    body = json.dumps(doc).replace('"DEEP"', DEEP).encode()
    judged = evaluate(parse_review(body), POLICY, UnknownClusterView(), NOW, KEYS, mode=mode)
    assert judged.decision is Decision.INVALID and not judged.response.allowed


def test_a_deeply_nested_state_annotation_is_malformed_and_the_write_judged() -> None:
    old = with_annotation(stored(), STATE_ANNOTATION, "STATE")
    body = json.dumps(review(old, kubelet_update(old, EBS, 39)))
    body = body.replace('"STATE"', json.dumps('{"sig":"x","a":' + DEEP + "}"))
    judged = judge(json.loads(body))
    # malformed where json's encoder hits the recursion limit; a bad signature where the limit is higher
    assert judged.state_problem in (StateProblem.MALFORMED, StateProblem.BAD_SIGNATURE)
    assert judged.decision is Decision.CLAMP and "count-ceiling" in judged.fired_rules


@pytest.mark.parametrize("field", ["name", "subResource"])
def test_a_review_field_of_the_wrong_type_is_a_review_error(field: str) -> None:
    doc = review(stored(), kubelet_update(stored(), EBS, 23))
    doc["request"][field] = "DEEP"
    with pytest.raises(ReviewError, match=f"request.{field} must be a string"):
        parse_review(json.dumps(doc).replace('"DEEP"', DEEP).encode())


@pytest.mark.parametrize(
    ("edit", "profile", "cause"),
    [
        pytest.param({"evidence": {"resourceExhaustedWithin": "1000000d"}}, None, "at most 100 years",
                     id="a window beyond 100 years"),
        pytest.param({"rules": {"writer-version": {"freezeFor": "99999999999999999999h"}}}, None,
                     "at most 100 years", id="a freeze beyond 100 years"),
        pytest.param({"drivers": {123: {"maxStepUp": 4}}}, None, "not a valid policy",
                     id="a driver key that is not a string"),
        pytest.param(None, "default: .inf", "cannot convert float infinity",
                     id="an infinite ceiling in a driver profile"),
    ],
)
def test_a_policy_with_values_that_would_overflow_judging_is_refused(
    tmp_path: Path, edit: dict[str, Any] | None, profile: str | None, cause: str
) -> None:
    doc = yaml.safe_load((REPO / "policies" / "default.yaml").read_text())
    for key, value in (edit or {}).items():
        if key == "drivers":
            doc["spec"]["drivers"].update(value)
        elif key == "rules":
            for rule, settings in value.items():
                doc["spec"]["rules"][rule].update(settings)
        else:
            doc["spec"].setdefault(key, {}).update(value)
    (tmp_path / "profiles").mkdir()
    for path in (REPO / "policies" / "profiles").iterdir():
        text = path.read_text()
        if profile and path.name == "ebs.csi.aws.com.yaml":
            text = re.sub(r"(?m)^  default: .*$", f"  {profile}", text)
        (tmp_path / "profiles" / path.name).write_text(text)
    (tmp_path / "policy.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    with pytest.raises(PolicyError, match=cause):
        load_policy(tmp_path / "policy.yaml")
