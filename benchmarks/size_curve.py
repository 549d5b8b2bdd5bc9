"""Answer time and patch size against the number of drivers of a CSINode: the cost of an answer must be linear
in the object and small.

    python -m benchmarks.size_curve [--drivers 1,10,100,1000,2000,6000,10000] [--rounds 3] [--core-only]

Two writes per size, each by the node's own kubelet (``system:node:size-node``):

* ``registration``: the object had no drivers and the write registers N new ones (each ``count: 10``), as a
  kubelet whose node plugins all start at once does (attack 5 of issue 32: 6,000 of them);
* ``update``: one count change (10 -> 9) of one entry of an N-driver object that already carries the guard's
  signed state (the steady state of a wide node).

Measured two ways: the pure core (``parse_review`` + ``evaluate`` + ``build_response``, process CPU time, best
of ``--rounds``), and the real ``csinode-guard serve`` over TLS (one worker, a CA-verified keep-alive client,
``?timeout=5s`` as the apiserver sends with the registered ``timeoutSeconds``; wall time from the first byte
sent to the last byte read, best of ``--rounds``). For each: the AdmissionReview's size, the answer's
decision, its JSON patch size (decoded bytes) and the size of the CSINode's annotations after the patch (key
plus value bytes, the sum the apiserver holds to 256 KiB). Prints one JSON line per (size, write), then a
Markdown table. In-process and loopback only.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jsonpatch

from benchmarks.reviews import BENCH_KEY
from benchmarks.served import BenchServer, start_server
from webhook.admission.cluster import UnknownClusterView
from webhook.admission.evaluation import Mode, evaluate
from webhook.admission.policy import load_policy
from webhook.admission.review import build_response, parse_review
from webhook.admission.state import StateKeys

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
NODE = "size-node"
UID = "5f0c9c1e-0000-4000-8000-0000000size0"
SIZES = (1, 10, 100, 1000, 2000, 6000, 10000)
ANNOTATION_LIMIT = 256 * 1024
"""kube-apiserver's total annotation size (apimachinery ``ValidateAnnotationsSize``: sum of len(key)+len(value))."""


def csinode(drivers: int, count: int = 10, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    """A CSINode of ``NODE`` with ``drivers`` drivers, each at ``count``."""
    return {
        "apiVersion": "storage.k8s.io/v1", "kind": "CSINode",
        "metadata": {"name": NODE, "uid": UID, "resourceVersion": "100", "annotations": dict(annotations or {})},
        "spec": {"drivers": [{"name": f"d{i}.csi.example.com", "nodeID": NODE, "topologyKeys": [],
                              "allocatable": {"count": count}} for i in range(drivers)]},
    }


def review_body(old: dict[str, Any], new: dict[str, Any], uid: str = "size") -> bytes:
    """A kubelet UPDATE AdmissionReview of ``old`` into ``new``."""
    return json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": uid, "kind": {"group": "storage.k8s.io", "version": "v1", "kind": "CSINode"},
        "resource": {"group": "storage.k8s.io", "version": "v1", "resource": "csinodes"},
        "name": NODE, "operation": "UPDATE",
        "userInfo": {"username": f"system:node:{NODE}", "groups": ["system:nodes", "system:authenticated"]},
        "object": new, "oldObject": old, "dryRun": False}}).encode()


