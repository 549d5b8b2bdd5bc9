"""A CSI driver DaemonSet rollout across many nodes, through the real kube-apiserver, with and without the guard.

``python -m benchmarks.rollout [--nodes 1000] [--paces 10,25]
[--configs none,go1,go2,guard-cel,guard,guard-cel-3,guard-3] [--rounds 1] [--json FILE] [--profile DIR]``

Every node plugin restart makes kubelet remove the driver from its CSINode and register it again (docs/
registration.md): two CSINode writes per node, GET then PUT each, as kubelet's ``nodeinfomanager`` does them. A
DaemonSet rolls ``maxUnavailable`` nodes at a time: here a rolling window of ``pace`` % of the nodes (10 % then
25 %), each slot taking the next node as soon as its two writes are done, until every node was restarted once.

The cluster is real (``../shared/k8s``: etcd, kube-apiserver with NodeRestriction and the Node authorizer); the
nodes are objects only: ``--nodes`` Nodes and their CSINodes with ``ebs.csi.aws.com`` at 25, created as admin.
Every rollout write is made as ``system:node:<name>`` in ``system:nodes`` through the admin's impersonation
(``Impersonate-User``/``Impersonate-Group``), so NodeRestriction and the guard see the node's own identity, over
keep-alive HTTPS (one pool, as many connections as the window).

Configurations, in rotating order inside every round:

- ``none``: no webhook;
- ``go1`` / ``go2``: ``../shared/k8s``'s Go no-op webhook with the guard's rules and matchConditions, mutating only
  (the floor of one call) / mutating and validating (two calls);
- ``guard-cel``: the guard (``serve``, default workers) registered with ``register --validation cel`` (one call:
  what ``auto`` registers where no other mutator matches CSINodes);
- ``guard``: the same guard with ``--validation webhook`` (two calls);
- ``guard-cel-3`` / ``guard-3``: three replicas of the guard behind one address, one call / two calls. In a
  cluster they are three pods behind a Service (kube-proxy spreads the apiserver's connections over them); here
  three ``serve --reuse-port`` processes listen on one loopback port and the kernel spreads the connections. They
  share the serving certificate, the state key, the policy and the audit Lease (one of them is the audit leader);
  each has its own audit log. Only the guards of the configuration being measured run (the others are stopped).
  The audit Lease's namespace (``csinode-guard``) is created, so one guard process of the running ones is the audit
  leader, as in a cluster.

Reported per configuration and pace: the rollout's wall time; PUT p50/p99 (the write: admission and etcd); failed
writes; writes the apiserver let through by failing open (its log's "failing open" lines during the rollout); the
guard's CPU seconds and RSS (every process of its sessions, from /proc; the sum over the replicas); the
apiserver's CPU seconds. ``--profile DIR`` also profiles the guard's request threads on their CPU clock
(:mod:`benchmarks.guard_profile`; it slows them down: not for the figures). The exit code
is 0 whatever is measured; ``uptime``'s load average is printed at the start and the end: compare ratios inside one
run, on an idle machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import queue
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import urllib3

from benchmarks.apiserver import (
    GUARD_CONFIGS,
    NodeClient,
    Webhooks,
    node_client,
    percentile,
    running_go_noop,
    switch,
    uptime,
)
from benchmarks.guard_profile import DIR_ENV
from tests.k8s.controlplane import (
    ControlPlane,
    Guard,
    policy_file,
    running_control_plane,
    running_guard,
    unique,
    wait_until,
)
from tests.ports import free_port

EBS = "ebs.csi.aws.com"
COUNT = 25
CONFIGS = ("none", "go1", "go2", "guard-cel", "guard", "guard-cel-3", "guard-3")
LABELS = {
    "none": "no webhook",
    "go1": "Go no-op, one call",
    "go2": "Go no-op, two calls",
    "guard-cel": "guard, one call (cel)",
    "guard": "guard, two calls (webhook)",
    "guard-cel-3": "guard ×3, one call (cel)",
    "guard-3": "guard ×3, two calls (webhook)",
}
GUARD_MODES = GUARD_CONFIGS
"""The guard's two registrations (``switch`` of :mod:`benchmarks.apiserver` registers them with these modes)."""
REPLICATED = {"guard-cel-3": "guard-cel", "guard-3": "guard"}
"""The three-replica configurations and the registration each uses."""
REPLICAS = 3
PORT_ATTEMPTS = 3
"""Tries at starting the replicas on newly chosen ports when one was taken meanwhile."""
LEASE_NAMESPACE = "csinode-guard"
"""The namespace of the guards' audit Lease (``serve --lease-namespace``' default), created here: without it no
replica becomes the audit leader."""
CSINODES = "/apis/storage.k8s.io/v1/csinodes"


