"""Hardening of the served endpoint: TLS versions and suites, client certificates, body limits, slow clients,
connection max age, and no secret in logs, audit records or metrics. All against the real server over TLS.
"""

from __future__ import annotations

import base64
import json
import os
import re
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import urllib3
from cryptography.hazmat.primitives import serialization

from tests.conftest import SERVICE_DNS, RunningServer, free_port, start_server
from tests.load import review_with_uid
from webhook.serving import dev_certs

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """One default server for the read-only checks of this module."""
    running = start_server(tmp_path_factory.mktemp("hardening"))
    yield running
    running.stop()


def client_context(server: RunningServer) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(server.cert_dir / "ca.crt"))


def handshake(server: RunningServer, context: ssl.SSLContext) -> tuple[str | None, str]:
    """Connect, complete a TLS handshake and one request; returns (protocol, cipher)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as raw, context.wrap_socket(
        raw, server_hostname=SERVICE_DNS
    ) as conn:
        conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answer = conn.recv(4096)  # TLS 1.3 reports a refused client certificate only here
        if not answer:
            raise ssl.SSLError("connection closed without an answer")
        cipher = conn.cipher()
        assert cipher is not None
        return conn.version(), cipher[0]


# -- TLS ---------------------------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:ssl.TLSVersion.TLSv1:DeprecationWarning")
@pytest.mark.parametrize("version", [pytest.param("TLSv1", id="TLS 1.0"), pytest.param("TLSv1_1", id="TLS 1.1")])
def test_an_old_protocol_is_refused_by_the_served_endpoint(server: RunningServer, version: str) -> None:
    context = client_context(server)
    context.minimum_version = context.maximum_version = getattr(ssl.TLSVersion, version)
    context.set_ciphers("DEFAULT:@SECLEVEL=0")  # so that OpenSSL 3 really offers the old protocol
    with pytest.raises((ssl.SSLError, ConnectionResetError)):
        handshake(server, context)


def test_tls_1_2_gets_an_ecdhe_aead_suite_and_tls_1_3_is_the_default(server: RunningServer) -> None:
    context = client_context(server)
    context.maximum_version = ssl.TLSVersion.TLSv1_2
    version, cipher = handshake(server, context)
    assert version == "TLSv1.2"
    assert cipher.startswith("ECDHE-") and ("GCM" in cipher or "CHACHA20" in cipher), cipher
    assert handshake(server, client_context(server))[0] == "TLSv1.3"


@pytest.mark.parametrize(
    "ciphers",
    [
        pytest.param("ECDHE-ECDSA-AES128-SHA:ECDHE-ECDSA-AES256-SHA384:ECDHE-ECDSA-AES128-SHA256", id="CBC suites"),
        pytest.param("AES128-GCM-SHA256:AES256-GCM-SHA384", id="no forward secrecy (RSA key exchange)"),
        pytest.param("DHE-RSA-AES128-GCM-SHA256", id="finite-field DHE"),
    ],
)
def test_tls_1_2_suites_that_are_not_ecdhe_aead_are_refused(server: RunningServer, ciphers: str) -> None:
    context = client_context(server)
    context.maximum_version = ssl.TLSVersion.TLSv1_2
    context.set_ciphers(ciphers + ":@SECLEVEL=0")
    with pytest.raises((ssl.SSLError, ConnectionResetError)):
        handshake(server, context)


def _write_client_ca(directory: Path, name: str) -> tuple[Path, Path, Path]:
    """A CA and a client certificate it signed: (ca.crt, client.crt, client.key)."""
    ca_key, ca_cert = dev_certs.generate_ca(f"{name} CA")
    key, cert = dev_certs.generate_client_cert(ca_key, ca_cert, "kube-apiserver")
    paths = directory / f"{name}-ca.crt", directory / f"{name}-client.crt", directory / f"{name}-client.key"
    paths[0].write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return paths


def test_with_client_ca_only_the_apiservers_client_certificate_gets_reviews_answered(tmp_path: Path) -> None:
    ca, cert, key = _write_client_ca(tmp_path, "apiserver")
    _, other_cert, other_key = _write_client_ca(tmp_path, "other")
    port = free_port()
    cert_dir = tmp_path / "certs"
    cmd = [sys.executable, "-m", "webhook", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--metrics-port", "0", "--cert-dir", str(cert_dir), "--dns-name", SERVICE_DNS, "--offline",
           "--client-ca", str(ca), "--audit-log", str(tmp_path / "audit.log")]
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    with (tmp_path / "server.stderr").open("wb") as err:
        process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 40
        while not (cert_dir / "ca.crt").exists() and time.monotonic() < deadline:
            time.sleep(0.1)

        def pool(cert_file: Path | None, key_file: Path | None) -> urllib3.HTTPSConnectionPool:
            return urllib3.HTTPSConnectionPool(
                "127.0.0.1", port, ca_certs=str(cert_dir / "ca.crt"), cert_reqs="CERT_REQUIRED",
                server_hostname=SERVICE_DNS, assert_hostname=SERVICE_DNS, retries=False, timeout=5,
                cert_file=str(cert_file) if cert_file else None, key_file=str(key_file) if key_file else None,
            )

        good = pool(cert, key)
        while time.monotonic() < deadline:
            try:
                if good.request("GET", "/healthz").status == 200:
                    break
            except urllib3.exceptions.HTTPError:
                time.sleep(0.2)
        answer = good.request("POST", "/mutate?timeout=10s", body=review_with_uid("with-client-cert"),
                              headers={"Content-Type": "application/json"})
        assert answer.status == 200 and json.loads(answer.data)["response"]["uid"] == "with-client-cert"
        # No certificate: the probes still answer (kubelet presents none), the reviews are refused.
        anonymous = pool(None, None)
        assert anonymous.request("GET", "/healthz").status == 200
        assert anonymous.request("GET", "/readyz").status == 200
        refused = anonymous.request("POST", "/mutate?timeout=10s", body=review_with_uid("no-client-cert"),
                                    headers={"Content-Type": "application/json"})
        assert refused.status == 403
        assert "client certificate" in json.loads(refused.data)["error"]
        # A certificate from another CA fails the handshake itself.
        with pytest.raises(urllib3.exceptions.HTTPError):
            pool(other_cert, other_key).request("GET", "/healthz")
    finally:
        process.terminate()
        process.wait(30)


# -- bodies, slow clients, connections ----------------------------------------------------------------------------


def tls_connection(server: RunningServer) -> ssl.SSLSocket:
    raw = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    return client_context(server).wrap_socket(raw, server_hostname=SERVICE_DNS)


def read_answer(conn: ssl.SSLSocket, timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    """Read one HTTP response (status, lower-cased headers, body) from ``conn``."""
    conn.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed after {data!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(lines[0].split()[1]), headers, body


def closed_by_server(conn: socket.socket, timeout: float) -> bool:
    """True when the server closes ``conn`` (EOF or reset) within ``timeout`` seconds."""
    conn.settimeout(timeout)
    try:
        while conn.recv(65536):
            pass
    except TimeoutError:
        return False
    except (OSError, ssl.SSLError):
        return True
    return True


def test_a_declared_body_over_the_limit_gets_413_and_is_not_read(server: RunningServer) -> None:
    with tls_connection(server) as conn:
        conn.sendall(b"POST /mutate?timeout=10s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 50000000\r\n\r\n" + b"{" * 65536)
        status, headers, body = read_answer(conn)
        assert status == 413 and json.loads(body)["code"] == 413
        assert headers.get("connection") == "close"
        # 64 KB of the declared 50 MB sent, and the server closed: it did not wait for the rest.
        assert closed_by_server(conn, 5), "the server waited for the rest of the 50 MB body"


def test_a_chunked_body_over_the_limit_gets_413(server_factory: Any) -> None:
    server = server_factory("--max-body-bytes", "4096")
    with tls_connection(server) as conn:
        chunk = b"x" * 3000
        conn.sendall(b"POST /validate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n" + (b"%x\r\n%s\r\n" % (len(chunk), chunk)) * 3)
        status, _, body = read_answer(conn)
        assert status == 413 and json.loads(body)["code"] == 413
    assert server.get("/healthz").status == 200


def test_stalled_clients_hold_a_thread_only_until_the_read_deadline(server_factory: Any) -> None:
    server = server_factory("--threads", "2", workers=1, env={"CSINODE_GUARD_CLIENT_READ_TIMEOUT": "1"})
    silent = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(8)]
    partial_headers = tls_connection(server)
    partial_headers.sendall(b"POST /mutate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
    partial_body = tls_connection(server)
    partial_body.sendall(b"POST /mutate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 6000\r\n\r\n{\"kind\":")
    half_hello = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    half_hello.sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")  # the start of a ClientHello
    stalled: list[socket.socket] = [partial_headers, partial_body, half_hello]
    try:
        # Both threads are held by stalled clients now, and a third one waits: the stalled ones never send more,
        # so a well-behaved request is answered at all (the client waits up to 15 s) only because the deadline
        # (1 s) freed a thread.
        answer = server.client().request("POST", "/mutate?timeout=10s", body=review_with_uid("after-stalls"),
                                         headers={"Content-Type": "application/json"})
        assert answer.status == 200
        for conn in stalled:
            assert closed_by_server(conn, 4)
        assert server.client().request("GET", "/healthz").status == 200
    finally:
        for s in [*silent, *stalled]:
            s.close()
    log = server.stderr_path.read_text()
    assert "Traceback" not in log
    assert log.count("client sent no complete") == 3, log  # one line per stalled client, no drain wait
    # Each line names what the client still owed: the half ClientHello its handshake, the others their request.
    assert log.count("client sent no complete TLS handshake") == 1, log
    assert log.count("client sent no complete request") == 2, log


def test_connections_that_send_nothing_hold_no_thread(server_factory: Any) -> None:
    """Eight idle connections and two threads, with a read deadline of an hour: a request is answered (the client
    waits up to 15 s) only because the idle connections wait in the worker's poller, not in its threads."""
    server = server_factory("--threads", "2", workers=1, env={"CSINODE_GUARD_CLIENT_READ_TIMEOUT": "3600"})
    silent = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(8)]
    try:
        for _ in range(3):
            assert server.client().request("GET", "/healthz").status == 200
        answer = server.client().request("POST", "/mutate?timeout=10s", body=review_with_uid("past-idle"),
                                         headers={"Content-Type": "application/json"})
        assert answer.status == 200
    finally:
        for s in silent:
            s.close()


