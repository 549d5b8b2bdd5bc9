"""The Flask app factory: POST /mutate and /validate, GET /healthz and /readyz.

Two error channels, kept apart: a request that is not a usable AdmissionReview is the apiserver's problem and
gets an HTTP error with a JSON body (400 not JSON / not an AdmissionReview v1 / no request, 415 wrong content
type, 413 body over the limit, never 500); a policy denial is the writer's and is an HTTP 200 AdmissionReview
with ``allowed: false``. The core raises typed review errors; :data:`REVIEW_ERROR_STATUS` is the one place that
gives each its HTTP status. Nothing happens at import; collaborators live in ``app.extensions["csinode_guard"]``.
"""

from __future__ import annotations

import json
import logging
import os
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import MappingProxyType
from typing import Any

from flask import Flask, Response, current_app, request
from werkzeug.exceptions import ClientDisconnected, HTTPException

from webhook.admission.audit_records import build_records
from webhook.admission.budget import IncreaseBudget
from webhook.admission.cluster import ClusterView
from webhook.admission.csinode import format_count
from webhook.admission.decision import AdmissionDecision, Decision, Mode
from webhook.admission.evaluation import evaluate, unjudged
from webhook.admission.label_provenance import NODE_LABELS_PATH, review_label_write
from webhook.admission.policy import Policy
from webhook.admission.review import (
    AdmissionRequest,
    AdmissionResponse,
    MalformedReviewError,
    NotJSONError,
    ReviewError,
    UnsupportedVersionError,
    build_response,
    dumps_compact,
    parse_review,
    peek_uid,
)
from webhook.admission.state import StateKeys
from webhook.serving import metrics
from webhook.serving.audit_writer import AuditWriter
from webhook.serving.cluster_budget import watched_budget
from webhook.serving.lateness import Lateness, apiserver_timeout, judge_lateness, request_started
from webhook.serving.live_policy import PolicyStore
from webhook.serving.shared_budget import SharedIncreaseBudget
from webhook.serving.workers import ClientTooSlowError

log = logging.getLogger("csinode_guard.server")
EXTENSION = "csinode_guard"
BENCHMARK_NOOP_ENV = "CSINODE_GUARD_BENCHMARK_NOOP"
"""Set to ``1`` to add ``POST /noop`` (benchmarks only): same stack, no judgement. Never set in production."""
RECORD_REVIEWS_ENV = "CSINODE_GUARD_RECORD_REVIEWS_DIR"
"""Tests only: a directory where every /mutate and /validate AdmissionReview received is written with its
answer (``<ns>-<pid>-<endpoint>.json``: ``{"review": ..., "answer": ...}``), to record what a real apiserver
sends (tests/data/apiserver). The bodies hold whole objects: never set in production."""


REVIEW_ERROR_STATUS: Mapping[type[ReviewError], int] = MappingProxyType({
    NotJSONError: 400,
    UnsupportedVersionError: 400,
    MalformedReviewError: 400,
    ReviewError: 400,
})
"""The HTTP status of each way a body is not a usable AdmissionReview (:mod:`webhook.admission.review`'s errors): all
400 Bad Request, the apiserver's problem (it logs the answer and applies the webhook's failurePolicy), never 500."""


def review_error_status(exc: ReviewError) -> int:
    """The HTTP status answering ``exc``: the :data:`REVIEW_ERROR_STATUS` entry of its class or nearest base."""
    for cls in type(exc).__mro__:
        status = REVIEW_ERROR_STATUS.get(cls)
        if status is not None:
            return status
    return 400


def _utcnow() -> datetime:
    return datetime.now(UTC)


BUDGET_SHARE_OF_TIMEOUT = 0.4
"""The share of the apiserver's ``timeout`` the evaluation may use at most (2 s of the registered 5): the rest is
for what comes after it (the audit record, encoding and sending the answer, 3 s) and for what came before the
worker saw the request. A budget much shorter than that turns a merely busy guard's answers into hurried ones."""


def answer_budget(configured: float, timeout: float | None) -> float:
    """Seconds, from a review's first byte, within which it is judged in full: ``configured``
    (``--answer-budget``), never more than :data:`BUDGET_SHARE_OF_TIMEOUT` of the apiserver's ``timeout``
    (seconds; None when it sent none). The registered ``timeoutSeconds`` is 5 (webhook/kube/registration.py)."""
    return configured if timeout is None else min(configured, timeout * BUDGET_SHARE_OF_TIMEOUT)


