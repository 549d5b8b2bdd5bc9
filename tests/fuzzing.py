"""Fuzzing strategies and answer checks shared by tests/test_fuzz_*.py and the long run (benchmarks/fuzz.py).

Inputs start from the realistic kubelet reviews (tests/data and reviews whose objects carry the guard's signed
state) and mutate them structurally: a value anywhere replaced by any JSON value, a key removed, a list entry
duplicated; bodies are also cut short, bit-flipped, or arbitrary bytes. ``FUZZ_EXAMPLES`` (environment) sets
hypothesis' ``max_examples`` per test: small in CI, 25,000 in the long run.
"""

from __future__ import annotations

import base64
import copy
import json
import math
import os
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from benchmarks.reviews import realistic_reviews
from webhook.admission.review import decode_json

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
FUZZ_POLICY = settings(FUZZ, max_examples=max(50, EXAMPLES // 10))
"""Policy loading validates against the JSON Schema (milliseconds per input): a tenth of the inputs."""
BASE_BODIES = [r.body for r in realistic_reviews()]
BASE_DOCS = [json.loads(b) for b in BASE_BODIES]

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from([0, 1, -1, 25, 27, 2147483647, 2147483648, 2**63, 2**64])
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
    | st.sampled_from(["", "UPDATE", "CREATE", "system:node:other", "system:nodes", "ebs.csi.aws.com", "v0.1.0",
                       "v99.0.0", "not-a-version", "2026-11-30T02:00:00Z", "{}", "[]", "\u2028", "a/b~c"])
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(doc, dict):
        for key, value in doc.items():
            out += _paths(value, (*prefix, key))
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            out += _paths(value, (*prefix, i))
    return out


@st.composite
def mutated_reviews(draw: st.DrawFn) -> Any:
    """A realistic review with 0-4 structural mutations anywhere in it."""
    doc = copy.deepcopy(draw(st.sampled_from(BASE_DOCS)))
    for _ in range(draw(st.integers(0, 4))):
        paths = _paths(doc)[1:]
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        action = draw(st.sampled_from(["set", "set", "delete", "duplicate"]))
        if action == "delete" and isinstance(parent, dict):
            del parent[path[-1]]
        elif action == "duplicate" and isinstance(parent, list):
            parent.append(copy.deepcopy(parent[path[-1]]))
        else:
            parent[path[-1]] = draw(json_values)
    return doc


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    """HTTP bodies: mutated reviews as JSON, cut or bit-flipped realistic bodies, or arbitrary bytes."""
    kind = draw(st.sampled_from(["review", "review", "review", "cut", "flip", "bytes", "json"]))
    if kind == "review":
        return json.dumps(draw(mutated_reviews())).encode("utf-8", "surrogatepass")
    if kind == "json":
        return json.dumps(draw(json_values)).encode("utf-8", "surrogatepass")
    if kind == "bytes":
        return draw(st.binary(max_size=300))
    body = bytearray(draw(st.sampled_from(BASE_BODIES)))
    if kind == "cut":
        return bytes(body[: draw(st.integers(0, len(body)))])
    for _ in range(draw(st.integers(1, 8))):
        i = draw(st.integers(0, len(body) - 1))
        body[i] ^= 1 << draw(st.integers(0, 7))
    return bytes(body)


def request_uid(body: bytes) -> Any:
    """The request uid the body carries, if it is a JSON object with one."""
    try:
        return json.loads(body)["request"]["uid"]
    except Exception:
        return None


def check_admission_review(document: Any, *, mode: str, uid: Any = None) -> None:
    """Assert ``document`` is a well-formed AdmissionReview answer (echoes, status, warnings, patch rules)."""
    assert isinstance(document, dict), document
    assert document.get("apiVersion") == "admission.k8s.io/v1"
    assert document.get("kind") == "AdmissionReview"
    response = document["response"]
    assert isinstance(response["uid"], str) and response["uid"]
    if uid is not None:
        assert response["uid"] == uid
    assert isinstance(response["allowed"], bool)
    if not response["allowed"]:
        status = response["status"]
        assert status["code"] in (400, 403, 422) and isinstance(status["message"], str) and status["message"]
    for warning in response.get("warnings", []):
        assert isinstance(warning, str) and len(warning) <= 256 and "\n" not in warning
        assert "internal error" not in warning, warning
    for key in response.get("auditAnnotations", {}):
        assert "/" not in key
    if "patch" in response or "patchType" in response:
        assert mode == "mutate" and response["allowed"] and response["patchType"] == "JSONPatch"
        ops = json.loads(base64.b64decode(response["patch"], validate=True))
        assert isinstance(ops, list) and ops
        for op in ops:
            assert op["op"] in ("add", "replace", "remove") and op["path"].startswith("/")


def check_http_answer(status: int, content_type: str, body: bytes, *, path: str, uid: Any) -> None:
    """Every answer: an AdmissionReview (200 from /mutate or /validate) or a 4xx JSON error; never 5xx."""
    assert status < 500, (status, body[:300])
    assert content_type.startswith("application/json"), content_type
    document = json.loads(body)
    if status == 200 and path.split("?", maxsplit=1)[0] in ("/mutate", "/validate"):
        check_admission_review(document, mode=path.split("?", maxsplit=1)[0].lstrip("/"), uid=uid)
    elif status >= 400:
        assert document["code"] == status and isinstance(document["error"], str), document


INT64_MIN, UINT64_MAX = -(2**63), 2**64 - 1


def _same(a: Any, b: Any) -> bool:
    """Equal JSON values, NaN equal to NaN, int distinct from float (1 vs 1.0); iterative (deep input).

    ``b`` may hold a float where ``a`` holds an integer beyond 64 bits (decode_json's documented difference),
    and only there.
    """
    pending = [(a, b)]
    while pending:
        x, y = pending.pop()
        if type(x) is int and type(y) is float and not INT64_MIN <= x <= UINT64_MAX:
            if float(x) != y:
                return False
            continue
        if type(x) is not type(y):
            return False
        if isinstance(x, float):
            if not (x == y or (math.isnan(x) and math.isnan(y))):
                return False
        elif isinstance(x, list):
            if len(x) != len(y):
                return False
            pending.extend(zip(x, y, strict=True))
        elif isinstance(x, dict):
            if list(x) != list(y):
                return False
            pending.extend((x[k], y[k]) for k in x)
        elif x != y:
            return False
    return True


def nesting_depth(text: bytes) -> int:
    """Deepest nesting of ``[``/``{`` outside JSON strings."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in text:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:
                escaped = True
            elif byte == 0x22:
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        elif byte in b"]}":
            depth -= 1
    return deepest


def check_decode_json(text: bytes, decode: Callable[[bytes], Any] = decode_json) -> None:
    """Assert ``decode(text)`` gives what ``json.loads(text)`` gives: the same value (integers beyond 64 bits
    may be floats) or the same exception type, or a value where json's recursion limit refuses nesting of at
    most 1024 levels (decode_json's documented differences)."""
    try:
        expected: tuple[str, Any] = ("value", json.loads(text))
    except Exception as exc:  # the same exception type is part of the contract
        expected = ("error", type(exc).__name__)
    try:
        actual: tuple[str, Any] = ("value", decode(text))
    except Exception as exc:
        actual = ("error", type(exc).__name__)
    if expected == ("error", "RecursionError") and actual[0] == "value":
        assert nesting_depth(text) <= 1024, "decode_json decoded nesting deeper than 1024 levels"
        return
    assert expected[0] == actual[0], f"decode_json differs from json.loads: {expected[1]!r} vs {actual[1]!r}"
    if expected[0] == "value":
        assert _same(expected[1], actual[1]), "decode_json differs from json.loads"
    else:
        assert expected[1] == actual[1], f"decode_json differs from json.loads: {expected[1]} vs {actual[1]}"
