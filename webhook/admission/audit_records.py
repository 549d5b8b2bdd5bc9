"""Audit records of one decision: the JSON-ready dicts the audit log holds, and their one-line encoding. Pure.

A record per (request, count change) — or one record with ``driver: null`` when the request changed no count —
with the time, request uid, endpoint, operation, dryRun, user, node, driver, old/new/final count, every rule's
result with its enforcement and message, the decision, the policy hash and generation, and the latency. The
server's audit writer (:mod:`webhook.serving.audit_writer`) appends them to the audit log; ``replay`` builds the same
records for the writes it judges.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import orjson

from webhook.admission.decision import AdmissionDecision, Mode, Note, RuleOutcome
from webhook.admission.policy import EnforcementAction
from webhook.admission.review import AdmissionRequest
from webhook.admission.state import format_time


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


def _capped(notes: Sequence[Note]) -> list[str]:
    """The notes' texts, at most ``MAX_NOTES`` (the last then counts the others)."""
    if len(notes) <= MAX_NOTES:
        return [n.text for n in notes]
    return [*(n.text for n in notes[: MAX_NOTES - 1]), f"... and {len(notes) - MAX_NOTES + 1} more notes"]


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
    drivers those are); notes are the ones about its driver (:attr:`webhook.admission.decision.Note.driver`; the first
    record also gets the others). So the records of a request grow with its number of changes, never with its
    square.
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
            record["notes"] = _capped(decision.notes)
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
    own_notes: dict[str, list[Note]] = {}
    other_notes: list[Note] = []
    for note in decision.notes:
        if note.driver is not None and note.driver in drivers:
            own_notes.setdefault(note.driver, []).append(note)
        else:
            other_notes.append(note)
    records: list[dict[str, Any]] = []
    for change in decision.changes:
        driver = change.change.driver
        own = by_driver.get(driver, [])
        record = dict(base)
        record.update(
            driver=driver,
            change=change.change.kind.value,
            registration=change.change.registration,
            old=None if change.change.is_first_registration else _count(change.before),
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