@dataclass
class Runtime:
    """Everything a request needs, built once per worker process.

    ``readiness()`` returns (ready, reason) for the cluster caches; ``certificate_problems()`` lists problems
    of the serving certificate (expired...). ``clock`` returns timezone-aware UTC.
    """

    policies: PolicyStore
    cluster: ClusterView
    keys: StateKeys
    audit: AuditWriter
    max_body_bytes: int = 3 * 1024 * 1024
    connection_max_age: float = 60.0
    answer_budget: float = 2.0
    """Seconds from a review's first byte within which it is judged in full (:func:`answer_budget`)."""
    clock: Callable[[], datetime] = _utcnow
    readiness: Callable[[], tuple[bool, str]] = lambda: (True, "offline")
    certificate_problems: Callable[[], list[str]] = list
    require_client_cert: bool = False
    """/mutate and /validate answer only clients that presented a verified certificate (``--client-ca``)."""
    observe_count: Callable[..., object] | None = None
    """Called with (driver, allocatable count, node, label=driver label) for every admitted count (headroom)."""
    known_driver: Callable[[str], bool] | None = None
    """True for a driver the policy names or the cluster has a CSIDriver for: only those label metric series
    (:func:`webhook.serving.metrics.driver_label`); None: the policy's names only."""

    def is_known_driver(self, driver: str) -> bool:
        """``known_driver(driver)``, or whether the policy in force names ``driver``."""
        if self.known_driver is not None:
            return self.known_driver(driver)
        return driver in self.policies.current().policy.drivers
    cert_file: Path | None = None
    budget_dir: Path | None = None
    """Where the replica's workers share the cluster increase budget (``webhook.serving.shared_budget``); None keeps it
    in this process."""
    _budget: tuple[str, IncreaseBudget | None] = ("", None)
    _connections: weakref.WeakKeyDictionary[Any, list[float]] = field(default_factory=weakref.WeakKeyDictionary)

    def budget_for(self, policy: Policy) -> IncreaseBudget | None:
        """The cluster-wide increase budget for ``policy`` (kept across requests, rebuilt on a new policy; shared by
        the replica's workers through ``budget_dir``, one file per policy hash)."""
        key, bucket = self._budget
        if key != policy.hash:
            cfg = policy.cluster_budget
            if cfg is None:
                bucket = None
            elif (watched := watched_budget(cfg.increases_per_second, cfg.burst, self.cluster)) is not None:
                bucket = watched  # one budget for every replica, from the CSINode watch (serving.cluster_budget)
            elif self.budget_dir is not None:
                path = self.budget_dir / f"budget-{policy.hash}.bin"
                bucket = SharedIncreaseBudget(cfg.increases_per_second, cfg.burst, path)
            else:
                bucket = IncreaseBudget(cfg.increases_per_second, cfg.burst)
            self._budget = (policy.hash, bucket)
        return bucket

    def should_close(self, sock: Any) -> bool:
        """True when the keep-alive connection ``sock`` is older than ``connection_max_age`` seconds.

        Closing it after a response makes the apiserver reconnect, and a new connection may land on another
        worker process: the few long-lived connections the apiserver keeps do not stay pinned to one worker.
        """
        if sock is None or self.connection_max_age <= 0:
            return False
        now = time.monotonic()
        try:
            opened = self._connections.setdefault(sock, [now])
        except TypeError:
            return False
        return now - opened[0] >= self.connection_max_age


def _json(document: Any, status: int = 200) -> Response:
    """A JSON response (orjson; ``json`` for what orjson refuses: lone surrogates, integers beyond 64 bits)."""
    return Response(dumps_compact(document), status=status, mimetype="application/json")


def _error(code: int, message: str) -> Response:
    metrics.count_bad_request(code)
    response = _json({"error": message, "code": code}, code)
    if code == 413:
        # The rest of the body is not read after the answer: close rather than let the server drain it to keep
        # the connection alive.
        response.headers["Connection"] = "close"
    return response


