"""Policy hot reload through the real server: a ConfigMap-style ``..data`` symlink swap under load.

A ConfigMap volume holds ``policy.yaml -> ..data/policy.yaml`` and ``..data -> ..<timestamp>``; kubelet updates
it by writing a new timestamped directory and renaming a new ``..data`` symlink over the old one (atomic). The
server (2 gunicorn workers, each with its own PolicyStore) checks every 0.5 s. Requests run from a second thread
during every swap and must all succeed.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import urllib3
import yaml

from tests.conftest import REPO, RunningServer
from tests.kube import EBS, base_csinode, kubelet_update, review
from webhook.admission.policy import PolicyError, load_policy
from webhook.serving.live_policy import GenerationLedger, PolicyStore


class ConfigMapVolume:
    """A directory laid out as kubelet lays out a ConfigMap volume, updated the way kubelet updates it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir()
        self.version = 0

    @property
    def policy(self) -> Path:
        """The path the server is given: ``<root>/policy.yaml`` (a symlink through ``..data``)."""
        return self.root / "policy.yaml"

    def publish(self, text: str) -> None:
        """Write ``text`` into a new timestamped directory and swap ``..data`` to it atomically."""
        self.version += 1
        stamp = f"..2026_11_30_02_00_{self.version:02d}.{os.getpid()}"
        target = self.root / stamp
        target.mkdir()
        (target / "policy.yaml").write_text(text)
        tmp_link = self.root / "..data_tmp"
        tmp_link.symlink_to(stamp)
        previous = os.readlink(self.root / "..data") if (self.root / "..data").is_symlink() else None
        os.replace(tmp_link, self.root / "..data")
        if not self.policy.is_symlink():
            self.policy.symlink_to("..data/policy.yaml")
        if previous:  # kubelet removes the old directory after the swap
            for f in (self.root / previous).iterdir():
                f.unlink()
            (self.root / previous).rmdir()


def policy_text(name: str, ceiling_action: str) -> str:
    doc = yaml.safe_load((REPO / "policies" / "default.yaml").read_text())
    doc["metadata"]["name"] = name
    doc["spec"]["rules"]["count-ceiling"]["enforcementAction"] = ceiling_action
    doc["spec"]["writers"]["users"] = [COUNT_WRITER]
    return yaml.safe_dump(doc, sort_keys=False)


def invalid_policy_text() -> str:
    doc = yaml.safe_load((REPO / "policies" / "default.yaml").read_text())
    doc["metadata"]["name"] = "broken"
    doc["spec"]["rules"]["change-rate"]["minInterval"] = "fast"
    return yaml.safe_dump(doc, sort_keys=False)


def readyz(server: RunningServer) -> dict[str, Any]:
    """/readyz over a fresh connection (so that it may land on either worker; a handshake the loaded machine made
    miss the server's deadline is tried again: :meth:`RunningServer.get_on_fresh_connection`)."""
    body: dict[str, Any] = json.loads(server.get_on_fresh_connection("/readyz").data)
    return body


def wait_for_generation(server: RunningServer, generation: int, policy_hash: str, timeout: float = 30) -> None:
    """Until /readyz shows (generation, hash) several times in a row over fresh connections."""
    deadline = time.monotonic() + timeout
    streak = 0
    last: dict[str, Any] = {}
    while time.monotonic() < deadline:
        last = readyz(server)
        if last["policy"] == {"hash": policy_hash, "generation": generation}:
            streak += 1
            if streak >= 8:
                return
        else:
            streak = 0
        time.sleep(0.1)
    raise AssertionError(f"/readyz did not settle on generation {generation} ({policy_hash}): {last}")


