"""A count's timeline from the guard's audit records: one (node, driver)'s writes in order, and its picture.

:func:`build_timeline` turns the records :mod:`webhook.simulation.audit_queries` reads into :class:`TimelinePoint`
values;
:func:`timeline_scale` places counts on the y axis (implausible counts off the scale); :func:`render_timeline`
draws the picture (``csinode-guard audit timeline``). Pure apart from writing the picture: matplotlib is
imported only when drawing (the optional ``timeline`` extra), and :class:`MissingDependencyError` says how to
get it when it is not installed.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from webhook.simulation.audit_queries import LogRecord


class MissingDependencyError(RuntimeError):
    """An optional dependency (matplotlib for the timeline) is not installed; the message says how to get it."""


@dataclass(frozen=True)
class TimelinePoint:
    """One write of the entry: requested ``new`` and admitted ``final`` (None = unbounded), how it was decided.

    ``refused``: the write was not stored — denied (or invalid) at /mutate, or denied at /validate after its
    /mutate record (the same request uid); the stored count stays ``old``. ``first_registration``: the driver
    registered with no count before (audit record ``change: registration``): ``old`` is no count at all, not
    unbounded, and the stored line starts here.
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
    first_registration: bool = False
    ceiling: int | None = None
    """The count-ceiling rule's ceiling for this write, as its record says (``within``/``above the ceiling N``);
    None when the record names none."""
    clamped_by: tuple[str, ...] = ()
    """The rules whose clamp set this write's count (effective enforcement ``clamp``)."""

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


CEILING_RULE = "count-ceiling"
_CEILING = re.compile(r"\bthe ceiling (\d+)\b")


def record_ceiling(rules: Any) -> int | None:
    """The ceiling a record's count-ceiling outcome names (``within the ceiling 27 (...)``, ``above the ceiling
    27``), or None."""
    for r in rules or ():
        if isinstance(r, Mapping) and r.get("rule") == CEILING_RULE:
            found = _CEILING.search(str(r.get("message") or ""))
            if found:
                return int(found.group(1))
    return None


def clamping_rules(rules: Any) -> tuple[str, ...]:
    """The rules of a record whose violation was enforced as a clamp, in order, each once."""
    out: list[str] = []
    for r in rules or ():
        if isinstance(r, Mapping) and r.get("result") == "violation" and r.get("effective") == "clamp" \
                and r.get("rule") not in out:
            out.append(str(r.get("rule")))
    return tuple(out)


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
            first_registration=d.get("change") == "registration",
            ceiling=record_ceiling(d.get("rules")),
            clamped_by=clamping_rules(d.get("rules")) or (tuple(r.fired()) if decision == "clamp" else ()),
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
                         unbounded=any(v is None for p in points for v in _counts_drawn(p)))


def _counts_drawn(p: TimelinePoint) -> tuple[int | None, ...]:
    """The counts a point puts on the y axis: a first registration has no ``old`` to draw."""
    return (p.new, p.final) if p.first_registration else (p.old, p.new, p.final)


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
        if p.first_registration:  # the line starts at the registered count: there was no count before it
            if p.refused:
                continue
            segments.append(([p.time], [y(p.stored_after)]))
            current = (p.time, p.stored_after)
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


MARK_STYLES: dict[str, dict[str, Any]] = {
    "allowed": {"marker": "o", "color": "#4a8fd4", "s": 18},
    "warn": {"marker": "D", "color": "#f2b600", "s": 36},
    "clamp": {"marker": "v", "color": "#e08a00", "s": 60},
    "deny": {"marker": "x", "color": DENY_COLOR, "s": 60},
    "dry run": {"marker": "o", "facecolors": "none", "edgecolors": "#777777", "s": 40},
    "correction": {"marker": "^", "color": "#2e7d32", "s": 70},
}
BURST_SHARE = 0.02
"""Writes within this share of the picture's time span from the first one are one opening burst..."""
BURST_MIN_WRITES = 3
"""...when there are at least this many of them (and later writes too): they get a zoomed inset."""


def opening_burst(points: Sequence[TimelinePoint]) -> list[TimelinePoint]:
    """The writes that would pile up at the left edge: at least :data:`BURST_MIN_WRITES` within
    :data:`BURST_SHARE` of the whole span after the first (kubelet's start: CREATE, registrations and the first
    updates within a second), with later writes after them. Empty when there is no such burst."""
    if len(points) <= BURST_MIN_WRITES:
        return []
    first, last = points[0].time, points[-1].time
    span = (last - first).total_seconds()
    if span <= 0:
        return []
    burst = [p for p in points if (p.time - first).total_seconds() <= span * BURST_SHARE]
    return burst if BURST_MIN_WRITES <= len(burst) < len(points) else []


