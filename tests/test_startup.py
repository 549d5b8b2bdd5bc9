"""``csinode-guard serve`` refuses to start, with exit code 2 and one clear line, when a port it needs is taken."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import free_port


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port another process listens on (127.0.0.1)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


@pytest.mark.parametrize("which", [
    pytest.param("https", id="the HTTPS port"),
    pytest.param("metrics", id="the metrics port"),
])
def test_serve_on_a_port_in_use_exits_2_with_one_clear_line(tmp_path: Path, taken_port: int, which: str) -> None:
    https_port = taken_port if which == "https" else free_port()
    metrics_port = taken_port if which == "metrics" else free_port()
    serve = subprocess.run(
        [sys.executable, "-m", "webhook", "serve", "--offline", "--host", "127.0.0.1", "--port", str(https_port),
         "--metrics-port", str(metrics_port), "--cert-dir", str(tmp_path / "certs"),
         "--audit-log", str(tmp_path / "audit.log"), "--workers", "1"],
        cwd=tmp_path, check=False, capture_output=True, text=True, timeout=120,
    )
    assert serve.returncode == 2, serve.stderr[-3000:]
    expected = (f"cannot start: HTTPS port {taken_port} on 127.0.0.1 is not free" if which == "https"
                else f"cannot start: metrics port {taken_port} is not free")
    assert expected in serve.stderr, serve.stderr[-3000:]
    assert "Connection in use" not in serve.stderr
    assert "Booting worker" not in serve.stderr
    assert "Traceback" not in serve.stderr


def test_the_first_run_says_why_it_issues_a_serving_certificate_in_plain_words(server_factory: Any) -> None:
    server = server_factory()
    log = server.stderr_path.read_text()
    [line] = [line for line in log.splitlines() if "issuing serving certificate in" in line]
    assert f"issuing serving certificate in {server.cert_dir}: first run: no CA in the directory yet, so a new one " \
           "was made" in line, line
    assert "forced" not in line


@pytest.mark.parametrize(("content", "expected"), [
    pytest.param("clusters: [\n", "cannot start: the kubeconfig is not valid YAML: ", id="not YAML"),
    pytest.param(None, "cannot start: kubeconfig {path} does not exist", id="missing"),
    pytest.param("apiVersion: v1\nkind: Config\nclusters: []\ncontexts: []\nusers: []\n",
                 "cannot start: Invalid kube-config file. Expected key current-context", id="no current-context"),
])
def test_serve_with_a_kubeconfig_it_cannot_load_exits_2_before_any_worker_boots(
    tmp_path: Path, content: str | None, expected: str
) -> None:
    path = tmp_path / "kubeconfig"
    if content is not None:
        path.write_text(content)
    serve = subprocess.run(
        [sys.executable, "-m", "webhook", "serve", "--host", "127.0.0.1", "--port", str(free_port()),
         "--metrics-port", str(free_port()), "--cert-dir", str(tmp_path / "certs"),
         "--audit-log", str(tmp_path / "audit.log"), "--workers", "1", "--kubeconfig", str(path)],
        cwd=tmp_path, check=False, capture_output=True, text=True, timeout=120,
    )
    assert serve.returncode == 2, serve.stderr[-3000:]
    assert expected.format(path=path) in serve.stderr, serve.stderr[-3000:]
    assert "Booting worker" not in serve.stderr
    assert "Traceback" not in serve.stderr
