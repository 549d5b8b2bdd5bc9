"""Shared fixtures: a real csinode-guard server over TLS, a CA-verified keep-alive HTTPS client, and a fake API
server with a kubeconfig for it (a test module that needs objects in it extends ``apiserver``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import urllib3

from tests.apiserver import FakeApiServer
from tests.ports import free_port

SERVICE_DNS = "csinode-guard.csinode-guard.svc"
REPO = Path(__file__).resolve().parent.parent


@dataclass
class RunningServer:
    """A ``csinode-guard serve`` subprocess and a client that verifies its CA and service DNS name."""

    process: subprocess.Popen[bytes]
    port: int
    metrics_port: int
    cert_dir: Path
    audit_log: Path
    stderr_path: Path
    pool: urllib3.HTTPSConnectionPool = field(init=False)

    def __post_init__(self) -> None:
        self.pool = self.client()

    def client(self, **kwargs: Any) -> urllib3.HTTPSConnectionPool:
        """A keep-alive HTTPS pool to 127.0.0.1 that checks the certificate against ca.crt and SERVICE_DNS."""
        return urllib3.HTTPSConnectionPool(
            "127.0.0.1",
            self.port,
            maxsize=1,
            ca_certs=str(self.cert_dir / "ca.crt"),
            cert_reqs="CERT_REQUIRED",
            server_hostname=SERVICE_DNS,
            assert_hostname=SERVICE_DNS,
            retries=False,
            timeout=urllib3.Timeout(connect=5, read=15),
            **kwargs,
        )

    def post(self, path: str, body: Any, content_type: str = "application/json") -> urllib3.BaseHTTPResponse:
        """POST ``body`` (a dict is JSON-encoded) to ``path`` with ``?timeout=10s`` as the apiserver does."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        return self.pool.request(
            "POST", f"{path}?timeout=10s", body=data, headers={"Content-Type": content_type}
        )

    def get(self, path: str) -> urllib3.BaseHTTPResponse:
        """GET ``path`` over HTTPS."""
        return self.pool.request("GET", path)

    def get_on_fresh_connection(self, path: str) -> urllib3.BaseHTTPResponse:
        """GET ``path`` over a new connection (so that it may land on either worker).

        The server closes a connection whose TLS handshake is not complete within its client read timeout (the
        slow-client bound, ``webhook.serving.workers.DeadlineSSLSocket``, logged as "no complete TLS handshake"),
        which a machine loaded by the rest of the suite can cause: such a reset, and only one the server logged
        so, is tried again on a new connection, twice at most. Any other reset fails the test."""
        for attempt in range(3):
            closed_before = self.handshake_closes()
            pool = self.client()
            try:
                return pool.request("GET", path)
            except urllib3.exceptions.ProtocolError as exc:
                if attempt == 2 or self.handshake_closes() == closed_before:
                    log = self.stderr_path.read_text(errors="replace")
                    raise AssertionError(f"GET {path} on a new connection: {exc}; the server's log ends:\n"
                                         f"{log[-3000:]}") from exc
            finally:
                pool.close()
        raise AssertionError("unreachable")

    def handshake_closes(self) -> int:
        """How many connections the server closed so far for a TLS handshake past its deadline (its log)."""
        return self.stderr_path.read_text(errors="replace").count("no complete TLS handshake")

    def audit_records(self) -> list[dict[str, Any]]:
        """Every record in the audit log so far."""
        if not self.audit_log.exists():
            return []
        return [json.loads(line) for line in self.audit_log.read_text().splitlines() if line.strip()]

    def stop(self) -> int:
        """SIGTERM and wait; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                raise
        return self.process.returncode


def start_server(
    tmp: Path,
    *extra: str,
    env: dict[str, str] | None = None,
    workers: int = 2,
    offline: bool = True,
    cert_dir: Path | None = None,
    stdout: Any = subprocess.DEVNULL,
    port: int | None = None,
) -> RunningServer:
    """Start ``python -m webhook serve`` on free ports (the HTTPS one ``port`` when given) with certs in
    ``tmp/certs``; wait until /healthz answers.

    ``stdout`` is the server's standard output (``subprocess.PIPE``: ``process.stdout``, for ``--audit-log -``).
    """
    port, metrics_port = port or free_port(), free_port()
    cert_dir = cert_dir or tmp / "certs"
    audit = tmp / "audit.log"
    stderr_path = tmp / "server.stderr"
    cmd = [
        sys.executable, "-m", "webhook", "serve",
        "--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(metrics_port),
        "--cert-dir", str(cert_dir), "--dns-name", SERVICE_DNS, "--audit-log", str(audit),
        "--workers", str(workers), *(["--offline"] if offline else []), *extra,
    ]
    full_env = dict(os.environ)
    full_env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    full_env.update(env or {})
    with stderr_path.open("wb") as err:
        process = subprocess.Popen(cmd, stdout=stdout, stderr=err, env=full_env, cwd=tmp)
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited {process.returncode}: {stderr_path.read_text()[-3000:]}")
        if (cert_dir / "ca.crt").exists():
            try:
                server = RunningServer(process, port, metrics_port, cert_dir, audit, stderr_path)
                if server.get("/healthz").status == 200:
                    return server
            except (urllib3.exceptions.HTTPError, OSError):
                pass
        time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"server did not become healthy: {stderr_path.read_text()[-3000:]}")


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator[Any]:
    """Start servers with ``server_factory(*extra_args)``; all are stopped at the end of the test."""
    started: list[RunningServer] = []

    def factory(*extra: str, **kwargs: Any) -> RunningServer:
        sub = tmp_path / f"server{len(started)}"
        sub.mkdir()
        server = start_server(sub, *extra, **kwargs)
        started.append(server)
        return server

    yield factory
    for server in started:
        # The test is over: close its keep-alive connection first, else the stopping worker keeps it open for
        # gunicorn's 2 s linger (so that a request arriving meanwhile is still answered).
        server.pool.close()
        server.stop()


@pytest.fixture
def apiserver(request: pytest.FixtureRequest) -> Iterator[FakeApiServer]:
    """A fake API server (the real wire format, for the real kubernetes client): empty, or holding the objects
    of the directory a test module names in ``APISERVER_DATA`` (e.g. tests/data/cluster)."""
    with FakeApiServer() as server:
        data = getattr(request.module, "APISERVER_DATA", None)
        if data is not None:
            server.load_dir(data)
        yield server


@pytest.fixture
def kubeconfig(apiserver: FakeApiServer, tmp_path: Path) -> str:
    """A kubeconfig file for ``apiserver``."""
    return apiserver.write_kubeconfig(tmp_path / "kubeconfig")
