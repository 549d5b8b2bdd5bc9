"""``csinode-guard audit``: review the guard's own audit log (summary, query, timeline picture)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click

from webhook.simulation.audit_queries import (
    AuditSummary,
    LogRecord,
    ReadStats,
    RecordFilter,
    parse_when,
    query,
    read_records,
    summarize,
)
from webhook.simulation.count_timeline import (
    MissingDependencyError,
    UnsupportedFormatError,
    build_timeline,
    off_scale_counts,
    render_timeline,
)

_DECISIONS = ["allow", "warn", "clamp", "deny", "invalid", "skip", "error"]


@click.group("audit")
def audit() -> None:
    """Review the guard's audit log (the --audit-log of serve): rotated and gzipped files are read too."""


def _when(text: str | None, param: str) -> datetime | None:
    if not text:
        return None
    try:
        return parse_when(text, datetime.now(UTC))
    except ValueError:
        raise click.BadParameter(f"not a time or duration: {text!r} (use 2026-11-30T02:00:00Z, 2026-11-30 "
                                 "or 2h for two hours ago)", param_hint=param) from None


def _filters(func: Callable[..., Any]) -> Callable[..., Any]:
    options = [
        click.option("--since", help="Records at or after this time: RFC 3339, a date, or a duration ago (2h)."),
        click.option("--until", help="Records before this time (same forms as --since)."),
        click.option("--node", "nodes", multiple=True, help="Node name or glob (repeatable)."),
        click.option("--driver", "drivers", multiple=True, help="Driver name or glob (repeatable)."),
        click.option("--rule", "rules", multiple=True, help="Records where this rule found a violation."),
        click.option("--decision", "decisions", multiple=True, type=click.Choice(_DECISIONS)),
        click.option("--user", "users", multiple=True, help="Writer (userInfo.username) or glob."),
        click.option("--dry-run/--no-dry-run", "dry_run", default=None,
                     help="Only the apiserver's dry-run requests, or none of them."),
        click.option("--endpoint", type=click.Choice(["mutate", "validate"]),
                     help="Only records of this endpoint (each write has a mutate and a validate record)."),
        click.option("--no-rotated", is_flag=True, help="Read only the files given, not their rotated siblings."),
        click.argument("logs", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False,
                                                                           path_type=Path)),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _build_filter(kwargs: dict[str, Any]) -> RecordFilter:
    return RecordFilter(
        since=_when(kwargs.get("since"), "--since"),
        until=_when(kwargs.get("until"), "--until"),
        nodes=tuple(kwargs.get("nodes") or ()),
        drivers=tuple(kwargs.get("drivers") or ()),
        rules=tuple(kwargs.get("rules") or ()),
        decisions=tuple(kwargs.get("decisions") or ()),
        users=tuple(kwargs.get("users") or ()),
        dry_run=kwargs.get("dry_run"),
        endpoint=kwargs.get("endpoint"),
    )


class UsageProblem(click.ClickException):
    """Unusable input or output (a log with no record in it, a picture format there is none of): exit code 2."""

    exit_code = 2


def _report_skipped(stats: ReadStats) -> None:
    if stats.skipped:
        click.echo(f"audit: {stats.skipped} line(s) skipped (not csinode-guard audit records)", err=True)
        for p in stats.problems[:5]:
            click.echo(f"  {p}", err=True)


def _exit_when_nothing_was_readable(stats: ReadStats) -> None:
    """Exit 2 when the files held no record at all and some lines were not records (as ``replay`` does): the
    wrong file, not an empty result."""
    if stats.skipped and not stats.records:
        click.echo(f"audit: no csinode-guard audit record could be read, and {stats.skipped} line(s) were not "
                   "records: is this the guard's --audit-log (JSON lines)?", err=True)
        sys.exit(2)


def _counts(c: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in c.items() if k not in ("name", "records")) or "-"


def _summary_text(s: AuditSummary, stats: ReadStats) -> list[str]:
    body = s.to_json()
    lines = [f"{s.records} records from {body['first'] or '-'} to {body['last'] or '-'} "
             f"({len(stats.files)} file(s), {stats.skipped} other lines)"]
    for endpoint, counts in body["byEndpoint"].items():
        lines.append(f"  {endpoint:9} {_counts(counts)}")
    lines.append(f"  apiserver dry runs {s.dry_run}, exempt (break glass) {s.exempt}, outside the enforcement scope "
                 f"{s.out_of_scope}")
    if body["rules"]:
        lines.append("violations (/mutate, by effective enforcement):")
        for rule, counts in body["rules"].items():
            lines.append(f"  {rule:16} {sum(counts.values()):6}  ({_counts(counts)})")
    if body["validateDenials"]:
        lines.append("/validate denials: " + _counts(body["validateDenials"]))
    lines.append(f"freezes {s.frozen}; corrections {_counts(body['corrections'])}; state not used "
                 f"{_counts(body['stateProblems'])} (missing: the entry's first judged write)")
    for title, rows in (("top nodes", body["topNodes"]), ("top drivers", body["topDrivers"])):
        if rows:
            lines.append(f"{title}:")
            lines += [f"  {r['name']:40} {r['records']:6}  ({_counts(r)})" for r in rows]
    if body["topUsers"]:
        lines.append("top writers: " + ", ".join(f"{u['name']} {u['records']}" for u in body["topUsers"]))
    if body["policies"]:
        lines.append("policies:")
        for p in body["policies"]:
            gens = ",".join(str(g) for g in p["generations"]) or "-"
            lines.append(f"  {p['hash']} generation {gens}: {p['records']} records, {p['first']} .. {p['last']}")
    if body["latencyMs"]:
        lat = body["latencyMs"]
        lines.append(f"latency ms: p50 {lat['p50']}, p99 {lat['p99']}, max {lat['max']}")
    return lines