def _patched(obj: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
    patch = answer["response"].get("patch")
    if not patch:
        return obj
    result: dict[str, Any] = jsonpatch.apply_patch(obj, json.loads(base64.b64decode(patch)))
    return result


def annotation_bytes(obj: dict[str, Any]) -> int:
    """Bytes the apiserver counts against its 256 KiB annotation limit: sum of len(key) + len(value), UTF-8."""
    annotations = obj.get("metadata", {}).get("annotations") or {}
    return sum(len(k.encode()) + len(v.encode()) for k, v in annotations.items())


def writes(drivers: int, keys: StateKeys) -> dict[str, tuple[bytes, dict[str, Any]]]:
    """The two reviews of this size, with each write's object: ``registration`` and ``update``."""
    policy = load_policy(None)
    empty, full = csinode(0), csinode(drivers)
    registration = review_body(empty, full)
    # The stored N-driver object with the guard's state: what the registration's answer leaves in etcd.
    decision = evaluate(parse_review(registration), policy, UnknownClusterView(), NOW, keys, mode=Mode.MUTATE)
    stored = _patched(full, dict(build_response("size", decision.response, allow_patch=True)))
    changed = json.loads(json.dumps(stored))
    changed["spec"]["drivers"][drivers // 2]["allocatable"]["count"] = 9
    return {"registration": (registration, full), "update": (review_body(stored, changed), changed)}


def measure_core(body: bytes, obj: dict[str, Any], keys: StateKeys, rounds: int) -> dict[str, Any]:
    """Best-of-``rounds`` CPU time of the pure core on ``body``; the patch and annotation sizes of its answer."""
    policy = load_policy(None)
    best = float("inf")
    answer: Any = {}
    for _ in range(rounds):
        t0 = time.process_time()
        review = parse_review(body)
        decision = evaluate(review, policy, UnknownClusterView(), NOW, keys, mode=Mode.MUTATE)
        answer = build_response(review.uid, decision.response, allow_patch=True)
        best = min(best, time.process_time() - t0)
    return _sizes(answer, obj) | {"ms": round(best * 1000, 2)}


def _sizes(answer: dict[str, Any], obj: dict[str, Any]) -> dict[str, Any]:
    response = answer["response"]
    patch = response.get("patch")
    return {
        "decision": "allow" if response["allowed"] else "deny",
        "patch_bytes": len(base64.b64decode(patch)) if patch else 0,
        "annotation_bytes": annotation_bytes(_patched(obj, answer)),
    }


def measure_served(server: BenchServer, body: bytes, obj: dict[str, Any], rounds: int) -> dict[str, Any]:
    """Best-of-``rounds`` wall time of POST /mutate?timeout=5s over one keep-alive TLS connection."""
    conn = http.client.HTTPSConnection("127.0.0.1", server.port, timeout=60, context=server.ssl_context())
    best = float("inf")
    answer: Any = {}
    try:
        for _ in range(rounds):
            t0 = time.perf_counter()
            conn.request("POST", "/mutate?timeout=5s", body=body, headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            data = response.read()
            best = min(best, time.perf_counter() - t0)
            if response.status != 200:
                raise RuntimeError(f"/mutate answered {response.status}: {data[:300]!r}")
            answer = json.loads(data)
    finally:
        conn.close()
    return _sizes(answer, obj) | {"ms": round(best * 1000, 2), "answer_bytes": len(data)}


def run_curve(sizes: tuple[int, ...] = SIZES, rounds: int = 3, served: bool = True,
              echo: bool = False) -> list[dict[str, Any]]:
    """One row per (size, write): the core's and (``served``) the served endpoint's figures; ``echo`` prints
    each row as a JSON line as soon as it is measured."""
    keys = StateKeys([BENCH_KEY])
    rows: list[dict[str, Any]] = []
    # A generous budget: the curve measures the full judgement, not the answer past the budget.
    server = start_server(workers=1, extra=["--state-key-file", str(_key_file()), "--answer-budget", "60"]) \
        if served else None
    try:
        for n in sizes:
            for kind, (body, obj) in writes(n, keys).items():
                row: dict[str, Any] = {"drivers": n, "write": kind, "review_kib": round(len(body) / 1024, 1),
                                       "core": measure_core(body, obj, keys, rounds)}
                if server is not None:
                    row["served"] = measure_served(server, body, obj, rounds)
                if echo:
                    print(json.dumps(row), flush=True)
                rows.append(row)
    finally:
        if server is not None:
            server.stop()
    return rows


def main() -> None:
    """Print one JSON line per (size, write), then a Markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drivers", default=",".join(str(n) for n in SIZES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--core-only", action="store_true", help="skip the served endpoint")
    args = parser.parse_args()
    rows = run_curve(tuple(int(x) for x in args.drivers.split(",")), args.rounds, not args.core_only, echo=True)
    print(markdown(rows))


def _key_file() -> Path:
    path = Path(tempfile.mkdtemp(prefix="csinode-guard-size-")) / "state.key"
    path.write_text(BENCH_KEY.hex() + "\n")
    return path


def markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table."""
    served = any("served" in r for r in rows)
    head = "| drivers | write | review KiB | core ms | µs/driver | patch KiB | annotations KiB | decision |"
    rule = "|---:|---|---:|---:|---:|---:|---:|---|"
    if served:
        head += " served ms |"
        rule += "---:|"
    lines = ["", head, rule]
    for r in rows:
        core = r["core"]
        line = (f"| {r['drivers']:,} | {r['write']} | {r['review_kib']:,} | {core['ms']:,} | "
                f"{core['ms'] * 1000 / r['drivers']:.1f} | {core['patch_bytes'] / 1024:,.1f} | "
                f"{core['annotation_bytes'] / 1024:,.1f} | {core['decision']} |")
        if served:
            line += f" {r['served']['ms']:,} |"
        lines.append(line)
    return "\n".join(lines)


if __name__ == "__main__":
    main()
