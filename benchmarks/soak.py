"""kubelet's real rhythm for minutes: CSINode refreshes every 10 s on many nodes, through the guard and without it.

``python -m benchmarks.soak [--nodes 50] [--minutes 10] [--phases guard,none] [--seed 1] [--json FILE]``
(``--minutes 1 --nodes 10`` for a quick check, about 4 minutes with both phases).

A real control plane from ``../shared/k8s`` (or ``KUBEBUILDER_ASSETS``, as ``tests/k8s``) and a real
``csinode-guard serve --kubeconfig`` (default policy, 2 workers) registered with ``csinode-guard register --url``.
Every node is a Node with a CSINode where ``kubelet-csinode install`` registered ``ebs.csi.aws.com`` at 20 (through
the guard). Each phase then runs, per node, one ``kubelet-csinode update --interval 10s --max-volumes-file F``
process: kubelet's own ``nodeinfomanager`` code, the KEP-4876 periodic refresh (GET the CSINode; no write when the
entry is unchanged; otherwise UPDATE it, as ``system:node:<name>``), the loops started at random moments of the
first interval like kubelets started at different times. While they run, a schedule drawn from ``--seed``
rewrites some nodes' files at random moments to a new value, up or down by 1-6 (``--changes-per-minute`` across
all nodes, values kept in 4..40, so some go past the default ceiling of 27 for an unknown EBS instance type).

Phases, on separate nodes of the same cluster, with the same schedule (same offsets, same node indices, same
values):

- ``guard``: the guard registered (mutating and validating). The default policy clamps the node's own kubelet's
  increases back to the stored count within change-rate's ``minInterval`` (60 s) and to the ceiling; decreases
  are admitted. kubelet retries on its next tick while the file differs from what is stored.
- ``none``: no webhook registered (the guard unregistered, still running).

Reported per phase: kubelet's updates that failed (``FAILED`` lines on its stderr and its exit code; must be 0),
the OK ticks; the apiserver's own counters from ``/metrics`` over the phase: ``apiserver_request_total`` for the
CSINode PUTs it answered, and
``etcd_requests_total{group="storage.k8s.io",resource="csinodes",operation="update"}`` for the writes it sent to
etcd (the apiserver skips etcd for a PUT whose admitted object equals the stored one: ``GuaranteedUpdate``
compares the bytes, and the counter counts only the transactions it sends); with the guard, its audit records of
``/mutate`` sorted into admitted changes, clamps back to the stored count, clamps to another count. The claim
checked: with the guard, etcd updates = PUTs - clamps back to the stored count (such a clamp writes nothing).

Through the guard phase the guard's RSS (the sum over all its processes: the gunicorn arbiter and workers, from
``/proc``) is sampled every 10 s: start, end, max, and the least-squares slope in MB per 10 minutes (over the
whole phase and over its second half, after the caches and allocator have warmed). ``uptime``'s load average is
printed at the start and the end. These are measurements: the exit code is 1 only when a kubelet update failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.apiserver import node_client, uptime
from tests.k8s.controlplane import ControlPlane, Guard, running_control_plane, running_guard

EBS = "ebs.csi.aws.com"
INITIAL = 20
LOW, HIGH = 4, 40
SAMPLE_SECONDS = 10.0


@dataclass(frozen=True)
class Change:
    """One rewrite of a node's ``--max-volumes-file``: at ``at`` seconds into the phase, node ``node`` (its index)
    gets ``value``."""

    at: float
    node: int
    value: int


def schedule(nodes: int, seconds: float, per_minute: float, seed: int) -> list[Change]:
    """The file rewrites of one phase, sorted by time: ``per_minute`` across ``nodes`` nodes on average (uniform
    moments), each a step of 1-6 up or down from that node's previous value, kept in ``LOW..HIGH``."""
    rng = random.Random(seed)
    values = [INITIAL] * nodes
    total = round(per_minute * seconds / 60)
    moments = sorted(rng.uniform(5.0, seconds - 5.0) for _ in range(total))
    out = []
    for at in moments:
        node = rng.randrange(nodes)
        step = rng.randint(1, 6) * rng.choice((-1, 1))
        value = min(HIGH, max(LOW, values[node] + step))
        if value == values[node]:
            value = values[node] - step
        values[node] = value
        out.append(Change(at, node, value))
    return out


