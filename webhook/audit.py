"""The guard's audit log: one JSON line per decision and change, written whole, never dropped silently.

A record per (request, count change) — or one record with ``driver: null`` when the request changed no count —
with the time, request uid, endpoint, operation, dryRun, user, node, driver, old/new/final count, every rule's
result with its enforcement and message, the decision, the policy hash and generation, and the latency.

Several gunicorn worker processes append to the same file or pipe: each record is one ``os.write`` of a whole
line under a lock shared by the workers (created before they fork), with ``O_APPEND`` for files. A failed write
is retried, then the record goes to the error log with the reason and a metric counts it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Callable
from datetime import datetime
from typing import Any, Protocol

import orjson

from webhook.evaluation import AdmissionDecision, Mode, RuleOutcome
from webhook.policy import EnforcementAction
from webhook.review import AdmissionRequest
from webhook.state import format_time

log = logging.getLogger("csinode_guard.audit")


class _Lock(Protocol):
    def acquire(self, block: bool = ..., timeout: float = ...) -> bool: ...
    def release(self) -> None: ...


def _count(value: int | None) -> int | str:
    return "unbounded" if value is None else value


MAX_NOTES = 10
"""Notes a record carries at most (the last then counts the others)."""


def _rule(o: RuleOutcome) -> dict[str, Any]:
    return {
        "rule": o.rule,
        "result": o.result,
        "enforcement": o.enforcement.value if o.enforcement else None,
        "effective": o.effective.value if o.effective else None,
        "message": o.message,
    }


def _capped(notes: list[str]) -> list[str]:
    if len(notes) <= MAX_NOTES:
        return notes
    return [*notes[: MAX_NOTES - 1], f"... and {len(notes) - MAX_NOTES + 1} more notes"]


def build_records(
    decision: AdmissionDecision,
    request: AdmissionRequest | None,
    *,
    endpoint: Mode | str,
    now: datetime,
    policy_hash: str,
    policy_generation: int,
    latency_seconds: float,
) -> list[dict[str, Any]]:
    """Audit records (JSON-ready dicts) for one decision: one per count change, at least one per request.

    A change's record carries its own rule results, the request-level ones, and, when the request was refused,
    the lines of the refusal about this change (or, for a change refused only because another one was, which
    drivers those are); notes are the ones about its driver (the first record also gets the others). So the
    records of a request grow with its number of changes, never with its square.
    """
    base: dict[str, Any] = {
        "time": format_time(now),
        "uid": request.uid if request else None,
        "endpoint": str(endpoint.value if isinstance(endpoint, Mode) else endpoint),
        "operation": request.operation if request else None,
        "dryRun": request.dry_run if request else False,
        "user": request.username if request else None,
        "groups": list(request.groups) if request else [],
        "node": decision.node or (request.name if request else None),
        "decision": decision.decision.value,
        "allowed": decision.response.allowed,
        "exempt": decision.exempt,
        "inScope": decision.in_scope,
        "policyHash": policy_hash,
        "policyGeneration": policy_generation,
        "latencyMs": round(latency_seconds * 1000, 3),
    }
    if decision.state_problem is not None:
        base["stateProblem"] = decision.state_problem.value
    if decision.approvals_recorded:
        base["approvalsRecorded"] = decision.approvals_recorded
    refused = not decision.response.allowed and bool(decision.response.message)
    by_driver: dict[str | None, list[RuleOutcome]] = {}
    for o in decision.outcomes:
        by_driver.setdefault(o.driver, []).append(o)
    request_level = [_rule(o) for o in by_driver.get(None, ())]
    if not decision.changes:
        record = dict(base, driver=None, rules=request_level)
        if refused:
            record["message"] = decision.response.message
        if decision.notes:
            record["notes"] = _capped(list(decision.notes))
        return [record]
    denying: list[str] = []  # drivers with a violation that denied the request, in order
    request_lines: list[str] = []
    if refused:
        for o in decision.outcomes:
            if o.result == "violation" and o.effective is EnforcementAction.DENY:
                if o.driver is None:
                    request_lines.append(o.message)
                elif not denying or denying[-1] != o.driver:
                    denying.append(o.driver)
    drivers = {c.change.driver for c in decision.changes}
    own_notes: dict[str, list[str]] = {}
    other_notes: list[str] = []
    for note in decision.notes:
        about = _note_driver(note, decision.node, drivers)
        if about is None:
            other_notes.append(note)
        else:
            own_notes.setdefault(about, []).append(note)
    records: list[dict[str, Any]] = []
    for change in decision.changes:
        driver = change.change.driver
        own = by_driver.get(driver, [])
        record = dict(base)
        record.update(
            driver=driver,
            change=change.change.kind.value,
            registration=change.change.registration,
            old=_count(change.before),
            new=_count(change.change.new),
            final=_count(change.final) if decision.response.allowed else _count(change.before),
            writerVersion=change.writer_version,
            rules=[_rule(o) for o in own] + request_level,
        )
        if refused:
            lines = request_lines + [
                o.message for o in own if o.result == "violation" and o.effective is EnforcementAction.DENY
            ]
            if not lines:
                named = ", ".join(denying[:3]) + (f" and {len(denying) - 3} more" if len(denying) > 3 else "")
                lines = [f"refused with the request's other changes: a deny rule fired for {named}"]
            record["message"] = "\n".join(lines)
        notes = own_notes.get(driver, []) + (other_notes if not records else [])
        if notes:
            record["notes"] = _capped(notes)
        if change.correction:
            record["correction"] = change.correction
        if change.frozen:
            record["frozen"] = True
        records.append(record)
    return records


def _note_driver(note: str, node: str, drivers: set[str]) -> str | None:
    """The changed driver a note is about (``<node>/<driver>: ...`` or ``justification for <driver> ...``)."""
    for prefix in (f"{node}/", "justification for "):
        if note.startswith(prefix):
            rest = note[len(prefix) :]
            for sep in (": ", " "):
                candidate = rest.split(sep, 1)[0]
                if candidate in drivers:
                    return candidate
    return None


_ORJSON_OPTIONS = (
    orjson.OPT_APPEND_NEWLINE
    | orjson.OPT_PASSTHROUGH_DATETIME
    | orjson.OPT_PASSTHROUGH_DATACLASS
    | orjson.OPT_PASSTHROUGH_SUBCLASS
)


def encode_record(record: dict[str, Any]) -> bytes:
    """One audit line: compact JSON, ASCII only (``\\uXXXX`` escapes), and a newline; what JSON cannot hold is
    written as ``str()``.

    ASCII keeps a record on one line for every reader (Python's ``str.splitlines`` also breaks at U+2028 or
    U+0085, which a node or driver name may carry). orjson when its output is ASCII (everything it would
    render itself is handed to ``str()``, as ``json.dumps(default=str)`` does); ``json`` otherwise, and for
    what orjson refuses (lone surrogates, integers beyond 64 bits).
    """
    try:
        line = orjson.dumps(record, default=str, option=_ORJSON_OPTIONS)
        if line.isascii():
            return line
    except orjson.JSONEncodeError:
        pass
    return (json.dumps(record, separators=(",", ":"), default=str) + "\n").encode("ascii")


class AuditWriter:
    """Appends audit records as JSON lines to ``path`` (``-`` = standard output).

    ``lock`` must be shared by all processes that write the same destination (a ``multiprocessing.Lock``
    created before gunicorn forks); a thread lock is used when None. ``on_failure(reason)`` is called for
    every record that could not be written (a metric); the record then goes to the error log.
    Raises OSError at construction when the file cannot be opened.
    """

    def __init__(
        self,
        path: str,
        lock: _Lock | None = None,
        on_failure: Callable[[str], None] | None = None,
    ) -> None:
        self.path = path
        self._lock: _Lock = lock if lock is not None else threading.Lock()
        self._on_failure = on_failure
        self._fd = self._open()
        self._pid = os.getpid()

    def _open(self) -> int:
        if self.path == "-":
            return 1
        return os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)

    def _reopen_after_fork(self) -> None:
        if os.getpid() != self._pid and self.path != "-":
            self._fd = self._open()
            self._pid = os.getpid()

    def _write_whole(self, line: bytes) -> None:
        """One line, whole, under the shared lock (waits at most 5 s for it); raises OSError."""
        got = self._lock.acquire(True, 5.0)
        try:
            n = os.write(self._fd, line)
            if n < len(line):  # a short write (a full pipe): the rest follows before anyone else writes
                view = memoryview(line)[n:]
                while view:
                    view = view[os.write(self._fd, view):]
        finally:
            if got:
                self._lock.release()

    def write(self, records: list[dict[str, Any]]) -> int:
        """Write ``records`` (each one line); returns how many were written. Never raises."""
        self._reopen_after_fork()
        written = 0
        for record in records:
            line = encode_record(record)
            error = ""
            for _attempt in range(2):
                try:
                    self._write_whole(line)
                    error = ""
                    break
                except OSError as exc:
                    error = f"{type(exc).__name__}: {exc.strerror or exc}"
            if error:
                if self._on_failure is not None:
                    self._on_failure(error)
                log.error("audit record not written to %s (%s): %s", self.path, error, line.decode().rstrip())
            else:
                written += 1
        return written

    def close(self) -> None:
        """Close the file (not standard output)."""
        if self.path != "-":
            with contextlib.suppress(OSError):
                os.close(self._fd)
