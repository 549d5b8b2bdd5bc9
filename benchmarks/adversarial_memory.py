"""Memory of the served guard under mixed adversarial traffic: the workers' RSS must level off.

    python -m benchmarks.adversarial_memory [--seconds 300] [--max-requests 400000] [--clients 4] [--json FILE]

The real ``csinode-guard serve`` (2 workers, TLS, offline, audit records to /dev/null) on 127.0.0.1 gets, from
``--clients`` threads, a mix in which nearly every request carries something new: invented driver names (a new
series per name, before), counts the policy refuses, random node names and writers, driver-versions annotations
with long random versions, justifications from random users, fuzzed and cut bodies, fresh TLS connections, and
a few clients that send half a request and stall. RSS (sum of the workers) is sampled every ``--sample`` seconds;
the first 20 % of the run is warm-up. Prints RSS at start, after warm-up and at the end, growth after warm-up
(target: under 5 %), requests and failures, and whether every worker still answers. Bounded by ``--seconds``
and ``--max-requests``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks.fuzz import body as fuzzed_body
from benchmarks.served import BenchServer, start_server

STATES = ["system:node:{node}", "system:serviceaccount:kube-system:x{n}", "admin-{n}"]


def _csinode(node: str, drivers: list[tuple[str, int | None]], annotations: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "storage.k8s.io/v1", "kind": "CSINode",
            "metadata": {"name": node, "uid": str(uuid.uuid4()), "annotations": annotations},
            "spec": {"drivers": [{"name": d, "nodeID": f"id-{node}", "topologyKeys": [],
                                  **({"allocatable": {"count": c}} if c is not None else {})} for d, c in drivers]}}


def adversarial_review(rng: random.Random) -> bytes:
    """One AdmissionReview with invented names and values (or a fuzzed body)."""
    if rng.random() < 0.2:
        return fuzzed_body(rng)
    node = f"node-{rng.getrandbits(48):x}"
    drivers = [f"{rng.getrandbits(40):x}.csi.invented.example" for _ in range(rng.randint(1, 4))]
    if rng.random() < 0.3:
        drivers.append("ebs.csi.aws.com")
    old_counts = [rng.randint(1, 30) for _ in drivers]
    new_counts: list[int | None] = [rng.choice([c + rng.randint(1, 200), c - 1, 2147483647, None]) for c in old_counts]
    annotations: dict[str, str] = {}
    if rng.random() < 0.3:
        annotations["csinode-guard.io/driver-versions"] = json.dumps(
            {d: f"v1.{rng.getrandbits(20)}.0-{rng.randbytes(rng.randint(10, 2000)).hex()}" for d in drivers})
    if rng.random() < 0.2:
        annotations["csinode-guard.io/justification"] = json.dumps([
            {"driver": d, "reason": rng.randbytes(40).hex(), "minCount": 0, "maxCount": 9999,
             "expires": "2030-01-01T00:00:00Z", "ticket": uuid.uuid4().hex} for d in drivers])
    old = _csinode(node, list(zip(drivers, old_counts, strict=True)), {})
    new = _csinode(node, list(zip(drivers, new_counts, strict=True)), annotations)
    new["metadata"]["uid"] = old["metadata"]["uid"]
    user = rng.choice(STATES).format(node=node, n=rng.getrandbits(32))
    request = {"uid": str(uuid.uuid4()), "kind": {"group": "storage.k8s.io", "version": "v1", "kind": "CSINode"},
               "resource": {"group": "storage.k8s.io", "version": "v1", "resource": "csinodes"}, "name": node,
               "operation": "UPDATE", "userInfo": {"username": user, "groups": ["system:nodes", f"g-{rng.random()}"]},
               "object": new, "oldObject": old, "dryRun": rng.random() < 0.1}
    return json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}).encode()


def _client(server: BenchServer, seed: int, stop: threading.Event, until: float, budget: list[int],
            lock: threading.Lock, stats: dict[str, int]) -> None:
    rng = random.Random(seed)
    context = server.ssl_context()
    conn: http.client.HTTPSConnection | None = None
    while not stop.is_set() and time.monotonic() < until:
        with lock:
            if budget[0] <= 0:
                return
            budget[0] -= 1
        roll = rng.random()
        try:
            if roll < 0.01:  # half a request, then gone: the deadline closes it
                raw = socket.create_connection(("127.0.0.1", server.port), timeout=5)
                tls = context.wrap_socket(raw, server_hostname="localhost")
                tls.sendall(b"POST /mutate HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n{")
                tls.close()
                stats["stalled"] += 1
                continue
            if conn is None or roll < 0.1:  # fresh TLS connections now and then
                if conn is not None:
                    conn.close()
                conn = http.client.HTTPSConnection("127.0.0.1", server.port, timeout=15, context=context)
            path = rng.choice(["/mutate", "/validate"])
            conn.request("POST", f"{path}?timeout=10s", body=adversarial_review(rng),
                         headers={"Content-Type": rng.choice(["application/json"] * 9 + ["text/plain"])})
            answer = conn.getresponse()
            answer.read()
            stats["status_5xx" if answer.status >= 500 else "answered"] += 1
            if answer.getheader("connection", "") == "close":
                conn.close()
                conn = None
        except (OSError, http.client.HTTPException):
            stats["errors"] += 1
            if conn is not None:
                conn.close()
            conn = None
    if conn is not None:
        conn.close()


def run(seconds: float, max_requests: int, clients: int, sample: float) -> dict[str, Any]:
    """The run described in the module docstring; returns its figures."""
    server = start_server(audit_log="/dev/null")
    try:
        stop = threading.Event()
        lock = threading.Lock()
        budget = [max_requests]
        stats = {"answered": 0, "status_5xx": 0, "errors": 0, "stalled": 0}
        started = time.monotonic()
        until = started + seconds
        threads = [threading.Thread(target=_client, args=(server, i, stop, until, budget, lock, stats), daemon=True)
                   for i in range(clients)]
        for t in threads:
            t.start()
        samples: list[tuple[float, int, int]] = []
        while any(t.is_alive() for t in threads):
            time.sleep(sample)
            samples.append((round(time.monotonic() - started, 1), stats["answered"], sum(server.rss_kib().values())))
        stop.set()
        warm = next((s for s in samples if s[0] >= 0.2 * (samples[-1][0] if samples else 0)), samples[0])
        final = samples[-1]
        probe = []
        for _ in range(8):  # fresh connections: every worker still answers quickly
            conn = http.client.HTTPSConnection("127.0.0.1", server.port, timeout=5, context=server.ssl_context())
            t0 = time.monotonic()
            conn.request("GET", "/readyz")
            probe.append((conn.getresponse().status, round(time.monotonic() - t0, 3)))
            conn.close()
        return {
            "seconds": round(time.monotonic() - started, 1), **stats,
            "rss_start_kib": samples[0][2], "rss_after_warmup_kib": warm[2], "rss_end_kib": final[2],
            "rss_max_after_warmup_kib": max(s[2] for s in samples if s[0] >= warm[0]),
            "growth_after_warmup_pct": round(100.0 * (final[2] - warm[2]) / warm[2], 2) if warm[2] else None,
            "workers": len(server.workers()), "readyz_after": probe, "samples": samples,
        }
    finally:
        server.stop()


def main() -> None:
    """Run once and print the figures (JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--max-requests", type=int, default=400_000)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--sample", type=float, default=10.0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    result = run(args.seconds, args.max_requests, args.clients, args.sample)
    summary = {k: v for k, v in result.items() if k != "samples"}
    print(json.dumps(summary))
    print("samples (seconds, answered, rss KiB):", result["samples"])
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
