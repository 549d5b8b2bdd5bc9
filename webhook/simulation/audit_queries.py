"""Reading the guard's own audit log (``webhook.serving.audit_writer``): find the files, read the records, filter,
summarise.

The log is JSON lines, one record per (request, count change) and endpoint; see
:func:`webhook.admission.audit_records.build_records` for the fields. It may be rotated (``audit.log``, ``audit.log.1``,
``audit.log.2.gz``, ``audit.log-20261130.gz``) and gzipped: :func:`expand_rotated` finds a file's rotated
siblings, and files are read oldest first (by the time of their first record). A line may carry a container
runtime prefix (``<time> stdout F {...}``, what ``kubectl logs`` files look like on a node) when the audit log
went to standard output; lines that are not records (other logs, broken lines) are counted and skipped.

Everything here is pure apart from reading files. A count's timeline drawn from the records is
:mod:`webhook.simulation.count_timeline`.
"""

from __future__ import annotations

import fnmatch
import heapq
import json
import re
import zlib
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from webhook.admission.durations import DURATION_PATTERN, parse_duration
from webhook.admission.state import format_time, parse_time
from webhook.simulation.replay_input import open_stream

_ROTATED = re.compile(r"^(?:\.\d+|-\d{8}(?:\d{2})?|-\d{4}-\d{2}-\d{2}(?:T[\d:.-]+)?|\.\d{8})?(?:\.gz)?$")
MAX_PROBLEMS_KEPT = 20


@dataclass(frozen=True)
class LogRecord:
    """One audit record with its parsed time and where it came from."""

    time: datetime
    data: Mapping[str, Any]
    source: str
    line: int

    def fired(self) -> list[str]:
        """Rule ids with a violation in this record, in order, without repeats."""
        out: list[str] = []
        for r in self.data.get("rules") or ():
            if isinstance(r, Mapping) and r.get("result") == "violation" and r.get("rule") not in out:
                out.append(str(r.get("rule")))
        return out


@dataclass
class ReadStats:
    """What reading found besides records: lines that were not records, and where."""

    files: list[str] = field(default_factory=list)
    lines: int = 0
    records: int = 0
    skipped: int = 0
    problems: list[str] = field(default_factory=list)

    def skip(self, source: str, line: int, why: str) -> None:
        """Count a skipped line, keeping the first few for the report."""
        self.skipped += 1
        if len(self.problems) < MAX_PROBLEMS_KEPT:
            self.problems.append(f"{source}:{line}: {why}")


def expand_rotated(paths: Sequence[Path]) -> list[Path]:
    """``paths`` plus the rotated siblings of each file (``NAME.1``, ``NAME.2.gz``, ``NAME-20261130.gz``...)."""
    found: list[Path] = []
    for p in paths:
        candidates = [p]
        parent = p.parent
        if parent.is_dir():
            for sibling in sorted(parent.iterdir()):
                rest = sibling.name[len(p.name):]
                if sibling.name.startswith(p.name) and rest and sibling.is_file() and _ROTATED.match(rest):
                    candidates.append(sibling)
        for c in candidates:
            if c.exists() and c not in found:
                found.append(c)
    return found


def _record_from_line(raw: bytes) -> tuple[dict[str, Any] | None, str]:
    text = raw.strip()
    if not text:
        return None, ""
    start = text.find(b"{")
    if start < 0:
        return None, "not JSON"
    try:
        doc = json.loads(text[start:])
    except (ValueError, RecursionError):
        return None, "not JSON (broken or truncated line)"
    if not isinstance(doc, dict) or "decision" not in doc or "endpoint" not in doc or "time" not in doc:
        return None, "not a csinode-guard audit record"
    return doc, ""


def _iter_file(path: Path, stats: ReadStats) -> Iterator[LogRecord]:
    try:
        raw, stream = open_stream(path)
    except OSError as exc:
        stats.skip(str(path), 0, f"cannot open: {exc.strerror or exc}")
        return
    lineno = 0
    with raw, stream:
        while True:
            try:
                line = stream.readline()
            except (EOFError, OSError, zlib.error) as exc:
                stats.skip(str(path), lineno + 1, f"compressed stream broken ({exc}); rest of the file skipped")
                return
            if not line:
                return
            lineno += 1
            stats.lines += 1
            doc, why = _record_from_line(line)
            if doc is None:
                if why:
                    stats.skip(str(path), lineno, why)
                continue
            try:
                when = parse_time(str(doc["time"]))
            except ValueError:
                stats.skip(str(path), lineno, "record with an unreadable time")
                continue
            stats.records += 1
            yield LogRecord(when, doc, str(path), lineno)