def _proc_cpu_seconds(pid: int) -> float:
    """utime + stime of one process (its own, not its children's), in seconds; 0 when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _session_pids(sid: int) -> list[int]:
    """Every live process of session ``sid`` (the guard's gunicorn master and workers share the session)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[3]) == sid:
                pids.append(int(entry.name))
    return pids


def _rss_mb(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
    return total / 1024


@dataclass
class Rollout:
    """One rollout of one configuration at one pace."""

    config: str
    pace: int
    seconds: float = 0.0
    put_ms: list[float] = field(default_factory=list)
    failures: dict[str, int] = field(default_factory=dict)
    failed_open: int = 0
    guard_cpu_s: float | None = None
    guard_rss_mb: float | None = None
    apiserver_cpu_s: float = 0.0
    records: list[int] = field(default_factory=list)
    """Audit records each running guard process wrote during the rollout (how the calls spread over replicas)."""


def _impersonating(name: str) -> dict[str, str]:
    return {"Impersonate-User": f"system:node:{name}", "Impersonate-Group": "system:nodes",
            "Content-Type": "application/json"}


def _write(admin: NodeClient, node: str, edit: Any, result: Rollout, lock: threading.Lock) -> None:
    """kubelet's GET + PUT of its CSINode with ``edit`` applied to ``spec.drivers``, as the node."""
    headers = _impersonating(node)
    got = admin.pool.request("GET", f"{CSINODES}/{node}", headers=headers)
    obj = json.loads(got.data)
    obj["spec"]["drivers"] = edit(obj["spec"].get("drivers") or [])
    t0 = time.perf_counter()
    put = admin.pool.request("PUT", f"{CSINODES}/{node}", body=json.dumps(obj).encode(), headers=headers)
    elapsed = (time.perf_counter() - t0) * 1000
    with lock:
        if put.status == 200:
            result.put_ms.append(elapsed)
        else:
            reason = f"{put.status} {json.loads(put.data).get('message', '')[:120]}"
            result.failures[reason] = result.failures.get(reason, 0) + 1


def restart_plugin(admin: NodeClient, node: str, result: Rollout, lock: threading.Lock) -> None:
    """One node plugin restart as kubelet writes it: the driver removed, then registered again at :data:`COUNT`
    (re-appended at the end of ``spec.drivers``)."""
    _write(admin, node, lambda drivers: [d for d in drivers if d.get("name") != EBS], result, lock)
    entry = {"name": EBS, "nodeID": f"i-{node}", "topologyKeys": None, "allocatable": {"count": COUNT}}
    _write(admin, node, lambda drivers: [*[d for d in drivers if d.get("name") != EBS], entry], result, lock)


def roll(admin: NodeClient, nodes: list[str], window: int, result: Rollout) -> None:
    """Restart every node's plugin, ``window`` nodes at a time (a slot takes the next node when it is done)."""
    todo: queue.SimpleQueue[str] = queue.SimpleQueue()
    for node in nodes:
        todo.put(node)
    lock = threading.Lock()

    def slot() -> None:
        while True:
            try:
                node = todo.get_nowait()
            except queue.Empty:
                return
            restart_plugin(admin, node, result, lock)

    threads = [threading.Thread(target=slot, daemon=True) for _ in range(window)]
    began = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    result.seconds = time.monotonic() - began


def _failing_open(cp: ControlPlane) -> int:
    log = Path(cp.env["LOG_DIR"]) / "kube-apiserver.log"
    if not log.exists():
        return 0
    with log.open("rb") as f:
        return sum(line.count(b"failing open") for line in f)


def create_nodes(cp: ControlPlane, names: list[str]) -> None:
    """The Nodes (untainted, as admin) and their CSINodes with :data:`EBS` at :data:`COUNT`, in lists of 200."""
    for kind, make in (
        ("Node", lambda n: {"apiVersion": "v1", "kind": "Node", "metadata": {"name": n}}),
        ("CSINode", lambda n: {"apiVersion": "storage.k8s.io/v1", "kind": "CSINode", "metadata": {"name": n},
                               "spec": {"drivers": [{"name": EBS, "nodeID": f"i-{n}",
                                                     "allocatable": {"count": COUNT}}]}}),
    ):
        for start in range(0, len(names), 200):
            items = [make(n) for n in names[start:start + 200]]
            cp.kubectl("create", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))
        print(f"created {len(names)} {kind}s", file=sys.stderr)


def _guard_sessions(guards: list[Guard]) -> list[int]:
    """The session ids of the running ``guards`` (each ``serve`` runs in a session of its own)."""
    return [os.getsid(g.process.pid) for g in guards if g.process is not None and g.process.poll() is None]


def _cpu_seconds(sessions: list[int]) -> float:
    return sum(_proc_cpu_seconds(p) for sid in sessions for p in _session_pids(sid))


def measure(cp: ControlPlane, guards: list[Guard], admin: NodeClient, names: list[str], config: str,
            pace: int) -> Rollout:
    """One rollout of ``config`` (already switched to; ``guards`` are its running guard processes, none for the
    others) at ``pace`` % of the nodes at a time."""
    result = Rollout(config, pace)
    window = max(1, len(names) * pace // 100)
    kas_pid = int(cp.env["KAS_PID"])
    sessions = _guard_sessions(guards)
    records_before = [_lines(g.decisions_log) for g in guards]
    guard_before = _cpu_seconds(sessions)
    kas_before, open_before = _proc_cpu_seconds(kas_pid), _failing_open(cp)
    roll(admin, names, window, result)
    result.apiserver_cpu_s = _proc_cpu_seconds(kas_pid) - kas_before
    result.failed_open = _failing_open(cp) - open_before
    if sessions:
        result.guard_cpu_s = _cpu_seconds(sessions) - guard_before
        result.guard_rss_mb = _rss_mb([p for sid in sessions for p in _session_pids(sid)])
    result.records = [_lines(g.decisions_log) - n for g, n in zip(guards, records_before, strict=True)]
    return result


def _lines(path: Path) -> int:
    if not path.exists():
        return 0
    with path.open("rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))


def _alive(guard: Guard) -> bool:
    return guard.process is not None and guard.process.poll() is None


def _synced(guard: Guard, offset: int) -> bool:
    """Whether every worker of ``guard`` has logged its CSINode cache synced after byte ``offset`` of its log."""
    with guard.log.open("rb") as log:
        log.seek(offset)
        return log.read().count(b"cache csinodes synced") >= guard.workers


class Guards:
    """The one-replica guard and the three replicas behind one address; only those of the configuration being
    measured run."""

    def __init__(self, cp: ControlPlane, work: Path, policy: Path, stack: contextlib.ExitStack,
                 extra_env: dict[str, str]) -> None:
        self.cp = cp
        self.single = stack.enter_context(running_guard(cp, work / "guard", policy, register=False,
                                                        extra_env=extra_env))
        port = free_port()
        self.replicas = [
            Guard(cp, work / f"replica-{i}", policy, unique("csinode-guard-x3"), extra_args=("--reuse-port",),
                  extra_env=extra_env, port=port)
            for i in range(REPLICAS)
        ]
        for replica in self.replicas:
            replica.work.mkdir(parents=True, exist_ok=True)
            stack.callback(replica.close)

    def running(self, config: str) -> list[Guard]:
        """Start the guards ``config`` is served by, stop the others; returns the started ones."""
        wanted = self.replicas if config in REPLICATED else [self.single] if config in GUARD_MODES else []
        for guard in [self.single, *self.replicas]:
            if guard not in wanted:
                guard.close()  # unregistered (when it is) and stopped
        if wanted is self.replicas and not any(_alive(g) for g in self.replicas):
            for attempt in range(PORT_ATTEMPTS):  # the ports are chosen as late as possible: others' servers bind too
                shared = free_port()
                try:
                    for replica in self.replicas:
                        replica.port, replica.metrics_port = shared, free_port()
                        self._start(replica)
                    break
                except RuntimeError as exc:
                    if "is not free" not in str(exc) or attempt == PORT_ATTEMPTS - 1:
                        raise
                    for replica in self.replicas:
                        replica.stop()
        for guard in wanted:
            if not _alive(guard):
                self._start(guard)
        return wanted

    @staticmethod
    def _start(guard: Guard) -> None:
        offset = guard.log.stat().st_size if guard.log.exists() else 0
        guard.start()
        # /readyz may have been answered by a replica already running on the shared port: wait for this one's own
        # workers to have synced their CSINode caches.
        wait_until(partial(_synced, guard, offset), timeout=120, what=f"{guard.name} synced")

    def switch(self, hooks: Webhooks, config: str) -> list[Guard]:
        """Make ``config`` the only registered configuration (the replicas register under the first one's name)
        and return its running guards."""
        guards = self.running(config)
        if config in REPLICATED:
            switch(self.cp, Webhooks(self.replicas[0], hooks.go_url), REPLICATED[config])
        else:
            switch(self.cp, hooks, config)
        return guards


def report(results: list[Rollout], nodes: int) -> dict[str, Any]:
    """Print the Markdown table and return the figures by ``pace`` and configuration."""
    out: dict[str, Any] = {}
    print(f"| pace | configuration | wall s | writes | PUT p50 ms | PUT p99 ms | failed | failed open | "
          f"guard CPU s | guard RSS MB | apiserver CPU s |  ({nodes} nodes, 2 writes each)")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        row = {"wall_s": r.seconds, "writes": len(r.put_ms), "put_p50_ms": percentile(r.put_ms, 0.5),
               "put_p99_ms": percentile(r.put_ms, 0.99), "failed": sum(r.failures.values()),
               "failures": r.failures, "failed_open": r.failed_open, "guard_cpu_s": r.guard_cpu_s,
               "guard_rss_mb": r.guard_rss_mb, "apiserver_cpu_s": r.apiserver_cpu_s, "records": r.records}
        out.setdefault(str(r.pace), {}).setdefault(r.config, []).append(row)
        cpu = "" if r.guard_cpu_s is None else f"{r.guard_cpu_s:.1f}"
        rss = "" if r.guard_rss_mb is None else f"{r.guard_rss_mb:.0f}"
        print(f"| {r.pace} % | {LABELS[r.config]} | {r.seconds:.1f} | {len(r.put_ms)} | {row['put_p50_ms']:.1f} | "
              f"{row['put_p99_ms']:.1f} | {row['failed']} | {r.failed_open} | {cpu} | {rss} | "
              f"{r.apiserver_cpu_s:.1f} |")
    floors = {"guard-cel": "go1", "guard": "go2", "guard-cel-3": "go1", "guard-3": "go2"}  # the same calls
    for pace, by_config in out.items():
        for config, floor_config in floors.items():
            if config not in by_config or floor_config not in by_config:
                continue
            p99 = percentile([row["put_p99_ms"] for row in by_config[config]], 0.5)
            floor_p99 = percentile([row["put_p99_ms"] for row in by_config[floor_config]], 0.5)
            print(f"{pace} %: {LABELS[config]} PUT p99 {p99:.1f} ms = {p99 / floor_p99:.1f}x "
                  f"{LABELS[floor_config]}'s {floor_p99:.1f} ms (target at 10 %: <= 3x)")
    for r in results:
        if r.failures:
            print(f"failures {r.config} at {r.pace} %: {r.failures}")
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the rollouts and print a Markdown table (and ``--json``)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.rollout", description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--paces", default="10,25", help="percent of the nodes restarting at once")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--profile", type=Path, metavar="DIR",
                        help="profile the guard's request threads into DIR (benchmarks.guard_profile)")
    args = parser.parse_args(argv)
    paces = [int(p) for p in args.paces.split(",")]
    configs = tuple(c.strip() for c in args.configs.split(","))
    if not set(configs) <= set(CONFIGS):
        parser.error(f"--configs: any of {', '.join(CONFIGS)}")
    load_start = uptime()
    print(f"start: {load_start}", file=sys.stderr)
    results: list[Rollout] = []
    with tempfile.TemporaryDirectory(prefix="csinode-guard-rollout-") as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        cp = stack.enter_context(running_control_plane(work / "cluster"))

        def open_up(doc: dict[str, Any]) -> None:  # every re-registration admitted: nothing ends a write early
            rate = doc["spec"]["rules"]["change-rate"]
            rate["minInterval"] = "1ms"
            rate["clusterBudget"] = {"increasesPerSecond": 1_000_000, "burst": 1_000_000}

        policy = policy_file(work / "policy.yaml", open_up)
        cp.kubectl("create", "namespace", LEASE_NAMESPACE)
        extra_env: dict[str, str] = {}
        if args.profile is not None:
            extra_env = profile_env(args.profile, work)
        guards = Guards(cp, work, policy, stack, extra_env)
        hooks = Webhooks(guards.single, stack.enter_context(running_go_noop(cp, work)))
        names = [f"roll-{i:04d}" for i in range(args.nodes)]
        create_nodes(cp, names)
        admin = node_client(cp.kas_url, cp.kubeconfig, "admin", work)
        window = max(1, args.nodes * max(paces) // 100)
        admin.pool = urllib3.HTTPSConnectionPool(
            admin.pool.host, admin.pool.port, maxsize=window, block=True, cert_file=admin.pool.cert_file,
            key_file=admin.pool.key_file, ca_certs=admin.pool.ca_certs, cert_reqs="CERT_REQUIRED", retries=False,
            timeout=urllib3.Timeout(connect=10, read=60))
        for round_no in range(args.rounds):
            for pace in paces:
                k = round_no % len(configs)
                for config in configs[k:] + configs[:k]:
                    running = guards.switch(hooks, config)
                    result = measure(cp, running, admin, names, config, pace)
                    results.append(result)
                    spread = f", audit records per guard process {result.records}" if result.records else ""
                    print(f"round {round_no + 1} {config:10} {pace:3d} %: {result.seconds:6.1f} s, p50 "
                          f"{percentile(result.put_ms, 0.5):6.1f} ms, p99 {percentile(result.put_ms, 0.99):6.1f} ms,"
                          f" failed {sum(result.failures.values())}, failed open {result.failed_open}{spread}",
                          file=sys.stderr)
        guards.switch(hooks, "none")
    load_end = uptime()
    out = {"machine": {"nproc": os.cpu_count(), "python": platform.python_version(), "uptime_start": load_start,
                       "uptime_end": load_end},
           "nodes": args.nodes, "paces": paces, "configs": list(configs), "rounds": args.rounds,
           "results": report(results, args.nodes)}
    print(f"uptime at the start: {load_start}")
    print(f"uptime at the end:   {load_end} ({os.cpu_count()} CPUs)")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    if args.profile is not None:
        print(f"profile of the guard's request threads: python -m benchmarks.guard_profile {args.profile}")
    return 0


def profile_env(directory: Path, work: Path) -> dict[str, str]:
    """The guard's environment for ``--profile``: a ``sitecustomize`` that installs
    :func:`benchmarks.guard_profile.install` (statistics into ``directory``)."""
    directory.mkdir(parents=True, exist_ok=True)
    site = work / "profile-site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("from benchmarks.guard_profile import install\ninstall()\n")
    repo = Path(__file__).resolve().parents[1]
    path = os.pathsep.join(filter(None, [str(site), str(repo), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": path, DIR_ENV: str(directory.resolve())}


if __name__ == "__main__":
    sys.exit(main())
