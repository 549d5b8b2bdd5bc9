"""A 413 reaches a client that sends its whole body before it reads, as kube-apiserver's Go HTTP client does.

Closing a TCP connection with unread bytes in its receive buffer makes the kernel answer with RST, and the
client loses the 413 it has not read yet. The server therefore reads and discards a refused body (up to a
bound) before it answers and closes. A raw TLS socket client: everything first (``sendall``), then read.
"""

from __future__ import annotations

import json
import socket
import ssl
from typing import Any

import pytest

from tests.conftest import SERVICE_DNS, RunningServer

FOUR_MIB = 4 * 1024 * 1024


def send_all_then_read(server: RunningServer, head: bytes, body: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``head`` and ``body`` completely, then read one HTTP response: (status, headers, body)."""
    context = ssl.create_default_context(cafile=str(server.cert_dir / "ca.crt"))
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as raw, context.wrap_socket(
        raw, server_hostname=SERVICE_DNS
    ) as conn:
        conn.sendall(head + body)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                raise ConnectionError(f"closed after {data!r}")
            data += chunk
        header_block, _, answer = data.partition(b"\r\n\r\n")
        lines = header_block.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
        while len(answer) < int(headers.get("content-length", "0")):
            chunk = conn.recv(65536)
            if not chunk:
                break
            answer += chunk
        return int(lines[0].split()[1]), headers, answer


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
