"""Differential run of the pure core: the same mutated AdmissionReviews through two checkouts, byte for byte.

``python -m benchmarks.differential [--inputs 100000] [--seed 24] [--out FILE]`` judges ``--inputs`` generated
AdmissionReviews with this checkout and writes a digest file; ``--compare OTHER_CHECKOUT`` judges the same
inputs with this checkout and with ``OTHER_CHECKOUT`` (a ``git worktree`` of another commit) in two
subprocesses, each with its checkout first on ``sys.path``, compares the digests and prints the first
differing input with both outputs (exit code 1), or ``identical`` (exit code 0). ``--show I`` prints the
outputs of input ``I``. ``--checkout DIR`` judges with DIR's code instead of this checkout's (in both modes; so
``--checkout BASE --compare BASE`` checks that a run is deterministic).

Inputs. Input ``i`` is generated from ``random.Random(f"{seed}-{i}")`` alone (so any input can be generated
again on its own): one of the realistic reviews of :mod:`benchmarks.reviews` (kubelet PUTs of an EBS node,
with and without the guard's signed state) or of four kubelet PUTs on an object whose state was signed 30 s
before ``NOW`` with the driver's version known (within change-rate's interval; a version to roll back from),
changed by up to three semantic edits (requester: the node's
kubelet, another node's, a justifier, an exempt principal, a listed writer, a version reporter; the counts;
a registration, a removal, a new driver, a CREATE; justification and driver-versions annotations, valid,
expired or malformed; the state annotation removed, changed or garbled; dryRun; resourceVersion), then by
up to three random mutations of :func:`benchmarks.fuzz.mutate` (any value replaced by any JSON value, keys
removed, list entries duplicated); one input in ten is a raw body of :func:`benchmarks.fuzz.body` (cut,
bit-flipped, arbitrary bytes). Only reviews that ``parse_review`` accepts reach evaluation; the others count
as skipped (their hash is that of the word ``unparsed``).

What is compared. Each parsed review is judged under one of two policies (the bundled default, and a
variant with an enforcement scope, the annotation version source, listed writers and version reporters,
clamping change-rate and a freeze) and one of two cluster views (nothing known; labels, versions, attach
errors, driver periods and the newest state sequence known), at four clocks (``NOW``, ``NOW`` + 1 s,
+ 1 h, + 30 days), in /validate, /mutate without a budget and /mutate with a cluster budget of 2 tokens
partly drained (12 evaluations). Each evaluation is called as ``webhook.serving.app`` calls it (an exception
gives :func:`webhook.admission.evaluation.unjudged`, as there) and gives four texts: the AdmissionReview
answer (``build_response`` as JSON), the explanation lines (``explain``), the audit records
(``build_records`` then ``encode_record``, latency 0) and the ``repr`` of the whole ``AdmissionDecision``
(outcomes, changes, notes, the next signed state), plus the budget's tokens left. An input's hash is the
SHA-256 of all of them; the stream digest the SHA-256 of the input hashes in order.

Output file: one line per input, ``index hash`` (flushed every 1,000 inputs), then a last line ``# `` and JSON
(seed, inputs, parsed, digest, seconds). ``--keep DIR`` keeps the two files of ``--compare``; ``--partial A B``
compares the inputs two files both hold (of runs stopped early). ``PYTHONHASHSEED`` is fixed in the
subprocesses, so two runs of one checkout are identical. An input costs some 10 ms of CPU per checkout (twelve
evaluations and their renderings): 2,000 inputs take some 20 s, the default 100,000 some 17 minutes of CPU.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
_WORKER_ENV = "CSINODE_GUARD_DIFFERENTIAL_WORKER"
DEFAULT_SEED = 24
USERS: list[tuple[str, list[str]]] = [
    ("system:node:other.ec2.internal", ["system:nodes", "system:authenticated"]),
    ("alice", ["csinode-guard:approvers", "system:authenticated"]),
    ("bob", ["csinode-guard:break-glass"]),
    ("system:serviceaccount:csinode-guard:csinode-guard", ["system:serviceaccounts"]),
    ("reporter", ["versions"]),
    ("", []),
]
COUNTS: list[int | None] = [None, 0, 1, 2, 20, 22, 23, 24, 25, 27, 28, 31, 39, 128, 2147483647]
VERSIONS = ["v1.40.0", "v1.20.0", "v0.1.0", "v99.0.0", "not-a-version", ""]


def _drivers(obj: dict[str, Any]) -> list[Any]:
    spec = obj.setdefault("spec", {})
    if not isinstance(spec, dict):
        return []
    drivers = spec.get("drivers")
    if not isinstance(drivers, list):
        drivers = spec["drivers"] = []
    return drivers


def _annotations(obj: dict[str, Any]) -> dict[str, Any]:
    meta = obj.setdefault("metadata", {})
    found: dict[str, Any] | None = meta.get("annotations")
    if not isinstance(found, dict):
        found = meta["annotations"] = {}
    return found


def _justification(rng: random.Random, now_iso: str) -> str:
    roll = rng.random()
    if roll < 0.1:
        return rng.choice(["not json", "{}", "[{}]", '[{"driver": "ebs.csi.aws.com"}]'])
    expires = now_iso if roll < 0.2 else rng.choice(["2026-12-01T00:00:00Z", "2027-06-01T00:00:00Z"])
    low = rng.choice([0, 10, 20, 23])
    entry = {"driver": rng.choice(["ebs.csi.aws.com", "ebs.csi.aws.com", "efs.csi.aws.com"]), "reason": "ops",
             "minCount": low, "maxCount": low + rng.choice([0, 5, 10, 200]), "expires": expires}
    if rng.random() < 0.5:
        entry["ticket"] = "OPS-1"
    return json.dumps([entry])


def _edit(request: dict[str, Any], rng: random.Random) -> None:
    """One semantic edit of an AdmissionReview's request (in place)."""
    new, old = request.get("object") or {}, request.get("oldObject") or {}
    roll = rng.randrange(12)
    if roll in (7, 8) and rng.random() < 0.5:  # a justifier's justification, a reporter's versions
        name, groups = USERS[1] if roll == 7 else USERS[4]
        request["userInfo"] = {"username": name, "groups": groups}
    if roll == 0:
        name, groups = rng.choice(USERS)
        request["userInfo"] = {"username": name, "groups": groups}
    elif roll in (1, 2):
        for d in _drivers(new):
            if isinstance(d, dict) and d.get("name") == "ebs.csi.aws.com":
                count = rng.choice(COUNTS)
                d["allocatable"] = {} if count is None else {"count": count}
    elif roll == 3:  # a registration: the entry absent from the stored object
        stored = _drivers(old)
        stored[:] = [d for d in stored if not (isinstance(d, dict) and d.get("name") == "ebs.csi.aws.com")]
    elif roll == 4:  # a removal
        written = _drivers(new)
        written[:] = [d for d in written if not (isinstance(d, dict) and d.get("name") == rng.choice(
            ["ebs.csi.aws.com", "efs.csi.aws.com"]))]
    elif roll == 5:  # a new driver
        _drivers(new).append({"name": "disk.csi.azure.com", "nodeID": "n", "topologyKeys": None,
                              "allocatable": {"count": rng.choice([7, 64, 2147483647])}})
    elif roll == 6:
        request["operation"] = "CREATE"
        request.pop("oldObject", None)
        _annotations(new).pop("csinode-guard.io/state", None) if rng.random() < 0.5 else None
    elif roll == 7:
        _annotations(new)["csinode-guard.io/justification"] = _justification(rng, "2026-11-30T02:00:00Z")
    elif roll == 8:
        versions = {"ebs.csi.aws.com": rng.choice(VERSIONS)}
        if rng.random() < 0.3:
            versions["efs.csi.aws.com"] = rng.choice(VERSIONS)
        _annotations(new)["csinode-guard.io/driver-versions"] = (
            json.dumps(versions) if rng.random() < 0.9 else "[1]")
    elif roll == 9:
        annotations = _annotations(new)
        state = annotations.get("csinode-guard.io/state")
        choice = rng.randrange(3)
        if choice == 0:
            annotations.pop("csinode-guard.io/state", None)
        elif choice == 1 and isinstance(state, str) and state:
            annotations["csinode-guard.io/state"] = state[:-3] + "abc"
        else:
            old_state = _annotations(old).get("csinode-guard.io/state") if isinstance(old, dict) else None
            if old_state is None:
                annotations["csinode-guard.io/state"] = "v1.garbled"
            else:
                _annotations(old).pop("csinode-guard.io/state", None)
    elif roll == 10:
        request["dryRun"] = True
    else:
        meta = new.get("metadata") if isinstance(new, dict) else None
        if isinstance(meta, dict):
            meta["resourceVersion"] = rng.choice(["1", "999", ""])


