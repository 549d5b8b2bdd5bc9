"""Where a served guard's CPU goes: cProfile on the CPU clock of every request thread, for the benchmarks only.

``python -m benchmarks.rollout --profile DIR`` starts the guard with ``PYTHONPATH`` leading to a directory whose
``sitecustomize`` calls :func:`install` (nothing of this reaches the product: ``serve`` never imports it). In every
process, each task a worker's thread pool runs (gunicorn's gthread: the whole-request reader, the TLS handshake,
parsing, the Flask app, the answer) is profiled with ``time.thread_time`` (CPU seconds of that thread, not wall
time), and every thread writes its statistics to ``DIR/<pid>-<thread id>.pstats`` at most every
:data:`DUMP_EVERY` seconds. :func:`summary` merges them: ``python -m benchmarks.guard_profile DIR``.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import sys
import threading
import time
from pathlib import Path
from typing import Any

DIR_ENV = "CSINODE_GUARD_BENCH_PROFILE_DIR"
DUMP_EVERY = 1.0
"""Seconds between two dumps of one thread's statistics (a dump costs a few milliseconds)."""


def install() -> None:
    """Profile every task of every ``concurrent.futures`` thread pool in this process (and its forks) when
    :data:`DIR_ENV` names a directory."""
    directory = os.environ.get(DIR_ENV)
    if not directory:
        return
    from concurrent.futures import thread  # noqa: PLC0415

    original = thread._WorkItem.run
    local = threading.local()

    def run(self: Any) -> None:
        profile: cProfile.Profile | None = getattr(local, "profile", None)
        if profile is None:
            profile = local.profile = cProfile.Profile(time.thread_time)
            local.dumped = time.monotonic()
        profile.enable()
        try:
            original(self)
        finally:
            profile.disable()
            if time.monotonic() - local.dumped >= DUMP_EVERY:
                local.dumped = time.monotonic()
                profile.dump_stats(os.path.join(directory, f"{os.getpid()}-{threading.get_native_id()}.pstats"))

    thread._WorkItem.run = run  # type: ignore[method-assign]


def summary(directory: Path, limit: int = 45) -> None:
    """Print the merged statistics of ``directory``: the functions by cumulative CPU time, then by own time."""
    files = sorted(str(p) for p in directory.glob("*.pstats"))
    if not files:
        print(f"no statistics in {directory}")
        return
    stats = pstats.Stats(files[0])
    for f in files[1:]:
        stats.add(f)
    total = sum(v[2] for v in stats.stats.values())  # type: ignore[attr-defined]
    print(f"{len(files)} threads, {total:.2f} CPU seconds in their own code")
    stats.sort_stats("cumulative").print_stats(limit)
    stats.sort_stats("tottime").print_stats(limit)


if __name__ == "__main__":
    summary(Path(sys.argv[1]))