def read_records(paths: Sequence[Path], stats: ReadStats | None = None, *, rotated: bool = True) -> Iterator[
    LogRecord
]:
    """Records of ``paths`` (and their rotated siblings) merged in time order, streaming.

    Each file is nearly in time order (several workers append at once), so files are merged with a heap rather
    than loaded: memory stays small for any log size.
    """
    stats = stats if stats is not None else ReadStats()
    files = expand_rotated(paths) if rotated else list(paths)
    stats.files = [str(f) for f in files]
    iterators = [_iter_file(f, stats) for f in files]
    yield from heapq.merge(*iterators, key=lambda r: r.time)


# -- filters ----------------------------------------------------------------------------------------------------


def parse_when(text: str, now: datetime) -> datetime:
    """An RFC 3339 time or date (``2026-11-30``, ``2026-11-30T02:00:00Z``), or a duration back from ``now``."""
    value = text.strip()
    if re.fullmatch(DURATION_PATTERN, value):
        return now - timedelta(seconds=parse_duration(value))
    return parse_time(value if "T" in value or " " in value else value + "T00:00:00Z")


@dataclass(frozen=True)
class RecordFilter:
    """Which records to keep. Empty tuples keep everything; ``node``/``driver``/``user`` accept globs."""

    since: datetime | None = None
    until: datetime | None = None
    nodes: tuple[str, ...] = ()
    drivers: tuple[str, ...] = ()
    rules: tuple[str, ...] = ()
    decisions: tuple[str, ...] = ()
    users: tuple[str, ...] = ()
    dry_run: bool | None = None
    endpoint: str | None = None

    def matches(self, record: LogRecord) -> bool:
        """True when ``record`` passes every filter."""
        d = record.data
        if self.since is not None and record.time < self.since:
            return False
        if self.until is not None and record.time >= self.until:
            return False
        if self.endpoint is not None and d.get("endpoint") != self.endpoint:
            return False
        if self.dry_run is not None and bool(d.get("dryRun")) != self.dry_run:
            return False
        if self.decisions and d.get("decision") not in self.decisions:
            return False
        if not _glob(self.nodes, d.get("node")) or not _glob(self.drivers, d.get("driver")):
            return False
        if not _glob(self.users, d.get("user")):
            return False
        return not (self.rules and not set(self.rules) & set(record.fired()))


def _glob(patterns: tuple[str, ...], value: Any) -> bool:
    if not patterns:
        return True
    if value is None:
        return False
    return any(fnmatch.fnmatchcase(str(value), p) for p in patterns)


def query(records: Iterable[LogRecord], flt: RecordFilter, limit: int | None = None) -> Iterator[LogRecord]:
    """The records that match ``flt``, at most ``limit``."""
    n = 0
    for r in records:
        if limit is not None and n >= limit:
            return
        if flt.matches(r):
            n += 1
            yield r


# -- summary ----------------------------------------------------------------------------------------------------


