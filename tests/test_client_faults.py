"""A client that never finishes its body is the client's fault: counted apart
(``csinode_guard_client_faults_total{reason}``), never as an internal error (the CSINodeGuardInternalErrors
alert is for the guard's own bugs). Against the real server over TLS."""

from __future__ import annotations

import time
import urllib.request
from typing import Any

import pytest

from tests.test_hardening_http import closed_by_server, read_answer, tls_connection

pytestmark = pytest.mark.slow


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def test_a_body_that_never_finishes_is_a_client_fault_not_an_internal_error(server_factory: Any) -> None:
    server = server_factory(env={"CSINODE_GUARD_CLIENT_READ_TIMEOUT": "1"})
    stalled = []
    for _ in range(3):  # a chunked body whose last chunk never comes
        conn = tls_connection(server)
        conn.sendall(b"POST /mutate?timeout=10s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n8\r\n{\"kind\":\r\n")
        stalled.append(conn)
    for _ in range(2):  # a declared length that is never reached
        conn = tls_connection(server)
        conn.sendall(b"POST /validate?timeout=10s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 6000\r\n\r\n{\"kind\":")
        stalled.append(conn)
    try:
        statuses = []
        for conn in stalled:
            try:
                statuses.append(read_answer(conn, timeout=8)[0])
            except (ConnectionError, OSError):
                statuses.append(None)  # closed without an answer: acceptable, the client is gone anyway
            assert closed_by_server(conn, 5)
    finally:
        for conn in stalled:
            conn.close()
    assert set(statuses) <= {408, None}, statuses
    time.sleep(1.5)  # per-request samples reach the metric files once a second
    samples = scrape(server.metrics_port)
    assert samples.get("csinode_guard_internal_errors_total", 0.0) == 0.0
    assert samples.get('csinode_guard_client_faults_total{reason="too_slow"}', 0.0) == 5.0, {
        k: v for k, v in samples.items() if "fault" in k or "error" in k}
    assert server.get("/healthz").status == 200
    assert "Traceback" not in server.stderr_path.read_text()