def metric(server: RunningServer, name: str, labels: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(f"{name}{{{labels}}} "):
            return float(line.split()[-1])
    return 0.0


class Load:
    """Sends /mutate and /validate reviews from a thread until stopped; every answer must be a 200 review."""

    def __init__(self, server: RunningServer) -> None:
        self.server = server
        self.sent = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        pool = self.server.client()
        old = base_csinode()
        old = kubelet_update(old, EBS, 25)
        new = kubelet_update(old, EBS, 24)
        while not self._stop.is_set():
            for path in ("/mutate", "/validate"):
                body = review(old, new)
                try:
                    answer = pool.request("POST", f"{path}?timeout=10s", body=json.dumps(body).encode(),
                                          headers={"Content-Type": "application/json"})
                    doc = json.loads(answer.data)
                    if answer.status != 200 or doc["response"]["uid"] != body["request"]["uid"]:
                        self.failures.append(f"{path}: HTTP {answer.status} {answer.data[:200]!r}")
                except (urllib3.exceptions.HTTPError, OSError, ValueError, KeyError) as exc:
                    self.failures.append(f"{path}: {type(exc).__name__}: {exc}")
                    pool = self.server.client()
                self.sent += 1
            time.sleep(0.01)
        pool.close()

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def audit_records(server: RunningServer) -> list[dict[str, Any]]:
    """The audit log so far; a line being appended right now is left for the next read."""
    records = []
    for line in server.audit_log.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


COUNT_WRITER = "count-operator"  # under spec.writers in policy_text's policies


def decide_39(server: RunningServer) -> tuple[str, int]:
    """(decision, policy generation) for a report of 39 by a listed writer (the ceiling for an unknown node is
    27): ``clamp`` under a clamping ceiling, ``deny`` under a denying one. (For the node's own kubelet a denying
    ceiling acts as a clamp to the stored count, which ``clamp`` would not tell apart.)"""
    old = kubelet_update(base_csinode(), EBS, 25)
    body = review(old, kubelet_update(old, EBS, 39), user=COUNT_WRITER, groups=["system:authenticated"])
    doc = json.loads(server.post("/mutate", body).data)
    annotations = doc["response"].get("auditAnnotations", {})
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        for record in reversed(audit_records(server)):
            if record["uid"] == body["request"]["uid"]:
                return annotations.get("decision", ""), int(record["policyGeneration"])
        time.sleep(0.05)
    raise AssertionError("no audit record for the request")


@pytest.fixture
def volume(tmp_path: Path) -> ConfigMapVolume:
    v = ConfigMapVolume(tmp_path / "configmap")
    v.publish(policy_text("clamping", "clamp"))
    return v


@pytest.fixture
def reloading_server(server_factory: Any, volume: ConfigMapVolume) -> Iterator[RunningServer]:
    yield server_factory("--policy", str(volume.policy), "--policy-reload-interval", "0.5")


def test_a_valid_policy_takes_effect_and_an_invalid_one_is_refused_while_requests_keep_succeeding(
    reloading_server: RunningServer, volume: ConfigMapVolume
) -> None:
    server = reloading_server
    first = readyz(server)["policy"]
    assert first["generation"] == 1
    assert decide_39(server) == ("clamp", 1)

    with Load(server) as load:
        volume.publish(policy_text("denying", "deny"))
        second_hash = _hash_of(volume.policy)
        assert second_hash != first["hash"]
        wait_for_generation(server, 2, second_hash)
        assert decide_39(server) == ("deny", 2)
        deadline = time.monotonic() + 10  # the master counts the reload on its own check of the file (0.5 s)
        while metric(server, "csinode_guard_policy_reloads_total", 'result="success"') < 1:
            assert time.monotonic() < deadline, "the reload was not counted"
            time.sleep(0.1)

        volume.publish(invalid_policy_text())
        deadline = time.monotonic() + 30
        while metric(server, "csinode_guard_policy_reloads_total", 'result="invalid"') < 1:
            assert time.monotonic() < deadline, "the invalid policy was never counted"
            time.sleep(0.1)
        time.sleep(1.2)  # more checks pass: the refusal sticks
        assert readyz(server)["policy"] == {"hash": second_hash, "generation": 2}
        assert decide_39(server) == ("deny", 2)

        volume.publish(policy_text("clamping-again", "clamp"))
        wait_for_generation(server, 3, _hash_of(volume.policy))
        assert decide_39(server) == ("clamp", 3)
        time.sleep(0.5)

    assert load.sent > 20
    assert load.failures == []
    log = server.stderr_path.read_text()
    refused = [line for line in log.splitlines() if "policy reload refused" in line]
    assert refused, log[-2000:]
    assert str(volume.policy) in refused[0]
    assert "$.spec.rules.change-rate.minInterval" in refused[0]
    assert "'fast' is not a duration like 30s, 15m or 2h" in refused[0]
    assert "\\\\d" not in refused[0] and "\\d" not in refused[0]  # no regular expression, escaped or not
    generations = {r["policyGeneration"] for r in audit_records(server)}
    assert generations == {1, 2, 3}
    hashes = {r["policyGeneration"]: r["policyHash"] for r in audit_records(server)}
    assert hashes[1] == first["hash"] and hashes[2] == second_hash


def test_a_missing_file_keeps_the_last_good_policy_and_a_restarted_worker_keeps_the_generation(
    reloading_server: RunningServer, volume: ConfigMapVolume
) -> None:
    """A swap caught halfway changes nothing. Then gunicorn restarts a worker (timeout, crash) after a reload: it
    loads the new policy first, yet calls it generation 2 like its sibling."""
    server = reloading_server
    before = readyz(server)["policy"]
    (volume.root / "..data").unlink()  # the symlink points nowhere for a moment
    time.sleep(1.2)
    assert readyz(server)["policy"] == before
    assert decide_39(server) == ("clamp", 1)

    volume.publish(policy_text("denying", "deny"))
    second = _hash_of(volume.policy)
    wait_for_generation(server, 2, second)
    restart_a_worker(server)
    wait_for_generation(server, 2, second)
    assert {r["policyGeneration"] for r in audit_records(server) if r["policyHash"] == second} <= {2}


def restart_a_worker(server: RunningServer) -> None:
    """SIGTERM the first worker the server booted and wait until gunicorn has booted a replacement."""
    pids = [int(p) for p in re.findall(r"Booting worker with pid: (\d+)", server.stderr_path.read_text())]
    os.kill(pids[0], signal.SIGTERM)
    deadline = time.monotonic() + 30
    while len(re.findall(r"Booting worker with pid", server.stderr_path.read_text())) <= len(pids):
        assert time.monotonic() < deadline, "gunicorn did not start a new worker"
        time.sleep(0.1)


def _hash_of(path: Path) -> str:
    return load_policy(path).hash


def test_stores_of_one_server_share_generation_numbers(tmp_path: Path) -> None:
    """Two stores on one ledger (two workers): the one created after a reload starts at the same generation."""
    v = ConfigMapVolume(tmp_path / "cm")
    v.publish(policy_text("clamping", "clamp"))
    ledger_path = tmp_path / "generations.jsonl"
    early = PolicyStore(v.policy, interval=0, ledger=GenerationLedger(ledger_path))
    v.publish(policy_text("denying", "deny"))
    assert early.check() == "success"
    late = PolicyStore(v.policy, interval=0, ledger=GenerationLedger(ledger_path))
    assert (early.current().generation, late.current().generation) == (2, 2)
    v.publish(policy_text("clamping", "clamp"))  # back to the first text: still a new generation
    assert late.check() == "success"
    assert early.check() == "success"
    assert (early.current().generation, late.current().generation) == (3, 3)
    assert early.check() is None


def test_the_refusal_log_record_names_file_path_and_constraint(tmp_path: Path) -> None:
    """The store's log record carries file, path and constraint as fields (JSON logs) and in its message."""
    v = ConfigMapVolume(tmp_path / "cm")
    v.publish(policy_text("clamping", "clamp"))
    results: list[str] = []
    store = PolicyStore(v.policy, interval=0, on_reload=lambda result, _snap: results.append(result),
                        ledger=GenerationLedger(None))
    v.publish(invalid_policy_text())
    records: list[logging.LogRecord] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Catch()
    logging.getLogger("csinode_guard.policy").addHandler(handler)
    try:
        assert store.check() == "invalid"
        assert store.check() is None  # the same broken file is refused once, not every interval
    finally:
        logging.getLogger("csinode_guard.policy").removeHandler(handler)
    assert results == ["invalid"]
    assert store.current().generation == 1
    (record,) = records
    assert record.file == str(v.policy)  # type: ignore[attr-defined]
    assert record.path == "$.spec.rules.change-rate.minInterval"  # type: ignore[attr-defined]
    assert "is not a duration like 30s, 15m or 2h" in record.constraint  # type: ignore[attr-defined]
    assert str(v.policy) in record.getMessage()


def test_a_worker_started_while_the_file_is_gone_or_refused_serves_the_servers_policy(tmp_path: Path) -> None:
    """A worker (re)started by gunicorn loads the file itself; with the master's snapshot as its fallback, a file
    gone for a moment or refused does not fail its boot (which would stop the whole server): it serves the
    snapshot and reports the file as a running worker would. Without a fallback (the master's own start), the
    file is refused as before."""
    v = ConfigMapVolume(tmp_path / "cm")
    v.publish(policy_text("clamping", "clamp"))
    ledger = GenerationLedger(tmp_path / "generations.jsonl")
    master = PolicyStore(v.policy, interval=0, ledger=ledger)
    served = master.current()

    (v.root / "..data").unlink()  # a swap caught halfway
    gone = PolicyStore(v.policy, interval=0, ledger=ledger, fallback=served, missing_grace=0)
    assert gone.current() == served
    assert gone.check() is None
    problem = gone.problem()
    assert problem is not None and problem.missing and problem.generation == served.generation
    with pytest.raises(PolicyError, match="cannot read"):
        PolicyStore(v.policy, interval=0, ledger=ledger)

    v.publish(invalid_policy_text())
    refused = PolicyStore(v.policy, interval=0, ledger=ledger, fallback=served)
    assert refused.current() == served
    problem = refused.problem()
    assert problem is not None and not problem.missing and " invalid since " in problem.describe()

    v.publish(policy_text("denying", "deny"))  # fixed: both load it as the next generation
    assert gone.check() == "success" and refused.check() == "success"
    assert gone.current().generation == refused.current().generation == served.generation + 1
    assert gone.problem() is None and refused.problem() is None


def test_a_worker_restarted_while_the_policy_file_is_gone_keeps_the_server_up(
    reloading_server: RunningServer, volume: ConfigMapVolume
) -> None:
    """gunicorn stops the whole server when a worker fails to boot: a worker restarted during a ConfigMap swap
    (or any time the file is gone) must boot on the policy the server serves."""
    server = reloading_server
    before = readyz(server)["policy"]
    target = os.readlink(volume.root / "..data")
    (volume.root / "..data").unlink()
    restart_a_worker(server)
    deadline = time.monotonic() + 30
    while "not loaded as this worker started" not in server.stderr_path.read_text():
        assert server.process.poll() is None, server.stderr_path.read_text()[-3000:]
        assert time.monotonic() < deadline, server.stderr_path.read_text()[-3000:]
        time.sleep(0.1)
    (volume.root / "..data").symlink_to(target)
    wait_for_generation(server, before["generation"], before["hash"])
    assert server.process.poll() is None
    assert "Worker failed to boot" not in server.stderr_path.read_text()
