"""Prometheus metrics of the background audit and reconciler (:mod:`webhook.serving.audit_loop`).

Only the process that holds the audit Lease sets them (one gunicorn worker of the leading replica); every other
process reports ``csinode_guard_leader`` 0 and no standing violations, so ``max`` across the replicas' scrapes is
the cluster's answer. Gauges merge as ``livemax`` across a replica's worker processes (a dead worker's samples
go). Labels are bounded: rule ids, driver names the policy or a CSIDriver knows (else ``other``, and ``none`` for
a finding about an object's state), triggers and results from fixed sets; never a node name.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

STANDING_VIOLATIONS = Gauge(
    "csinode_guard_standing_violations",
    "Driver entries (and, with driver=none, objects' states) that the last audit pass found the rules no longer "
    "allow, by rule and driver.",
    ["rule", "driver"],
    multiprocess_mode="livemax",
)
AUDIT_PASSES = Counter(
    "csinode_guard_audit_passes",
    "Audit passes over every stored CSINode, by trigger: start, relist, policy-reload, interval, brake.",
    ["trigger"],
)
AUDIT_LAST_PASS = Gauge(
    "csinode_guard_audit_last_pass_timestamp_seconds",
    "Unix time at which the last audit pass ended (0 in a process that does not audit).",
    multiprocess_mode="livemax",
)
AUDIT_PASS_DURATION = Histogram(
    "csinode_guard_audit_pass_duration_seconds",
    "Time to judge every stored CSINode in one audit pass (repairs not included), in seconds.",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
)
REPAIRS = Counter(
    "csinode_guard_reconcile_repairs",
    "Repairs of standing counts (spec.reconcile: clamp) by driver and result: repaired, conflict (still after "
    "every retry), refused (by the apiserver or a webhook), error, dry-run (--reconcile-dry-run).",
    ["driver", "result"],
)
LEADER = Gauge(
    "csinode_guard_leader",
    "1 while this replica holds the audit Lease (it audits and repairs), else 0.",
    multiprocess_mode="livemax",
)
STATE_KEY_FOREIGN = Gauge(
    "csinode_guard_state_key_foreign",
    "1 while this guard's state key verifies none of the stored states (some are stored, none verifies): the key "
    "is not the cluster's, and the audit takes no Lease and reports nothing (webhook.serving.key_check).",
    multiprocess_mode="livemax",
)
LEASE_UNRENEWED = Gauge(
    "csinode_guard_audit_lease_unrenewed_seconds",
    "Seconds the audit Lease has gone without a renewal as this replica's candidate observes it (0 while it holds "
    "it). A renewing leader keeps it under its retry period (2 s at most); a stale or foreign holder is replaced "
    "at the guard's own --lease-duration, so a value that keeps growing means no replica can take the Lease (alert "
    "CSINodeGuardAuditLeaderless).",
    multiprocess_mode="livemax",
)
BRAKE_ENGAGED = Gauge(
    "csinode_guard_brake_engaged",
    "1 while the brake of a driver is engaged (capacity-class attach failures followed the increases the guard "
    "admitted: every increase of the driver is held cluster-wide; docs/brake.md), else 0. Set by the audit leader.",
    ["driver"],
    multiprocess_mode="livemax",
)
