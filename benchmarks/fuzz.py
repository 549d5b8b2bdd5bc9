"""The long fuzz run (not in CI): ``python -m benchmarks.fuzz [--inputs 100000] [--seed N] [--hypothesis N]``.

Fast random mutation of the realistic reviews (the same kinds of mutations as tests/fuzzing.py: any value
replaced by any JSON value, keys removed, list entries duplicated, bodies cut, bit-flipped, or arbitrary bytes),
checked with the same rules as the CI tests:

1. core: ``decode_json`` gives what ``json.loads`` gives (but for its documented differences); ``parse_review``
   raises only ``ReviewError``; every parsed review is judged without an exception and answered with a
   well-formed AdmissionReview (``--inputs``);
2. app: the Flask app of a worker answers any method, path, content type and body with an AdmissionReview or a
   4xx JSON error (``--inputs``);
3. policy loader: mutated policy documents load or raise ``PolicyError`` (``--inputs`` / 20);
4. served: the real server over TLS, keep-alive, answers fuzzed requests the same way (``--inputs`` / 20).

``--hypothesis N`` afterwards runs tests/test_fuzz_*.py with N examples per test. Exit code 1 on the first
failure, with the input that caused it.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
import os
import random
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import yaml

from benchmarks.reviews import BENCH_KEY, NOW, realistic_reviews

BASE_BODIES = [r.body for r in realistic_reviews()]
BASE_DOCS = [json.loads(b) for b in BASE_BODIES]
SCALARS: list[Any] = [None, True, False, 0, 1, -1, 25, 27, 2147483647, 2147483648, 2**63, 2**64, 2**70, -(2**70),
                      1.5, -0.0, 1e300, "", "x", "UPDATE", "CREATE", "DELETE", "system:node:other", "system:nodes",
                      "ebs.csi.aws.com", "v0.1.0", "v99.0.0", "not-a-version", "2026-11-30T02:00:00Z", "{}", "[]",
                      "\u2028", "\ud800", "a/b~c", "é", "30s", "-5s", "deny", "clamp"]
PATHS = ["/mutate?timeout=10s", "/validate?timeout=10s", "/mutate", "/healthz", "/readyz", "/nothing-here",
         "/mutate/../validate", "/%ff", "/validate?timeout=10s&timeout=x"]
CONTENT_TYPES = ["application/json", "application/json; charset=utf-8", "APPLICATION/JSON", "text/plain", "",
                 "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"]
METHODS = ["POST", "POST", "POST", "POST", "GET", "PUT", "DELETE", "PATCH", "OPTIONS"]


def value(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.random()
    if depth < 2 and roll < 0.1:
        return [value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if depth < 2 and roll < 0.2:
        return {rng.choice(["a", "count", "name", "uid", "", "é"]): value(rng, depth + 1)
                for _ in range(rng.randint(0, 3))}
    return rng.choice(SCALARS)


def mutate(doc: Any, rng: random.Random, edits: int) -> Any:
    doc = copy.deepcopy(doc)
    for _ in range(edits):
        paths: list[tuple[Any, ...]] = []
        stack: list[tuple[Any, tuple[Any, ...]]] = [(doc, ())]
        while stack:
            node, prefix = stack.pop()
            paths.append(prefix)
            if isinstance(node, dict):
                stack.extend((v, (*prefix, k)) for k, v in node.items())
            elif isinstance(node, list):
                stack.extend((v, (*prefix, i)) for i, v in enumerate(node))
        if len(paths) < 2:
            break
        path = rng.choice(paths[1:])
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        roll = rng.random()
        if roll < 0.2 and isinstance(parent, dict):
            del parent[path[-1]]
        elif roll < 0.3 and isinstance(parent, list):
            parent.append(copy.deepcopy(parent[path[-1]]))
        else:
            parent[path[-1]] = value(rng)
    return doc


def body(rng: random.Random) -> bytes:
    roll = rng.random()
    if roll < 0.6:
        return json.dumps(mutate(rng.choice(BASE_DOCS), rng, rng.randint(0, 4))).encode("utf-8", "surrogatepass")
    raw = bytearray(rng.choice(BASE_BODIES))
    if roll < 0.75:
        return bytes(raw[: rng.randint(0, len(raw))])
    if roll < 0.9:
        for _ in range(rng.randint(1, 8)):
            raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        return bytes(raw)
    return rng.randbytes(rng.randint(0, 300))


def fuzz_core(n: int, rng: random.Random) -> None:
    from tests.fuzzing import check_admission_review, check_decode_json, request_uid  # noqa: PLC0415
    from webhook.admission.cluster import UnknownClusterView  # noqa: PLC0415
    from webhook.admission.evaluation import Mode, evaluate  # noqa: PLC0415
    from webhook.admission.policy import load_policy  # noqa: PLC0415
    from webhook.admission.review import ReviewError, build_response, parse_review  # noqa: PLC0415
    from webhook.admission.state import StateKeys  # noqa: PLC0415

    policy, keys, cluster = load_policy(None), StateKeys([BENCH_KEY]), UnknownClusterView()
    clocks = [NOW, NOW + timedelta(seconds=5), NOW + timedelta(hours=2), NOW + timedelta(days=400)]
    for _ in range(n):
        data = body(rng)
        check_decode_json(data)
        try:
            request = parse_review(data)
        except ReviewError:
            continue
        mode = rng.choice(["mutate", "validate"])
        decision = evaluate(request, policy, cluster, rng.choice(clocks), keys, mode=Mode(mode))
        document = build_response(request.uid, decision.response, allow_patch=mode == "mutate")
        check_admission_review(json.loads(json.dumps(document)), mode=mode, uid=request_uid(data))


def fuzz_app(n: int, rng: random.Random) -> None:
    directory = Path(tempfile.mkdtemp(prefix="fuzz-app-"))
    from tests.fuzzing import check_http_answer, request_uid  # noqa: PLC0415
    from webhook.admission.cluster import UnknownClusterView  # noqa: PLC0415
    from webhook.admission.state import StateKeys  # noqa: PLC0415
    from webhook.serving.app import Runtime, create_app  # noqa: PLC0415
    from webhook.serving.audit_writer import AuditWriter  # noqa: PLC0415
    from webhook.serving.live_policy import PolicyStore  # noqa: PLC0415

    audit = directory / "audit.log"
    runtime = Runtime(policies=PolicyStore(None), cluster=UnknownClusterView(), keys=StateKeys([BENCH_KEY]),
                      audit=AuditWriter(str(audit)), max_body_bytes=64 * 1024)
    client = create_app(runtime).test_client()
    for _ in range(n):
        data, path, content_type, method = body(rng), rng.choice(PATHS), rng.choice(CONTENT_TYPES), rng.choice(METHODS)
        headers = {"Content-Type": content_type} if content_type else {}
        answer = client.open(path, method=method, data=data, headers=headers)
        check_http_answer(answer.status_code, answer.content_type or "", answer.data, path=path,
                          uid=request_uid(data))
    for line in audit.read_text().splitlines():
        json.loads(line)


def fuzz_policy(n: int, rng: random.Random) -> None:
    from webhook.admission.policy import PolicyError, bundled_policy_path, parse_policy  # noqa: PLC0415

    base = yaml.safe_load(bundled_policy_path().read_text())
    for _ in range(n):
        with contextlib.suppress(PolicyError):
            parse_policy(mutate(base, rng, rng.randint(1, 3)), "fuzzed.yaml")


def fuzz_served(n: int, rng: random.Random) -> None:
    import urllib3  # noqa: PLC0415

    from benchmarks.served import start_server  # noqa: PLC0415
    from tests.fuzzing import check_http_answer, request_uid  # noqa: PLC0415

    server = start_server()
    try:
        pool = urllib3.HTTPSConnectionPool("127.0.0.1", server.port, ca_certs=str(server.ca), assert_hostname=False,
                                           cert_reqs="CERT_REQUIRED", retries=False, timeout=15, maxsize=1)
        for _ in range(n):
            data, path = body(rng), rng.choice(PATHS)
            content_type, method = rng.choice(CONTENT_TYPES), rng.choice(METHODS)
            headers = {"Content-Type": content_type} if content_type else {}
            answer = pool.request(method, path, body=data, headers=headers)
            check_http_answer(answer.status, answer.headers.get("Content-Type", ""), answer.data, path=path,
                              uid=request_uid(data))
        log = (server.workdir / "server.log").read_text()
        if "Traceback" in log or "evaluation failed" in log:
            raise AssertionError(f"the server logged an error: {log[-2000:]}")
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inputs", type=int, default=100_000, help="inputs for the core and for the app")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--hypothesis", type=int, default=0, help="then run tests/test_fuzz_*.py with N examples")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)  # refused inputs are logged by design; the checks are the output here
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    total = 0
    for name, target, n in (("core", fuzz_core, args.inputs), ("app", fuzz_app, args.inputs),
                            ("policy", fuzz_policy, args.inputs // 20), ("served", fuzz_served, args.inputs // 20)):
        started = time.monotonic()
        rng = random.Random(f"{seed}-{name}")
        target(n, rng)
        total += n
        print(f"{name:7} {n:8,} inputs  ok  ({time.monotonic() - started:6.1f} s, seed {seed})", flush=True)
    print(f"total   {total:8,} inputs, no crash, no 5xx, every answer well-formed")
    if args.hypothesis:
        env = dict(os.environ, FUZZ_EXAMPLES=str(args.hypothesis))
        return subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                "tests/test_fuzz_core.py", "tests/test_fuzz_http.py"], env=env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
