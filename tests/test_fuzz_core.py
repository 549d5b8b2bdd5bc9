"""Fuzzing the review parser, the pipeline behind it and the policy loader (hypothesis).

Whatever the body: ``parse_review`` raises nothing but ``ReviewError``; a parsed review is judged without an
exception and answered with a well-formed AdmissionReview; ``decode_json`` gives exactly what ``json.loads``
gives (value or exception) but for its two documented differences. Whatever the policy document or file: the
loader raises nothing but ``PolicyError``. ``FUZZ_EXAMPLES`` sets the number of inputs per test (small in CI;
benchmarks/fuzz.py runs 100,000 and more).
"""

from __future__ import annotations

import copy
import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.reviews import BENCH_KEY, NOW
from tests.fuzzing import (
    FUZZ,
    FUZZ_POLICY,
    bodies,
    check_admission_review,
    check_decode_json,
    json_values,
    request_uid,
)
from webhook.admission.cluster import UnknownClusterView
from webhook.admission.evaluation import Mode, evaluate
from webhook.admission.policy import PolicyError, bundled_policy_path, load_policy, parse_policy
from webhook.admission.review import ReviewError, build_response, decode_json, parse_review
from webhook.admission.state import StateKeys
from webhook.serving.app import review_error_status

POLICY = load_policy(None)
KEYS = StateKeys([BENCH_KEY])
DEFAULT_POLICY_DOC = yaml.safe_load(bundled_policy_path().read_text())
CLOCKS = [NOW, NOW + timedelta(seconds=5), NOW + timedelta(hours=2), NOW + timedelta(days=400)]


json_texts = st.one_of(
    json_values.map(lambda v: json.dumps(v).encode("utf-8", "surrogatepass")),
    bodies(),
    st.sampled_from([b"[" * 600 + b"]" * 600, b"{\"a\":" * 999 + b"1" + b"}" * 999, b"12345678901234567890",
                     b"-9223372036854775809", b"1e400", b"NaN", b"\xef\xbb\xbf{}", "{}".encode("utf-16"),
                     b'"\\ud800"', b'"\xed\xa0\x80"', b"[1.5e308, -0.0, 5e-324]"]),
)


def test_decode_json_differences_are_the_documented_ones() -> None:
    assert decode_json(b"[18446744073709551616]") == [float(2**64)]
    assert decode_json(b"[18446744073709551615, -9223372036854775808]") == [2**64 - 1, -(2**63)]
    assert decode_json(b"[" * 1010 + b"]" * 1010) is not None
    check_decode_json(b"[" * 1030 + b"]" * 1030)  # beyond orjson's limit: json decides, whatever its limit is
    with pytest.raises(AssertionError, match="differs"):
        check_decode_json(b"[1]", decode=lambda _: [1.0])  # the check itself tells int from float
    review = json.loads((Path(__file__).parent / "data" / "review-report-39.json").read_text())
    review["request"]["object"]["spec"]["drivers"][-1]["allocatable"]["count"] = 10**20
    request = parse_review(json.dumps(review).encode())
    decision = evaluate(request, POLICY, UnknownClusterView(), NOW, KEYS, mode=Mode.MUTATE)
    assert decision.decision.value == "invalid" and not decision.response.allowed
    assert "allocatable.count must be an integer from 0 to 2147483647 (int32)" in decision.response.message


@FUZZ
@given(json_texts)
def test_decode_json_gives_what_json_loads_gives(text: bytes) -> None:
    check_decode_json(text)


@FUZZ
@given(bodies(), st.sampled_from(["mutate", "validate"]), st.sampled_from(CLOCKS))
def test_any_body_is_refused_with_review_error_or_answered_with_a_well_formed_review(
    body: bytes, mode: str, now: Any
) -> None:
    try:
        request = parse_review(body)
    except ReviewError as exc:
        assert review_error_status(exc) == 400 and exc.message
        return
    decision = evaluate(request, POLICY, UnknownClusterView(), now, KEYS, mode=Mode(mode))
    document = build_response(request.uid, decision.response, allow_patch=mode == "mutate")
    check_admission_review(json.loads(json.dumps(document)), mode=mode, uid=request_uid(body))