@dataclass
class AuditSummary:
    """Counts over a set of records. ``rules`` counts /mutate findings; /validate denials are listed apart."""

    records: int = 0
    first: datetime | None = None
    last: datetime | None = None
    by_endpoint: dict[str, Counter[str]] = field(default_factory=dict)
    rules: dict[str, Counter[str]] = field(default_factory=dict)
    validate_denials: Counter[str] = field(default_factory=Counter)
    nodes: dict[str, Counter[str]] = field(default_factory=dict)
    drivers: dict[str, Counter[str]] = field(default_factory=dict)
    users: Counter[str] = field(default_factory=Counter)
    dry_run: int = 0
    exempt: int = 0
    out_of_scope: int = 0
    frozen: int = 0
    corrections: Counter[str] = field(default_factory=Counter)
    state_problems: Counter[str] = field(default_factory=Counter)
    policies: dict[str, dict[str, Any]] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)

    def add(self, record: LogRecord) -> None:
        """Count one record."""
        d = record.data
        self.records += 1
        self.first = record.time if self.first is None else min(self.first, record.time)
        self.last = record.time if self.last is None else max(self.last, record.time)
        endpoint = str(d.get("endpoint"))
        decision = str(d.get("decision"))
        self.by_endpoint.setdefault(endpoint, Counter())[decision] += 1
        if d.get("dryRun"):
            self.dry_run += 1
        if d.get("exempt"):
            self.exempt += 1
        if d.get("inScope") is False:
            self.out_of_scope += 1
        if d.get("stateProblem"):
            self.state_problems[str(d["stateProblem"])] += 1
        policy_hash = str(d.get("policyHash") or "")
        if policy_hash:
            p = self.policies.setdefault(policy_hash, {"hash": policy_hash, "generations": set(), "records": 0,
                                                       "first": record.time, "last": record.time})
            p["generations"].add(d.get("policyGeneration"))
            p["records"] += 1
            p["first"] = min(p["first"], record.time)
            p["last"] = max(p["last"], record.time)
        if isinstance(d.get("latencyMs"), int | float) and len(self.latencies) < 1_000_000:
            self.latencies.append(float(d["latencyMs"]))
        if endpoint == "validate":
            if decision == "deny":
                for rule in record.fired():
                    self.validate_denials[rule] += 1
                self._count_target(record, decision)
            return
        for r in d.get("rules") or ():
            if isinstance(r, Mapping) and r.get("result") == "violation":
                self.rules.setdefault(str(r.get("rule")), Counter())[str(r.get("effective"))] += 1
        if d.get("frozen"):
            self.frozen += 1
        if d.get("correction"):
            self.corrections[str(d["correction"])] += 1
        self.users[str(d.get("user"))] += 1
        self._count_target(record, decision)

    def _count_target(self, record: LogRecord, decision: str) -> None:
        d = record.data
        if d.get("node"):
            self.nodes.setdefault(str(d["node"]), Counter())[decision] += 1
        if d.get("driver"):
            self.drivers.setdefault(str(d["driver"]), Counter())[decision] += 1

    @staticmethod
    def top(table: Mapping[str, Counter[str]], n: int = 10) -> list[dict[str, Any]]:
        """The ``n`` names with the most denied, clamped or warned records, then the most records."""
        def key(item: tuple[str, Counter[str]]) -> tuple[int, int, str]:
            name, c = item
            return (-(c["deny"] + c["clamp"] + c["warn"] + c["invalid"]), -sum(c.values()), name)

        return [{"name": k, "records": sum(c.values()), **dict(sorted(c.items()))}
                for k, c in sorted(table.items(), key=key)[:n]]

    def latency(self) -> dict[str, float]:
        """p50, p99 and max of ``latencyMs``."""
        if not self.latencies:
            return {}
        values = sorted(self.latencies)

        def pct(q: float) -> float:
            return values[min(len(values) - 1, int(q * (len(values) - 1) + 0.5))]

        return {"p50": pct(0.5), "p99": pct(0.99), "max": values[-1]}

    def to_json(self) -> dict[str, Any]:
        """The summary as a JSON object."""
        return {
            "records": self.records,
            "first": format_time(self.first) if self.first else None,
            "last": format_time(self.last) if self.last else None,
            "byEndpoint": {e: dict(sorted(c.items())) for e, c in sorted(self.by_endpoint.items())},
            "rules": {r: dict(sorted(c.items())) for r, c in sorted(self.rules.items())},
            "validateDenials": dict(sorted(self.validate_denials.items())),
            "topNodes": self.top(self.nodes),
            "topDrivers": self.top(self.drivers),
            "topUsers": [{"name": u, "records": n} for u, n in self.users.most_common(10)],
            "dryRun": self.dry_run,
            "exempt": self.exempt,
            "outOfScope": self.out_of_scope,
            "frozen": self.frozen,
            "corrections": dict(sorted(self.corrections.items())),
            "stateProblems": dict(sorted(self.state_problems.items())),
            "policies": [
                {"hash": p["hash"], "generations": sorted(g for g in p["generations"] if g is not None),
                 "records": p["records"], "first": format_time(p["first"]), "last": format_time(p["last"])}
                for p in sorted(self.policies.values(), key=lambda p: p["first"])
            ],
            "latencyMs": self.latency(),
        }


def summarize(records: Iterable[LogRecord]) -> AuditSummary:
    """Count ``records`` (already filtered)."""
    summary = AuditSummary()
    for r in records:
        summary.add(r)
    return summary
