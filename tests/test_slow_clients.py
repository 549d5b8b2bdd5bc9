"""Slow clients hold no thread: a request reaches a thread only once it has arrived whole, and the whole request
(headers and body) has a deadline of its own. Against the real server over TLS: one worker with two threads,
64 connections trickling headers or bodies a byte at a time, and the apiserver's reviews meanwhile.

(``python -m benchmarks.slow_clients`` measures the latencies; here only what a loaded machine cannot blur:
before, each attacker held a thread for the whole 5 s read deadline and the reviews queued behind them.)
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
import urllib.request
from typing import Any

import pytest

from tests.conftest import SERVICE_DNS, RunningServer
from tests.load import review_with_uid
from webhook.serving.wholerequest import request_complete

pytestmark = pytest.mark.slow


def trickle(server: RunningServer, head: bytes, payload: bytes, stop: threading.Event, closed: list[int]) -> None:
    """Send ``head`` then ``payload`` one byte per 0.2 s until stopped or closed by the server."""
    context = ssl.create_default_context(cafile=str(server.cert_dir / "ca.crt"))
    try:
        raw = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        conn = context.wrap_socket(raw, server_hostname=SERVICE_DNS)
    except OSError:
        return
    try:
        conn.sendall(head)
        for byte in payload:
            if stop.wait(0.2):
                return
            conn.sendall(bytes([byte]))
    except OSError:
        closed.append(1)
    finally:
        conn.close()


def test_64_slow_connections_leave_the_threads_to_whole_requests(server_factory: Any) -> None:
    server = server_factory("--threads", "2", workers=1)
    stop = threading.Event()
    closed: list[int] = []
    body_head = (b"POST /mutate?timeout=10s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 6000\r\n\r\n")
    attackers = [
        threading.Thread(target=trickle, daemon=True, args=(
            server, body_head if i % 2 else b"POST /mutate HTTP/1.1\r\nHost: x\r\n",
            b"{" * 6000 if i % 2 else b"X-Slow: " + b"a" * 6000, stop, closed))
        for i in range(64)
    ]
    for t in attackers:
        t.start()
    try:
        time.sleep(1.5)  # every attacker holds a half-sent request now
        pool = server.client()
        waits = []
        for n in range(20):
            started = time.monotonic()
            answer = pool.request("POST", "/mutate?timeout=10s", body=review_with_uid(f"amid-slow-{n}"),
                                  headers={"Content-Type": "application/json"})
            waits.append(time.monotonic() - started)
            assert answer.status == 200
        fresh = []
        for n in range(5):
            started = time.monotonic()
            assert server.client().request("POST", "/mutate?timeout=10s", body=review_with_uid(f"fresh-{n}"),
                                           headers={"Content-Type": "application/json"}).status == 200
            fresh.append(time.monotonic() - started)
        # Two threads behind 64 attackers held for the 5 s deadline each: reviews used to wait 5 s and more.
        assert max(waits) < 2.5 and max(fresh) < 2.5, (waits, fresh)
        deadline = time.monotonic() + 15
        while len(closed) < 64 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(closed) == 64, "the request deadline did not close every slow connection"
    finally:
        stop.set()
        for t in attackers:
            t.join(5)
    time.sleep(1.5)
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    assert 'csinode_guard_client_faults_total{reason="too_slow"} 64.0' in text
    assert "csinode_guard_internal_errors_total 0.0" in text


@pytest.mark.parametrize(
    ("data", "complete"),
    [
        pytest.param(b"POST / HTTP/1.1\r\nHost: x\r\n", False, id="headers not ended"),
        pytest.param(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", True, id="no body"),
        pytest.param(b"POST / HTTP/1.1\r\nContent-Length: 5\r\n\r\nabc", False, id="body short of its length"),
        pytest.param(b"POST / HTTP/1.1\r\ncontent-length:5\r\n\r\nabcde", True, id="body of its length"),
        pytest.param(b"POST / HTTP/1.1\r\nContent-Length: 999999\r\n\r\n", True, id="declared over the limit"),
        pytest.param(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n", False,
                     id="chunked without its last chunk"),
        pytest.param(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n", True,
                     id="chunked whole"),
        pytest.param(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\nX-T: 1\r\n", False,
                     id="chunked trailers not ended"),
        pytest.param(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", True,
                     id="chunked malformed: the parser refuses it"),
        pytest.param(b"POST / HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n", True,
                     id="expects 100 Continue"),
    ],
)
def test_request_complete(data: bytes, complete: bool) -> None:
    assert request_complete(data, max_body=1000) is complete