def generate(seed: int, index: int, base_docs: list[Any], fuzz: Any) -> bytes:
    """The body of input ``index`` (see the module docstring); depends on ``seed`` and ``index`` only."""
    rng = random.Random(f"{seed}-{index}")
    if rng.random() < 0.1:
        return bytes(fuzz.body(rng))
    doc = copy.deepcopy(rng.choice(base_docs))
    request = doc.get("request")
    if isinstance(request, dict):
        for _ in range(rng.randint(0, 3)):
            _edit(request, rng)
    if rng.random() < 0.5:
        doc = fuzz.mutate(doc, rng, rng.randint(1, 3))
    return json.dumps(doc).encode("utf-8", "surrogatepass")


class Judge:
    """Everything one checkout needs to judge inputs: policies, cluster views, keys, the functions under test."""

    def __init__(self) -> None:
        import yaml  # noqa: PLC0415

        from benchmarks import fuzz  # noqa: PLC0415
        from benchmarks.reviews import BENCH_KEY, NOW  # noqa: PLC0415
        from webhook.admission import evaluation  # noqa: PLC0415
        from webhook.admission.audit_records import build_records, encode_record  # noqa: PLC0415
        from webhook.admission.budget import IncreaseBudget  # noqa: PLC0415
        from webhook.admission.cluster import AttachError, StaticClusterView, UnknownClusterView  # noqa: PLC0415
        from webhook.admission.policy import bundled_policy_path, load_policy, parse_policy  # noqa: PLC0415
        from webhook.admission.review import ReviewError, build_response, parse_review  # noqa: PLC0415
        from webhook.admission.state import StateKeys  # noqa: PLC0415

        self.fuzz, self.evaluation = fuzz, evaluation
        self.build_records, self.encode_record, self.budget_type = build_records, encode_record, IncreaseBudget
        self.review_error, self.build_response, self.parse_review = ReviewError, build_response, parse_review
        self.keys = StateKeys([BENCH_KEY])
        self.base_docs = [*fuzz.BASE_DOCS, *self._recent_docs(NOW)]
        document = yaml.safe_load(bundled_policy_path().read_text())
        spec = document["spec"]
        spec["enforcementScope"] = {"nodeSelector": {"matchLabels": {"csinode-guard.io/enforce": "true"}}}
        spec["writers"]["users"] = ["system:serviceaccount:csinode-guard:csinode-guard", "carol"]
        spec["versionReporters"] = {"groups": ["versions"]}
        spec["defaults"]["versionSource"] = {"type": "annotation"}
        spec["rules"]["change-rate"]["enforcementAction"] = "clamp"
        spec["rules"]["count-rollback"]["dropToZero"] = {"enforcementAction": "deny"}
        spec["drivers"]["ebs.csi.aws.com"]["versionSource"] = {"type": "annotation"}
        spec["drivers"]["ebs.csi.aws.com"]["minVersion"] = "v1.30.0"
        self.policies = [load_policy(None), parse_policy(document, "differential.yaml")]
        node = "ip-10-0-1-23.ec2.internal"
        errors = [AttachError(8, NOW - timedelta(minutes=5), "va-1"),
                  AttachError(4, NOW - timedelta(minutes=3), "va-2")]
        uids = {str(d.get("request", {}).get("oldObject", {}).get("metadata", {}).get("uid"))
                for d in self.base_docs if isinstance(d, dict)}
        self.clusters: list[Any] = [
            UnknownClusterView(),
            StaticClusterView(
                nodes={node: {"labels": {"csinode-guard.io/enforce": "true",
                                         "node.kubernetes.io/instance-type": "m5.large"},
                              "kubeletVersion": "v1.35.0"}},
                driver_periods={"ebs.csi.aws.com": 30.0},
                driver_versions={node: {"ebs.csi.aws.com": "v1.40.0"}},
                attach_error_list={(node, "ebs.csi.aws.com"): errors},
                state_sequences={uid: 2 for uid in uids},
            ),
        ]
        self.clusters[1].driver_versions[node]["ebs.csi.aws.com"] = "v1.20.0"  # below the recorded v1.40.0
        self.clocks = [NOW, NOW + timedelta(seconds=1), NOW + timedelta(hours=1), NOW + timedelta(days=30)]

    def _recent_docs(self, now: Any) -> list[Any]:
        """Kubelet PUTs on an object whose signed state was written 30 s before ``now`` by a /mutate that knew
        the driver's version (v1.40.0 from its pod): within change-rate's interval, with a version to roll back
        from."""
        from tests.kube import EBS, apply_response, kubelet_update, review  # noqa: PLC0415
        from webhook.admission.cluster import StaticClusterView  # noqa: PLC0415
        from webhook.admission.policy import load_policy  # noqa: PLC0415

        template = copy.deepcopy(self.fuzz.BASE_DOCS[1]["request"])
        stored = template["oldObject"]
        cluster = StaticClusterView(driver_versions={str(stored["metadata"]["name"]): {EBS: "v1.40.0"}})
        new = kubelet_update(stored, EBS, 23)
        body = json.dumps(review(stored, new, uid="differential-setup")).encode()
        decision = self.evaluation.evaluate(self.parse_review(body), load_policy(None), cluster,
                                            now - timedelta(seconds=30), self.keys, mode=self.evaluation.Mode.MUTATE)
        answer: Any = self.build_response("differential-setup", decision.response, allow_patch=True)
        stored = apply_response(new, answer)
        docs = []
        for count in (25, 22, 39, None):
            doc = review(stored, kubelet_update(stored, EBS, count), uid=f"differential-recent-{count}")
            doc["request"]["requestKind"] = template["requestKind"]
            docs.append(doc)
        return docs

    def outputs(self, body: bytes, index: int) -> Iterator[str]:
        """The texts of one input (nothing but ``unparsed`` when ``parse_review`` refuses it)."""
        try:
            request = self.parse_review(body)
        except self.review_error:
            yield "unparsed"
            return
        mode_type = self.evaluation.Mode
        policy = self.policies[index % 2]
        cluster = self.clusters[(index // 2) % 2]
        drain = index % 3
        for c, now in enumerate(self.clocks):
            for mode, budgeted in ((mode_type.VALIDATE, False), (mode_type.MUTATE, False), (mode_type.MUTATE, True)):
                budget = self.budget_type(1.0, 2) if budgeted else None
                clock = float(c)
                if budget is not None:
                    budget.take(drain, 0.0)
                yield f"-- {now.isoformat()} {mode.value} budget={budgeted}"
                try:
                    decision = self.evaluation.evaluate(request, policy, cluster, now, self.keys, mode=mode,
                                                        budget=budget, budget_clock=clock)
                except Exception as exc:  # as the app: logged, then the unjudged decision
                    yield f"raised {type(exc).__name__}: {exc}"
                    decision = self.evaluation.unjudged(request)
                document = self.build_response(request.uid, decision.response, allow_patch=mode is mode_type.MUTATE)
                yield json.dumps(document)
                yield "\n".join(self.evaluation.explain(decision))
                records = self.build_records(decision, request, endpoint=mode, now=now, policy_hash=policy.hash,
                                             policy_generation=1, latency_seconds=0.0)
                yield b"".join(self.encode_record(r) for r in records).decode("ascii")
                yield repr(decision)
                if budget is not None:
                    yield f"budget {budget.available(clock)!r}"


def _digest_run(seed: int, inputs: int, out: Path) -> None:
    started = time.monotonic()
    judge = Judge()
    stream = hashlib.sha256()
    parsed = 0
    with out.open("w") as f:
        for i in range(inputs):
            body = generate(seed, i, judge.base_docs, judge.fuzz)
            h = hashlib.sha256()
            for text in judge.outputs(body, i):
                h.update(text.encode("utf-8", "surrogatepass"))
                h.update(b"\0")
            digest = h.hexdigest()
            parsed += digest != _UNPARSED
            stream.update(digest.encode())
            f.write(f"{i} {digest}\n")
            if i % 1000 == 999:
                f.flush()  # a run stopped early still leaves its prefix to compare (--partial)
        header = {"seed": seed, "inputs": inputs, "parsed": parsed, "digest": stream.hexdigest(),
                  "seconds": round(time.monotonic() - started, 1), "webhook": str(judge.evaluation.__file__)}
        f.write("# " + json.dumps(header) + "\n")


_UNPARSED = hashlib.sha256(b"unparsed\0").hexdigest()


def _show(seed: int, index: int) -> str:
    judge = Judge()
    body = generate(seed, index, judge.base_docs, judge.fuzz)
    texts = [f"input {index}: {body[:4000]!r}", *judge.outputs(body, index)]
    return "\n".join(texts)


def _subprocess(checkout: Path, *args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(checkout), PYTHONHASHSEED="0", **{_WORKER_ENV: "1"})
    return subprocess.Popen([sys.executable, str(HERE), *args], cwd=checkout, env=env, text=True,
                            stdout=subprocess.PIPE)


def _read(path: Path) -> tuple[dict[str, Any], list[str]]:
    lines = path.read_text().splitlines()
    header = json.loads(lines[-1][2:]) if lines and lines[-1].startswith("# ") else {}
    return header, [line.split(" ", 1)[1] for line in lines if not line.startswith("#")]


def partial(a: Path, b: Path) -> int:
    """Compare the inputs two (possibly unfinished) digest files both hold; 0 when identical."""
    (_, x), (_, y) = _read(a), _read(b)
    common = min(len(x), len(y))
    first = next((i for i in range(common) if x[i] != y[i]), None)
    if first is None:
        print(f"identical over the first {common:,} inputs")
        return 0
    print(f"DIFFERENT: first at input {first} (--show {first} with each --checkout shows both)")
    return 1


def compare(seed: int, inputs: int, mine: Path, other: Path, keep: Path | None = None) -> int:
    """Judge the inputs with both checkouts (in parallel); 0 when identical, else 1 after showing the first
    differing input with both outputs."""
    with tempfile.TemporaryDirectory(prefix="differential-") as tmp:
        where = keep or Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        files = [where / "a.txt", where / "b.txt"]
        started = time.monotonic()
        procs = [_subprocess(c, "--worker", "--seed", str(seed), "--inputs", str(inputs), "--out", str(f))
                 for c, f in zip((mine, other), files, strict=True)]
        if any(p.wait() != 0 for p in procs):
            print("a run failed", file=sys.stderr)
            return 2
        (ha, a), (hb, b) = _read(files[0]), _read(files[1])
        wall = time.monotonic() - started
    for label, h in ((mine, ha), (other, hb)):
        print(f"{label}: {h['inputs']:,} inputs, {h['parsed']:,} judged, digest {h['digest']}, {h['seconds']} s "
              f"({h['webhook']})")
    if ha["digest"] == hb["digest"] and a == b:
        print(f"identical ({wall:.0f} s wall)")
        return 0
    first = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
    print(f"DIFFERENT: first at input {first} ({sum(x != y for x, y in zip(a, b, strict=True))} inputs differ)")
    shown = []
    for checkout in (mine, other):
        proc = _subprocess(checkout, "--show", str(first), "--seed", str(seed))
        text, _ = proc.communicate()
        shown.append(text.splitlines())
    for n, (x, y) in enumerate(zip(shown[0], shown[1], strict=False)):
        if x != y:
            print(f"first differing text (#{n}):\n  {mine}:\n    {x}\n  {other}:\n    {y}")
            break
    print(f"\n== {mine} ==\n" + "\n".join(shown[0]) + f"\n\n== {other} ==\n" + "\n".join(shown[1]))
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--inputs", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--out", type=Path, default=Path("differential.txt"))
    parser.add_argument("--compare", type=Path, default=None, metavar="OTHER_CHECKOUT")
    parser.add_argument("--checkout", type=Path, default=HERE.parent.parent,
                        help="whose code --show and --compare judge with (default: this checkout)")
    parser.add_argument("--show", type=int, default=None, metavar="I")
    parser.add_argument("--partial", type=Path, nargs=2, default=None, metavar="FILE",
                        help="compare the common prefix of two digest files (runs stopped early)")
    parser.add_argument("--keep", type=Path, default=None, help="with --compare: write the two digest files here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _digest_run(args.seed, args.inputs, args.out)
        return 0
    if args.partial is not None:
        return partial(*args.partial)
    if args.show is not None:
        if os.environ.get(_WORKER_ENV):
            print(_show(args.seed, args.show))
            return 0
        text, _ = _subprocess(args.checkout.resolve(), "--show", str(args.show), "--seed", str(args.seed)).communicate()
        print(text)
        return 0
    if args.compare is not None:
        return compare(args.seed, args.inputs, args.checkout.resolve(), args.compare.resolve(), args.keep)
    proc = _subprocess(HERE.parent.parent, "--worker", "--seed", str(args.seed), "--inputs", str(args.inputs),
                       "--out", str(args.out.resolve()))
    if proc.wait() != 0:
        return 2
    header, _ = _read(args.out)
    print(json.dumps(header))
    return 0


if __name__ == "__main__":
    sys.exit(main())
