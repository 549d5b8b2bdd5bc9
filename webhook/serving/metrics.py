"""Prometheus metrics of the webhook, correct with several gunicorn worker processes.

Under ``serve`` the environment variable ``PROMETHEUS_MULTIPROC_DIR`` is set before this module is imported,
so every worker writes its samples to files there and the master serves the merged view on the plain-HTTP
metrics port (prometheus_client multiprocess mode). Gauges declare how they merge across processes.
Label values are bounded: endpoints, decisions, rule ids, enforcement actions, HTTP codes, reasons from fixed
sets, and drivers — never node names. A driver name comes from the request, so it labels a series only when the
policy names it or the cluster has a CSIDriver of that name (:func:`driver_label`); any other name counts under
``other``, and at most :data:`MAX_DRIVER_LABELS` names ever label a series in one process.
The policy metrics are the master's (:mod:`webhook.serving.policy_metrics`): one series per live policy, once per
replica.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from webhook.admission.evaluation import AdmissionDecision, Decision
from webhook.admission.policy import EnforcementAction
from webhook.admission.state import STATE_ANNOTATION, StateProblem
from webhook.serving.flushlock import flush_lock

log = logging.getLogger("csinode_guard.state")

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
VIOLATIONS = Counter(
    "csinode_guard_violations",
    "Rule violations per count change, by rule, driver and effective enforcement action (deny|clamp|warn|dryrun):"
    " the per-driver view of csinode_guard_rule_results_total{result=\"violation\"}.",
    ["rule", "driver", "enforcement"],
)
LATENCY = Histogram(
    "csinode_guard_request_duration_seconds",
    "Time from receiving an AdmissionReview to having its answer, in seconds.",
    ["endpoint"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)
STATE_FAILURES = Counter(
    "csinode_guard_state_verification_failures",
    "Reviews whose state annotation was not used, by reason: missing (no state yet: normal for an entry's first "
    "judged write), bad-signature, other-object, malformed, unsupported-version.",
    ["reason"],
)
FREEZES = Counter(
    "csinode_guard_freezes",
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
    "Evaluations that failed with an unexpected error (count increases refused, other writes admitted unjudged).",
)
CLIENT_FAULTS = Counter(
    "csinode_guard_client_faults",
    "Requests dropped for the client's fault, by reason (too_slow: headers or body not sent within the read "
    "deadline; disconnected: the client went away mid-body). Not the guard's errors: no internal-errors alert.",
    ["reason"],
)
LATE_ANSWERS = Counter(
    "csinode_guard_late_answers",
    "AdmissionReviews answered after the apiserver stopped waiting (past the timeout it sent, or on a connection it "
    "had closed), by endpoint: the apiserver applied the webhook's failurePolicy, the guard's decision did not take "
    "effect. The audit records of these reviews carry \"late\": true.",
    ["endpoint"],
)
HURRIED_ANSWERS = Counter(
    "csinode_guard_hurried_answers",
    "AdmissionReviews judged past the guard's internal time budget (--answer-budget), by endpoint: answered with "
    "the ceilings for registrations and the stored count for increases, no new state. Their audit records carry "
    "the auditAnnotation hurried=true.",
    ["endpoint"],
)
ENDPOINTS = ("mutate", "validate")
"""The endpoints that judge AdmissionReviews (the ``endpoint`` label values of the request metrics)."""
AUDIT_FAILURES = Counter(
    "csinode_guard_audit_write_failures",
    "Audit records that could not be written to the audit log (they went to the error log instead).",
)
AUDIT_TIMEOUTS = Counter(
    "csinode_guard_audit_write_timeouts",
    "Audit records not written within the write deadline (a stalled reader); their count increases were refused.",
)
AUDIT_STALLED = Gauge(
    "csinode_guard_audit_log_stalled",
    "1 while a worker's audit log is stalled (its last record missed the write deadline), else 0.",
    multiprocess_mode="livemax",
)
AUDIT_REOPENS = Counter(
    "csinode_guard_audit_log_reopens",
    "Times the audit file was found removed or replaced (rotated) under its path and opened again, by reason.",
    ["reason"],
)
AUDIT_ORPHANED = Counter(
    "csinode_guard_audit_records_orphaned",
    "Records written to an audit file that had been deleted (written again to the new file).",
)

OTHER_DRIVER = "other"
"""The driver label of every driver the policy does not name and the cluster has no CSIDriver for."""
MAX_DRIVER_LABELS = 256
"""Distinct driver label values one process uses at most (a cluster with more CSIDrivers counts the rest as
``other``)."""
_driver_labels: set[str] = set()
_driver_labels_lock = threading.Lock()


def driver_label(driver: str, known: Callable[[str], bool] | None) -> str:
    """The metric label for ``driver`` (a name from a request): itself when ``known(driver)`` (the policy names
    it, or a CSIDriver exists) and fewer than :data:`MAX_DRIVER_LABELS` names are in use, else ``other``."""
    if driver in _driver_labels:
        return driver
    if known is None or not known(driver):
        return OTHER_DRIVER
    with _driver_labels_lock:
        if len(_driver_labels) >= MAX_DRIVER_LABELS:
            return OTHER_DRIVER
        _driver_labels.add(driver)
    return driver


_children: dict[tuple[int, tuple[str, ...]], Any] = {}


def _child(metric: Any, *values: str) -> Any:
    """``metric.labels(*values)``, remembered: label values are bounded, and ``labels()`` costs on every call."""
    key = (id(metric), values)
    child = _children.get(key)
    if child is None:
        child = _children[key] = metric.labels(*values)
    return child


class PendingUpdates:
    """Per-request counts and latencies held in memory and written to the metric files by one flusher thread.

    In multiprocess mode every ``inc()`` takes a lock and writes the sample into an mmap'd file: a review
    touches eight to ten samples (request, latency, one per rule result), about 15 µs on the request path.
    Here a review adds to a dict under one lock (about 1 µs), and :meth:`flush` writes the sums, one ``inc`` per
    label set, every ``interval`` seconds and when the worker exits. The merged view a scrape sees lags by at most
    ``interval`` seconds; a worker killed with SIGKILL loses at most that much of its counts (never audit
    records, which are written before the answer).
    """

    def __init__(self, interval: float = 1.0) -> None:
        self.interval = interval
        self._lock = threading.Lock()
        self._counts: dict[tuple[Any, tuple[str, ...]], float] = {}
        self._latencies: dict[str, list[float]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, keys: list[tuple[Any, tuple[str, ...]]], endpoint: str, seconds: float) -> None:
        """Count 1 for each (Counter, label values) in ``keys`` and record one request duration (seconds) of
        ``endpoint`` for the latency histogram; one lock for the whole review."""
        counts = self._counts
        with self._lock:
            for key in keys:
                counts[key] = counts.get(key, 0.0) + 1.0
            latencies = self._latencies.get(endpoint)
            if latencies is None:
                latencies = self._latencies[endpoint] = []
            latencies.append(seconds)

    def flush(self) -> None:
        """Write everything recorded so far to the metrics (safe from any thread).

        The batch is written under the multiprocess directory's exclusive flush lock
        (:func:`webhook.serving.flushlock.flush_lock`): a scrape sees all of a batch or none of it.
        """
        with self._lock:
            counts, self._counts = self._counts, {}
            latencies, self._latencies = self._latencies, {}
        if not counts and not latencies:
            return
        with flush_lock(os.environ.get("PROMETHEUS_MULTIPROC_DIR"), shared=False):
            for (metric, labels), amount in counts.items():
                _child(metric, *labels).inc(amount)
            for endpoint, values in latencies.items():
                child = _child(LATENCY, endpoint)
                for value in values:
                    child.observe(value)

    def start(self) -> None:
        """Start the flusher thread (daemon) and flush once more at interpreter exit."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="metrics-flush", daemon=True)
        self._thread.start()
        atexit.register(self.stop)

    def stop(self) -> None:
        """Stop the flusher and write what is pending."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self.flush()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.flush()


_PENDING: list[PendingUpdates] = []  # the serving worker's batch, once batch_updates() was called


def batch_updates(interval: float = 1.0) -> PendingUpdates:
    """Hold per-request updates in memory and flush them every ``interval`` seconds (serving workers).

    Without this call (tests, tools), :func:`observe_decision` writes every sample at once.
    """
    if not _PENDING:
        _PENDING.append(PendingUpdates(interval))
        _PENDING[0].start()
    return _PENDING[0]


def count_bad_request(code: int) -> None:
    """Count one HTTP request answered with a 4xx error."""
    _child(BAD_REQUESTS, str(code)).inc()


def count_late_answer(endpoint: str) -> None:
    """Count one AdmissionReview of ``endpoint`` answered after the apiserver stopped waiting (written at once:
    rare, and it should reach a scrape even if the worker dies next)."""
    _child(LATE_ANSWERS, endpoint).inc()


def count_hurried_answer(endpoint: str) -> None:
    """Count one AdmissionReview of ``endpoint`` answered past the time budget (written at once: rare)."""
    _child(HURRIED_ANSWERS, endpoint).inc()


def start_late_answer_series() -> None:
    """Create the late-answer series of every endpoint at 0 (a rate and an alert need the series before the
    first late answer)."""
    for endpoint in ENDPOINTS:
        _child(LATE_ANSWERS, endpoint)
        _child(HURRIED_ANSWERS, endpoint)


def count_client_fault(reason: str) -> None:
    """Count one request dropped for the client's fault (``reason``: too_slow | disconnected)."""
    _child(CLIENT_FAULTS, reason).inc()


