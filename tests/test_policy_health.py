"""A refused policy file is visible, policy metrics count once per replica, and every metric is documented
(docs/monitoring.md).

Through the real server (2 gunicorn workers, hot reload every 0.5 s, a ConfigMap-style volume), its /readyz over
fresh connections (either worker) and its /metrics port.
"""

from __future__ import annotations

import calendar
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from tests.conftest import REPO, RunningServer
from tests.kube import EBS, base_csinode, kubelet_update, review
from tests.test_hot_reload import ConfigMapVolume, decide_39, invalid_policy_text, policy_text, readyz
from webhook.admission.policy import load_policy


def scrape(server: RunningServer) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).read().decode()


def samples(text: str, name: str) -> dict[str, float]:
    """``{labels: value}`` of every sample of ``name`` (labels as written, "" for none)."""
    found = {}
    for line in text.splitlines():
        match = re.match(rf"{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if match:
            found[match.group(1) or ""] = float(match.group(2))
    return found


def wait_until(what: str, condition: Any, timeout: float = 90) -> Any:
    """``condition()`` once truthy; generous: workers reload every 0.5 s, but the machine may be busy."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def readyz_everywhere(server: RunningServer, rounds: int = 8) -> list[tuple[int, dict[str, Any]]]:
    """(HTTP status, body) of /readyz over ``rounds`` fresh connections (they land on both workers)."""
    answers = []
    for _ in range(rounds):
        answer = server.get_on_fresh_connection("/readyz")
        answers.append((answer.status, json.loads(answer.data)))
    return answers


def _hash(text: str, tmp: Path) -> str:
    path = tmp / f"p{abs(hash(text))}.yaml"
    path.write_text(text)
    return load_policy(path).hash


def test_a_refused_policy_file_is_reported_by_readyz_and_a_gauge_and_clears_when_rolled_back(
    server_factory: Any, tmp_path: Path
) -> None:
    volume = ConfigMapVolume(tmp_path / "configmap")
    good = policy_text("denying", "deny")
    volume.publish(good)
    server = server_factory("--policy", str(volume.policy), "--policy-reload-interval", "0.5", workers=2)
    good_hash = readyz(server)["policy"]["hash"]
    assert samples(scrape(server), "csinode_guard_policy_file_invalid") == {"": 0.0}

    volume.publish(invalid_policy_text())
    written = (volume.policy).stat().st_mtime
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(written))

    def all_report() -> list[tuple[int, dict[str, Any]]] | None:
        answers = readyz_everywhere(server)
        return answers if all(body["problems"] for _, body in answers) else None

    answers = wait_until("every worker to report the refused file", all_report)
    for status, body in answers:
        assert status == 200, body  # the last good policy serves: still ready
        assert body["status"] == "degraded"
        assert body["policy"] == {"hash": good_hash, "generation": 1}
        [problem] = body["problems"]
        assert problem.startswith(f"policy file {volume.policy} invalid since {stamp}, serving generation 1: ")
        assert "minInterval" in problem
    wait_until("the gauge", lambda: samples(scrape(server), "csinode_guard_policy_file_invalid") == {"": 1.0})
    assert decide_39(server) == ("deny", 1)

    # Rollback: the last good content back in the volume, as the runbook says.
    volume.publish(good)
    # Fresh connections can all land on one worker: wait until a whole round of them is ok, so that a worker
    # that reloads later than the other is waited for rather than read once before it has.
    # Three whole rounds in a row, so that both workers have answered ok (a round's connections may all land on one).
    ok = (200, "ok", {"hash": good_hash, "generation": 1})
    streak = [0]

    def cleared() -> bool:
        round_ok = all((status, body["status"], body["policy"]) == ok for status, body in readyz_everywhere(server))
        streak[0] = streak[0] + 1 if round_ok else 0
        return streak[0] >= 3

    wait_until("the problem to clear on every worker", cleared)
    wait_until("the gauge to clear", lambda: samples(scrape(server), "csinode_guard_policy_file_invalid") == {"": 0})
    assert decide_39(server) == ("deny", 1)


def test_a_bad_but_valid_policy_is_rolled_back_by_hot_reload(server_factory: Any, tmp_path: Path) -> None:
    volume = ConfigMapVolume(tmp_path / "configmap")
    good = policy_text("denying", "deny")
    volume.publish(good)
    server = server_factory("--policy", str(volume.policy), "--policy-reload-interval", "0.5", workers=2)
    good_hash = readyz(server)["policy"]["hash"]
    assert decide_39(server) == ("deny", 1)

    volume.publish(policy_text("too-loose", "dryrun"))
    wait_until("the bad policy", lambda: all(b["policy"]["generation"] == 2 for _, b in readyz_everywhere(server, 4)))
    assert decide_under(server, 2, {1: "deny"}) == "allow"

    volume.publish(good)
    wait_until("the rollback", lambda: all(b["policy"] == {"hash": good_hash, "generation": 3}
                                           for _, b in readyz_everywhere(server, 4)))
    assert decide_under(server, 3, {2: "allow"}) == "deny"


def decide_under(server: RunningServer, generation: int, before: dict[int, str]) -> str:
    """The decision on a kubelet report of 39 by the first worker that judges it under ``generation``.

    Four /readyz answers may all come from one worker while the other has not reloaded yet, so the request is
    repeated until its audit record names ``generation``: the event, not a longer wait. A request judged
    meanwhile by a worker that still serves an earlier generation must have that generation's decision
    (``before``: generation -> decision); none may be judged under a later one.
    """
    def judged() -> tuple[str, int] | None:
        decision, seen = decide_39(server)
        assert seen in before or seen == generation, (decision, seen)
        if seen != generation:
            assert decision == before[seen], (decision, seen)
            return None
        return decision, seen

    decision, _ = wait_until(f"a decision under generation {generation}", judged)
    return decision


def test_policy_metrics_keep_one_series_and_count_each_reload_once_per_replica(
    server_factory: Any, tmp_path: Path
) -> None:
    volume = ConfigMapVolume(tmp_path / "configmap")
    volume.publish(policy_text("p0", "clamp"))
    server = server_factory("--policy", str(volume.policy), "--policy-reload-interval", "0.5", workers=2)
    last_hash = ""
    for i in range(1, 6):
        text = policy_text(f"p{i}", "clamp" if i % 2 else "deny")
        volume.publish(text)
        last_hash = _hash(text, tmp_path)
        wait_until(f"generation {i + 1}", lambda g=i + 1: all(
            b["policy"]["generation"] == g for _, b in readyz_everywhere(server, 4)))
        # The master counts reloads on its own check of the file: the next publish waits for it too, or two
        # publishes between two of its checks would be one reload for it.
        wait_until(f"the master at generation {i + 1}", lambda g=i + 1: samples(
            scrape(server), "csinode_guard_policy_generation") == {"": float(g)})
    text = scrape(server)
    assert samples(text, "csinode_guard_policy_info") == {f'{{hash="{last_hash}",name="p5"}}': 1.0}
    assert samples(text, "csinode_guard_policy_generation") == {"": 6.0}
    reloads = samples(text, "csinode_guard_policy_reloads_total")
    assert reloads == {'{result="success"}': 5.0, '{result="invalid"}': 0.0}


def _documented_metric_names() -> set[str]:
    """The metrics the documentation lists: docs/monitoring.md (the README's former "Audit log and metrics")."""
    page = (REPO / "docs" / "monitoring.md").read_text("utf-8")
    section = page[page.index("Metrics (prometheus-client multiprocess mode"):page.index("## Dashboard")]
    return set(re.findall(r"`(csinode_guard_[a-z_]+)", section))


def _exposed_names(text: str) -> set[str]:
    """Metric names of a scrape as a user queries them: the ``# TYPE`` lines (counters with ``_total``,
    histograms by their base name)."""
    return {name for name in re.findall(r"^# TYPE (\S+) \S+$", text, re.M) if name.startswith("csinode_guard_")}


def test_every_metric_of_a_serving_replica_is_documented(server_factory: Any, tmp_path: Path) -> None:
    volume = ConfigMapVolume(tmp_path / "configmap")
    volume.publish(policy_text("denying", "deny"))
    server = server_factory("--policy", str(volume.policy), "--policy-reload-interval", "0.5")
    old = kubelet_update(base_csinode(), EBS, 25)
    assert server.post("/mutate", review(old, kubelet_update(old, EBS, 39))).status == 200
    assert server.post("/validate", b"{", "application/json").status == 400
    volume.publish(invalid_policy_text())
    wait_until("a flushed scrape", lambda: "csinode_guard_bad_requests_total{" in scrape(server)
               and "csinode_guard_requests_total{" in scrape(server))
    exposed = _exposed_names(scrape(server))
    assert {"csinode_guard_requests_total", "csinode_guard_request_duration_seconds",
            "csinode_guard_policy_info", "csinode_guard_policy_reloads_total"} <= exposed
    assert exposed - _documented_metric_names() == set()


def test_every_metric_the_code_defines_is_documented_and_counters_name_events() -> None:
    script = """
import calendar
import json
import os
from prometheus_client import REGISTRY
import webhook.serving.metrics, webhook.kube.watch.metrics, webhook.serving.audit_metrics
import webhook.serving.registration_metrics
from webhook.serving.policy_metrics import PolicyCollector
from webhook.serving.live_policy import PolicyStore
collector = PolicyCollector()
collector.store = PolicyStore(None)
names = {}
for family in [*REGISTRY.collect(), *collector.collect()]:
    if family.name.startswith("csinode_guard_"):
        names[family.name] = family.type
print(json.dumps(names))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=REPO)
    families: dict[str, str] = json.loads(out.stdout)
    defined = {name + "_total" if kind == "counter" else name for name, kind in families.items()}
    assert "csinode_guard_freezes_total" in defined
    assert defined - _documented_metric_names() == set()
    documented = _documented_metric_names()
    assert documented - defined - {"csinode_guard_serving_certificate_expiry_timestamp_seconds"} == set()
    # A counter counts events; a name that reads as a number of things (a gauge's name) is not one.
    assert [n for n, kind in families.items() if kind == "counter" and n.endswith(("_entries", "_objects"))] == []


def test_a_deleted_policy_file_is_reported_by_readyz_a_gauge_and_the_log_but_a_brief_swap_gap_is_not(
    server_factory: Any, tmp_path: Path
) -> None:
    """``rm`` of the policy file: after a couple of reload intervals every worker reports it missing (after an
    invalid edit too, the problem line changes from "invalid" to "missing"), the gauge is 1 and the log says so.
    A ConfigMap's ``..data`` symlink dangling for a moment reports nothing. Putting a file back clears it."""
    volume = ConfigMapVolume(tmp_path / "configmap")
    good = policy_text("denying", "deny")
    volume.publish(good)
    server = server_factory("--policy", str(volume.policy), "--policy-reload-interval", "0.5", workers=2)
    good_hash = readyz(server)["policy"]["hash"]

    # A swap caught halfway: the symlink points nowhere for a moment, then the same content is back.
    target = os.readlink(volume.root / "..data")
    (volume.root / "..data").unlink()
    time.sleep(0.2)
    (volume.root / "..data").symlink_to(target)
    for _ in range(3):
        time.sleep(0.5)
        assert all(not body["problems"] for _, body in readyz_everywhere(server, 4))
    assert samples(scrape(server), "csinode_guard_policy_file_invalid") == {"": 0.0}

    volume.publish(invalid_policy_text())
    wait_until("the refused file", lambda: all(
        body["problems"] and " invalid since " in body["problems"][0] for _, body in readyz_everywhere(server)))

    deleted_at = time.time()
    shutil.rmtree(volume.root)

    def all_missing() -> list[tuple[int, dict[str, Any]]] | None:
        answers = readyz_everywhere(server)
        return answers if all(body["problems"] and " missing " in body["problems"][0] for _, body in answers) else None

    for status, body in wait_until("every worker to report the missing file", all_missing):
        assert (status, body["status"]) == (200, "degraded"), body
        assert body["policy"] == {"hash": good_hash, "generation": 1}
        [problem] = body["problems"]
        match = re.fullmatch(rf"policy file {re.escape(str(volume.policy))} missing since (\S+), serving generation 1",
                             problem)
        assert match, problem
        since = calendar.timegm(time.strptime(match.group(1), "%Y-%m-%dT%H:%M:%SZ"))
        assert deleted_at - 1 <= since <= time.time()
    wait_until("the gauge", lambda: samples(scrape(server), "csinode_guard_policy_file_invalid") == {"": 1.0})
    log = server.stderr_path.read_text()
    assert [line for line in log.splitlines() if f"policy file {volume.policy} missing since" in line], log[-2000:]
    assert decide_39(server) == ("deny", 1)

    volume = ConfigMapVolume(tmp_path / "configmap")
    volume.publish(good)
    wait_until("the problem to clear on every worker",
               lambda: all(not body["problems"] for _, body in readyz_everywhere(server)))
    wait_until("the gauge to clear", lambda: samples(scrape(server), "csinode_guard_policy_file_invalid") == {"": 0})
