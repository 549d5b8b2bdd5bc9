"""Run the benchmarks and print the results as Markdown: ``python -m benchmarks.run [--quick]``.

Sections (``--only core,served,spread,memory``, and ``audit`` and ``size`` on request): the pure core on
realistic reviews; the served webhook over TLS next to the no-op endpoint at 1 and 8 connections (``--audit-log
PATH``: where its audit records go); what building and writing the audit record costs per review (``audit``);
answer time and patch size against the drivers of one CSINode (``size``, :mod:`benchmarks.size_curve`); how few
long-lived connections spread over the workers;
RSS over many requests (``--memory-requests``, 1,000,000 by default, 50,000 with ``--quick``).
``--json FILE`` also writes every number. Targets (issue 5) are checked and printed; the exit code is 0
either way (these are measurements, not tests).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

CORE_TARGET_P50_US = 50.0
RATIO_TARGET = 0.9
P99_TARGET_US = 10_000.0
RSS_GROWTH_TARGET_PCT = 5.0


def machine() -> dict[str, Any]:
    """nproc, CPU model, Python, load average: what the numbers were measured on."""
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    wrk = shutil.which("wrk")
    return {
        "nproc": os.cpu_count(),
        "cpu": model,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average": os.getloadavg(),
        "load_generator": "wrk" if wrk else "python (install Debian's wrk for better numbers)",
    }


def _mark(ok: bool) -> str:
    return "met" if ok else "MISSED"


def section_core(quick: bool, out: dict[str, Any]) -> None:
    from benchmarks.core import run_core  # noqa: PLC0415

    results = run_core(iterations=2000 if quick else 20000, warmup=200 if quick else 1000)
    out["core"] = [asdict(r) for r in results]
    print("\n## Core: parse_review + evaluate + build_response (one thread, one CPU)\n")
    print("| review | decision | p50 µs | p99 µs | CPU p50 µs | samples |")
    print("|---|---|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r.name} | {r.decision} | {r.p50_us:.1f} | {r.p99_us:.1f} | {r.cpu_p50_us:.1f} | {r.samples} |")
    overall = next(r for r in results if r.name.startswith("tests/data"))
    print(f"\nTarget p50 <= {CORE_TARGET_P50_US:.0f} µs on the tests/data reviews: "
          f"{overall.p50_us:.1f} µs — {_mark(overall.p50_us <= CORE_TARGET_P50_US)}")


def section_served(quick: bool, out: dict[str, Any], audit_log: str | None = None) -> None:
    from benchmarks.served import Comparison, compare  # noqa: PLC0415

    comparisons, info = compare(rounds=2 if quick else 5, seconds=3.0 if quick else 6.0, audit_log=audit_log)
    out["served"] = {"info": info, "runs": []}
    print(f"\n## Served over TLS, keep-alive, {info['workers']} workers × {info['threads']} threads, "
          f"--connection-max-age {info['connection_max_age']:g} s, audit log to {info['audit_log']} "
          f"(load: {info['load_generator']}, alternating rounds)\n")
    print("| connections | endpoint | req/s | p50 µs | p99 µs | failed | guard/no-op |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for c in comparisons:
        g, n = Comparison.summary(c.guard), Comparison.summary(c.noop)
        out["served"]["runs"].append({"connections": c.connections, "guard": g, "noop": n, "ratio": c.ratio,
                                      "round_ratios": c.round_ratios})
        print(f"| {c.connections} | /noop | {n['rps']:.0f} | {n['p50_us']:.0f} | {n['p99_us']:.0f} | "
              f"{n['failed']} | |")
        print(f"| {c.connections} | /mutate | {g['rps']:.0f} | {g['p50_us']:.0f} | {g['p99_us']:.0f} | "
              f"{g['failed']} | {c.ratio:.2f} (rounds {', '.join(f'{x:.2f}' for x in c.round_ratios)}) |")
    for c in comparisons:
        print(f"\nTarget guard/no-op >= {RATIO_TARGET} at {c.connections} connection(s): {c.ratio:.2f} — "
              f"{_mark(c.ratio >= RATIO_TARGET)}")
    one = next((c for c in comparisons if c.connections == 1), None)
    if one is not None:
        p99 = Comparison.summary(one.guard)["p99_us"]
        print(f"Target /mutate p99 <= 10 ms at 1 connection: {p99 / 1000:.2f} ms — {_mark(p99 <= P99_TARGET_US)}")


def section_audit(quick: bool, out: dict[str, Any]) -> None:
    from benchmarks.audit_cost import run_cost  # noqa: PLC0415

    results, facts = run_cost(iterations=300 if quick else 3000, warmup=30 if quick else 300)
    out["audit"] = {"facts": facts, "steps": [asdict(r) for r in results]}
    print(f"\n## The audit record on the answer path: build + encode + write, per review ({facts['reviews']} "
          f"reviews, {facts['records_per_review']:.1f} records, {facts['bytes_per_review']:.0f} bytes each)\n")
    print("| step | p50 µs | p99 µs | CPU p50 µs | samples |")
    print("|---|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r.step} | {r.p50_us:.1f} | {r.p99_us:.1f} | {r.cpu_p50_us:.1f} | {r.samples} |")


def section_size(quick: bool, out: dict[str, Any]) -> None:
    from benchmarks.size_curve import SIZES, markdown, run_curve  # noqa: PLC0415

    rows = run_curve(SIZES[:5] if quick else SIZES, rounds=2 if quick else 3)
    out["size"] = rows
    print("\n## Size: answer time and patch size against the drivers of one CSINode (registration of N new "
          "drivers; one count change among N)")
    print(markdown(rows))


def section_spread(quick: bool, out: dict[str, Any]) -> None:
    from benchmarks.served import spread  # noqa: PLC0415

    seconds = 8.0 if quick else 20.0
    runs = [spread(0, seconds=seconds), spread(2.0, seconds=seconds)]
    out["spread"] = runs
    print(f"\n## Spread: 2 long-lived keep-alive connections for {seconds:.0f} s, 2 workers\n")
    print("| --connection-max-age | requests per worker | workers per connection | reconnects | failed |")
    print("|---|---|---|---|---:|")
    for r in runs:
        per_worker = ", ".join(str(v) for _, v in sorted(r["requests_per_worker"].items()))
        age = "0 (off)" if not r["connection_max_age"] else f"{r['connection_max_age']:g} s"
        print(f"| {age} | {per_worker} | {r['workers_per_connection']} | {r['reconnects']} | {r['failures']} |")


def section_memory(quick: bool, requests: int | None, out: dict[str, Any]) -> None:
    from benchmarks.served import memory  # noqa: PLC0415

    n = requests or (50_000 if quick else 1_000_000)
    result = memory(n, segment_seconds=5.0 if quick else 20.0)
    out["memory"] = result
    print(f"\n## Memory: RSS of the workers over {result['requests']:,} /mutate requests\n")
    print("| after | RSS (all workers) |")
    print("|---|---:|")
    samples = result["samples"]
    shown = samples[:: max(1, len(samples) // 12)]
    for done, rss in shown if shown[-1] == samples[-1] else [*shown, samples[-1]]:
        print(f"| {done:,} requests | {rss / 1024:.1f} MiB |")
    growth = result["growth_after_warmup_pct"]
    print(f"\nGrowth after warm-up ({result['warmup_requests']:,} requests): {growth:+.2f} % "
          f"(failed requests: {result['failed']}) — {_mark(abs(growth) < RSS_GROWTH_TARGET_PCT)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="short runs (about 2 minutes in all)")
    parser.add_argument("--only", default="core,served,spread,memory", help="comma-separated sections")
    parser.add_argument("--memory-requests", type=int, default=None, help="requests for the memory section")
    parser.add_argument("--audit-log", default=None,
                        help="the served section's --audit-log (default: a file; /dev/null to leave it out)")
    parser.add_argument("--json", type=Path, default=None, help="also write all numbers to this file")
    args = parser.parse_args(argv)
    out: dict[str, Any] = {"machine": machine(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    m = out["machine"]
    print(f"# csinode-guard benchmarks{' (quick)' if args.quick else ''}\n")
    print(f"Machine: {m['nproc']} CPUs ({m['cpu']}), Python {m['python']}, {m['platform']}; "
          f"load average at start {m['load_average'][0]:.2f}; load generator {m['load_generator']}.")
    sections = [s.strip() for s in args.only.split(",") if s.strip()]
    for name in sections:
        sys.stdout.flush()
        if name == "core":
            section_core(args.quick, out)
        elif name == "served":
            section_served(args.quick, out, args.audit_log)
        elif name == "audit":
            section_audit(args.quick, out)
        elif name == "size":
            section_size(args.quick, out)
        elif name == "spread":
            section_spread(args.quick, out)
        elif name == "memory":
            section_memory(args.quick, args.memory_requests, out)
        else:
            parser.error(f"unknown section {name!r}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
