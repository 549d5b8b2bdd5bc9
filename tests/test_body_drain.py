"""A 413 reaches a client that sends its whole body before it reads, as kube-apiserver's Go HTTP client does.

Closing a TCP connection with unread bytes in its receive buffer makes the kernel answer with RST, and the
client loses the 413 it has not read yet. The server therefore reads and discards a refused body (up to a
bound) before it answers and closes. A raw TLS socket client: everything first (``sendall``), then read.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.conftest import RunningServer
from tests.test_hardening_http import read_answer, tls_connection

FOUR_MIB = 4 * 1024 * 1024


def send_all_then_read(server: RunningServer, head: bytes, body: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``head`` and ``body`` completely, then read one HTTP response: (status, headers, body)."""
    with tls_connection(server) as conn:
        conn.sendall(head + body)
        return read_answer(conn, timeout=30)


@pytest.mark.parametrize("path", ["/validate", "/mutate"])
def test_a_4_mib_body_sent_before_reading_gets_the_413(server_factory: Any, path: str) -> None:
    server = server_factory()
    body = b'{"kind": "AdmissionReview", "padding": "' + b"x" * (FOUR_MIB - 64) + b'"}'
    head = (f"POST {path}?timeout=10s HTTP/1.1\r\nHost: csinode-guard\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    for _ in range(3):
        status, headers, answer = send_all_then_read(server, head, body)
        assert status == 413, answer[:300]
        assert json.loads(answer) == {"code": 413, "error": json.loads(answer)["error"]}
        assert f"of {len(body)} bytes is over the limit" in json.loads(answer)["error"]
        assert headers.get("connection") == "close"
    assert server.get("/healthz").status == 200


def test_a_4_mib_chunked_body_sent_before_reading_gets_the_413(server_factory: Any) -> None:
    server = server_factory()
    chunk = b"x" * 65536
    body = (b"%x\r\n%s\r\n" % (len(chunk), chunk)) * (FOUR_MIB // len(chunk)) + b"0\r\n\r\n"
    head = (b"POST /validate?timeout=10s HTTP/1.1\r\nHost: csinode-guard\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    status, _, answer = send_all_then_read(server, head, body)
    assert status == 413, answer[:300]
    assert json.loads(answer)["code"] == 413
