"""``serve --reuse-port``: several ``serve`` processes listen on one address and the kernel spreads new connections
over them (three replicas behind one address, as a Service spreads the apiserver's connections over pods)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import RunningServer, free_port
from tests.load import review_with_uid

CONNECTIONS = 200
"""New connections tried at most before both processes must have answered one (the kernel picks a listener per
connection by a hash of its addresses and ports: all on one of two has probability 2**-199)."""


def _judged_uids(server: RunningServer) -> list[str]:
    return [record["uid"] for record in server.audit_records()]


def test_two_serve_processes_with_reuse_port_share_one_port_and_both_answer(server_factory: Any) -> None:
    first = server_factory("--reuse-port")
    second = server_factory("--reuse-port", port=first.port, cert_dir=first.cert_dir)
    assert second.port == first.port
    sent: list[str] = []
    for n in range(CONNECTIONS):
        uid = f"reuse-port-{n}"
        pool = first.client()  # a new connection each time, verified against the CA and the service DNS name
        try:
            answer = pool.request(
                "POST", "/mutate?timeout=10s", body=review_with_uid(uid), headers={"Content-Type": "application/json"}
            )
        finally:
            pool.close()
        assert answer.status == 200, answer.data[:300]
        assert json.loads(answer.data)["response"]["uid"] == uid
        sent.append(uid)
        if _judged_uids(first) and _judged_uids(second):
            break
    # Each process judged some of the requests, in its own audit log, and every request was judged exactly once.
    assert _judged_uids(first), "the first process answered none"
    assert _judged_uids(second), "the second process answered none"
    assert sorted(_judged_uids(first) + _judged_uids(second)) == sorted(sent)
    assert first.process.poll() is None
    assert second.process.poll() is None


@pytest.mark.parametrize(
    ("first_flags", "second_flags"),
    [
        pytest.param(("--reuse-port",), (), id="the second without --reuse-port"),
        pytest.param((), ("--reuse-port",), id="the first without --reuse-port"),
    ],
)
def test_a_port_is_shared_only_when_every_process_asks_for_it(
    server_factory: Any, tmp_path: Path, first_flags: tuple[str, ...], second_flags: tuple[str, ...]
) -> None:
    first = server_factory(*first_flags)
    serve = subprocess.run(
        [
            sys.executable,
            "-m",
            "webhook",
            "serve",
            "--offline",
            "--host",
            "127.0.0.1",
            "--port",
            str(first.port),
            "--metrics-port",
            str(free_port()),
            "--cert-dir",
            str(first.cert_dir),
            "--audit-log",
            str(tmp_path / "second.log"),
            "--workers",
            "1",
            *second_flags,
        ],
        cwd=tmp_path,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert serve.returncode == 2, serve.stderr[-3000:]
    assert f"cannot start: HTTPS port {first.port} on 127.0.0.1 is not free" in serve.stderr, serve.stderr[-3000:]
    assert "Booting worker" not in serve.stderr
    assert first.get("/healthz").status == 200
