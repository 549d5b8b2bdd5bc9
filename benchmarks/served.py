"""Served benchmarks: the real ``csinode-guard serve`` (gunicorn gthread workers, TLS, keep-alive) on loopback.

* Throughput and latency of /mutate next to ``/noop`` — the same server, workers, TLS settings and connection
  handling, the cheapest valid admission webhook: it decodes the AdmissionReview and allows it, judging nothing
  (enabled by ``CSINODE_GUARD_BENCHMARK_NOOP=1``, benchmarks only) — at 1 and 8
  keep-alive connections, in alternating rounds so that both see the same machine. The load comes from a
  second process: ``wrk`` (Debian package ``wrk``) when it is installed, else a Python load generator.
* Spread: a few long-lived connections, as the apiserver keeps, and which worker process answers each request,
  with ``--connection-max-age`` on and off.
* Memory: the workers' RSS while /mutate answers N requests (1,000,000 in the long run).

All traffic goes to 127.0.0.1; every loop is bounded in requests and time.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import shutil
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from benchmarks.reviews import realistic_reviews
from tests.ports import free_port

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
LUA = HERE / "post.lua"
DNS = "localhost"


@dataclass
class BenchServer:
    """A ``csinode-guard serve`` subprocess on 127.0.0.1 with the benchmark endpoint enabled."""

    process: subprocess.Popen[bytes]
    port: int
    workdir: Path
    audit_log: str

    @property
    def ca(self) -> Path:
        return self.workdir / "certs" / "ca.crt"

    def url(self, path: str) -> str:
        return f"https://127.0.0.1:{self.port}{path}"

    def ssl_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.ca))
        context.check_hostname = False  # the certificate names localhost; we connect to 127.0.0.1
        return context

    def workers(self) -> list[int]:
        """Worker pids (children of the gunicorn master)."""
        path = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
        try:
            return [int(p) for p in path.read_text().split()]
        except OSError:
            return []

    def rss_kib(self) -> dict[int, int]:
        """VmRSS of each worker, KiB."""
        out = {}
        for pid in self.workers():
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        out[pid] = int(line.split()[1])
            except OSError:
                continue
        return out

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)


def start_server(*, workers: int = 2, threads: int = 8, connection_max_age: float = 60.0,
                 audit_log: str | None = None, extra: list[str] | None = None) -> BenchServer:
    """Start the server (dev certificates in a temporary directory) and wait until /healthz answers.

    ``extra``: more ``serve`` arguments."""
    workdir = Path(tempfile.mkdtemp(prefix="csinode-guard-bench-"))
    port = free_port()
    audit = audit_log or str(workdir / "audit.log")
    cmd = [
        sys.executable, "-m", "webhook", "serve", "--host", "127.0.0.1", "--port", str(port),
        "--metrics-port", "0", "--cert-dir", str(workdir / "certs"), "--audit-log", audit, "--offline",
        "--workers", str(workers), "--threads", str(threads), "--connection-max-age", str(connection_max_age),
        "--log-level", "warning", *(extra or []),
    ]
    env = dict(os.environ, CSINODE_GUARD_BENCHMARK_NOOP="1", PYTHONPATH=str(REPO))
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    with (workdir / "server.log").open("wb") as log:
        process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, cwd=workdir, env=env)
    server = BenchServer(process, port, workdir, audit)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited: {(workdir / 'server.log').read_text()[-2000:]}")
        if server.ca.exists():
            try:
                conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=5, context=server.ssl_context())
                conn.request("GET", "/healthz")
                if conn.getresponse().status == 200 and len(server.workers()) == workers:
                    conn.close()
                    time.sleep(0.5)  # let every worker finish booting
                    return server
            except OSError:
                pass
        time.sleep(0.2)
    server.stop()
    raise RuntimeError("server did not become healthy")


def write_bodies(directory: Path) -> list[Path]:
    """The realistic reviews as files (for wrk)."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for review in realistic_reviews():
        path = directory / f"{review.name}.json"
        path.write_bytes(review.body)
        paths.append(path)
    return paths


@dataclass(frozen=True)
class LoadResult:
    """One load run: answered requests, seconds, latency percentiles (µs) and failures."""

    requests: int
    seconds: float
    p50_us: float
    p99_us: float
    non_2xx: int
    socket_errors: int

    @property
    def rate(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


def have_wrk() -> bool:
    return shutil.which("wrk") is not None


def run_wrk(server: BenchServer, path: str, bodies: list[Path], connections: int, seconds: float) -> LoadResult:
    """``wrk -t1 -c<connections>`` for ``seconds`` against ``path`` with the bodies in rotation."""
    env = dict(os.environ, BODY_FILES=":".join(str(b) for b in bodies), BENCH_PATH=path)
    cmd = ["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s", "--timeout", "10s", "-s", str(LUA),
           server.url("/")]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=seconds + 60, check=True).stdout
    for line in out.splitlines():
        if line.startswith("RESULT "):
            n, duration, p50, p99, non2xx, errors = line.split()[1:]
            return LoadResult(int(n), int(duration) / 1e6, float(p50), float(p99), int(non2xx), int(errors))
    raise RuntimeError(f"wrk printed no result: {out}")


