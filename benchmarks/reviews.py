"""Realistic kubelet CSINode AdmissionReviews for the benchmarks (about 6.6 KB each, with managedFields).

The six reviews of ``tests/data`` (no guard state yet) and four built from them the way the apiserver would see
them later: the stored object carries the guard's signed state annotation (written by an earlier /mutate whose
patch was applied), so /mutate verifies an HMAC, judges with history and signs the next state.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from tests.kube import EBS, apply_response, kubelet_update, review
from webhook.admission.cluster import UnknownClusterView
from webhook.admission.evaluation import Mode, evaluate
from webhook.admission.policy import load_policy
from webhook.admission.review import build_response, parse_review
from webhook.admission.state import StateKeys

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"
NOW = datetime(2026, 11, 30, 2, 0, tzinfo=UTC)
"""The clock of every benchmark evaluation (the reviews' objects were created the day before)."""
BENCH_KEY = bytes(range(32))
"""State HMAC key of the benchmarks (a fixed test key, nothing secret)."""
DATA_REVIEWS = ("register", "eni-25-to-23", "report-39", "unbounded", "drop-to-zero", "other-node")


@dataclass(frozen=True)
class BenchReview:
    """One AdmissionReview body and what it exercises."""

    name: str
    body: bytes


def _mutate(stored: dict[str, Any], new: dict[str, Any], keys: StateKeys, now: datetime) -> dict[str, Any]:
    """What the apiserver stores after /mutate admits ``new`` (the guard's patch applied)."""
    body = json.dumps(review(stored, new, uid="bench-setup")).encode()
    decision = evaluate(parse_review(body), load_policy(None), UnknownClusterView(), now, keys, mode=Mode.MUTATE)
    answer = build_response("bench-setup", decision.response, allow_patch=True)
    if not answer["response"]["allowed"]:
        raise RuntimeError(f"setup write refused: {answer['response']}")
    return apply_response(new, answer)


def realistic_reviews(keys: StateKeys | None = None) -> list[BenchReview]:
    """The benchmark reviews: the files of tests/data and four kubelet PUTs on an object with guard state."""
    keys = keys or StateKeys([BENCH_KEY])
    out = [BenchReview(name, (DATA / f"review-{name}.json").read_bytes()) for name in DATA_REVIEWS]
    template = json.loads((DATA / "review-eni-25-to-23.json").read_bytes())["request"]
    stored = template["oldObject"]
    earlier = NOW - timedelta(hours=2)
    stored = _mutate(stored, kubelet_update(stored, EBS, 23), keys, earlier)  # now carries signed state
    for name, count in (("state-23-to-25", 25), ("state-23-to-22", 22), ("state-23-to-39", 39),
                        ("state-23-to-unbounded", None)):
        doc = review(stored, kubelet_update(stored, EBS, count), uid=f"0d4c3b2a-{name}")
        doc["request"]["requestKind"] = template["requestKind"]
        out.append(BenchReview(name, json.dumps(doc).encode()))
    return out
