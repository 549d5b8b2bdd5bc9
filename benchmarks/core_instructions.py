"""Instructions per review of the core, counted by callgrind: whether a change made the core slower, on a machine
whose wall clock moves by ±15 % between runs.

``python -m benchmarks.core_instructions [--rounds 300] [CHECKOUT ...]`` runs, for each checkout (default: this
one; another commit as a ``git worktree``), the work of :mod:`benchmarks.core` (``parse_review`` + ``evaluate``
+ ``build_response`` of the ten realistic reviews of :mod:`benchmarks.reviews`, default policy, /mutate) under
``valgrind --tool=callgrind`` twice: 5 rounds and ``5 + rounds`` rounds, each process with that checkout first on
``sys.path``. The difference of the two totals divided by ``rounds`` × 10 is the instructions per review, with
the start-up (imports, policy, keys) cancelled out. Each run has ``PYTHONHASHSEED=0``, address-space
randomization off (``setarch -R``) and the garbage collector off, so two runs of one checkout agree to about
1 %. The checkouts are measured in turn in one sitting; the first is the reference of the printed ratios.

Needs ``valgrind`` and ``setarch`` (Debian: ``apt install valgrind``; setarch is in util-linux). 300 rounds
take about a minute per checkout.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WARMUP_ROUNDS = 5
REVIEWS = 10

# The loop of benchmarks.core.run_core, written out rather than imported: it must run unchanged in an older
# checkout, whose benchmarks package may not have any helper added after it.
_WORKER = """
import gc, sys
from benchmarks.reviews import BENCH_KEY, NOW, realistic_reviews
from webhook.admission.cluster import UnknownClusterView
from webhook.admission.evaluation import Mode, evaluate
from webhook.admission.policy import load_policy
from webhook.admission.review import build_response, parse_review
from webhook.admission.state import StateKeys

policy, keys, cluster = load_policy(None), StateKeys([BENCH_KEY]), UnknownClusterView()
reviews = realistic_reviews(keys)
assert len(reviews) == {reviews}, len(reviews)


def round_():
    for review in reviews:
        request = parse_review(review.body)
        decision = evaluate(request, policy, cluster, NOW, keys, mode=Mode.MUTATE)
        build_response(request.uid, decision.response, allow_patch=True)


round_()
gc.disable()
for _ in range(int(sys.argv[1])):
    round_()
"""


def instructions(checkout: Path, rounds: int) -> int:
    """Total instructions (callgrind's ``Collected``) of one run of ``rounds`` rounds in ``checkout``.

    Raises RuntimeError when valgrind fails or prints no total."""
    env = dict(os.environ, PYTHONHASHSEED="0", PYTHONPATH=str(checkout), PYTHONDONTWRITEBYTECODE="1")
    run = subprocess.run(
        ["setarch", "-R", "valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable,
         "-c", _WORKER.format(reviews=REVIEWS), str(rounds)],
        cwd=checkout, env=env, capture_output=True, text=True, check=False,
    )
    found = re.search(r"Collected\s*:\s*(\d+)", run.stderr)
    if run.returncode != 0 or found is None:
        raise RuntimeError(f"callgrind in {checkout} failed ({run.returncode}): {run.stderr[-2000:]}")
    return int(found.group(1))


def per_review(checkout: Path, rounds: int) -> float:
    """Instructions per review in ``checkout``: (run of 5 + ``rounds`` − run of 5) / (``rounds`` × 10)."""
    short = instructions(checkout, WARMUP_ROUNDS)
    long = instructions(checkout, WARMUP_ROUNDS + rounds)
    return (long - short) / (rounds * REVIEWS)


def main(argv: list[str] | None = None) -> int:
    """Print the instructions per review of each checkout and its ratio to the first; exit code 2 without
    valgrind or setarch."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.core_instructions",
                                     description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("checkouts", nargs="*", type=Path, default=[ROOT], help="checkouts to measure (default: this)")
    parser.add_argument("--rounds", type=int, default=300, help="rounds of the ten reviews in the long run")
    args = parser.parse_args(argv)
    missing = [tool for tool in ("valgrind", "setarch") if shutil.which(tool) is None]
    if missing:
        print(f"needs {' and '.join(missing)} (Debian: apt install valgrind)", file=sys.stderr)
        return 2
    reference: float | None = None
    for checkout in args.checkouts:
        value = per_review(checkout.resolve(), args.rounds)
        reference = reference or value
        print(f"{checkout}: {value / 1000:.1f} k instructions per review ({value / reference:.4f} of the first)",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