def metric_values(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """``(labels, value)`` of every sample of metric ``name`` in a Prometheus text exposition."""
    out = []
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        labels_text, value = line[len(name) + 1:].rsplit("} ", 1)
        labels = {}
        for part in labels_text.split('",'):
            if "=" in part:
                k, v = part.split("=", 1)
                labels[k] = v.strip('"')
        out.append((labels, float(value)))
    return out


def write_counters(metrics: str) -> dict[str, float]:
    """The apiserver's CSINode counters from its ``/metrics``: PUTs answered by code, GETs, and etcd updates."""
    out: dict[str, float] = {}
    for labels, value in metric_values(metrics, "apiserver_request_total"):
        if labels.get("resource") == "csinodes" and not labels.get("subresource"):
            key = f"{labels.get('verb')} {labels.get('code')}"
            out[key] = out.get(key, 0.0) + value
    for labels, value in metric_values(metrics, "etcd_requests_total"):
        if labels.get("resource") == "csinodes" and labels.get("group") == "storage.k8s.io":
            key = f"etcd {labels.get('operation')}"
            out[key] = out.get(key, 0.0) + value
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    """``after - before`` for every counter that moved."""
    return {k: round(v - before.get(k, 0.0)) for k, v in sorted(after.items()) if v - before.get(k, 0.0)}


def group_rss_mb(pgid: int) -> float:
    """The summed resident set (MB) of every process in process group ``pgid`` (``/proc/*/stat``, ``VmRSS``)."""
    total_kb = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[2]) != pgid:  # pgrp, the 5th field of stat
                continue
            for line in (entry / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total_kb += int(line.split()[1])
    return total_kb / 1024


def slope_per_10min(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of ``(seconds, MB)`` samples, in MB per 10 minutes (0.0 for fewer than 2)."""
    if len(samples) < 2:
        return 0.0
    n = len(samples)
    mt = sum(t for t, _ in samples) / n
    mv = sum(v for _, v in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    if var == 0:
        return 0.0
    return sum((t - mt) * (v - mv) for t, v in samples) / var * 600


@dataclass
class PhaseResult:
    """What one phase measured."""

    phase: str
    seconds: float = 0.0
    ok_ticks: int = 0
    failed: int = 0
    failed_lines: list[str] = field(default_factory=list)
    exit_codes: dict[str, int] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)
    decisions: dict[str, int] = field(default_factory=dict)
    rss: list[tuple[float, float]] = field(default_factory=list)
    changes: int = 0

    def summary(self) -> dict[str, Any]:
        """JSON-ready numbers, with the RSS figures."""
        out: dict[str, Any] = {
            "phase": self.phase, "seconds": round(self.seconds, 1), "ok_ticks": self.ok_ticks,
            "failed_updates": self.failed, "failed_lines": self.failed_lines[:20],
            "exit_codes": self.exit_codes, "file_rewrites": self.changes,
            "apiserver": self.counters, "guard_mutate_records": self.decisions,
        }
        if self.rss:
            values = [v for _, v in self.rss]
            half = [s for s in self.rss if s[0] >= self.rss[-1][0] / 2]
            out["guard_rss_mb"] = {
                "start": round(values[0], 1), "end": round(values[-1], 1), "max": round(max(values), 1),
                "slope_mb_per_10min": round(slope_per_10min(self.rss), 2),
                "slope_second_half_mb_per_10min": round(slope_per_10min(half), 2),
                "samples": [(round(t), round(v, 1)) for t, v in self.rss],
            }
        return out


def mutate_tally(records: list[dict[str, Any]], nodes: set[str]) -> dict[str, int]:
    """``/mutate``'s audit records of ``nodes`` sorted by what happened to the count: ``unchanged`` (no count
    change), ``admitted`` (stored as asked), ``clamped-to-stored`` (held at the stored count),
    ``clamped-other`` (stored, but another count than asked), ``refused``."""
    out: dict[str, int] = {}
    for r in records:
        if r.get("endpoint") != "mutate" or r.get("node") not in nodes or r.get("dryRun"):
            continue
        if r.get("change") is None:
            kind = "unchanged"
        elif not r.get("allowed"):
            kind = "refused"
        elif r.get("final") == r.get("new"):
            kind = "admitted"
        elif r.get("final") == r.get("old"):
            kind = "clamped-to-stored"
        else:
            kind = "clamped-other"
        out[kind] = out.get(kind, 0) + 1
    return out


def run_phase(cp: ControlPlane, phase: str, names: list[str], files: Path, minutes: float, interval: float,
              changes: list[Change], guard: Guard | None, seed: int) -> PhaseResult:
    """One phase: a ``kubelet-csinode update`` loop per node in ``names`` for ``minutes``, ``changes`` applied
    to their files on time; the guard's RSS sampled when ``guard`` is given. Returns its numbers."""
    result = PhaseResult(phase, changes=len(changes))
    paths = []
    for name in names:
        path = files / f"{name}.max"
        path.write_text(f"{INITIAL}\n")
        paths.append(path)
    ticks = max(1, round(minutes * 60 / interval))
    rng = random.Random(seed + 1)
    delays = [rng.uniform(0, interval) for _ in names]
    admin = node_client(cp.kas_url, cp.kubeconfig, f"admin-{phase}", files)
    before = write_counters(admin.pool.request("GET", "/metrics").data.decode())
    seen = len(guard.decisions()) if guard else 0
    logs = files / phase
    logs.mkdir()
    procs: list[tuple[str, subprocess.Popen[bytes]]] = []
    started = time.monotonic()
    stop_sampling = threading.Event()

    def sample() -> None:
        assert guard is not None and guard.process is not None
        while True:
            result.rss.append((time.monotonic() - started, group_rss_mb(guard.process.pid)))
            if stop_sampling.wait(SAMPLE_SECONDS):
                return

    sampler = threading.Thread(target=sample, daemon=True) if guard else None
    if sampler:
        sampler.start()

    def launch() -> None:
        for name, path, delay in sorted(zip(names, paths, delays, strict=True), key=lambda x: x[2]):
            time.sleep(max(0.0, started + delay - time.monotonic()))
            cmd = [str(cp.kubelet_csinode), "--kubeconfig", str(cp.node_kubeconfig(name)), "--node", name,
                   "update", "--driver", EBS, "--max-volumes-file", str(path), "--interval", f"{interval:g}s",
                   "--times", str(ticks)]
            with (logs / f"{name}.out").open("wb") as out, (logs / f"{name}.err").open("wb") as err:
                procs.append((name, subprocess.Popen(cmd, stdout=out, stderr=err)))

    launcher = threading.Thread(target=launch, daemon=True)
    launcher.start()
    for change in changes:
        time.sleep(max(0.0, started + change.at - time.monotonic()))
        target = paths[change.node]
        tmp = target.with_suffix(".tmp")
        tmp.write_text(f"{change.value}\n")
        tmp.replace(target)  # kubelet-csinode reads the file whole before every tick: never a half-written one
    launcher.join()
    for name, proc in procs:
        code = proc.wait()
        if code:
            result.exit_codes[name] = code
    result.seconds = time.monotonic() - started
    stop_sampling.set()
    if sampler:
        sampler.join()
    time.sleep(2)  # the last writes' metrics
    result.counters = delta(before, write_counters(admin.pool.request("GET", "/metrics").data.decode()))
    for name in names:
        out_text = (logs / f"{name}.out").read_text()
        err_text = (logs / f"{name}.err").read_text()
        result.ok_ticks += out_text.count("OK update")
        failed = [line for line in err_text.splitlines() if line.startswith("FAILED")]
        result.failed += len(failed)
        result.failed_lines += [f"{name}: {line[:300]}" for line in failed]
    if guard:
        result.decisions = mutate_tally(guard.decisions()[seen:], set(names))
    return result


def prepare_nodes(cp: ControlPlane, names: list[str]) -> None:
    """Create the Nodes and register the driver on each with ``kubelet-csinode install`` (4 at a time)."""

    def one(name: str) -> None:
        cp.create_node(name)
        cp.kubelet(name, "install", "--driver", EBS, "--node-id", f"i-{name}", "--max-volumes", str(INITIAL))

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, names))


