"""The audit log under faults, through the real server: its file mode, workers killed while writing, a stalled
standard output (the default destination), the file deleted or rotated under load, a full disk.

Standard output is a pipe the test reads, or stops reading, on purpose. Bounded in time and requests.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import urllib3

from tests.conftest import RunningServer
from tests.kube import EBS, base_csinode, kubelet_update, review
from tests.load import Load, review_with_uid
from tests.test_hardening_faults import workers

pytestmark = pytest.mark.slow


def scrape(server: RunningServer) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def readyz(server: RunningServer) -> tuple[int, dict[str, Any]]:
    pool = server.client()
    try:
        answer = pool.request("GET", "/readyz")
        return answer.status, json.loads(answer.data)
    finally:
        pool.close()


STORED = kubelet_update(base_csinode(), EBS, 23)


def increase(uid: str) -> bytes:
    """kubelet raising ebs from 23 to 25 (admitted by the default policy when the log works), each on a node of its
    own: a node's fair share of the cluster budget is 5 increases per 10 s, and this checks the audit log, not the
    budget."""
    stored = json.loads(json.dumps(STORED))
    stored["metadata"]["name"] = node = f"node-{uid}"
    return json.dumps(review(stored, kubelet_update(stored, EBS, 25), uid=uid, user=f"system:node:{node}",
                             groups=["system:nodes", "system:authenticated"])).encode()


def timed_post(server: RunningServer, body: bytes, timeout: float = 8) -> tuple[float, int | None, dict[str, Any]]:
    """(seconds, HTTP status or None on timeout, response) for one /mutate on a fresh connection."""
    pool = server.client()
    started = time.monotonic()
    try:
        answer = pool.request("POST", "/mutate?timeout=10s", body=body, headers={"Content-Type": "application/json"},
                              timeout=urllib3.Timeout(connect=5, read=timeout))
        return time.monotonic() - started, answer.status, json.loads(answer.data).get("response", {})
    except urllib3.exceptions.HTTPError:
        return time.monotonic() - started, None, {}
    finally:
        pool.close()


class StdoutReader:
    """Reads the server's standard output (the audit log) in a thread once started; keeps every line."""

    def __init__(self, server: RunningServer) -> None:
        assert server.process.stdout is not None
        self.stream = server.process.stdout
        self.lines: list[bytes] = []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        for line in self.stream:
            self.lines.append(line)

    def start(self) -> StdoutReader:
        self._thread.start()
        return self

    def uids(self) -> set[str]:
        return {json.loads(line)["uid"] for line in list(self.lines)}


def test_the_audit_log_the_server_creates_is_0640(server_factory: Any) -> None:
    old = os.umask(0o022)
    try:
        server = server_factory()
    finally:
        os.umask(old)
    assert server.post("/mutate", b"{}").status == 400  # served: the workers have opened it too
    assert stat.S_IMODE(server.audit_log.stat().st_mode) == 0o640


def test_a_stalled_standard_output_bounds_every_review_refuses_increases_and_fails_readiness(
    server_factory: Any,
) -> None:
    server = server_factory("--audit-log", "-", stdout=subprocess.PIPE)
    assert timed_post(server, increase("before-stall"))[2]["allowed"] is True
    # Nobody reads standard output now: its 64 KB pipe fills after some 40 records.
    results = []
    for n in range(120):
        body = increase(f"stall-up-{n}") if n % 2 else review_with_uid(f"stall-down-{n}")
        results.append((n % 2 == 1, *timed_post(server, body)))
        if results[-1][2] is None:
            break  # no answer within 8 s: the review hung on the audit log
    assert all(status == 200 for _, _, status, _ in results), [r[:3] for r in results if r[2] != 200][:5]
    slowest = max(seconds for _, seconds, _, _ in results)
    assert slowest < 3, f"a review took {slowest:.1f}s with the audit log stalled"
    refused = [r for up, _, _, r in results if up and not r["allowed"]]
    assert refused and all("audit log stalled" in r["status"]["message"] for r in refused)
    assert all(r["allowed"] for up, _, _, r in results if not up), "a decrease was refused"
    assert not any(up and r["allowed"] for up, _, _, r in results[-20:]), "increases admitted while stalled"
    status, body = readyz(server)
    statuses = {readyz(server)[0] for _ in range(6)} | {status}
    assert 503 in statuses and any("audit log" in p for p in body["problems"] + readyz(server)[1]["problems"])
    time.sleep(1.5)  # metric batches
    samples = scrape(server)
    assert samples.get("csinode_guard_audit_write_timeouts_total", 0) >= len(refused)
    assert samples.get("csinode_guard_audit_log_stalled") == 1
    assert "audit record not written to - (timeout" in server.stderr_path.read_text()
    # The reader comes back: the records are written again, increases admitted, readiness restored.
    reader = StdoutReader(server).start()
    deadline = time.monotonic() + 20
    answers: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        # Slower than the default clusterBudget's 5 increases per second: the increases refused while the log was
        # stalled took its burst, and this checks the audit log's recovery, not the budget's.
        time.sleep(0.3)
        answers.append(timed_post(server, increase(f"after-{len(answers)}"))[2])
        if len(answers) > 10 and all(a.get("allowed") for a in answers[-6:]) and \
                all(readyz(server)[0] == 200 for _ in range(4)):
            break
    assert all(a.get("allowed") for a in answers[-6:])
    assert all(readyz(server)[0] == 200 for _ in range(4))
    time.sleep(0.5)
    assert {f"after-{n}" for n in range(len(answers) - 6, len(answers))} <= reader.uids()