class ClientFaultError(Exception):
    """The client did not send its whole body: too slow (``reason="too_slow"``) or gone (``"disconnected"``)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def _read_body(limit: int) -> bytes | None:
    """The request body, or None when it is longer than ``limit`` bytes (then at most ``limit + 1`` are read).

    A declared Content-Length over the limit is refused before reading anything. A chunked body (no length)
    is read up to one byte past the limit: werkzeug's own limit would silently cut it to ``limit`` bytes.
    Raises :class:`ClientFaultError` when the client stalls past the read deadline or goes away mid-body.
    """
    length = request.content_length
    try:
        if length is not None:
            return None if length > limit else request.get_data(cache=False)
        body: bytes = request.environ["wsgi.input"].read(limit + 1)
    except ClientTooSlowError as exc:
        raise ClientFaultError("too_slow", exc.strerror or str(exc)) from None
    except (ConnectionError, TimeoutError, ClientDisconnected) as exc:
        # werkzeug turns a read error under a declared length into ClientDisconnected: the socket knows whether
        # it was the read deadline.
        if getattr(request.environ.get("gunicorn.socket"), "timed_out", False):
            raise ClientFaultError("too_slow", "client sent no complete request in time") from None
        raise ClientFaultError("disconnected", str(exc) or type(exc).__name__) from None
    return None if len(body) > limit else body


def _client_fault(fault: ClientFaultError) -> Response:
    """408 for a body that did not arrive (counted as a client fault, not a bad request nor an internal error);
    the connection is closed after it."""
    metrics.count_client_fault(fault.reason)
    response = _json({"error": f"the request body did not arrive: {fault}", "code": 408}, 408)
    response.headers["Connection"] = "close"
    return response


MAX_DRAIN_BYTES = 8 * 1024 * 1024
"""Bytes of a refused (413) body read and discarded before the answer, so that a client that sends its whole body
before it reads (kube-apiserver's HTTP client) reads the 413 instead of a connection reset: closing a TCP
connection with unread data makes the kernel send RST, and the client's unread answer is lost. A body declared
longer than this is not drained (answered at once and closed). Reads stop at the client read deadline
(:mod:`webhook.serving.workers`), so a stalled client holds the thread no longer than any other request."""


DRAIN_IDLE_SECONDS = 1.0
"""A client that sends nothing for this long while its refused body is drained gets the 413 at once."""


def _drain_body() -> None:
    """Read and discard the rest of the request body, at most ``MAX_DRAIN_BYTES`` in all (see there)."""
    length = request.content_length
    if length is not None and length > MAX_DRAIN_BYTES:
        return
    stream = request.environ["wsgi.input"]
    sock = request.environ.get("gunicorn.socket")
    if sock is not None and hasattr(sock, "settimeout"):
        sock.settimeout(DRAIN_IDLE_SECONDS)  # within the request deadline (webhook.serving.workers.DeadlineSSLSocket)
    left = MAX_DRAIN_BYTES
    try:
        while left > 0:
            chunk = stream.read(min(65536, left))
            if not chunk:
                return
            left -= len(chunk)
    except (OSError, ValueError) as exc:  # a stalled or broken client: the connection is closed anyway
        log.info("stopped draining a refused body of %s bytes: %s", length if length is not None else "chunked", exc)


def _refuse_too_large(message: str) -> Response:
    """413 for a body over the limit, after draining what the client sends (:func:`_drain_body`)."""
    _drain_body()
    return _error(413, message)


def _has_client_certificate(sock: Any) -> bool:
    """True when the TLS peer presented a certificate that verified against --client-ca."""
    getpeercert = getattr(sock, "getpeercert", None)
    if getpeercert is None:
        return False
    try:
        return bool(getpeercert())
    except (ValueError, OSError):
        return False


def _read_review_body(runtime: Runtime, sock: Any) -> bytes | Response:
    """The body of an AdmissionReview request after the checks every endpoint makes, or the error to answer:
    403 without the apiserver's client certificate (with --client-ca), 415 for another Content-Type, a client
    fault's status, 413 over the size limit (the rest drained)."""
    if runtime.require_client_cert and not _has_client_certificate(sock):
        return _error(403, "a client certificate signed by the --client-ca is required (the apiserver's webhook "
                           "client certificate)")
    if request.mimetype != "application/json":
        return _error(415, f"Content-Type must be application/json, not {request.mimetype or '(none)'!r}")
    try:
        body = _read_body(runtime.max_body_bytes)
    except ClientFaultError as fault:
        return _client_fault(fault)
    if body is None:
        size = f"of {request.content_length} bytes " if request.content_length is not None else ""
        return _refuse_too_large(f"body {size}is over the limit of {runtime.max_body_bytes} bytes")
    return body


def _review(mode: Mode) -> Response:
    runtime: Runtime = current_app.extensions[EXTENSION]
    started = time.perf_counter()
    sock = request.environ.get("gunicorn.socket")
    reading_started = request_started(sock)
    if reading_started is None:  # not served by gunicorn's worker (a test client): from now
        reading_started = time.monotonic()
    body = _read_review_body(runtime, sock)
    if isinstance(body, Response):
        return body
    try:
        review = parse_review(body)
    except ReviewError as exc:
        log.warning("bad AdmissionReview (uid %s): %s", peek_uid(body), exc.message)
        return _error(review_error_status(exc), exc.message)
    snapshot = runtime.policies.current()
    policy = snapshot.policy
    now = runtime.clock()
    timeout = apiserver_timeout(request.args.get("timeout"))
    budget = answer_budget(runtime.answer_budget, timeout)
    spent_at = reading_started + budget
    try:
        decision = evaluate(
            review,
            policy,
            runtime.cluster,
            now,
            runtime.keys,
            mode=mode,
            budget=runtime.budget_for(policy) if mode is Mode.MUTATE else None,
            budget_clock=time.monotonic(),
            deadline=lambda: time.monotonic() > spent_at,
            budget_seconds=budget,
        )
    except Exception:
        log.exception("evaluation failed for request %s; count increases refused, other writes admitted", review.uid)
        metrics.INTERNAL_ERRORS.inc()
        decision = unjudged(review)
    if decision.notes and decision.decision in (Decision.SKIP, Decision.DENY):
        log.warning("request %s: %s", review.uid, "; ".join(decision.notes))
    if decision.response.audit_annotations.get("hurried"):
        metrics.count_hurried_answer(mode.value)
        log.warning("request %s (/%s, CSINode %s): time budget of %gs spent; answered with the ceilings and the "
                    "stored counts", review.uid, mode.value, review.name, budget)
    # The answer is encoded before its lateness is judged: for a wide object, encoding a large patch is part of
    # what the apiserver waits for (issue 32: the check used to run before it, and missed a fail-open).
    response = _json(build_response(review.uid, decision.response, allow_patch=mode is Mode.MUTATE))
    late = judge_lateness(sock, reading_started, timeout)
    if late is not None:
        _report_late(mode, review, late)
    if not _audit(runtime, decision, review, mode, now, snapshot.policy.hash, snapshot.generation,
                  time.perf_counter() - started, late):
        decision = _unaudited(decision, review)
        response = _json(build_response(review.uid, decision.response, allow_patch=mode is Mode.MUTATE))
    if late is None and timeout is not None:
        # What follows (the audit write, metrics, sending the answer) can still make it late: looked at again
        # once the answer is sent, by the clock only (a peer may close a keep-alive connection after a timely
        # answer).
        response.call_on_close(lambda: _late_after_sending(mode, review, reading_started, timeout))
    latency = time.perf_counter() - started
    metrics.observe_decision(mode.value, decision, review.dry_run, latency, runtime.is_known_driver)
    if runtime.observe_count is not None and mode is Mode.MUTATE and decision.response.allowed:
        # The attach headroom of every count the write stores: observed where it is admitted, at /mutate, which
        # every such write reaches (with `register --validation cel` /validate is called only where CEL cannot
        # decide). A clamp back to the stored count stores nothing and is not observed.
        for change in decision.changes:
            if change.final == change.before and not change.change.registration:
                continue
            driver = change.change.driver
            runtime.observe_count(driver, change.final, decision.node,
                                  label=metrics.driver_label(driver, runtime.is_known_driver))
    record_dir = current_app.config.get(RECORD_REVIEWS_ENV)
    if record_dir:
        _record(Path(record_dir), mode, body, response.get_data())
    if runtime.should_close(request.environ.get("gunicorn.socket")):
        response.headers["Connection"] = "close"
    return response


def _node_review() -> Response:
    """The Node entry (``/node-labels``): records who set the Node's labels (:mod:`label_provenance`), never refuses.

    The same client-certificate, content-type and body checks as /mutate; a malformed AdmissionReview is a 400. An
    unexpected error is logged and answered with an allow without a patch (the entry's failurePolicy is Ignore too:
    the label is then simply not vouched for)."""
    runtime: Runtime = current_app.extensions[EXTENSION]
    body = _read_review_body(runtime, request.environ.get("gunicorn.socket"))
    if isinstance(body, Response):
        return body
    try:
        review = parse_review(body)
    except ReviewError as exc:
        log.warning("bad AdmissionReview for a Node (uid %s): %s", peek_uid(body), exc.message)
        return _error(review_error_status(exc), exc.message)
    try:
        answer = review_label_write(review, runtime.keys)
    except Exception:
        log.exception("label provenance failed for request %s; allowed without a record", review.uid)
        metrics.INTERNAL_ERRORS.inc()
        answer = AdmissionResponse(allowed=True)
    return _json(build_response(review.uid, answer, allow_patch=True))


def _noop() -> Any:
    """The benchmark floor: the cheapest valid admission webhook on the same stack, judging nothing.

    The same client-certificate, content-type and body checks, body read and connection handling as /mutate;
    it decodes the AdmissionReview (an answer must echo ``request.uid``) and allows it. ``worker`` (the pid of
    the worker process that answered) is for the spread benchmark.
    """
    runtime: Runtime = current_app.extensions[EXTENSION]
    if runtime.require_client_cert and not _has_client_certificate(request.environ.get("gunicorn.socket")):
        return _error(403, "a client certificate signed by the --client-ca is required")
    if request.mimetype != "application/json":
        return _error(415, "Content-Type must be application/json")
    try:
        body = _read_body(runtime.max_body_bytes)
    except ClientFaultError as fault:
        return _client_fault(fault)
    if body is None:
        return _refuse_too_large(f"body is over the limit of {runtime.max_body_bytes} bytes")
    try:
        review = parse_review(body)
    except ReviewError as exc:
        return _error(review_error_status(exc), exc.message)
    answer = build_response(review.uid, AdmissionResponse(allowed=True), allow_patch=False)
    response = _json({**answer, "worker": os.getpid()})
    if runtime.should_close(request.environ.get("gunicorn.socket")):
        response.headers["Connection"] = "close"
    return response


def _raises_a_count(decision: AdmissionDecision, review: AdmissionRequest) -> list[str]:
    """The admitted count increases of ``decision`` (``driver: old -> final``); registrations and CREATE have none
    (never refused)."""
    if not decision.response.allowed or review.operation != "UPDATE":
        return []
    rising = []
    for c in decision.changes:
        old, final = c.change.old, c.final
        if old is not None and (final is None or final > old):
            rising.append(f"{c.change.driver}: {format_count(old)} -> {format_count(final)}")
    return rising


def _unaudited(decision: AdmissionDecision, review: AdmissionRequest) -> AdmissionDecision:
    """The decision when its audit record could not be written in time: the design's asymmetry.

    An admitted count increase is refused (403; kubelet retries at its next period), since nothing would record
    why it was let in; any other write keeps its decision. The records went to the error log."""
    rising = _raises_a_count(decision, review)
    if not rising:
        return decision
    message = (f"csinode-guard could not write its audit record in time (audit log stalled), so it refuses count "
               f"increases ({', '.join(rising[:5])}{', ...' if len(rising) > 5 else ''}); other writes are admitted")
    log.error("request %s: %s", review.uid, message)
    return decision._replace(
        response=AdmissionResponse(allowed=False, status_code=403, reason="Forbidden", message=message,
                                   audit_annotations={"decision": "error"}),
        decision=Decision.DENY,
    )


def _report_late(mode: Mode, review: AdmissionRequest, late: Lateness, after_record: bool = False) -> None:
    """Count and log an answer the apiserver no longer waits for (:mod:`webhook.serving.lateness`);
    ``after_record``: found once the answer was sent, after its audit record was written unmarked."""
    metrics.count_late_answer(mode.value)
    if after_record:
        log.warning("request %s (/%s, CSINode %s) finished sending its answer %.3fs after the worker began reading "
                    "it, past the apiserver's timeout (%gs), which applied the webhook's failurePolicy instead: this "
                    "decision did not take effect (its audit record, written before, is not marked late)",
                    review.uid, mode.value, review.name, late.elapsed_seconds, late.deadline_seconds or 0.0)
        return
    deadline = f"{late.deadline_seconds:g}s" if late.deadline_seconds is not None else "none sent"
    why = ("past the apiserver's timeout" if late.reason == "deadline"
           else "the apiserver had already closed the connection")
    log.warning("request %s (/%s, CSINode %s) answered %.3fs after the worker began reading it (timeout %s): %s, "
                "which applied the webhook's failurePolicy instead: this decision did not take effect", review.uid,
                mode.value, review.name, late.elapsed_seconds, deadline, why)


def _late_after_sending(mode: Mode, review: AdmissionRequest, started: float, timeout: float,
                        now: float | None = None) -> bool:
    """Count and log an answer whose last byte left after the apiserver's ``timeout`` (seconds) although it was on
    time when its audit record was written (that record is not marked ``late``; the log line names the uid).
    True when it was late. ``now``: the monotonic clock (tests)."""
    late = judge_lateness(None, started, timeout, now=now)
    if late is None:
        return False
    _report_late(mode, review, late, after_record=True)
    return True


def _audit(
    runtime: Runtime,
    decision: AdmissionDecision,
    review: AdmissionRequest,
    mode: Mode,
    now: datetime,
    policy_hash: str,
    generation: int,
    latency: float,
    late: Lateness | None = None,
) -> bool:
    """Write the decision's audit records (marked ``late`` with ``late``); False when one of them was not written
    (it went to the error log)."""
    records = build_records(
        decision,
        review,
        endpoint=mode,
        now=now,
        policy_hash=policy_hash,
        policy_generation=generation,
        latency_seconds=latency,
    )
    if late is not None:
        fields = late.record_fields()
        for record in records:
            record.update(fields)
    return runtime.audit.write(records) == len(records)


def _record(directory: Path, mode: Mode, body: bytes, answer: bytes) -> None:
    """Write one received AdmissionReview and its answer under ``directory`` (see :data:`RECORD_REVIEWS_ENV`)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        document = {"review": json.loads(body), "answer": json.loads(answer)}
        name = f"{time.time_ns()}-{os.getpid()}-{mode.value}.json"
        (directory / name).write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    except (OSError, ValueError) as exc:
        log.warning("could not record the AdmissionReview in %s: %s", directory, exc)


def create_app(runtime: Runtime) -> Flask:
    """Build the Flask app serving ``runtime``. Registers JSON error handlers for every HTTP error."""
    app = Flask("csinode_guard")
    app.config["MAX_CONTENT_LENGTH"] = runtime.max_body_bytes
    app.json.sort_keys = False  # type: ignore[attr-defined]
    app.extensions[EXTENSION] = runtime

    @app.post("/mutate", provide_automatic_options=False)
    def mutate() -> Any:
        return _review(Mode.MUTATE)

    @app.post("/validate", provide_automatic_options=False)
    def validate() -> Any:
        return _review(Mode.VALIDATE)

    @app.post(NODE_LABELS_PATH, provide_automatic_options=False)
    def node_labels() -> Any:
        return _node_review()

    if os.environ.get(RECORD_REVIEWS_ENV):
        app.config[RECORD_REVIEWS_ENV] = os.environ[RECORD_REVIEWS_ENV]
        log.warning("%s is set: recording every AdmissionReview received (tests only)", RECORD_REVIEWS_ENV)
    if os.environ.get(BENCHMARK_NOOP_ENV) == "1":
        app.add_url_rule("/noop", "noop", _noop, methods=["POST"], provide_automatic_options=False)
        log.warning("%s=1: serving the benchmark endpoint POST /noop", BENCHMARK_NOOP_ENV)

    @app.get("/healthz", provide_automatic_options=False)
    def healthz() -> Any:
        return _json({"status": "ok"})

    @app.get("/readyz", provide_automatic_options=False)
    def readyz() -> Any:
        """200 while this worker can judge (status "ok", or "degraded" with problems that do not stop it, such
        as a refused policy file); 503 "unavailable" otherwise. ``problems`` lists both kinds, one line each."""
        snapshot = runtime.policies.current()
        problems = list(runtime.certificate_problems())
        cluster_ready, cluster_reason = runtime.readiness()
        if not cluster_ready:
            problems.append(f"cluster caches: {cluster_reason}")
        problems += runtime.audit.problems()
        ready = not problems
        # A refused policy file does not make the replica unready (the last good policy serves), but it is
        # reported: the next start would refuse the file.
        policy_problem = runtime.policies.problem()
        if policy_problem is not None:
            problems.append(policy_problem.describe())
        body = {
            "status": ("ok" if not problems else "degraded") if ready else "unavailable",
            "policy": {"hash": snapshot.policy.hash, "generation": snapshot.generation},
            "cluster": cluster_reason,
            "problems": problems,
        }
        return _json(body, 200 if ready else 503)

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException) -> Any:
        code = exc.code or 500
        if code == 413:
            return _error(413, f"body is over the limit of {runtime.max_body_bytes} bytes")
        return _error(code, exc.description or exc.name)

    @app.errorhandler(Exception)
    def unexpected(exc: Exception) -> Any:  # pragma: no cover - defence in depth
        log.exception("unexpected error")
        metrics.INTERNAL_ERRORS.inc()
        return _json({"error": "internal error", "code": 400}, 400)

    return app