def _python_client(args: tuple[int, str, str, list[bytes], float, Any]) -> tuple[list[float], int, int]:
    port, ca, path, bodies, seconds, start = args
    context = ssl.create_default_context(cafile=ca)
    context.check_hostname = False
    conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=10, context=context)
    latencies: list[float] = []
    non_2xx = errors = 0
    start.wait()
    deadline = time.monotonic() + seconds
    i = 0
    while time.monotonic() < deadline:
        body = bodies[i % len(bodies)]
        i += 1
        t0 = time.perf_counter()
        try:
            conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            response.read()
        except (OSError, http.client.HTTPException):
            errors += 1
            conn.close()
            continue
        latencies.append((time.perf_counter() - t0) * 1e6)
        if response.status >= 300:
            non_2xx += 1
    conn.close()
    return latencies, non_2xx, errors


def run_python_load(server: BenchServer, path: str, bodies: list[Path], connections: int,
                    seconds: float) -> LoadResult:
    """The fallback load generator: one process per keep-alive connection (slower than wrk)."""
    context = get_context("spawn")
    payloads = [b.read_bytes() for b in bodies]
    with context.Manager() as manager:
        start = manager.Event()
        with context.Pool(connections) as pool:
            pending = pool.map_async(_python_client, [(server.port, str(server.ca), path, payloads[i:] + payloads[:i],
                                                       seconds, start) for i in range(connections)])
            time.sleep(1.0)
            start.set()
            results = pending.get(timeout=seconds + 120)
    latencies = sorted(v for r in results for v in r[0])
    if not latencies:
        return LoadResult(0, seconds, math.nan, math.nan, sum(r[1] for r in results), sum(r[2] for r in results))
    return LoadResult(len(latencies), seconds, latencies[len(latencies) // 2],
                      latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
                      sum(r[1] for r in results), sum(r[2] for r in results))


def run_load(server: BenchServer, path: str, bodies: list[Path], connections: int, seconds: float) -> LoadResult:
    if have_wrk():
        return run_wrk(server, path, bodies, connections, seconds)
    return run_python_load(server, path, bodies, connections, seconds)


@dataclass
class Comparison:
    """Guard vs no-op at one connection count, over alternating rounds."""

    connections: int
    guard: list[LoadResult] = field(default_factory=list)
    noop: list[LoadResult] = field(default_factory=list)

    @staticmethod
    def summary(results: list[LoadResult]) -> dict[str, float]:
        requests = sum(r.requests for r in results)
        seconds = sum(r.seconds for r in results)
        return {
            "rps": requests / seconds if seconds else 0.0,
            "p50_us": statistics.median(r.p50_us for r in results),
            "p99_us": statistics.median(r.p99_us for r in results),
            "requests": requests,
            "failed": sum(r.non_2xx + r.socket_errors for r in results),
        }

    @property
    def ratio(self) -> float:
        noop = self.summary(self.noop)["rps"]
        return self.summary(self.guard)["rps"] / noop if noop else 0.0

    @property
    def round_ratios(self) -> list[float]:
        return [g.rate / n.rate for g, n in zip(self.guard, self.noop, strict=True) if n.rate]


def compare(connections: tuple[int, ...] = (1, 8), rounds: int = 5, seconds: float = 5.0,
            workers: int = 2, threads: int = 8, connection_max_age: float = 1.0,
            audit_log: str | None = None) -> tuple[list[Comparison], dict[str, Any]]:
    """Alternate /noop and /mutate runs (``rounds`` each per connection count) on one server.

    ``audit_log``: the server's ``--audit-log`` (default: a file in its temporary directory; ``/dev/null`` to
    leave out the cost of the file system; /noop writes no record either way).

    ``connection_max_age`` is short by default: wrk opens its connections at once and a 6 s run would keep
    whatever split over the workers the first accepts gave (all on one worker, sometimes); closing them every
    second lets them spread as the apiserver's do over a minute. It applies to both endpoints alike.
    """
    server = start_server(workers=workers, threads=threads, connection_max_age=connection_max_age,
                          audit_log=audit_log)
    try:
        bodies = write_bodies(server.workdir / "bodies")
        for path in ("/noop?timeout=10s", "/mutate?timeout=10s"):  # warm both code paths and TLS sessions
            run_load(server, path, bodies, 2, 1.0)
        out = []
        for c in connections:
            comparison = Comparison(c)
            for i in range(rounds):
                order = ("noop", "guard") if i % 2 == 0 else ("guard", "noop")
                for which in order:
                    path = "/noop?timeout=10s" if which == "noop" else "/mutate?timeout=10s"
                    result = run_load(server, path, bodies, c, seconds)
                    getattr(comparison, which).append(result)
            out.append(comparison)
        info = {"load_generator": "wrk" if have_wrk() else "python", "workers": workers, "threads": threads,
                "connection_max_age": connection_max_age, "audit_log": audit_log or "a file",
                "audit_records": _count_lines(Path(server.audit_log))}
        return out, info
    finally:
        server.stop()


def _count_lines(path: Path) -> int:
    try:
        with path.open("rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


class _CountingConnection(http.client.HTTPSConnection):
    connects = 0

    def connect(self) -> None:
        self.connects += 1
        super().connect()


def spread(connection_max_age: float, connections: int = 2, seconds: float = 12.0,
           interval: float = 0.005) -> dict[str, Any]:
    """``connections`` long-lived keep-alive clients (as the apiserver keeps) for ``seconds``: who answers?

    Returns requests per worker pid, reconnects, and for each connection the workers it was served by.
    """
    server = start_server(connection_max_age=connection_max_age)
    try:
        body = realistic_reviews()[1].body
        per_worker: Counter[int] = Counter()
        per_connection: list[Counter[int]] = [Counter() for _ in range(connections)]
        reconnects = [0] * connections
        failures = [0] * connections

        def client(index: int) -> None:
            conn = _CountingConnection("127.0.0.1", server.port, timeout=10, context=server.ssl_context())
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                try:
                    conn.request("POST", "/noop?timeout=10s", body=body, headers={"Content-Type": "application/json"})
                    answer = conn.getresponse()
                    pid = int(json.loads(answer.read())["worker"])
                except (OSError, http.client.HTTPException, ValueError, KeyError):
                    failures[index] += 1
                    conn.close()
                    continue
                per_connection[index][pid] += 1
                time.sleep(interval)
            reconnects[index] = conn.connects - 1
            conn.close()

        threads = [threading.Thread(target=client, args=(i,)) for i in range(connections)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(seconds + 60)
        for c in per_connection:
            per_worker.update(c)
        return {
            "connection_max_age": connection_max_age,
            "connections": connections,
            "seconds": seconds,
            "workers": sorted(server.workers()),
            "requests_per_worker": dict(per_worker),
            "workers_per_connection": [len(c) for c in per_connection],
            "reconnects": reconnects,
            "failures": sum(failures),
        }
    finally:
        server.stop()


def memory(requests: int, connections: int = 4, segment_seconds: float = 10.0,
           warmup_fraction: float = 0.1, max_seconds: float = 3600.0) -> dict[str, Any]:
    """RSS of the workers while /mutate answers ``requests`` requests (audit records to /dev/null).

    Warm-up: the first ``warmup_fraction`` of the requests, and at least 20,000 (caches, allocator arenas and
    the TLS session state settle in the first 15,000 or so), but no more than half.
    """
    server = start_server(audit_log=os.devnull)
    try:
        bodies = write_bodies(server.workdir / "bodies")
        samples: list[tuple[int, int]] = [(0, sum(server.rss_kib().values()))]
        done = failed = 0
        warm: tuple[int, int] | None = None
        started = time.monotonic()
        while done < requests and time.monotonic() - started < max_seconds:
            result = run_load(server, "/mutate?timeout=10s", bodies, connections, segment_seconds)
            done += result.requests
            failed += result.non_2xx + result.socket_errors
            samples.append((done, sum(server.rss_kib().values())))
            if warm is None and done >= min(max(warmup_fraction * requests, 20_000), requests / 2):
                warm = samples[-1]
        warm = warm or samples[-1]
        final = samples[-1]
        return {
            "requests": done,
            "failed": failed,
            "workers": len(server.workers()),
            "rss_start_kib": samples[0][1],
            "rss_after_warmup_kib": warm[1],
            "warmup_requests": warm[0],
            "rss_end_kib": final[1],
            "rss_max_after_warmup_kib": max(s[1] for s in samples if s[0] >= warm[0]),
            "growth_after_warmup_pct": 100.0 * (final[1] - warm[1]) / warm[1] if warm[1] else math.nan,
            "samples": samples,
            "seconds": round(time.monotonic() - started, 1),
        }
    finally:
        server.stop()