def _draw_writes(ax: Any, points: Sequence[TimelinePoint], y: Any, x: Any, *, legend: bool) -> None:
    """Markers for every write of ``points`` at (``x(time)``, ``y(count)``): see :func:`render_timeline`."""
    marks: dict[str, tuple[list[Any], list[float]]] = {name: ([], []) for name in MARK_STYLES}
    labels = [0]  # clamps labelled with their rules so far (the main plot only: the inset is small)
    for p in points:
        if p.dry_run:
            kind = "dry run"
        elif p.decision in ("deny", "clamp"):
            kind = p.decision
        else:
            kind = "warn" if p.decision == "warn" else "allowed"
        marks[kind][0].append(x(p.time))
        marks[kind][1].append(y(p.new))
        if kind == "clamp":
            ax.vlines(x(p.time), min(y(p.new), y(p.final)), max(y(p.new), y(p.final)), colors="#e08a00",
                      linestyles="dotted", linewidth=1)
            if legend and labels[0] < MAX_CLAMP_LABELS and p.clamped_by:
                labels[0] += 1
                ax.annotate(", ".join(p.clamped_by), (x(p.time), y(p.new)), xytext=(5, 4),
                            textcoords="offset points", fontsize=7, color="#8a4b00")
        if p.correction:
            marks["correction"][0].append(x(p.time))
            marks["correction"][1].append(y(p.final))
    for name, (ts, ys) in marks.items():
        if ts:
            ax.scatter(ts, ys, label=f"{name} ({len(ts)})" if legend else None, zorder=3, **MARK_STYLES[name])


MAX_CLAMP_LABELS = 40
"""Clamps labelled with the rules that clamped them; the rest are counted in the command's output line."""
CEILING_COLOR = "#c62828"


def _draw_ceiling(ax: Any, points: Sequence[TimelinePoint], y: Any) -> None:
    """The count-ceiling's ceiling as a dashed step line over the writes whose records name it."""
    known = [(p.time, p.ceiling) for p in points if p.ceiling is not None]
    if not known:
        return
    ts = [t for t, _ in known] + [points[-1].time]
    ys = [y(c) for _, c in known] + [y(known[-1][1])]
    ax.step(ts, ys, where="post", color=CEILING_COLOR, linestyle="--", linewidth=1.2,
            label=f"ceiling ({CEILING_RULE})")
    ax.annotate(f"ceiling {known[-1][1]}", (ts[-1], ys[-1]), xytext=(-4, 3), textcoords="offset points",
                fontsize=7, color=CEILING_COLOR, ha="right")


def clamps_by_rule(points: Sequence[TimelinePoint]) -> dict[str, int]:
    """How many of the writes each rule clamped (a write clamped by two rules counts for both)."""
    counts: dict[str, int] = {}
    for p in points:
        if p.decision == "clamp":
            for rule in p.clamped_by:
                counts[rule] = counts.get(rule, 0) + 1
    return dict(sorted(counts.items()))


def _draw_burst(ax: Any, burst: Sequence[TimelinePoint], scale: TimelineScale) -> None:
    """An inset over the main plot with the opening burst's writes spread over its own axis (seconds after
    the first write), drawn the same way; the main plot keeps the true time axis."""
    start = burst[0].time

    def seconds(t: datetime) -> float:
        return (t - start).total_seconds()

    segments, _gaps = _stored_segments(burst, scale.y)
    drawn = [v for _ts, ys in segments for v in ys] + [scale.y(p.new) for p in burst]
    # Over the half of the plot the counts leave free (they mostly sit near the top of their scale).
    low = sum(drawn) / len(drawn) > scale.y_max / 2
    inset = ax.inset_axes([0.30, 0.14 if low else 0.52, 0.36, 0.36])
    for ts, ys in segments:
        inset.step([seconds(t) for t in ts], ys, where="post", color=STORED_COLOR, linewidth=2)
    _draw_writes(inset, burst, scale.y, seconds, legend=False)
    duration = seconds(burst[-1].time)
    inset.set_xlim(-0.05 * duration - 0.01, duration * 1.05 + 0.01)
    inset.set_ylim(min(drawn) - 1, max(drawn) + 1)
    inset.set_title(f"the first {len(burst)} writes, within {duration:.3g} s of {start:%H:%M:%S}", fontsize=8)
    inset.set_xlabel("seconds after the first write", fontsize=7)
    inset.tick_params(labelsize=7)
    inset.grid(True, alpha=0.3)


def render_timeline(points: Sequence[TimelinePoint], node: str, driver: str, output: Path) -> None:
    """Draw the count over time (PNG, or any format matplotlib knows by ``output``'s suffix).

    The stored count is a step line that moves only at writes that were stored (never at a denial); where the
    log lacks the writes that changed it, a dashed grey line joins the last known count to the next. A driver's
    first registration starts the line at its count (there was no count before). Warnings are marked with a
    diamond, clamps at the requested value with a line down to the admitted one, denials with a cross at the
    requested value, each clamp labelled with the rules that clamped it (the first :data:`MAX_CLAMP_LABELS`), the
    count-ceiling's ceiling as a dashed red step line where the records name it, freezes (version rollback) with a
    vertical line, ResourceExhausted or justified corrections
    with a triangle. An opening burst (:func:`opening_burst`: kubelet's first writes within a second) is drawn
    again in an inset, spread over its own seconds axis, instead of piling up at the left edge. The y axis is
    scaled to the plausible counts (:func:`scale_top`): counts off the scale (2147483647, or far above the others)
    are drawn in a band at the top edge, each labelled with its value; unbounded is drawn above that. The legend
    sits outside the plot.
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
    _draw_ceiling(ax, points, y)
    _draw_writes(ax, points, y, lambda t: t, legend=True)
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
    burst = opening_burst(points)
    if burst:
        _draw_burst(ax, burst, scale)
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
