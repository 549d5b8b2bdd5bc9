"""The state key in operations, through the real server: no key, no serving; a bad key rotation rolled back.

Install order (docs/operations.md, "Install"): a replica is never ready without its state key, so the webhook
configurations are applied only once a replica is. Rollback (docs/operations.md, "Rolling back", the state
key): state signed with the old key is ignored by a replica that lost that key, and verifies again once the old
key is back as a line of the key file.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.conftest import SERVICE_DNS, RunningServer, free_port
from tests.kube import EBS, apply_response, base_csinode, kubelet_update, review
from webhook.admission.state import STATE_ANNOTATION


def test_without_its_state_key_the_guard_exits_and_never_serves(tmp_path: Path) -> None:
    port = free_port()
    missing = tmp_path / "state-key" / "key"
    result = subprocess.run(
        [sys.executable, "-m", "webhook", "serve", "--host", "127.0.0.1", "--port", str(port), "--metrics-port", "0",
         "--cert-dir", str(tmp_path / "certs"), "--dns-name", SERVICE_DNS, "--offline",
         "--state-key-file", str(missing)],
        capture_output=True, text=True, timeout=60, check=False, env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"state key file {missing} does not exist" in result.stderr  # and it exited (run()'s timeout: 60 s)
    assert f"make one with `csinode-guard certs generate --cert-dir {missing.parent}`" in result.stderr, "says how"
    assert "csinode-guard-state-key" in result.stderr, "or where the cluster's key is"
    with socket.socket() as probe:  # nothing ever listened: a readiness probe fails, the Service has no endpoint
        assert probe.connect_ex(("127.0.0.1", port)) != 0
    assert not missing.exists()  # a named key file is never generated


def _audit_for(server: RunningServer, uid: str) -> dict[str, Any]:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        for line in server.audit_log.read_text().splitlines():
            try:
                record: dict[str, Any] = json.loads(line)
            except ValueError:
                continue
            if record.get("uid") == uid:
                return record
        time.sleep(0.05)
    raise AssertionError(f"no audit record for {uid}")


def _mutate(server: RunningServer, stored: dict[str, Any], count: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """kubelet's write of ``count`` through /mutate: (the object the apiserver stores, the audit record)."""
    new = kubelet_update(stored, EBS, count)
    body = review(stored, new)
    answer = json.loads(server.post("/mutate", body).data)
    assert answer["response"]["allowed"] is True, answer
    return apply_response(new, answer), _audit_for(server, body["request"]["uid"])


def test_a_bad_key_rotation_is_rolled_back_by_restoring_the_old_key_line(
    server_factory: Any, tmp_path: Path
) -> None:
    old_key, new_key = os.urandom(32).hex(), os.urandom(32).hex()
    files = {}
    for name, text in {"old": f"{old_key}\n", "bad": f"{new_key}\n", "restored": f"{new_key}\n{old_key}\n"}.items():
        files[name] = tmp_path / f"{name}.key"
        files[name].write_text(text)

    before = server_factory("--state-key-file", str(files["old"]), workers=1)
    stored, _ = _mutate(before, kubelet_update(base_csinode(), EBS, 25), 23)
    assert STATE_ANNOTATION in stored["metadata"]["annotations"]
    before.stop()

    bad = server_factory("--state-key-file", str(files["bad"]), workers=1)
    _, record = _mutate(bad, stored, 22)
    assert record.get("stateProblem") == "bad-signature", record
    bad.stop()

    restored = server_factory("--state-key-file", str(files["restored"]), workers=1)
    _, record = _mutate(restored, stored, 22)
    assert "stateProblem" not in record, record
