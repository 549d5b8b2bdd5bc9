"""Do concurrent audit writers keep lines whole? Processes append JSON lines to one destination at once.

    python -m benchmarks.audit_lines [--processes 8] [--records 2000]

Destinations: a regular file opened ``O_APPEND`` (no lock), a pipe with no lock, and a pipe with the
writers' ``flock`` (each process opens the lock file itself, so the kernel releases it when the holder dies).
Record sizes: 200 B, 8 KB (twice PIPE_BUF) and 100 KB (more than a pipe's 64 KB buffer). Prints, per case,
how many lines came out torn (not one whole record). Bounded: processes x records lines per case; local files
and pipes only.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import select
import tempfile
import time


def _writer(fd: int, index: int, records: int, size: int, lock_path: str | None) -> None:
    lock = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600) if lock_path else None
    pad = "x" * size
    for n in range(records):
        line = (json.dumps({"w": index, "n": n, "pad": pad}) + "\n").encode()
        if lock is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
        view = memoryview(line)
        while view:
            view = view[os.write(fd, view):]
        if lock is not None:
            fcntl.flock(lock, fcntl.LOCK_UN)
    os._exit(0)


def _count_torn(data: bytes, expected: int) -> tuple[int, int]:
    whole = torn = 0
    for line in data.split(b"\n"):
        if not line:
            continue
        try:
            json.loads(line)
            whole += 1
        except ValueError:
            torn += 1
    return whole, torn + max(0, expected - whole - torn)


def run_case(kind: str, processes: int, records: int, size: int) -> tuple[int, int, float]:
    """(whole lines, torn or missing lines, seconds) for one destination kind: file | pipe | pipe+flock."""
    directory = tempfile.mkdtemp(prefix="audit-lines-")
    lock_path = os.path.join(directory, "audit.lock") if kind == "pipe+flock" else None
    started = time.perf_counter()
    if kind == "file":
        path = os.path.join(directory, "audit.log")
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
        pids = []
        for i in range(processes):
            pid = os.fork()
            if pid == 0:
                _writer(os.open(path, os.O_WRONLY | os.O_APPEND), i, records, size, None)
            pids.append(pid)
        for pid in pids:
            os.waitpid(pid, 0)
        os.close(fd)
        with open(path, "rb") as f:
            data = f.read()
    else:
        read_end, write_end = os.pipe()
        pids = []
        for i in range(processes):
            pid = os.fork()
            if pid == 0:
                os.close(read_end)
                _writer(write_end, i, records, size, lock_path)
            pids.append(pid)
        os.close(write_end)
        chunks = []
        while True:
            select.select([read_end], [], [])
            chunk = os.read(read_end, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
        for pid in pids:
            os.waitpid(pid, 0)
        os.close(read_end)
        data = b"".join(chunks)
    seconds = time.perf_counter() - started
    whole, torn = _count_torn(data, processes * records)
    return whole, torn, seconds


def main() -> None:
    """Run every (destination, size) case and print one line each."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--records", type=int, default=2000)
    args = parser.parse_args()
    for size in (200, 8 * 1024, 100 * 1024):
        records = args.records if size < 10_000 else max(1, args.records // 10)
        for kind in ("file", "pipe", "pipe+flock"):
            whole, torn, seconds = run_case(kind, args.processes, records, size)
            print(f"{kind:<11} {size:>7} B x {args.processes} processes x {records}: {whole} whole, {torn} torn "
                  f"({seconds:.2f} s)")


if __name__ == "__main__":
    main()
