"""One log format: every line ``serve`` writes (its own loggers, gunicorn's master and workers, warnings) is a
JSON object, through start-up, requests, a malformed AdmissionReview, a worker killed and replaced, and a
graceful shutdown."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from tests.conftest import start_server
from tests.kube import EBS, base_csinode, kubelet_update, review


def log_lines(path: Path) -> list[str]:
    """The non-empty lines of ``path``."""
    return [line for line in path.read_text().splitlines() if line.strip()]


def parsed(lines: list[str]) -> list[dict[str, Any]]:
    """Every line as a JSON object; fails naming the first line that is not one."""
    out = []
    for number, line in enumerate(lines, 1):
        try:
            obj = json.loads(line)
        except ValueError:
            raise AssertionError(f"line {number} is not JSON: {line!r}") from None
        assert isinstance(obj, dict), f"line {number} is not a JSON object: {line!r}"
        out.append(obj)
    return out


def booted_workers(path: Path) -> list[int]:
    """The worker pids of gunicorn's ``Booting worker with pid: N`` lines so far."""
    return [int(r["message"].rsplit(" ", 1)[1]) for r in parsed(log_lines(path))
            if r.get("logger") == "gunicorn.error" and r["message"].startswith("Booting worker with pid: ")]


def wait_for_workers(path: Path, booted: int) -> None:
    """Wait (30 s at most) until ``booted`` workers have logged their boot."""
    deadline = time.monotonic() + 30
    while len(booted_workers(path)) < booted:
        assert time.monotonic() < deadline, path.read_text()[-3000:]
        time.sleep(0.1)


def test_every_line_serve_writes_is_a_json_object(tmp_path: Path) -> None:
    stdout_path = tmp_path / "server.stdout"
    with stdout_path.open("wb") as stdout:
        # every warning shown (a library's DeprecationWarning would be Python's two-line text without capture)
        server = start_server(tmp_path, stdout=stdout, env={"PYTHONWARNINGS": "always"})
    try:
        stored = base_csinode()
        assert server.post("/mutate", review(stored, kubelet_update(stored, EBS, 30))).status == 200
        assert server.post("/validate", b"{not json").status == 400
        assert server.get("/healthz").status == 200

        wait_for_workers(server.stderr_path, 2)
        os.kill(booted_workers(server.stderr_path)[0], signal.SIGKILL)  # the master logs it, boots another
        wait_for_workers(server.stderr_path, 3)
        assert server.post("/mutate", review(stored, kubelet_update(stored, EBS, 31))).status == 200
    finally:
        code = server.stop()
    assert code == 0

    lines = log_lines(server.stderr_path) + log_lines(stdout_path)
    records = parsed(lines)
    for record in records:
        assert {"time", "level", "logger", "pid", "message"} <= record.keys(), record
    gunicorn = [r["message"] for r in records if r["logger"] == "gunicorn.error"]
    # gunicorn's own lines, master and workers, start to finish, are JSON objects of logger gunicorn.error
    for expected in ("Starting gunicorn", "Booting worker with pid", "Worker (pid:", "Handling signal: term",
                     "Worker exiting", "Shutting down: Master"):
        assert any(m.startswith(expected) for m in gunicorn), (expected, gunicorn)
    # and the guard's own, the malformed review's warning among them
    assert any(r["logger"].startswith("csinode_guard") and r["message"].startswith("bad AdmissionReview")
               for r in records), lines
