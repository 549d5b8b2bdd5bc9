"""Reading the guard's own audit log (``webhook.audit``): filter, summarise, and draw a count's timeline.

The log is JSON lines, one record per (request, count change) and endpoint; see
:func:`webhook.audit.build_records` for the fields. It may be rotated (``audit.log``, ``audit.log.1``,
``audit.log.2.gz``, ``audit.log-20261130.gz``) and gzipped: :func:`expand_rotated` finds a file's rotated
siblings, and files are read oldest first (by the time of their first record). A line may carry a container
runtime prefix (``<time> stdout F {...}``, what ``kubectl logs`` files look like on a node) when the audit log
went to standard output; lines that are not records (other logs, broken lines) are counted and skipped.

Everything here is pure apart from reading files; :func:`render_timeline` imports matplotlib only when called
(the optional ``timeline`` extra) and raises :class:`MissingDependencyError` when it is not installed.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import heapq
import importlib
import json
import re
import zlib
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from webhook.durations import DURATION_PATTERN, parse_duration
from webhook.replay import open_stream
from webhook.state import format_time, parse_time

_ROTATED = re.compile(r"^(?:\.\d+|-\d{8}(?:\d{2})?|-\d{4}-\d{2}-\d{2}(?:T[\d:.-]+)?|\.\d{8})?(?:\.gz)?$")
MAX_PROBLEMS_KEPT = 20


class MissingDependencyError(RuntimeError):
    """An optional dependency (matplotlib for the timeline) is not installed; the message says how to get it."""


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


# -- timeline ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TimelinePoint:
    """One write of the entry: requested ``new`` and admitted ``final`` (None = unbounded), how it was decided.

    ``refused``: the write was not stored — denied (or invalid) at /mutate, or denied at /validate after its
    /mutate record (the same request uid); the stored count stays ``old``.
    """

    time: datetime
    old: int | None
    new: int | None
    final: int | None
    decision: str
    rules: tuple[str, ...]
    dry_run: bool
    frozen: bool
    correction: str | None
    endpoint: str
    uid: str | None = None
    refused: bool = False

    @property
    def stored_after(self) -> int | None:
        """The count stored after this write (``old`` when refused)."""
        return self.old if self.refused else self.final


INT32_MAX = 2147483647
"""kubelet cuts a driver's reported limit above int32 to this value: never a real count, always off the scale."""
OFF_SCALE_FACTOR = 10
"""A count above this many times the median of the entry's counts (and above the median + 50) is off the scale."""
MAX_OFF_SCALE_LABELS = 30


