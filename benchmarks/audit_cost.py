"""What the audit record costs on the answer path: build + encode + write, per review, per destination.

    python -m benchmarks.audit_cost [--iterations 3000] [--warmup 300]

/mutate writes a decision's audit records before it answers (:func:`webhook.serving.app._audit`), so that a
worker killed at any moment has lost no answered request's record. This measures that step alone, in one
thread pinned to one CPU, for the realistic reviews of :mod:`benchmarks.reviews` (each judged once beforehand
by the bundled policy, as /mutate would):

* ``build``: :func:`webhook.admission.audit_records.build_records` (the record dicts);
* ``encode``: :func:`webhook.admission.audit_records.encode_record` of each (the JSON lines);
* ``write`` to each destination: :meth:`webhook.serving.audit_writer.AuditWriter.write` (encodes again, then one
  ``os.write`` per line), to a regular file opened ``O_APPEND`` (in the system temporary directory), to a named
  pipe drained by another process (``cat``; what standard output is under a container runtime, the default),
  and to ``/dev/null``;
* ``total`` = build + write, what the answer waits for.

Prints p50 and p99 microseconds per review (wall clock) and the CPU-time p50 for each, and the load average.
Bounded: iterations x 10 reviews per step and destination; local files only.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.reviews import BENCH_KEY, NOW, realistic_reviews
from webhook.admission.audit_records import build_records, encode_record
from webhook.admission.cluster import UnknownClusterView
from webhook.admission.decision import AdmissionDecision
from webhook.admission.evaluation import Mode, evaluate
from webhook.admission.policy import load_policy
from webhook.admission.review import AdmissionRequest, parse_review
from webhook.admission.state import StateKeys
from webhook.serving.audit_writer import AuditWriter
from webhook.serving.gctuning import settle_for_requests


@dataclass(frozen=True)
class CostResult:
    """Microseconds per review of one step (``build``, ``encode``, ``write <dest>``, ``total <dest>``): wall-clock
    p50 and p99, and the p50 of the thread's CPU time (what it cost the CPU, whatever else the machine did)."""

    step: str
    p50_us: float
    p99_us: float
    cpu_p50_us: float
    samples: int


def _percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))]


def _judged() -> list[tuple[AdmissionDecision, AdmissionRequest]]:
    policy = load_policy(None)
    keys = StateKeys([BENCH_KEY])
    out = []
    for review in realistic_reviews(keys):
        request = parse_review(review.body)
        out.append((evaluate(request, policy, UnknownClusterView(), NOW, keys, mode=Mode.MUTATE), request))
    return out


def _records(decision: AdmissionDecision, request: AdmissionRequest) -> list[dict[str, Any]]:
    return build_records(decision, request, endpoint=Mode.MUTATE, now=NOW, policy_hash="0" * 64,
                         policy_generation=1, latency_seconds=0.0005)


def _time(step: Callable[[AdmissionDecision, AdmissionRequest], object],
          judged: list[tuple[AdmissionDecision, AdmissionRequest]], iterations: int,
          warmup: int) -> tuple[list[float], list[float]]:
    """Sorted wall-clock and thread-CPU microseconds of ``step`` per review."""
    perf, thread_time = time.perf_counter_ns, time.thread_time_ns
    wall, cpu = [], []
    for i in range(warmup + iterations):
        for decision, request in judged:
            c0 = thread_time()  # a system call: read outside the wall-clock interval
            t0 = perf()
            step(decision, request)
            t1 = perf()
            c1 = thread_time()
            if i >= warmup:
                wall.append((t1 - t0) / 1000)
                cpu.append((c1 - c0) / 1000)
    return sorted(wall), sorted(cpu)


def run_cost(iterations: int = 3000, warmup: int = 300) -> tuple[list[CostResult], dict[str, Any]]:
    """Measure every step and destination; returns the results and facts (records and bytes per review)."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    judged = _judged()
    lines = [[encode_record(r) for r in _records(d, q)] for d, q in judged]
    facts = {"reviews": len(judged), "records_per_review": sum(map(len, lines)) / len(lines),
             "bytes_per_review": sum(len(x) for ls in lines for x in ls) / len(lines)}
    settle_for_requests()
    results: list[CostResult] = []

    def add(step: str, timed: tuple[list[float], list[float]]) -> None:
        wall, cpu = timed
        results.append(CostResult(step, _percentile(wall, 0.5), _percentile(wall, 0.99), _percentile(cpu, 0.5),
                                  len(wall)))

    add("build", _time(_records, judged, iterations, warmup))
    prebuilt = {id(q): _records(d, q) for d, q in judged}
    add("encode", _time(lambda d, q: [encode_record(r) for r in prebuilt[id(q)]], judged, iterations, warmup))
    with tempfile.TemporaryDirectory(prefix="audit-cost-") as tmp:
        fifo = Path(tmp) / "audit.fifo"
        os.mkfifo(fifo)
        reader = subprocess.Popen(["cat", str(fifo)], stdout=subprocess.DEVNULL)
        try:
            for name, path in (("file", str(Path(tmp) / "audit.log")), ("pipe", str(fifo)),
                               ("/dev/null", os.devnull)):
                writer = AuditWriter(path)

                def write(d: AdmissionDecision, q: AdmissionRequest, w: AuditWriter = writer) -> int:
                    return w.write(prebuilt[id(q)])

                def total(d: AdmissionDecision, q: AdmissionRequest, w: AuditWriter = writer) -> int:
                    return w.write(_records(d, q))

                try:
                    add(f"write {name} ({writer.kind})", _time(write, judged, iterations, warmup))
                    add(f"total {name}", _time(total, judged, iterations, warmup))
                finally:
                    writer.close()
        finally:
            reader.terminate()
            reader.wait(timeout=10)
    return results, facts


def main() -> None:
    """Run and print one table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=3000)
    parser.add_argument("--warmup", type=int, default=300)
    args = parser.parse_args()
    before = os.getloadavg()
    results, facts = run_cost(args.iterations, args.warmup)
    print(f"load average before {before[0]:.2f}, after {os.getloadavg()[0]:.2f}; {facts['reviews']} reviews, "
          f"{facts['records_per_review']:.1f} records and {facts['bytes_per_review']:.0f} bytes per review\n")
    print("| step | p50 µs | p99 µs | CPU p50 µs | samples |")
    print("|---|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r.step} | {r.p50_us:.1f} | {r.p99_us:.1f} | {r.cpu_p50_us:.1f} | {r.samples} |")


if __name__ == "__main__":
    main()
