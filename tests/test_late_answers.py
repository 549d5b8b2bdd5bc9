"""Answers the apiserver no longer waits for are marked in the audit record and counted.

Against the real served guard over TLS (CA-verified client): the apiserver's HTTP client sends ``?timeout=Ns``,
gives up after it, closes the connection and applies the webhook's failurePolicy. A review that waited in the
socket of a keep-alive connection while the worker was stopped (SIGSTOP) is answered after that: its record says
``late`` (the peer had closed), and ``csinode_guard_late_answers_total`` counts it. A request whose reading took
longer than its timeout is late by the clock alone. A normal answer is not marked.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any, Protocol

import pytest

from tests.conftest import SERVICE_DNS, RunningServer
from tests.load import review_with_uid
from tests.test_hardening_http import read_answer, tls_connection

pytestmark = pytest.mark.slow


def worker_pids(server: RunningServer) -> list[int]:
    """The gunicorn worker pids of ``server``."""
    path = Path(f"/proc/{server.process.pid}/task/{server.process.pid}/children")
    return [int(p) for p in path.read_text().split()]


def request_bytes(path: str, body: bytes) -> bytes:
    """An HTTP/1.1 keep-alive POST as the apiserver sends it."""
    return (f"POST {path} HTTP/1.1\r\nHost: {SERVICE_DNS}\r\nContent-Type: application/json\r\n"
            f"Accept: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


def records_of(server: RunningServer, uid: str, timeout: float = 15.0) -> list[dict[str, Any]]:
    """The audit records of request ``uid``, waiting up to ``timeout`` seconds for them."""
    deadline = time.monotonic() + timeout
    while True:
        found = [r for r in server.audit_records() if r["uid"] == uid]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


class _ServesMetrics(Protocol):
    metrics_port: int


def late_answers(server: _ServesMetrics) -> dict[str, float]:
    """``csinode_guard_late_answers_total`` by endpoint, from the /metrics of a guard (a served one or a cluster's)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("csinode_guard_late_answers_total{"):
            labels, value = line.rsplit(" ", 1)
            out[labels.split('endpoint="', 1)[1].split('"', 1)[0]] = float(value)
    return out


def wait_for_late_answers(server: RunningServer, expected: dict[str, float], timeout: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        seen = late_answers(server)
        if seen == expected or time.monotonic() > deadline:
            return seen
        time.sleep(0.2)


def test_a_review_that_waited_in_a_stopped_workers_socket_past_its_timeout_is_recorded_late(
        server_factory: Any) -> None:
    server = server_factory(workers=1)
    [worker] = worker_pids(server)
    assert late_answers(server) == {"mutate": 0.0, "validate": 0.0}  # both series exist before any late answer
    conn = tls_connection(server)
    try:
        conn.sendall(request_bytes("/mutate?timeout=10s", review_with_uid("warm-on-time")))
        status, _, body = read_answer(conn, timeout=10)
        assert status == 200 and json.loads(body)["response"]["uid"] == "warm-on-time"
        os.kill(worker, signal.SIGSTOP)
        try:
            conn.sendall(request_bytes("/mutate?timeout=1s", review_with_uid("answered-too-late")))
            with pytest.raises(TimeoutError):  # the apiserver waits for its timeout...
                read_answer(conn, timeout=1.0)
        finally:
            conn.close()  # ...then gives up and closes the connection, and applies failurePolicy
            time.sleep(0.5)
            os.kill(worker, signal.SIGCONT)
    finally:
        conn.close()
    [late] = records_of(server, "answered-too-late")
    assert late["late"] is True, late
    assert late["deadlineSeconds"] == 1.0
    # The worker began reading only after SIGCONT: its clock cannot see the wait, the closed connection can.
    assert late["lateReason"] == ("client-closed" if late["elapsedSeconds"] <= 1.0 else "deadline"), late
    [warm] = records_of(server, "warm-on-time")
    assert "late" not in warm and "lateReason" not in warm, warm
    assert wait_for_late_answers(server, {"mutate": 1.0, "validate": 0.0}) == {"mutate": 1.0, "validate": 0.0}
    log = server.stderr_path.read_text()
    assert "answered-too-late" in log and "did not take effect" in log


def test_a_request_whose_reading_outlasted_its_timeout_is_late_by_the_clock(server_factory: Any) -> None:
    """The client here still waits, but an apiserver would have stopped at 1 s: the elapsed time since the worker
    began reading the request (a lower bound of the apiserver's) is past the timeout it sent."""
    server = server_factory(workers=1)
    whole = request_bytes("/validate?timeout=1s", review_with_uid("read-past-its-timeout"))
    with tls_connection(server) as conn:
        conn.sendall(whole[:200])
        time.sleep(1.5)  # within the 5 s client read deadline, past the 1 s timeout
        conn.sendall(whole[200:])
        status, _, _ = read_answer(conn, timeout=10)
        assert status == 200
        conn.sendall(request_bytes("/validate?timeout=1s", review_with_uid("on-time")))
        assert read_answer(conn, timeout=10)[0] == 200
    [late] = records_of(server, "read-past-its-timeout")
    assert late["late"] is True and late["lateReason"] == "deadline", late
    assert late["elapsedSeconds"] > 1.0 and late["deadlineSeconds"] == 1.0, late
    [on_time] = records_of(server, "on-time")
    assert "late" not in on_time, on_time
    assert wait_for_late_answers(server, {"mutate": 0.0, "validate": 1.0}) == {"mutate": 0.0, "validate": 1.0}