def _count_value(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def build_timeline(records: Iterable[LogRecord], node: str, driver: str) -> list[TimelinePoint]:
    """The writes of (``node``, ``driver``) in time order: every /mutate record and /validate denials.

    A /mutate record whose request was then denied at /validate (same uid) is marked ``refused``.
    """
    points = []
    denied_at_validate: set[str] = set()
    for r in records:
        d = r.data
        if d.get("node") != node or d.get("driver") != driver:
            continue
        endpoint = str(d.get("endpoint"))
        decision = str(d.get("decision"))
        if endpoint == "validate" and decision != "deny":
            continue
        uid = str(d["uid"]) if d.get("uid") else None
        if endpoint == "validate" and uid is not None:
            denied_at_validate.add(uid)
        points.append(TimelinePoint(
            time=r.time,
            old=_count_value(d.get("old")),
            new=_count_value(d.get("new")),
            final=_count_value(d.get("final")),
            decision=decision,
            rules=tuple(r.fired()),
            dry_run=bool(d.get("dryRun")),
            frozen=bool(d.get("frozen")),
            correction=str(d["correction"]) if d.get("correction") else None,
            endpoint=endpoint,
            uid=uid,
            refused=decision in ("deny", "invalid"),
        ))
    points = [dataclasses.replace(p, refused=True) if p.endpoint == "mutate" and p.uid in denied_at_validate
              else p for p in points]
    points.sort(key=lambda p: p.time)
    return points


def scale_top(values: Sequence[int]) -> int:
    """The largest count drawn to scale: the largest of ``values`` that is not off the scale.

    Off the scale: 2147483647 (kubelet's cut of anything above int32), and any count above
    ``OFF_SCALE_FACTOR`` times the median and above the median + 50 — one implausible write must not squash
    the real counts against the axis. At least 1.
    """
    if not values:
        return 1
    ordered = sorted(values)
    median = ordered[len(ordered) // 2]
    limit = max(OFF_SCALE_FACTOR * median, median + 50)
    return max((v for v in ordered if v <= limit and v != INT32_MAX), default=max(1, min(median, limit)))


@dataclass(frozen=True)
class TimelineScale:
    """Where counts go on the y axis: to scale up to ``top``, then one band for counts off the scale, then one for
    unbounded (no count: +infinity to the scheduler)."""

    top: int
    off_scale: bool
    unbounded: bool

    @property
    def off_scale_y(self) -> float:
        """The y of every count above ``top``: a band just above the scaled part."""
        return self.top * 1.12 + 1

    @property
    def unbounded_y(self) -> float:
        """The y of unbounded, above the off-scale band when there is one."""
        return (self.off_scale_y if self.off_scale else self.top) + self.top * 0.12 + 1

    @property
    def y_max(self) -> float:
        """The top of the axis."""
        highest = self.unbounded_y if self.unbounded else self.off_scale_y if self.off_scale else self.top
        return highest * 1.08 + 0.5

    def y(self, value: int | None) -> float:
        """The y of ``value``."""
        if value is None:
            return self.unbounded_y
        return self.off_scale_y if value > self.top else float(value)


def timeline_scale(points: Sequence[TimelinePoint]) -> TimelineScale:
    """The y scale of ``points`` (see :func:`scale_top`)."""
    finite = [v for p in points for v in (p.old, p.new, p.final) if v is not None]
    top = scale_top(finite)
    return TimelineScale(top=top, off_scale=any(v > top for v in finite),
                         unbounded=any(v is None for p in points for v in (p.old, p.new, p.final)))


def off_scale_counts(points: Sequence[TimelinePoint]) -> list[int]:
    """The distinct counts of ``points`` drawn off the scale (at the edge, labelled), smallest first."""
    top = timeline_scale(points).top
    return sorted({v for p in points for v in (p.old, p.new, p.final) if v is not None and v > top})


class UnsupportedFormatError(ValueError):
    """The picture's suffix names no format matplotlib writes (the message lists those it does)."""


def _pyplot() -> Any:
    try:
        matplotlib = importlib.import_module("matplotlib")
    except ImportError:
        raise MissingDependencyError(
            "the timeline needs matplotlib, which is not installed: pip install 'csinode-guard[timeline]'"
        ) from None
    matplotlib.use("Agg")
    return importlib.import_module("matplotlib.pyplot")


STORED_COLOR = "#1f5fa8"
"""The stored-count line's colour (nothing else in the picture uses it)."""
DENY_COLOR = "#c62828"
"""The colour of denial markers."""


def _stored_segments(points: Sequence[TimelinePoint], y: Any) -> tuple[
    list[tuple[list[datetime], list[float]]], list[tuple[datetime, float, datetime, float]]
]:
    """The stored count as step segments, and the gaps between them: where a write's ``old`` is not the count
    stored after the previous record, the change was made by writes the log does not have (not judged, or in a
    rotated file not given), at an unknown time in between. A refused write never moves the line."""
    segments: list[tuple[list[datetime], list[float]]] = []
    gaps: list[tuple[datetime, float, datetime, float]] = []
    current: tuple[datetime, int | None] | None = None
    for p in points:
        if p.dry_run or p.endpoint != "mutate":
            continue
        if current is None or p.old != current[1]:
            if current is not None:
                gaps.append((current[0], y(current[1]), p.time, y(p.old)))
            segments.append(([p.time], [y(p.old)]))
        ts, ys = segments[-1]
        ts.append(p.time)
        ys.append(y(p.stored_after))
        current = (p.time, p.stored_after)
    if segments and points:
        segments[-1][0].append(points[-1].time)
        segments[-1][1].append(segments[-1][1][-1])
    return segments, gaps


def render_timeline(points: Sequence[TimelinePoint], node: str, driver: str, output: Path) -> None:
    """Draw the count over time (PNG, or any format matplotlib knows by ``output``'s suffix).

    The stored count is a step line that moves only at writes that were stored (never at a denial); where the
    log lacks the writes that changed it, a dashed grey line joins the last known count to the next. Warnings are
    marked with a diamond, clamps at the requested value with a line down to the admitted one, denials with a
    cross at the requested value, freezes (version rollback) with a vertical line, ResourceExhausted or
    justified corrections with a triangle. The y axis is scaled to the plausible counts (:func:`scale_top`):
    counts off the scale (2147483647, or far above the others) are drawn in a band at the top edge, each labelled
    with its value; unbounded is drawn above that. The legend sits outside the plot.
    Raises :class:`MissingDependencyError` without matplotlib, :class:`UnsupportedFormatError` (naming the
    formats there are) for a suffix matplotlib cannot write; nothing is written then.
    """
    plt = _pyplot()
    scale = timeline_scale(points)
    y = scale.y

    fig, ax = plt.subplots(figsize=(12.5, 4.8), dpi=100)
    formats = fig.canvas.get_supported_filetypes()
    suffix = output.suffix[1:].lower()
    if suffix and suffix not in formats:
        plt.close(fig)
        raise UnsupportedFormatError(
            f"{output}: {output.suffix!r} is not a picture format matplotlib writes; use one of "
            + ", ".join(f".{name}" for name in sorted(formats))
        )
    segments, gaps = _stored_segments(points, y)
    for i, (ts, ys) in enumerate(segments):
        ax.step(ts, ys, where="post", color=STORED_COLOR, linewidth=2, label="stored count" if i == 0 else None)
    for i, (t0, y0, t1, y1) in enumerate(gaps):
        ax.plot([t0, t1], [y0, y1], color="#9e9e9e", linestyle="--", linewidth=1.2,
                label="changed by writes not in this log" if i == 0 else None)
    marks: dict[str, tuple[list[Any], list[float]]] = {
        "allowed": ([], []), "warn": ([], []), "clamp": ([], []), "deny": ([], []), "dry run": ([], []),
        "correction": ([], []),
    }
    for p in points:
        if p.dry_run:
            marks["dry run"][0].append(p.time)
            marks["dry run"][1].append(y(p.new))
        elif p.decision == "deny":
            marks["deny"][0].append(p.time)
            marks["deny"][1].append(y(p.new))
        elif p.decision == "clamp":
            marks["clamp"][0].append(p.time)
            marks["clamp"][1].append(y(p.new))
            ax.vlines(p.time, min(y(p.new), y(p.final)), max(y(p.new), y(p.final)), colors="#e08a00",
                      linestyles="dotted", linewidth=1)
        else:
            kind = "warn" if p.decision == "warn" else "allowed"
            marks[kind][0].append(p.time)
            marks[kind][1].append(y(p.new))
        if p.correction:
            marks["correction"][0].append(p.time)
            marks["correction"][1].append(y(p.final))
    styles = {
        "allowed": {"marker": "o", "color": "#4a8fd4", "s": 18},
        "warn": {"marker": "D", "color": "#f2b600", "s": 36},
        "clamp": {"marker": "v", "color": "#e08a00", "s": 60},
        "deny": {"marker": "x", "color": DENY_COLOR, "s": 60},
        "dry run": {"marker": "o", "facecolors": "none", "edgecolors": "#777777", "s": 40},
        "correction": {"marker": "^", "color": "#2e7d32", "s": 70},
    }
    for name, (ts, ys) in marks.items():
        if ts:
            ax.scatter(ts, ys, label=f"{name} ({len(ts)})", zorder=3, **styles[name])
    freezes = [p.time for p in points if p.frozen]
    for i, t in enumerate(freezes):
        ax.axvline(t, color="#6a1b9a", linestyle="--", linewidth=1.2,
                   label="freeze (driver version rollback)" if i == 0 else None)
    if scale.off_scale:
        ax.axhline(scale.off_scale_y, color="#bbbbbb", linestyle=(0, (1, 3)), linewidth=1)
        ax.text(points[0].time, scale.off_scale_y, f" off the scale (above {scale.top}): ↑ value", va="bottom",
                fontsize=8, color="#555555")
        labelled: set[tuple[datetime, int]] = set()
        for p in points:
            for v in (p.new, p.final):
                if v is not None and v > scale.top and (p.time, v) not in labelled:
                    if len(labelled) < MAX_OFF_SCALE_LABELS:
                        ax.annotate(f"↑ {v}", (p.time, scale.off_scale_y), xytext=(4, -11),
                                    textcoords="offset points", fontsize=7, color="#333333")
                    labelled.add((p.time, v))
    if scale.unbounded:
        ax.axhline(scale.unbounded_y, color="#999999", linestyle=":", linewidth=1)
        ax.text(points[0].time, scale.unbounded_y, " unbounded", va="bottom", fontsize=8, color="#555555")
    ax.set_ylim(bottom=0, top=scale.y_max)
    ax.set_title(f"{node} / {driver}: allocatable count")
    ax.set_xlabel("time (UTC)")
    ax.set_ylabel("count")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, borderaxespad=0)
    dates = importlib.import_module("matplotlib.dates")
    # Ticks where the span needs them (seconds for a minute-long incident, days for a month) and labels that
    # name only what changes from one tick to the next, the date once as the axis offset; ticks seconds apart
    # keep their hour and minute ("02:00:10", not a bare "10" that the next minute repeats).
    locator = dates.AutoDateLocator()
    ax.xaxis.set_major_locator(locator)
    ax.xaxis.set_major_formatter(dates.ConciseDateFormatter(
        locator, formats=["%Y", "%b", "%d", "%H:%M", "%H:%M", "%H:%M:%S"]))
    fig.tight_layout()
    fig.savefig(output)
    plt.close(fig)
