"""The monitoring overlay's alerts in a real Prometheus scraping real guards on the real apiserver.

Each situation is made for real (a broken policy file, an audit log nobody reads, a serving certificate that
expires tomorrow, a burst of denied increases, a cache that cannot list, a guard that went away) and the alert's
rule, loaded from deploy/overlays/monitoring/prometheusrule.yaml unchanged, becomes active on it: pending while
its ``for:`` runs (those durations are minutes; tests/deploy/test_deploy_alerts.py proves with ``promtool test
rules`` that they then fire), firing at once where there is no ``for:``. A healthy installation stays silent.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.k8s.controlplane import ControlPlane, fast_policy, unique, wait_until
from tests.k8s.monitoring import (
    EBS,
    GLOBAL_ALERTS,
    active,
    admin_writes,
    assert_alert_active,
    condition,
    restricted_kubeconfig,
    scraped,
    short_lived_cert,
)
from tests.k8s.prometheus import JOB, Prometheus, alert_rules


def _node_with_ebs(control_plane: ControlPlane, count: int = 25) -> str:
    node = unique("mon")
    control_plane.create_node(node)
    control_plane.kubelet(node, "install", "--driver", EBS, "--node-id", f"i-{node}", "--max-volumes", str(count))
    return node


def test_every_rule_loads_and_evaluates(prometheus: Prometheus) -> None:
    def evaluated() -> list[dict[str, Any]]:
        rules = prometheus.rules()
        return rules if all(r["health"] != "unknown" for r in rules) else []

    rules = wait_until(evaluated, timeout=30, what="every rule evaluated once")
    assert {r["name"] for r in rules if r["type"] == "alerting"} == set(alert_rules())
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r["health"], r.get("lastError")) for r in rules]
    for rule in rules:  # loaded as shipped: the same for: durations
        if rule["type"] == "alerting":
            shipped = alert_rules()[rule["name"]]
            assert rule["duration"] == _seconds(shipped.get("for", "0s")), (rule["name"], rule["duration"])


def _seconds(duration: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    return float(duration[:-1]) * units[duration[-1]]


def test_a_healthy_installation_stays_silent(
    guard_factory: Any, prometheus: Prometheus, control_plane: ControlPlane, tmp_path: Path
) -> None:
    policy = fast_policy(tmp_path / "policy.yaml")
    # Two replicas (so no single-replica warning); the apiserver calls the first, as a Service may pick one. Their
    # audit Lease lives in a namespace that exists (as the guard's own does in an installation): one of them leads.
    lease = ("--lease-namespace", "default", "--lease-name", unique("audit"))
    first, second = guard_factory(policy, extra_args=lease), guard_factory(policy, register=False, extra_args=lease)
    with scraped(prometheus, first, second) as namespace:
        node = _node_with_ebs(control_plane, 25)
        control_plane.kubelet(node, "update", "--driver", EBS, "--max-volumes", "23")  # a decrease
        control_plane.kubelet(node, "update", "--driver", EBS, "--max-volumes", "24")  # an increase within policy
        prometheus.wait_for_series(f'sum(csinode_guard_requests_total{{namespace="{namespace}"}}) >= 3')
        # Both replicas scraped up before the silence is checked: until the second one's first scrape, the job has
        # one target up, which is what CSINodeGuardSingleReplica is for.
        prometheus.wait_for_series(f'count(up{{job="{JOB}", namespace="{namespace}"}} == 1) == 2')
        wait_until(lambda: not active(prometheus.alerts(), lambda labels: labels["alertname"] in GLOBAL_ALERTS),
                   timeout=30, what="the job-wide alerts evaluated with both replicas up")
        started = time.time()
        while time.time() - started < 8:  # eight evaluations of every rule on the installation's data
            mine = active(prometheus.alerts(),
                          lambda labels: labels.get("namespace") == namespace or labels["alertname"] in GLOBAL_ALERTS)
            assert mine == [], mine
            time.sleep(1)
        for alert in alert_rules():
            if alert_rules()[alert]["expr"].count("csinode_guard_") or alert in GLOBAL_ALERTS:
                assert condition(prometheus, alert, namespace) == [], alert


def test_a_guard_that_went_away_raises_guard_down(guard_factory: Any, prometheus: Prometheus) -> None:
    guard = guard_factory(register=False)
    with scraped(prometheus, guard) as namespace:
        assert_alert_active(prometheus, "CSINodeGuardSingleReplica", namespace)
        assert prometheus.query(f'up{{job="{JOB}"}} == 0') == []
        guard.stop()
        wait_until(lambda: prometheus.query(f'up{{job="{JOB}", pod="{guard.name}"}} == 0'), timeout=30,
                   what="scrape failing")
        assert_alert_active(prometheus, "CSINodeGuardDown", namespace)
        guard.start()  # back: the condition clears
        wait_until(lambda: not condition(prometheus, "CSINodeGuardDown", namespace), timeout=30,
                   what="guard back up")


def test_a_broken_policy_file_raises_policy_file_invalid(
    guard_factory: Any, prometheus: Prometheus, tmp_path: Path
) -> None:
    policy = fast_policy(tmp_path / "policy.yaml")
    guard = guard_factory(policy, register=False)
    with scraped(prometheus, guard) as namespace:
        good = policy.read_text()
        policy.write_text(good.replace("enforcementAction: deny", "enforcementAction: sometimes", 1))
        assert_alert_active(prometheus, "CSINodeGuardPolicyFileInvalid", namespace, pod=guard.name)
        policy.write_text(good)  # fixed: the condition clears
        wait_until(lambda: not condition(prometheus, "CSINodeGuardPolicyFileInvalid", namespace), timeout=30,
                   what="policy fixed")


def test_a_serving_certificate_that_expires_tomorrow_raises_both_expiry_alerts(
    guard_factory: Any, prometheus: Prometheus, control_plane: ControlPlane
) -> None:
    guard = guard_factory(register=False)
    with scraped(prometheus, guard) as namespace:
        assert condition(prometheus, "CSINodeGuardCertificateExpiringSoon", namespace) == []
        not_after = short_lived_cert(control_plane, guard.cert_dir, days=1)
        wait_until(lambda: [s for s in prometheus.query(
            f'csinode_guard_serving_certificate_expiry_timestamp_seconds{{pod="{guard.name}"}}')
            if abs(float(s["value"][1]) - not_after.timestamp()) < 1], timeout=30, what="new certificate scraped")
        assert_alert_active(prometheus, "CSINodeGuardCertificateExpiring", namespace, pod=guard.name)
        assert_alert_active(prometheus, "CSINodeGuardCertificateExpiringSoon", namespace, pod=guard.name)


def test_a_burst_of_denied_increases_raises_denial_rate_high(
    guard: Any, prometheus: Prometheus, control_plane: ControlPlane
) -> None:
    node = _node_with_ebs(control_plane, 20)
    with scraped(prometheus, guard) as namespace:
        denied = f'csinode_guard_requests_total{{namespace="{namespace}", decision="deny", dry_run="false"}}'
        assert admin_writes(control_plane, node, [21]) == [403]  # the admin is no writer: writer-identity denies
        prometheus.wait_for_series(denied)  # the counter exists before the burst: rate() sees all of it
        assert condition(prometheus, "CSINodeGuardDenialRateHigh", namespace) == []  # one denial is no spike
        statuses = admin_writes(control_plane, node, [22 + n % 5 for n in range(45)])
        assert statuses == [403] * 45
        assert_alert_active(prometheus, "CSINodeGuardDenialRateHigh", namespace)


def test_a_cache_that_cannot_list_raises_cache_not_synced(
    guard_factory: Any, prometheus: Prometheus, control_plane: ControlPlane
) -> None:
    kubeconfig = restricted_kubeconfig(control_plane, unique("guard-no-va"), forbidden="volumeattachments")
    guard = guard_factory(register=False, extra_args=("--kubeconfig", str(kubeconfig), "--cache-sync-timeout", "2"))
    with scraped(prometheus, guard) as namespace:
        assert prometheus.wait_for_series(
            f'csinode_guard_cache_synced{{pod="{guard.name}", kind="volumeattachments"}} == 0')
        assert_alert_active(prometheus, "CSINodeGuardCacheNotSynced", namespace, pod=guard.name,
                            kind="volumeattachments")
        synced = prometheus.query(f'csinode_guard_cache_synced{{pod="{guard.name}"}} == 1')
        assert {s["metric"]["kind"] for s in synced} >= {"nodes", "csidrivers"}  # only the forbidden kind is out


def test_an_audit_log_nobody_reads_raises_audit_log_stalled(
    guard_factory: Any, prometheus: Prometheus, control_plane: ControlPlane, tmp_path: Path
) -> None:
    fifo = tmp_path / "audit.fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # the log shipper: connected, and then it stops reading
    try:
        guard = guard_factory(register=False, extra_args=("--audit-log", str(fifo)))
        node = _node_with_ebs(control_plane, 20)
        guard.register(wait=False)
        with scraped(prometheus, guard) as namespace:
            stalled = f'csinode_guard_audit_log_stalled{{pod="{guard.name}"}} == 1'
            deadline = time.monotonic() + 120
            while not prometheus.query(stalled):  # records fill the pipe (64 KiB) until one misses its deadline
                assert time.monotonic() < deadline, "the audit log never stalled"
                admin_writes(control_plane, node, [19, 18, 17], dry_run=True)
            assert_alert_active(prometheus, "CSINodeGuardAuditLogStalled", namespace, pod=guard.name)
            drained = threading.Event()

            def drain() -> None:  # the shipper reads again: the condition clears
                while not drained.is_set():
                    try:
                        os.read(reader, 1 << 16)
                    except BlockingIOError:
                        time.sleep(0.05)

            thread = threading.Thread(target=drain, daemon=True)
            thread.start()
            try:
                def recovered() -> bool:
                    admin_writes(control_plane, node, [19], dry_run=True)
                    return not condition(prometheus, "CSINodeGuardAuditLogStalled", namespace)

                wait_until(recovered, timeout=60, interval=1, what="audit log read again")
            finally:
                drained.set()
                thread.join(timeout=5)
    finally:
        os.close(reader)


@pytest.mark.parametrize("alert", sorted(alert_rules()))
def test_every_alert_has_a_real_scenario_or_a_reason(alert: str) -> None:
    made_here = {
        "CSINodeGuardDown", "CSINodeGuardSingleReplica", "CSINodeGuardPolicyFileInvalid",
        "CSINodeGuardCertificateExpiring", "CSINodeGuardCertificateExpiringSoon", "CSINodeGuardDenialRateHigh",
        "CSINodeGuardCacheNotSynced", "CSINodeGuardAuditLogStalled",
        # made by the rollout scenario of tests/k8s/test_monitoring_dashboard.py
        "CSINodeGuardPersistentDisagreement", "CSINodeGuardEntriesFrozen",
        # made by the engage-and-release scenario of tests/k8s/test_brake.py
        "CSINodeGuardBrakeEngaged",
    }
    assert alert in made_here | UNIT_TESTED_ONLY.keys(), f"{alert}: add a scenario, or a reason in UNIT_TESTED_ONLY"


UNIT_TESTED_ONLY = {
    "CSINodeGuardClampRateHigh": "same expression as DenialRateHigh on decision clamp",
    "CSINodeGuardStateVerificationFailures": "a forged state annotation; promtool unit test",
    "CSINodeGuardInternalErrors": "needs a bug in the guard; promtool unit test",
    "CSINodeGuardCacheStale": "needs a watch down for more than 120 s (--max-staleness); promtool unit test",
    "CSINodeGuardHighLatency": "needs p99 above 1 s; promtool unit test",
    "CSINodeGuardLatencyNearTimeout": "needs p99 above 2.5 s; promtool unit test",
    "CSINodeGuardLateAnswers": "needs a worker stopped past the apiserver's timeout (tests/test_late_answers.py makes "
                               "the late answer and its metric for real); promtool unit test",
    "CSINodeGuardMatchConditionErrors": "kube-apiserver's metrics; promtool unit test",
    "CSINodeGuardCallsFailing": "kube-apiserver's metrics; promtool unit test",
    "CSINodeGuardFailOpen": "kube-apiserver's metrics; promtool unit test",
    "CSINodeGuardAuditLeaderless": "needs 3 minutes without a leader (for: 3m); the stranger's Lease it watches for "
                                   "is taken back on the real apiserver in tests/k8s/test_audit.py (attack 7); "
                                   "promtool unit test",
}
"""Alerts shown to fire only by tests/deploy/test_deploy_alerts.py (promtool), and why."""