def report(out: dict[str, Any]) -> None:
    """Print the phases side by side and the checks."""
    phases = out["phases"]
    print("| phase | minutes | nodes | file rewrites | kubelet OK ticks | failed updates | CSINode PUTs (code) | "
          "etcd CSINode updates |")
    print("|---|---:|---:|---:|---:|---:|---|---:|")
    for p in phases.values():
        puts = ", ".join(f"{k.split()[1]}: {v}" for k, v in p["apiserver"].items() if k.startswith("PUT "))
        print(f"| {p['phase']} | {p['seconds'] / 60:.1f} | {out['nodes']} | {p['file_rewrites']} | {p['ok_ticks']} | "
              f"{p['failed_updates']} | {puts or '0'} | {p['apiserver'].get('etcd update', 0)} |")
    print()
    for p in phases.values():
        print(f"{p['phase']}: apiserver CSINode counters over the phase: {p['apiserver']}")
        if p["guard_mutate_records"]:
            print(f"{p['phase']}: the guard's /mutate records: {p['guard_mutate_records']}")
        if p["failed_lines"]:
            print(f"{p['phase']}: failed updates, first ones:\n  " + "\n  ".join(p["failed_lines"]))
        if p["exit_codes"]:
            print(f"{p['phase']}: non-zero exits: {p['exit_codes']}")
    g = phases.get("guard")
    if g:
        puts = sum(v for k, v in g["apiserver"].items() if k.startswith("PUT "))
        clamps = g["guard_mutate_records"].get("clamped-to-stored", 0)
        etcd = g["apiserver"].get("etcd update", 0)
        verdict = "writes nothing" if etcd == puts - clamps else "WROTE"
        print(f"guard: {puts} PUTs - {clamps} clamps back to the stored count = {puts - clamps}; "
              f"etcd updates {etcd}: a clamp to the stored count {verdict}")
        rss = g.get("guard_rss_mb")
        if rss:
            print(f"guard RSS (all processes, every {SAMPLE_SECONDS:g} s): start {rss['start']} MB, "
                  f"end {rss['end']} MB, "
                  f"max {rss['max']} MB; slope {rss['slope_mb_per_10min']:+.2f} MB/10 min "
                  f"(second half {rss['slope_second_half_mb_per_10min']:+.2f})")
    n = phases.get("none")
    if g and n:
        print(f"etcd CSINode updates: guard {g['apiserver'].get('etcd update', 0)}, "
              f"no webhook {n['apiserver'].get('etcd update', 0)}")
    failed = sum(p["failed_updates"] + len(p["exit_codes"]) for p in phases.values())
    print(f"failed kubelet updates: {failed} (target 0)")