_REPLAYS_LOGGED: dict[str, None] = {}
"""CSINodes whose replayed state was logged (insertion order; the oldest forgotten past 10000)."""


def _first_replay(node: str) -> bool:
    """True the first time a replayed state of the CSINode ``node`` is seen (logged once per object)."""
    if node in _REPLAYS_LOGGED:
        return False
    _REPLAYS_LOGGED[node] = None
    if len(_REPLAYS_LOGGED) > 10000:
        del _REPLAYS_LOGGED[next(iter(_REPLAYS_LOGGED))]
    return True


def _log_state_problem(endpoint: str, decision: AdmissionDecision) -> None:
    # One warning per AdmissionReview whose state annotation was present but not used. It names the CSINode and
    # why (``DecodedState.detail``), never the annotation's value, its signature or a key.
    log.warning("/%s: state annotation %s of CSINode %s not used (%s: %s); its entries are judged as new",
                endpoint, STATE_ANNOTATION, decision.node, decision.state_problem, decision.state_detail)


def observe_decision(endpoint: str, decision: AdmissionDecision, dry_run: bool, seconds: float,
                     known_driver: Callable[[str], bool] | None = None) -> None:
    """Record one answered AdmissionReview: request count, latency, rule results, state and freezes.

    A state annotation that was not used is counted under its reason (``missing`` too); one that was present but
    unusable (a bad signature, another object's, malformed) is also logged once, at warning, as is a missing state
    on an object a state was seen for; a ``replayed`` state is logged once per CSINode. Drivers label series
    only when ``known_driver(name)`` is true (:func:`driver_label`); None: none does."""
    keys: list[tuple[Any, tuple[str, ...]]] = [
        (REQUESTS, (endpoint, decision.decision.value, "true" if dry_run else "false"))
    ]
    keys += [(RULE_RESULTS, (o.rule, o.result, o.effective.value if o.effective else "none"))
             for o in decision.outcomes]
    keys += [(VIOLATIONS, (o.rule, driver_label(o.driver, known_driver), o.effective.value if o.effective else "none"))
             for o in decision.outcomes if o.result == "violation" and o.driver is not None]
    if decision.decision is not Decision.ALLOW:
        finals = {c.change.driver: c for c in decision.changes}
        for o in decision.outcomes:
            if o.result == "violation" and o.driver is not None and o.effective in (
                EnforcementAction.DENY,
                EnforcementAction.CLAMP,
            ):
                change = finals.get(o.driver)
                if decision.decision is Decision.DENY or (change is not None and change.final == change.change.old):
                    keys.append((DISAGREEMENT, (driver_label(o.driver, known_driver), o.rule)))
    if decision.state_problem is not None:
        keys.append((STATE_FAILURES, (decision.state_problem.value,)))
        if decision.state_problem is StateProblem.REPLAYED:
            if _first_replay(decision.node):
                _log_state_problem(endpoint, decision)
        elif decision.state_problem is not StateProblem.MISSING or decision.state_detail:
            _log_state_problem(endpoint, decision)  # a missing state is logged when the object had one
    if not dry_run:
        keys += [(FREEZES, (driver_label(c.change.driver, known_driver),)) for c in decision.changes if c.frozen]
    if _PENDING:
        _PENDING[0].add(keys, endpoint, seconds)
        return
    for metric, labels in keys:
        _child(metric, *labels).inc()
    _child(LATENCY, endpoint).observe(seconds)
