"""Core benchmark: ``parse_review`` + ``evaluate`` + ``build_response`` on realistic reviews, in one thread.

Each iteration decodes the HTTP body (JSON included), judges it with the bundled default policy and builds the
AdmissionReview answer, as /mutate does for one request. The process is pinned to one CPU and its startup
objects are frozen out of the garbage collector and the youngest generation's threshold is raised, as the server
does in each worker (``webhook.serving.gctuning.settle_for_requests``).
Reported per review and over all of them: p50 and p99 of wall-clock microseconds per iteration, and the p50 of
the thread's CPU time (what the iteration cost the CPU, whatever else the machine was doing).
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from dataclasses import dataclass

from benchmarks.reviews import BENCH_KEY, DATA_REVIEWS, NOW, realistic_reviews
from webhook.admission.cluster import UnknownClusterView
from webhook.admission.evaluation import Mode, evaluate
from webhook.admission.policy import load_policy
from webhook.admission.review import build_response, parse_review
from webhook.admission.state import StateKeys
from webhook.serving.gctuning import settle_for_requests


@dataclass(frozen=True)
class CoreResult:
    """Microseconds per review for one review (or ``all``)."""

    name: str
    decision: str
    p50_us: float
    p99_us: float
    cpu_p50_us: float
    samples: int


def _percentile(sorted_values: list[float], q: float) -> float:
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]


def run_core(iterations: int = 20000, warmup: int = 500) -> list[CoreResult]:
    """Measure every realistic review ``iterations`` times (round robin); returns per review and ``all``."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    policy = load_policy(None)
    keys = StateKeys([BENCH_KEY])
    cluster = UnknownClusterView()
    reviews = realistic_reviews(keys)
    decisions = {}
    for review in reviews:
        request = parse_review(review.body)
        decisions[review.name] = evaluate(request, policy, cluster, NOW, keys, mode=Mode.MUTATE).decision.value
    thresholds = gc.get_threshold()
    settle_for_requests()
    wall: dict[str, list[float]] = {r.name: [] for r in reviews}
    cpu: dict[str, list[float]] = {r.name: [] for r in reviews}
    perf, thread_time = time.perf_counter_ns, time.thread_time_ns
    for i in range(warmup + iterations):
        for review in reviews:
            c0 = thread_time()  # the CPU clock is a system call: read outside the wall-clock interval
            t0 = perf()
            request = parse_review(review.body)
            decision = evaluate(request, policy, cluster, NOW, keys, mode=Mode.MUTATE)
            build_response(request.uid, decision.response, allow_patch=True)
            t1 = perf()
            c1 = thread_time()
            if i >= warmup:
                wall[review.name].append((t1 - t0) / 1000)
                cpu[review.name].append((c1 - c0) / 1000)
    gc.unfreeze()
    gc.set_threshold(*thresholds)
    results = []
    for name, samples in wall.items():
        w, c = sorted(samples), sorted(cpu[name])
        results.append(CoreResult(name, decisions[name], _percentile(w, 0.5), _percentile(w, 0.99),
                                  statistics.median(c), len(w)))
    for label, names in (("tests/data (6)", DATA_REVIEWS), ("all (10)", tuple(wall))):
        w = sorted(v for n in names for v in wall[n])
        c = sorted(v for n in names for v in cpu[n])
        results.append(CoreResult(label, "", _percentile(w, 0.5), _percentile(w, 0.99), statistics.median(c), len(w)))
    return results