def test_workers_killed_while_writing_the_audit_log_leave_nothing_held(server_factory: Any) -> None:
    server = server_factory("--audit-log", "-", "--threads", "4", stdout=subprocess.PIPE)
    before = workers(server)
    # Four clients fill the unread pipe: every worker is then in the middle of writing a record.
    load = Load(server, clients=4, max_seconds=4, max_requests=400).start()
    time.sleep(3)
    for pid in before:
        os.kill(pid, signal.SIGKILL)
    load.stop()
    reader = StdoutReader(server).start()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (set(workers(server)) & set(before) or len(workers(server)) < 2):
        time.sleep(0.1)
    assert not set(workers(server)) & set(before) and len(workers(server)) == 2
    timeouts = "csinode_guard_audit_write_timeouts_total"
    time.sleep(1.5)  # the killed workers' last counts are final; the new workers flush once a second
    timeouts_before = scrape(server).get(timeouts, 0)
    times = [timed_post(server, review_with_uid(f"after-kill-{n}")) for n in range(20)]
    assert all(status == 200 for _, status, _ in times)
    # A lock left held by a killed worker made every record miss its write deadline (each review waited for it):
    # the new workers' records all met theirs, counted by the guard itself rather than by a clock here.
    time.sleep(1.5)
    seconds = sorted(t for t, _, _ in times)
    assert scrape(server).get(timeouts, 0) == timeouts_before, f"records missed the write deadline: {seconds}"
    assert scrape(server).get("csinode_guard_audit_log_stalled", 0) == 0
    assert {f"after-kill-{n}" for n in range(20)} <= reader.uids()
    assert all(readyz(server)[0] == 200 for _ in range(4))


def test_an_audit_file_deleted_then_rotated_under_load_loses_no_record(server_factory: Any) -> None:
    server = server_factory()
    rotated = server.audit_log.with_name("audit.log.1")
    load = Load(server, clients=2, max_seconds=40).start()
    try:
        load.wait_for_answers(100)
        server.audit_log.unlink()  # deleted: what was written to it since the last check is written again
        deleted_at = time.monotonic()
        load.wait_for_answers(300)
        os.rename(server.audit_log, rotated)  # rotated away: the writers open a new file
        load.wait_for_answers(300)
    finally:
        outcomes = load.stop()
    time.sleep(1.5)
    # What was written before the deletion went with the file; every answer sent after it must have its record.
    answered = {o.uid for o in outcomes if o.status == 200 and o.sent >= deleted_at}
    assert len(answered) >= 500
    records = [json.loads(line) for path in (rotated, server.audit_log) if path.exists()
               for line in path.read_text().splitlines()]
    missing = answered - {r["uid"] for r in records}
    assert not missing, f"{len(missing)} answered requests have no audit record, e.g. {sorted(missing)[:3]}"
    assert stat.S_IMODE(server.audit_log.stat().st_mode) == 0o640
    samples = scrape(server)
    assert samples.get('csinode_guard_audit_log_reopens_total{reason="removed"}', 0) >= 1
    assert samples.get('csinode_guard_audit_log_reopens_total{reason="replaced"}', 0) >= 1
    assert samples.get("csinode_guard_audit_records_orphaned_total", 0) >= 1
    assert "was removed; reopened it" in server.stderr_path.read_text()


def test_a_full_disk_counts_and_logs_every_record(server_factory: Any, tmp_path: Path) -> None:
    server = server_factory("--audit-log", "/dev/full")
    for n in range(5):
        assert server.post("/mutate", review_with_uid(f"full-{n}")).status == 200
    time.sleep(1.5)
    assert scrape(server).get("csinode_guard_audit_write_failures_total") == 5
    log = server.stderr_path.read_text()
    assert all(f'full-{n}' in log for n in range(5))
    assert log.count("audit record not written to /dev/full (OSError: No space left on device)") == 5


def test_standard_output_redirected_to_a_file_gets_every_record_and_no_file_named_dash(
    server_factory: Any, tmp_path: Path
) -> None:
    """``serve > serve.out`` (nohup, a unit's StandardOutput=file:) with the default ``--audit-log -``: standard
    output is a regular file the guard did not open by name, so there is no path to watch for rotation; the
    records go to it, and nothing is created under the name ``-``."""
    out_path = tmp_path / "serve.out"
    with out_path.open("wb") as out:
        server = server_factory("--audit-log", "-", stdout=out)
    uids = [f"stdout-file-{n}" for n in range(3)]
    for uid in uids:
        assert server.post("/mutate", review_with_uid(uid)).status == 200
        time.sleep(1.1)  # past the file check's interval between records
    deadline = time.monotonic() + 10
    seen: set[str] = set()
    while time.monotonic() < deadline and not set(uids) <= seen:
        for line in out_path.read_text().splitlines():
            try:
                seen.add(json.loads(line).get("uid", ""))
            except ValueError:
                continue
        time.sleep(0.2)
    assert set(uids) <= seen, "every record reached the redirected standard output"
    assert not (server.audit_log.parent / "-").exists(), "no audit file named '-' in the working directory"
    assert "was replaced" not in server.stderr_path.read_text()
