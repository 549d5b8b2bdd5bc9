"""What a kubelet feels: CSINode count updates through the real kube-apiserver, with and without the guard.

``python -m benchmarks.apiserver [--nodes 32] [--seconds 8] [--rounds 2] [--json FILE]``

A real control plane from ``../shared/k8s`` (or ``KUBEBUILDER_ASSETS``, as ``tests/k8s``). ``--nodes`` Nodes
each get a CSINode with ``ebs.csi.aws.com`` registered by ``kubelet-csinode`` (kubelet's own code). Writers then
do what kubelet's ``nodeinfomanager`` does for a count update: GET the CSINode, set the count, PUT it back with
its resourceVersion, as ``system:node:<name>`` (each node's own client certificate: NodeRestriction lets a node
write only its own CSINode). Counts alternate 19/20 (a small decrease, then a small increase) and each writer
cycles through its own nodes, so there are no conflicts. JSON over keep-alive HTTPS (urllib3), one connection
per node, like one kubelet per node.

Configurations side by side, in rotating order inside every round, at 1 and 16 concurrent writers:

(a) no webhook registered;
(g1) the floor of one call: ``../shared/k8s``'s ``noop-webhook`` (Go standard library: TLS, HTTP/2, decode,
     allow) registered as the guard's mutating webhook only;
(g2) the floor of two calls: the same Go no-op as the guard's mutating and validating webhooks;
(c) a no-op webhook on the guard's stack: the same server's ``/noop`` (``CSINODE_GUARD_BENCHMARK_NOOP=1``) behind
    two configurations with the guard's rules and matchConditions;
(b) the guard: ``csinode-guard serve --kubeconfig`` (default workers and threads) registered with
    ``csinode-guard register --url`` (both webhooks), on the default policy with change-rate's ``minInterval``
    and cluster budget opened up so that every write is admitted (a denial would end the write early);
(b1) the same guard registered with ``register --validation cel``: the apiserver calls /validate only where the
    final counts are not the ones the state /mutate wrote records (none of these writes), so one call per write;
(b0) the same guard registered as ``register`` registers it by default (``--validation auto``: one call unless
    another mutating webhook matches CSINodes; the other configurations of this benchmark are deleted before it
    registers, so it sees the cluster an operator's install would). The target is measured on it: its added p50
    over the Go no-op's with the same number of calls (g1 for the one call ``auto`` chooses here).

Every webhook configuration has the guard's rules, matchConditions and failurePolicy (only the URL differs).
``--fronts gunicorn,granian,granian-h1`` adds (c) and (b) with the same Flask app behind granian instead of
gunicorn (:mod:`benchmarks.granian_front`: native TLS, HTTP/1.1 and HTTP/2): ``granian`` offers h2 and http/1.1
through ALPN, so the apiserver speaks h2 to it, ``granian-h1`` offers HTTP/1.1 only; in the same rotation. It
needs ``pip install -e '.[bench]'``.

Reported per configuration: successful writes/s, p50/p99 of the PUT (the write: admission, etcd) and of GET+PUT;
the added PUT p50 over (a) of every webhook configuration, and the guard's against the Go two-call floor
(goal, issue 21: <= 2x); the ratio (b)/(a) of throughput. Targets: +<= 2 ms p50 at 1 writer, (b)/(a)
throughput >= 0.8 at 16 writers. These are measurements: the exit code is 0 either way. ``uptime``'s load
average is printed at the start and the end: on a shared machine compare ratios inside one run.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import platform
import re
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import urllib3
import yaml

from tests.k8s.controlplane import (
    ControlPlane,
    Guard,
    free_port,
    policy_file,
    running_control_plane,
    running_guard,
    unique,
    wait_until,
)
from webhook.kube.registration import WebhookTarget, build_webhook_configurations

EBS = "ebs.csi.aws.com"
NOOP_NAME = "csinode-guard-noop"
CONFIGS = ("none", "go1", "go2", "noop", "guard", "guard-cel", "guard-default")
GUARD_CONFIGS = {"guard": "webhook", "guard-cel": "cel", "guard-default": "auto"}
"""The configurations that are the guard's own registration (``register --validation``)."""
FRONTS = {"granian": "auto", "granian-h1": "1"}
"""The optional fronts and granian's ``--http`` for each."""
LABELS = {
    "none": "(a) no webhook",
    "go1": "(g1) Go no-op, mutating only",
    "go2": "(g2) Go no-op, mutating + validating",
    "noop": "(c) no-op, guard's stack (gunicorn)",
    "guard": "(b) guard (gunicorn)",
    "guard-cel": "(b1) guard, --validation cel",
    "guard-default": "(b0) guard, register's default (auto)",
    "noop-granian": "(c') no-op, granian, h2",
    "guard-granian": "(b') guard, granian, h2",
    "noop-granian-h1": "(c'') no-op, granian, HTTP/1.1",
    "guard-granian-h1": "(b'') guard, granian, HTTP/1.1",
}
BENCH_NAMES = {
    "go1": "csinode-guard-go-1", "go2": "csinode-guard-go-2", "noop": NOOP_NAME,
    "noop-granian": "csinode-guard-noop-granian", "guard-granian": "csinode-guard-granian",
    "noop-granian-h1": "csinode-guard-noop-granian-h1", "guard-granian-h1": "csinode-guard-granian-h1",
}
"""The webhook configurations this benchmark applies itself (the guard's own are ``register``'s)."""
FLOOR_RATIO_TARGET = 2.0
P50_ADDED_TARGET_MS = 2.0
RATIO_TARGET_16 = 0.8


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` by nearest rank; 0.0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


@dataclass
class NodeClient:
    """One node's identity: a keep-alive HTTPS pool to the apiserver with ``system:node:<name>``'s cert."""

    name: str
    pool: urllib3.HTTPSConnectionPool
    count: int = 20


def node_client(kas_url: str, kubeconfig: Path, name: str, work: Path) -> NodeClient:
    """A :class:`NodeClient` from a cluster.sh node kubeconfig (certificate data embedded)."""
    doc = yaml.safe_load(kubeconfig.read_text())
    user = doc["users"][0]["user"]
    crt, key = work / f"{name}.crt", work / f"{name}.key"
    crt.write_bytes(base64.b64decode(user["client-certificate-data"]))
    key.write_bytes(base64.b64decode(user["client-key-data"]))
    ca = work / "ca.crt"
    ca.write_bytes(base64.b64decode(doc["clusters"][0]["cluster"]["certificate-authority-data"]))
    host, port = kas_url.removeprefix("https://").split(":")
    pool = urllib3.HTTPSConnectionPool(
        host, int(port), maxsize=1, cert_file=str(crt), key_file=str(key), ca_certs=str(ca),
        cert_reqs="CERT_REQUIRED", retries=False, timeout=urllib3.Timeout(connect=10, read=60),
    )
    return NodeClient(name, pool)


@dataclass
class Result:
    """One run: a configuration at a number of writers for some seconds."""

    config: str
    writers: int
    seconds: float
    put_ms: list[float] = field(default_factory=list)
    cycle_ms: list[float] = field(default_factory=list)
    failures: dict[str, int] = field(default_factory=dict)
    webhook_ms: dict[str, float] = field(default_factory=dict)
    guard_internal_ms: float | None = None

    @property
    def rate(self) -> float:
        """Successful writes per second."""
        return len(self.put_ms) / self.seconds if self.seconds else 0.0


def write_once(client: NodeClient, result: Result, lock: threading.Lock) -> None:
    """kubelet's count update: GET the CSINode, change the count, PUT it back (JSON, keep-alive)."""
    path = f"/apis/storage.k8s.io/v1/csinodes/{client.name}"
    t0 = time.perf_counter()
    got = client.pool.request("GET", path)
    obj = json.loads(got.data)
    client.count = 19 if client.count == 20 else 20
    for entry in obj["spec"]["drivers"]:
        if entry["name"] == EBS:
            entry["allocatable"] = {"count": client.count}
    body = json.dumps(obj).encode()
    t1 = time.perf_counter()
    put = client.pool.request("PUT", path, body=body, headers={"Content-Type": "application/json"})
    t2 = time.perf_counter()
    with lock:
        if put.status == 200:
            result.put_ms.append((t2 - t1) * 1000)
            result.cycle_ms.append((t2 - t0) * 1000)
        else:
            reason = f"{put.status} {json.loads(put.data).get('message', '')[:120]}"
            result.failures[reason] = result.failures.get(reason, 0) + 1
            client.count = 19 if client.count == 20 else 20  # the stored count did not change


def run(clients: list[NodeClient], writers: int, seconds: float, config: str) -> Result:
    """``writers`` threads, each cycling through its share of ``clients``, for ``seconds``."""
    result = Result(config, writers, seconds)
    lock = threading.Lock()
    shares = [clients[i::writers] for i in range(writers)]
    end = time.monotonic() + seconds
    start_gate = threading.Barrier(writers + 1)

    def writer(share: list[NodeClient]) -> None:
        start_gate.wait()
        i = 0
        while time.monotonic() < end:
            write_once(share[i % len(share)], result, lock)
            i += 1

    threads = [threading.Thread(target=writer, args=(share,), daemon=True) for share in shares]
    for t in threads:
        t.start()
    start_gate.wait()
    began = time.monotonic()
    for t in threads:
        t.join()
    result.seconds = time.monotonic() - began
    return result


WEBHOOK_METRIC = "apiserver_admission_webhook_admission_duration_seconds"


def webhook_seconds(admin: NodeClient) -> dict[str, tuple[float, float]]:
    """``{webhook name: (seconds, calls)}`` so far, from the apiserver's own
    ``apiserver_admission_webhook_admission_duration_seconds`` (the time it waited for each webhook call)."""
    text = admin.pool.request("GET", "/metrics").data.decode()
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        for suffix, index in (("_sum{", 0), ("_count{", 1)):
            if line.startswith(WEBHOOK_METRIC + suffix):
                labels, value = line[len(WEBHOOK_METRIC + suffix):].rsplit("} ", 1)
                name = next(p.split("=", 1)[1].strip('"') for p in labels.split(",") if p.startswith("name="))
                out.setdefault(name, [0.0, 0.0])[index] += float(value)
    return {k: (v[0], v[1]) for k, v in out.items()}


def webhook_breakdown(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]],
                      writes: int) -> dict[str, float]:
    """Milliseconds per successful write the apiserver spent waiting for each webhook during a run."""
    out = {}
    for name, (seconds, _calls) in after.items():
        spent = seconds - before.get(name, (0.0, 0.0))[0]
        if spent > 0 and writes:
            out[name] = spent * 1000 / writes
    return out


def configurations_called(cp: ControlPlane) -> set[str]:
    """The webhook configurations the apiserver called for one probe write (from its audit annotations)."""
    marker = unique("probe")
    cp.probe_write(marker)

    def event() -> dict[str, Any] | None:
        with cp.audit_log.open("rb") as f:
            f.seek(max(0, cp.audit_log.stat().st_size - 4_000_000))
            lines = f.read().splitlines()
        for line in reversed(lines):
            if marker.encode() in line:
                with contextlib.suppress(ValueError):
                    found: dict[str, Any] = json.loads(line)
                    if found.get("stage") == "ResponseComplete":
                        return found
        return None

    found = wait_until(event, timeout=30, what="probe audited")
    return {
        json.loads(v)["configuration"]
        for k, v in (found.get("annotations") or {}).items()
        if k.startswith("mutation.webhook.admission.k8s.io/")
    }


@dataclass
class Webhooks:
    """Where each configuration's webhooks answer: the guard (gunicorn), the Go no-op, and the optional fronts
    (``{front: (base URL, audit log)}``)."""

    guard: Guard
    go_url: str
    fronts: dict[str, tuple[str, Path]] = field(default_factory=dict)


def front_of(config: str) -> str | None:
    """The optional front a configuration runs on (``guard-granian-h1`` -> ``granian-h1``), None for the others."""
    for prefix in ("noop-", "guard-"):
        if config.startswith(prefix) and config[len(prefix):] in FRONTS:
            return config[len(prefix):]
    return None


def configuration_objects(cp: ControlPlane, base_url: str, name: str, path: str | None = None,
                          mutating_only: bool = False) -> list[dict[str, Any]]:
    """The guard's configurations (rules, matchConditions, failurePolicy) named ``name`` calling ``base_url``
    (``/mutate``, ``/validate``; every URL at ``path`` when given); the mutating one alone with ``mutating_only``."""
    target = WebhookTarget(ca_bundle=cp.ca_crt.read_bytes(), url=base_url)
    objects = build_webhook_configurations(target, name=name)
    if path is not None:
        for obj in objects:
            for webhook in obj["webhooks"]:
                webhook["clientConfig"]["url"] = base_url + path
    return objects[:1] if mutating_only else objects


def objects_for(cp: ControlPlane, hooks: Webhooks, config: str) -> list[dict[str, Any]]:
    """What this benchmark applies for ``config`` (nothing for ``none`` and ``guard``)."""
    name = BENCH_NAMES.get(config)
    if name is None:
        return []
    if config in ("go1", "go2"):
        return configuration_objects(cp, hooks.go_url, name, mutating_only=config == "go1")
    front = front_of(config)
    base = hooks.guard.url if front is None else hooks.fronts[front][0]
    return configuration_objects(cp, base, name, path="/noop" if config.startswith("noop") else None)


CHOSEN: dict[str, str] = {}
"""What ``register --validation auto`` chose (``cel`` or ``webhook``) each time ``guard-default`` was registered
(from its output), by configuration."""


def switch(cp: ControlPlane, hooks: Webhooks, config: str) -> None:
    """Make ``config`` the only one registered, and wait until the apiserver calls exactly that. The other
    configurations go first: ``register --validation auto`` then sees no mutating webhook but the guard's own."""
    guard = hooks.guard
    want = set() if config == "none" else {guard.name if config in GUARD_CONFIGS else BENCH_NAMES[config]}
    stale = [name for other, name in BENCH_NAMES.items() if other != config]
    cp.kubectl("delete", "mutatingwebhookconfiguration,validatingwebhookconfiguration", *stale, "--ignore-not-found")
    if config in GUARD_CONFIGS:
        proc = guard.register("--validation", GUARD_CONFIGS[config], wait=False)
        chosen = re.search(r"^validation (\w+):", proc.stdout, re.MULTILINE)
        CHOSEN[config] = chosen.group(1) if chosen else GUARD_CONFIGS[config]
    else:
        guard.unregister(check=False, wait=False)
    objects = objects_for(cp, hooks, config)
    if objects:
        cp.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}))
    wait_until(lambda: configurations_called(cp) == want, timeout=60, what=f"only {config} called")


def wait_healthy(url: str, ca: Path, what: str, process: subprocess.Popen[bytes], log: Path,
                 timeout: float = 90.0) -> None:
    """Poll ``url`` (HTTPS, ``ca``-verified) until it answers 200; raise with the log's tail if the process
    exits or ``timeout`` seconds pass."""
    context = ssl.create_default_context(cafile=str(ca))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited {process.returncode}: {log.read_text()[-3000:]}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, context=context, timeout=2) as answer:
            if answer.status == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{what} not ready within {timeout}s: {log.read_text()[-3000:]}")


def stop_group(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM ``process``'s group (it was started in a session of its own), SIGKILL after 20 s."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)


@contextlib.contextmanager
def running_go_noop(cp: ControlPlane, work: Path) -> Iterator[str]:
    """``noop-webhook`` of ``../shared/k8s`` (unpacked by cluster.sh next to the apiserver) on a free loopback
    port with a serving certificate of the cluster CA; yields its ``https://127.0.0.1:PORT``."""
    binary = Path(cp.env["K8S_BIN"]) / "noop-webhook"
    if not os.access(binary, os.X_OK):
        raise RuntimeError(f"{binary} is missing: the Go no-op configurations need ../shared/k8s's noop-webhook")
    crt, key = cp.serving_cert("noop-webhook")
    port = free_port()
    log = work / "noop-webhook.log"
    with log.open("ab") as out:
        process = subprocess.Popen([str(binary), "--cert", str(crt), "--key", str(key), "--addr", f"127.0.0.1:{port}"],
                                   stdout=out, stderr=out, start_new_session=True)
    try:
        url = f"https://127.0.0.1:{port}"
        wait_healthy(f"{url}/healthz", cp.ca_crt, "noop-webhook", process, log)
        yield url
    finally:
        stop_group(process)


@contextlib.contextmanager
def running_granian(cp: ControlPlane, guard: Guard, work: Path, policy: Path,
                    http: str = "auto") -> Iterator[tuple[str, Path]]:
    """The guard's app behind granian (:mod:`benchmarks.granian_front`), the guard's certificates and state key,
    as many workers as the guard, ``http`` its protocols (``auto``: h2 and http/1.1 offered through ALPN, ``1``);
    yields ``(https://127.0.0.1:PORT, its audit log)``."""
    work.mkdir(parents=True, exist_ok=True)
    port = free_port()
    audit, log = work / "decisions.log", work / "serve.log"
    cmd = [sys.executable, "-m", "benchmarks.granian_front", "--port", str(port), "--cert-dir", str(guard.cert_dir),
           "--kubeconfig", str(cp.kubeconfig), "--policy", str(policy), "--audit-log", str(audit),
           "--workers", str(guard.workers), "--http", http]
    drop = {"PROMETHEUS_MULTIPROC_DIR", "KUBECONFIG", "CSINODE_GUARD_BUDGET_DIR"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["CSINODE_GUARD_BENCHMARK_NOOP"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                      env.get("PYTHONPATH")]))
    with log.open("ab") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=out, env=env, cwd=work, start_new_session=True)
    try:
        url = f"https://127.0.0.1:{port}"
        wait_healthy(f"{url}/readyz", cp.ca_crt, "granian front", process, log)
        yield url, audit
    finally:
        stop_group(process)


def read_decisions(path: Path) -> list[dict[str, Any]]:
    """The audit records in ``path`` so far (none when it does not exist yet)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def uptime() -> str:
    """``uptime``'s line (load averages over 1, 5, 15 minutes), or the load averages alone without it."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5, check=True).stdout.strip()
    return "load average: " + ", ".join(f"{v:.2f}" for v in os.getloadavg())


def summary(results: list[Result]) -> dict[str, Any]:
    """Pooled numbers of several runs of one configuration and writer count."""
    put = [v for r in results for v in r.put_ms]
    cycle = [v for r in results for v in r.cycle_ms]
    seconds = sum(r.seconds for r in results)
    failures: dict[str, int] = {}
    for r in results:
        for k, v in r.failures.items():
            failures[k] = failures.get(k, 0) + v
    webhook_ms: dict[str, float] = {}
    for r in results:
        for name, ms in r.webhook_ms.items():
            webhook_ms[name] = webhook_ms.get(name, 0.0) + ms / len(results)
    internal = [r.guard_internal_ms for r in results if r.guard_internal_ms is not None]
    return {
        "webhook_wait_ms_per_write": webhook_ms,
        "guard_internal_ms_per_write": sum(internal) / len(internal) if internal else None,
        "writes": len(put), "writes_per_s": len(put) / seconds if seconds else 0.0,
        "put_p50_ms": percentile(put, 0.5), "put_p99_ms": percentile(put, 0.99),
        "cycle_p50_ms": percentile(cycle, 0.5), "cycle_p99_ms": percentile(cycle, 0.99),
        "failures": failures, "runs": [r.rate for r in results],
    }


def measure(cp: ControlPlane, hooks: Webhooks, clients: list[NodeClient], admin: NodeClient,
            config: str, writers: int, seconds: float) -> Result:
    """One run of ``config`` (already switched to) at ``writers``, after a 1 s warm-up: writes, the apiserver's
    wait per webhook, and the guard's own judging time (its audit records' ``latencyMs``) per write."""
    front = front_of(config)
    audit = (hooks.guard.decisions_log if config in GUARD_CONFIGS else
             hooks.fronts[front][1] if front is not None and config.startswith("guard") else None)
    run(clients, writers, 1.0, config)  # warm connections and caches
    before = webhook_seconds(admin)
    seen = len(read_decisions(audit)) if audit else 0
    result = run(clients, writers, seconds, config)
    result.webhook_ms = webhook_breakdown(before, webhook_seconds(admin), len(result.put_ms))
    if audit:
        judged = [r["latencyMs"] for r in read_decisions(audit)[seen:] if r.get("node", "").startswith("bench-")]
        if judged and result.put_ms:  # mutate + validate, per write
            result.guard_internal_ms = sum(judged) / len(result.put_ms)
    return result


def report(out: dict[str, Any], configs: tuple[str, ...], writer_counts: list[int]) -> None:
    """Print the Markdown table, the added p50s and ratios, and where the time goes; fills ``out["results"]``'s
    ratios."""
    print("| writers | configuration | writes/s | PUT p50 ms | added p50 ms | PUT p99 ms | GET+PUT p50 ms | "
          "GET+PUT p99 ms |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for writers in writer_counts:
        s = out["results"][str(writers)]
        base = s["none"]["put_p50_ms"]
        for c in configs:
            r = s[c]
            r["added_p50_ms"] = r["put_p50_ms"] - base
            added = "" if c == "none" else f"{r['added_p50_ms']:+.2f}"
            print(f"| {writers} | {LABELS[c]} | {r['writes_per_s']:.0f} | {r['put_p50_ms']:.2f} | {added} | "
                  f"{r['put_p99_ms']:.2f} | {r['cycle_p50_ms']:.2f} | {r['cycle_p99_ms']:.2f} |")
    print()
    for writers in writer_counts:
        s = out["results"][str(writers)]
        ratios: dict[str, float] = {}
        a = s["none"]["writes_per_s"]
        floor, floor1 = s["go2"]["added_p50_ms"], s["go1"]["added_p50_ms"]
        for c in configs:
            if c in ("none", "go1", "go2"):
                continue
            ratios[f"{c}_over_none_throughput"] = s[c]["writes_per_s"] / a if a else 0.0
            ratios[f"{c}_over_go2_added_p50"] = s[c]["added_p50_ms"] / floor if floor > 0 else float("inf")
            ratios[f"{c}_over_go1_added_p50"] = s[c]["added_p50_ms"] / floor1 if floor1 > 0 else float("inf")
            print(f"{writers} writer(s), {LABELS[c]}: throughput {ratios[f'{c}_over_none_throughput']:.2f}x (a), "
                  f"adds {s[c]['added_p50_ms']:+.2f} ms to the PUT p50 = "
                  f"{ratios[f'{c}_over_go2_added_p50']:.1f}x the Go two-call floor's {floor:+.2f} ms, "
                  f"{ratios[f'{c}_over_go1_added_p50']:.1f}x the one-call floor's {floor1:+.2f} ms")
        s["ratios"] = ratios
    if 1 in writer_counts and "guard-default" in configs:
        r1 = out["results"]["1"]
        mode = CHOSEN.get("guard-default", "auto")
        floor_config = "go1" if mode == "cel" else "go2"
        added, floor_added = r1["guard-default"]["added_p50_ms"], r1[floor_config]["added_p50_ms"]
        ratio = added / floor_added if floor_added > 0 else float("inf")
        r1["ratios"]["guard-default_over_same_calls_floor_added_p50"] = ratio
        out["default_validation"] = mode
        print(f"target: {LABELS['guard-default']} (registered {mode}: {'one call' if mode == 'cel' else 'two calls'}) "
              f"adds {added:+.2f} ms to the PUT p50 at 1 writer = {ratio:.1f}x the Go no-op's {floor_added:+.2f} ms "
              f"with the same calls ({LABELS[floor_config]}); goal <= {FLOOR_RATIO_TARGET}x: "
              f"{'met' if ratio <= FLOOR_RATIO_TARGET else 'MISSED'}")
    for g in GUARD_CONFIGS:
        if g == "guard-default":
            continue
        if 1 in writer_counts:
            r1 = out["results"]["1"]
            added, ratio = r1[g]["added_p50_ms"], r1["ratios"][f"{g}_over_go2_added_p50"]
            print(f"target: {LABELS[g]} adds <= {P50_ADDED_TARGET_MS} ms p50 at 1 writer: "
                  f"{'met' if added <= P50_ADDED_TARGET_MS else 'MISSED'} ({added:+.2f} ms)")
            print(f"target: {LABELS[g]}'s added p50 <= {FLOOR_RATIO_TARGET}x the Go two-call floor's at 1 writer: "
                  f"{'met' if ratio <= FLOOR_RATIO_TARGET else 'MISSED'} ({ratio:.1f}x)")
        if 16 in writer_counts:
            ratio = out["results"]["16"]["ratios"][f"{g}_over_none_throughput"]
            print(f"target: {LABELS[g]} / (a) >= {RATIO_TARGET_16} at 16 writers: "
                  f"{'met' if ratio >= RATIO_TARGET_16 else 'MISSED'} ({ratio:.2f})")
    print()
    print("Where the time goes (mean ms per write): the apiserver's wait for each webhook call "
          "(apiserver_admission_webhook_admission_duration_seconds), and the guard's own judging time "
          "(latencyMs of its audit records, mutate + validate):")
    for writers in writer_counts:
        for c in configs:
            if c == "none":
                continue
            r = out["results"][str(writers)][c]
            waits = ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["webhook_wait_ms_per_write"].items()))
            internal = r["guard_internal_ms_per_write"]
            inside = f"; inside the guard {internal:.2f}" if internal is not None else ""
            print(f"- {writers} writer(s), {LABELS[c]}: {waits or '-'}{inside}")
    for writers in writer_counts:
        for c in configs:
            if out["results"][str(writers)][c]["failures"]:
                print(f"failures {c} x{writers}: {out['results'][str(writers)][c]['failures']}")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print Markdown tables (and ``--json``)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.apiserver", description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=8.0, help="per run")
    parser.add_argument("--rounds", type=int, default=2, help="runs per configuration and writer count")
    parser.add_argument("--writers", default="1,16")
    parser.add_argument("--fronts", default="gunicorn",
                        help="gunicorn, plus granian (h2 offered) and/or granian-h1 (HTTP/1.1 only) to compare fronts")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    writer_counts = [int(w) for w in args.writers.split(",")]
    if max(writer_counts) > args.nodes:
        parser.error("--nodes must be at least the largest writer count (each writer owns its nodes)")
    fronts = {f.strip() for f in args.fronts.split(",")}
    if not fronts <= {"gunicorn", *FRONTS} or "gunicorn" not in fronts:
        parser.error(f"--fronts: gunicorn, and any of {', '.join(FRONTS)}")
    extra = [f for f in FRONTS if f in fronts]
    configs = CONFIGS + tuple(f"{kind}-{f}" for f in extra for kind in ("noop", "guard"))
    load_start = uptime()
    print(f"start: {load_start}", file=sys.stderr)

    with tempfile.TemporaryDirectory(prefix="csinode-guard-bench-") as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        cp = stack.enter_context(running_control_plane(work / "cluster"))

        def open_up(doc: dict[str, Any]) -> None:
            rate = doc["spec"]["rules"]["change-rate"]
            rate["minInterval"] = "1ms"
            rate["clusterBudget"] = {"increasesPerSecond": 1_000_000, "burst": 1_000_000}

        policy = policy_file(work / "policy.yaml", open_up)
        guard = stack.enter_context(running_guard(cp, work / "guard", policy, register=False,
                                                  extra_env={"CSINODE_GUARD_BENCHMARK_NOOP": "1"}))
        hooks = Webhooks(guard, stack.enter_context(running_go_noop(cp, work)))
        for front in extra:
            hooks.fronts[front] = stack.enter_context(
                running_granian(cp, guard, work / front, policy, FRONTS[front]))
        names = [f"bench-{i:03d}" for i in range(args.nodes)]
        certs = work / "node-certs"
        certs.mkdir()
        for name in names:
            cp.create_node(name)
            cp.kubelet(name, "install", "--driver", EBS, "--node-id", f"i-{name}", "--max-volumes", "20")
        clients = [node_client(cp.kas_url, cp.node_kubeconfig(n), n, certs) for n in names]
        admin = node_client(cp.kas_url, cp.kubeconfig, "admin", certs)
        results: dict[tuple[str, int], list[Result]] = {}
        for round_no in range(args.rounds):
            for writers in writer_counts:
                k = round_no % len(configs)
                for config in configs[k:] + configs[:k]:
                    switch(cp, hooks, config)
                    result = measure(cp, hooks, clients, admin, config, writers, args.seconds)
                    results.setdefault((config, writers), []).append(result)
                    print(f"round {round_no + 1} {config:16} x{writers:<2}: {result.rate:7.1f} writes/s "
                          f"put p50 {percentile(result.put_ms, 0.5):6.2f} ms, failures {result.failures}",
                          file=sys.stderr)
        switch(cp, hooks, "none")

    load_end = uptime()
    out: dict[str, Any] = {
        "machine": {"nproc": os.cpu_count(), "python": platform.python_version(),
                    "uptime_start": load_start, "uptime_end": load_end},
        "nodes": args.nodes, "seconds": args.seconds, "rounds": args.rounds, "configs": list(configs),
        "results": {str(w): {c: summary(results[(c, w)]) for c in configs} for w in writer_counts},
    }
    report(out, configs, writer_counts)
    print(f"uptime at the start: {load_start}")
    print(f"uptime at the end:   {load_end} ({os.cpu_count()} CPUs)")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