def _mutate_policy(doc: Any, draw: st.DrawFn) -> Any:
    paths: list[tuple[Any, ...]] = []

    def walk(node: Any, prefix: tuple[Any, ...]) -> None:
        paths.append(prefix)
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, (*prefix, k))
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, (*prefix, i))

    walk(doc, ())
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(paths[1:]))
        parent = doc
        try:
            for key in path[:-1]:
                parent = parent[key]
            if draw(st.booleans()) and isinstance(parent, dict):
                del parent[path[-1]]
            else:
                parent[path[-1]] = draw(json_values | st.sampled_from(["30s", "1h30m", "-5s", "deny", "clamp",
                                                                      "nope", "ebs.csi.aws.com", "v1.2.3"]))
        except (KeyError, IndexError, TypeError):
            continue
    return doc


@FUZZ_POLICY
@given(st.data())
def test_a_mutated_policy_document_loads_or_is_refused_with_policy_error(data: st.DataObject) -> None:
    doc = _mutate_policy(copy.deepcopy(DEFAULT_POLICY_DOC), data.draw)
    try:
        policy = parse_policy(doc, "fuzzed.yaml")
    except PolicyError as exc:
        assert exc.source == "fuzzed.yaml" and exc.constraint
        return
    assert policy.hash and policy.default_driver is not None


@FUZZ_POLICY
@given(data=st.data())
def test_any_policy_file_loads_or_is_refused_with_policy_error(tmp_path_factory: Any, data: st.DataObject) -> None:
    text = bundled_policy_path().read_bytes()
    kind = data.draw(st.sampled_from(["cut", "flip", "bytes", "yaml"]))
    if kind == "cut":
        text = text[: data.draw(st.integers(0, len(text)))]
    elif kind == "flip":
        raw = bytearray(text)
        for _ in range(data.draw(st.integers(1, 6))):
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
        text = bytes(raw)
    elif kind == "bytes":
        text = data.draw(st.binary(max_size=400))
    else:
        text = yaml.safe_dump(data.draw(json_values)).encode()
    path = Path(tmp_path_factory.mktemp("policy")) / "policy.yaml"
    path.write_bytes(text)
    try:
        load_policy(path)
    except PolicyError as exc:
        assert exc.source == str(path)


@pytest.mark.parametrize("depth", [pytest.param(400, id="400 levels"), pytest.param(5000, id="5000 levels")])
def test_a_deeply_nested_body_is_a_review_error_or_a_review(depth: int) -> None:
    body = b'{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":' + b'{"a":' * depth
    body += b"1" + b"}" * (depth + 1)
    with pytest.raises(ReviewError):
        parse_review(body)


# -- what fuzzing found (kept as plain regression tests) ---------------------------------------------------------


@pytest.mark.parametrize("spec", [pytest.param([], id="a list"), pytest.param(0, id="zero"),
                                  pytest.param("", id="an empty string"), pytest.param(None, id="null")])
def test_a_falsy_spec_that_is_no_object_is_judged_not_crashed_on(spec: Any) -> None:
    doc = json.loads((Path(__file__).parent / "data" / "review-report-39.json").read_bytes())
    doc["request"]["object"]["spec"] = spec
    request = parse_review(json.dumps(doc).encode())
    decision = evaluate(request, POLICY, UnknownClusterView(), NOW, KEYS, mode=Mode.MUTATE)
    check_admission_review(build_response(request.uid, decision.response, allow_patch=True), mode="mutate")


def test_a_signed_state_with_a_field_of_the_wrong_type_is_ignored_as_malformed() -> None:
    from webhook.admission.state import StateProblem, _canonical, decode_state  # noqa: PLC0415

    doc = {"v": 1, "uid": "u-1", "approvals": [],
           "drivers": {"ebs.csi.aws.com": {"count": 3, "changedAt": ["not", "a", "time"]}}}
    doc["sig"] = KEYS.sign(_canonical(doc))
    decoded = decode_state(_canonical(doc).decode(), "u-1", KEYS)
    assert decoded.state is None and decoded.problem is StateProblem.MALFORMED


def test_a_policy_file_that_is_not_utf8_is_refused_with_policy_error(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_bytes(b"apiVersion: csinode-guard.io/v1alpha1\nkind: \x80GuardPolicy\n")
    with pytest.raises(PolicyError, match="not UTF-8"):
        load_policy(path)