def test_a_keep_alive_connection_older_than_max_age_is_closed_after_its_next_response(
    server_factory: Any,
) -> None:
    server = server_factory("--connection-max-age", "1")
    with tls_connection(server) as conn:
        request = (b"POST /mutate?timeout=10s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   b"Content-Length: %d\r\n\r\n")
        body = review_with_uid("age-1")
        conn.sendall(request % len(body) + body)
        status, headers, _ = read_answer(conn)
        assert status == 200 and headers.get("connection", "keep-alive") != "close"
        time.sleep(1.2)
        body = review_with_uid("age-2")
        conn.sendall(request % len(body) + body)
        status, headers, _ = read_answer(conn)
        assert status == 200
        assert headers.get("connection") == "close"
        assert closed_by_server(conn, 5)


# -- secrets -----------------------------------------------------------------------------------------------------


def _secret_fragments(cert_dir: Path) -> list[str]:
    """Strings that would betray a secret: the state key (as written, hex, base64) and private-key material."""
    fragments = []
    for raw_line in (cert_dir / "state.key").read_text().splitlines():
        line = raw_line.strip()
        if line and not line.startswith("#"):
            raw = bytes.fromhex(line)
            fragments += [line, raw.hex(), base64.b64encode(raw).decode(), base64.urlsafe_b64encode(raw).decode()]
            fragments.append(base64.b64encode(raw).decode().rstrip("="))
    for name in ("tls.key", "ca.key"):
        body = [ln for ln in (cert_dir / name).read_text().splitlines() if ln and not ln.startswith("-----")]
        fragments += [ln[8:40] for ln in body if len(ln) >= 40]
    fragments.append("PRIVATE KEY")
    return fragments


def test_no_secret_reaches_logs_audit_records_or_metrics(server_factory: Any, tmp_path: Path) -> None:
    server = server_factory("--log-level", "debug")
    for body in (review_with_uid("secrets-1"), b"{not json", b'{"apiVersion": "admission.k8s.io/v1"}'):
        server.post("/mutate", body)
        server.post("/validate", body)
    server.get("/readyz")
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as answer:
        metrics = answer.read().decode()
    server.stop()
    texts = {"stderr": server.stderr_path.read_text(), "audit": server.audit_log.read_text(), "metrics": metrics}
    assert "secrets-1" in texts["audit"]
    for fragment in _secret_fragments(server.cert_dir):
        for name, text in texts.items():
            assert fragment not in text, f"{name} contains secret material {fragment[:6]}..."
    assert not re.search(r"-----BEGIN [A-Z ]*PRIVATE KEY-----", "".join(texts.values()))