def main(argv: list[str] | None = None) -> int:
    """Run the soak; print the tables (and ``--json``). Exit 1 when a kubelet update failed."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=50)
    parser.add_argument("--minutes", type=float, default=10.0, help="per phase")
    parser.add_argument("--interval", type=float, default=10.0, help="kubelet's refresh period, seconds")
    parser.add_argument("--changes-per-minute", type=float, default=6.0, help="file rewrites across all nodes")
    parser.add_argument("--phases", default="guard,none", help="guard and/or none, in this order")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    if not phases or not set(phases) <= {"guard", "none"}:
        parser.error("--phases: guard and/or none")
    changes = schedule(args.nodes, args.minutes * 60, args.changes_per_minute, args.seed)
    load_start = uptime()
    print(f"start: {load_start}", file=sys.stderr)
    results: dict[str, PhaseResult] = {}
    with tempfile.TemporaryDirectory(prefix="csinode-guard-soak-") as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        cp = stack.enter_context(running_control_plane(work / "cluster"))
        guard = stack.enter_context(running_guard(cp, work / "guard"))
        names = {p: [f"soak-{p[0]}-{i:03d}" for i in range(args.nodes)] for p in phases}
        t0 = time.monotonic()
        prepare_nodes(cp, [n for p in phases for n in names[p]])
        print(f"{sum(map(len, names.values()))} nodes ready in {time.monotonic() - t0:.0f} s", file=sys.stderr)
        files = work / "files"
        files.mkdir()
        for phase in phases:
            if phase == "guard" and not guard.registered:
                guard.register()
            if phase == "none" and guard.registered:
                guard.unregister()
            print(f"phase {phase}: {args.nodes} kubelet loops for {args.minutes:g} min, {uptime()}", file=sys.stderr)
            results[phase] = run_phase(cp, phase, names[phase], files, args.minutes, args.interval, changes,
                                       guard if phase == "guard" else None, args.seed)
            brief = {k: v for k, v in results[phase].summary().items() if k != "guard_rss_mb"}
            print(f"phase {phase}: {json.dumps(brief)}", file=sys.stderr)
    load_end = uptime()
    out: dict[str, Any] = {
        "machine": {"nproc": os.cpu_count(), "python": platform.python_version(),
                    "uptime_start": load_start, "uptime_end": load_end},
        "nodes": args.nodes, "minutes": args.minutes, "interval": args.interval,
        "changes_per_minute": args.changes_per_minute, "seed": args.seed,
        "phases": {p: r.summary() for p, r in results.items()},
    }
    report(out)
    print(f"uptime at the start: {load_start}")
    print(f"uptime at the end:   {load_end} ({os.cpu_count()} CPUs)")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 1 if any(r.failed or r.exit_codes for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
