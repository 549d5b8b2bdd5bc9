"""Slow clients against the served guard: legitimate latency while attackers trickle headers or bodies.

    python -m benchmarks.slow_clients [--attack body|headers|both] [--connections 64] [--seconds 20]
                                      [--worker-class gthread] [--json FILE]

Attackers: ``--connections`` TLS connections, each sending a request one byte per ``--trickle`` seconds —
``body``: whole headers with ``Content-Length: 6000`` and then the body; ``headers``: the request line and then
the headers — and reconnecting at once when the server closes them (the pressure stays on). Meanwhile one
legitimate client (the apiserver: a keep-alive connection) POSTs /mutate reviews back to back, and a second one
opens a fresh connection per request. Prints the legitimate requests' count, failures, p50/p99/max (ms).
Bounded by ``--seconds``; 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.reviews import realistic_reviews
from benchmarks.served import BenchServer, start_server


def _attacker(server: BenchServer, kind: str, trickle: float, stop: threading.Event, counts: dict[str, int]) -> None:
    context = server.ssl_context()
    body_head = (b"POST /mutate?timeout=10s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 6000\r\n\r\n")
    while not stop.is_set():
        try:
            raw = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            conn = context.wrap_socket(raw, server_hostname="localhost")
            counts["connections"] += 1
        except OSError:
            time.sleep(0.05)
            continue
        try:
            if kind == "body":
                conn.sendall(body_head)
                payload = b"{" * 6000
            else:
                payload = b"POST /mutate HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"a" * 6000
            for byte in payload:
                if stop.wait(trickle):
                    break
                conn.sendall(bytes([byte]))
        except OSError:
            counts["closed_by_server"] += 1
        finally:
            conn.close()


def _legitimate(server: BenchServer, bodies: list[bytes], keep_alive: bool, stop: threading.Event,
                latencies: list[float], failures: list[str]) -> None:
    context = server.ssl_context()
    conn: http.client.HTTPSConnection | None = None
    n = 0
    while not stop.is_set():
        body = bodies[n % len(bodies)]
        n += 1
        started = time.perf_counter()
        try:
            if conn is None:
                conn = http.client.HTTPSConnection("127.0.0.1", server.port, timeout=10, context=context)
            conn.request("POST", "/mutate?timeout=10s", body=body, headers={"Content-Type": "application/json"})
            answer = conn.getresponse()
            answer.read()
            if answer.status != 200:
                failures.append(f"HTTP {answer.status}")
            else:
                latencies.append(time.perf_counter() - started)
            if not keep_alive or answer.getheader("connection", "") == "close":
                conn.close()
                conn = None
        except (OSError, http.client.HTTPException) as exc:
            failures.append(f"{type(exc).__name__}: {exc}")
            if conn is not None:
                conn.close()
            conn = None
        time.sleep(0.01)
    if conn is not None:
        conn.close()


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def attack(kind: str, connections: int, seconds: float, trickle: float = 0.5, worker_class: str | None = None,
           threads: int = 8) -> dict[str, Any]:
    """Legitimate latency (ms) with ``connections`` attackers of ``kind`` (none, body, headers, both)."""
    extra = ["--worker-class", worker_class] if worker_class else []  # for comparing fronts
    server = start_server(threads=threads, extra=extra)
    try:
        bodies = [r.body for r in realistic_reviews()]
        stop = threading.Event()
        counts = {"connections": 0, "closed_by_server": 0}
        kinds = [] if kind == "none" else ["body", "headers"] if kind == "both" else [kind]
        attackers = [threading.Thread(target=_attacker, args=(server, kinds[i % len(kinds)], trickle, stop, counts),
                                      daemon=True) for i in range(connections if kinds else 0)]
        for t in attackers:
            t.start()
        time.sleep(min(3.0, seconds / 4))  # the attack is in place
        results: dict[str, tuple[list[float], list[str]]] = {}
        clients = []
        for name, keep in (("keep-alive", True), ("fresh", False)):
            results[name] = ([], [])
            clients.append(threading.Thread(target=_legitimate, args=(server, bodies, keep, stop, *results[name]),
                                            daemon=True))
        for t in clients:
            t.start()
        time.sleep(seconds)
        stop.set()
        for t in clients + attackers:
            t.join(15)
        out: dict[str, Any] = {"attack": kind, "connections": connections if kinds else 0,
                               "attacker_connections_opened": counts["connections"], "seconds": seconds}
        for name, (lat, fails) in results.items():
            out[name] = {
                "requests": len(lat) + len(fails), "failures": len(fails),
                "p50_ms": round(1000 * statistics.median(lat), 1) if lat else None,
                "p99_ms": round(1000 * _percentile(lat, 0.99), 1), "max_ms": round(1000 * max(lat, default=0), 1),
                "over_1s": sum(1 for v in lat if v > 1.0), "first_failures": fails[:3],
            }
        return out
    finally:
        server.stop()


def main() -> None:
    """Run the attack(s) and print one JSON document per run."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attack", default="both", choices=["none", "body", "headers", "both", "all"])
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--trickle", type=float, default=0.5)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--worker-class", default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    kinds = ["none", "body", "headers", "both"] if args.attack == "all" else [args.attack]
    runs = [attack(k, args.connections, args.seconds, args.trickle, args.worker_class, args.threads) for k in kinds]
    for run in runs:
        print(json.dumps(run))
    if args.json:
        args.json.write_text(json.dumps(runs, indent=2))


if __name__ == "__main__":
    main()