@audit.command("summary")
@_filters
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
def summary_command(fmt: str, logs: tuple[Path, ...], no_rotated: bool, **kwargs: Any) -> None:
    """Counts by endpoint and decision, violations by rule, top nodes, drivers and writers, policy generations.

    Exit code 2 when the files held no audit record at all but other lines (the wrong file)."""
    stats = ReadStats()
    flt = _build_filter(kwargs)
    result = summarize(query(read_records(list(logs), stats, rotated=not no_rotated), flt))
    if fmt == "json":
        body = result.to_json()
        body["files"] = stats.files
        body["skippedLines"] = stats.skipped
        click.echo(json.dumps(body, indent=2))
    else:
        click.echo("\n".join(_summary_text(result, stats)))
    _report_skipped(stats)
    _exit_when_nothing_was_readable(stats)


def _row(r: LogRecord) -> str:
    d = r.data
    change = f"{d.get('old', '-')} -> {d.get('new', '-')}" if d.get("driver") else "-"
    rules = ",".join(r.fired()) or "-"
    dry = " (dry run)" if d.get("dryRun") else ""
    return (f"{d.get('time', ''):24} {d.get('endpoint', ''):8} {d.get('node') or '-':34} {d.get('driver') or '-':24} "
            f"{change:18} {d.get('final', '-')!s:9} {d.get('decision', ''):8} {rules}  {d.get('user') or '-'}{dry}")


@audit.command("query")
@_filters
@click.option("--format", "fmt", type=click.Choice(["table", "json"]), default="table", show_default=True,
              help="table: one line per record; json: the matching records as JSON lines.")
@click.option("--limit", type=click.IntRange(min=1), help="Stop after this many records.")
def query_command(fmt: str, limit: int | None, logs: tuple[Path, ...], no_rotated: bool, **kwargs: Any) -> None:
    """Print the records that match the filters, oldest first. Exit code 1 when none match, 2 when the files
    held no audit record at all but other lines (the wrong file)."""
    stats = ReadStats()
    flt = _build_filter(kwargs)
    if fmt == "table":
        click.echo(f"{'TIME':24} {'ENDPOINT':8} {'NODE':34} {'DRIVER':24} {'OLD -> NEW':18} {'FINAL':9} "
                   f"{'DECISION':8} RULES  WRITER")
    n = 0
    for r in query(read_records(list(logs), stats, rotated=not no_rotated), flt, limit):
        n += 1
        click.echo(json.dumps(r.data, separators=(",", ":")) if fmt == "json" else _row(r))
    _report_skipped(stats)
    _exit_when_nothing_was_readable(stats)
    if n == 0:
        click.echo("audit: no matching records", err=True)
        sys.exit(1)


@audit.command("timeline")
@click.argument("logs", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--node", required=True, help="Node (CSINode) name.")
@click.option("--driver", required=True, help="CSI driver name.")
@click.option("--output", "-o", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Picture to write (timeline.png; the suffix picks the format).")
@click.option("--since", help="Start at this time: RFC 3339, a date, or a duration ago (2h).")
@click.option("--until", help="End before this time.")
@click.option("--no-rotated", is_flag=True, help="Read only the files given, not their rotated siblings.")
def timeline_command(logs: tuple[Path, ...], node: str, driver: str, output: Path, since: str | None,
                     until: str | None, no_rotated: bool) -> None:
    """Draw one entry's count over time with clamps, denials, corrections and freezes marked (incident review).

    The y axis fits the plausible counts: 2147483647 and counts far above the others are drawn at the top edge
    and labelled with their value (the output line lists them).

    Needs matplotlib: pip install 'csinode-guard[timeline]'.
    """
    flt = RecordFilter(since=_when(since, "--since"), until=_when(until, "--until"))
    stats = ReadStats()
    points = build_timeline(query(read_records(list(logs), stats, rotated=not no_rotated), flt), node, driver)
    _report_skipped(stats)
    if not points:
        raise click.ClickException(f"no records for node {node!r} and driver {driver!r}")
    try:
        render_timeline(points, node, driver, output)
    except MissingDependencyError as exc:
        raise click.ClickException(str(exc)) from None
    except UnsupportedFormatError as exc:
        raise UsageProblem(str(exc)) from None
    counts: dict[str, int] = {}
    for p in points:
        counts[p.decision] = counts.get(p.decision, 0) + 1
    off_scale = off_scale_counts(points)
    edge = f"; off the scale, marked at the top edge: {', '.join(map(str, off_scale))}" if off_scale else ""
    click.echo(f"{output}: {len(points)} writes ({', '.join(f'{k} {v}' for k, v in sorted(counts.items()))}), "
               f"{sum(1 for p in points if p.frozen)} freeze(s){edge}")
