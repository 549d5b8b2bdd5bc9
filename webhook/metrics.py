"""Prometheus metrics of the webhook, correct with several gunicorn worker processes.

Under ``serve`` the environment variable ``PROMETHEUS_MULTIPROC_DIR`` is set before this module is imported,
so every worker writes its samples to files there and the master serves the merged view on the plain-HTTP
metrics port (prometheus_client multiprocess mode). Gauges declare how they merge across processes.
Label values are bounded: endpoints, decisions, rule ids, enforcement actions, drivers — never node names.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from webhook.evaluation import AdmissionDecision, Decision
from webhook.policy import EnforcementAction

REQUESTS = Counter(
    "csinode_guard_requests",
    "AdmissionReview requests answered, by endpoint, decision and the apiserver's dryRun flag.",
    ["endpoint", "decision", "dry_run"],
)
RULE_RESULTS = Counter(
    "csinode_guard_rule_results",
    "Rule results per count change: result pass|violation, enforcement = the effective enforcement action.",
    ["rule", "result", "enforcement"],
)
LATENCY = Histogram(
    "csinode_guard_request_duration_seconds",
    "Time from receiving an AdmissionReview to having its answer, in seconds.",
    ["endpoint"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)
STATE_FAILURES = Counter(
    "csinode_guard_state_verification_failures",
    "State annotations that were present but unusable (bad signature, other object, malformed).",
    ["reason"],
)
FREEZES = Counter(
    "csinode_guard_frozen_entries",
    "Entries whose increases were frozen after a driver version rollback.",
    ["driver"],
)
DISAGREEMENT = Counter(
    "csinode_guard_persistent_disagreement",
    "Writes refused or clamped back to the stored count: the driver keeps reporting what the policy refuses.",
    ["driver", "rule"],
)
BAD_REQUESTS = Counter(
    "csinode_guard_bad_requests",
    "HTTP requests answered with a 4xx error (not a usable AdmissionReview), by status code.",
    ["code"],
)
INTERNAL_ERRORS = Counter(
    "csinode_guard_internal_errors",
    "Evaluations that failed with an unexpected error (the write was admitted unjudged, with a warning).",
)
AUDIT_FAILURES = Counter(
    "csinode_guard_audit_write_failures",
    "Audit records that could not be written to the audit log (they went to the error log instead).",
)
POLICY_INFO = Gauge(
    "csinode_guard_policy_info",
    "The policy in force: 1 for its hash, 0 for earlier ones.",
    ["hash", "name"],
    multiprocess_mode="max",
)
POLICY_GENERATION = Gauge(
    "csinode_guard_policy_generation",
    "Generation of the policy in force (1 at start, +1 per successful reload).",
    multiprocess_mode="max",
)
POLICY_RELOADS = Counter(
    "csinode_guard_policy_reloads",
    "Policy reload attempts by result (success|invalid).",
    ["result"],
)


_children: dict[tuple[int, tuple[str, ...]], Any] = {}


def _child(metric: Any, *values: str) -> Any:
    """``metric.labels(*values)``, remembered: label values are bounded, and ``labels()`` costs on every call."""
    key = (id(metric), values)
    child = _children.get(key)
    if child is None:
        child = _children[key] = metric.labels(*values)
    return child


def count_bad_request(code: int) -> None:
    """Count one HTTP request answered with a 4xx error."""
    _child(BAD_REQUESTS, str(code)).inc()


def observe_decision(endpoint: str, decision: AdmissionDecision, dry_run: bool, seconds: float) -> None:
    """Record one answered AdmissionReview: request count, latency, rule results, state and freezes."""
    _child(REQUESTS, endpoint, decision.decision.value, "true" if dry_run else "false").inc()
    _child(LATENCY, endpoint).observe(seconds)
    for o in decision.outcomes:
        effective = o.effective.value if o.effective else "none"
        _child(RULE_RESULTS, o.rule, o.result, effective).inc()
        if o.result == "violation" and o.driver is not None and o.effective in (
            EnforcementAction.DENY,
            EnforcementAction.CLAMP,
        ):
            change = next((c for c in decision.changes if c.change.driver == o.driver), None)
            refused = decision.decision is Decision.DENY or (change is not None and change.final == change.change.old)
            if refused:
                DISAGREEMENT.labels(o.driver, o.rule).inc()
    if decision.state_problem is not None and decision.state_problem.value != "missing":
        STATE_FAILURES.labels(decision.state_problem.value).inc()
    if not dry_run:
        for c in decision.changes:
            if c.frozen:
                FREEZES.labels(c.change.driver).inc()
