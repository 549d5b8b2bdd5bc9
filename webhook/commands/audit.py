"""``csinode-guard audit``: review the guard's own audit log (summary, query, timeline picture)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click

from webhook.admission.decision import Decision
from webhook.admission.standing import AUDIT_ENDPOINT
from webhook.commands.options import (
    EXIT_FINDINGS,
    EXIT_USAGE,
    deprecated_alias,
    echo_document,
    output_option,
    take_deprecated,
)
from webhook.kube.repair import RepairResult
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
    clamps_by_rule,
    off_scale_counts,
    render_timeline,
)

ENDPOINTS = ["mutate", "validate", AUDIT_ENDPOINT]
"""Every ``endpoint`` a record has: admission's two, and the background audit's."""
DECISIONS = list(dict.fromkeys([*(d.value for d in Decision), "error", "standing-violation",
                                *(r.value for r in RepairResult)]))
"""Every ``decision`` a record has: admission's, and the audit's (a standing violation, a repair's result)."""


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
        click.option("--decision", "decisions", multiple=True, type=click.Choice(DECISIONS),
                     help="Records with this decision (repeatable): admission's allow ... error, the audit's "
                     "standing-violation and a repair's repaired, conflict, refused, dry-run."),
        click.option("--user", "users", multiple=True, help="Writer (userInfo.username) or glob."),
        click.option("--dry-run/--no-dry-run", "dry_run", default=None,
                     help="Only the apiserver's dry-run requests, or none of them."),
        click.option("--endpoint", type=click.Choice(ENDPOINTS),
                     help="Only records of this endpoint (each write has a mutate and a validate record; audit: "
                     "the background audit's findings and repairs)."),
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
        sys.exit(EXIT_USAGE)


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


def _legacy_format(kwargs: dict[str, Any], output: str) -> str:
    """``-o`` as given, or the deprecated ``--format`` (``text`` -> ``table``) when that was given instead."""
    legacy = take_deprecated(kwargs, "output")
    if legacy is None:
        return output
    return "table" if legacy == "text" else str(legacy)


@audit.command("summary")
@_filters
@output_option(["table", "json", "yaml"], aliases={"text": "table"},
               help="table: readable summary; json or yaml: every count.")
@deprecated_alias("--format", "-o/--output", dest="output", type=click.Choice(["text", "table", "json"]))
def summary_command(output: str, logs: tuple[Path, ...], no_rotated: bool, **kwargs: Any) -> None:
    """Counts by endpoint and decision, violations by rule, top nodes, drivers and writers, policy generations.

    Exit code 2 when the files held no audit record at all but other lines (the wrong file)."""
    output = _legacy_format(kwargs, output)
    stats = ReadStats()
    flt = _build_filter(kwargs)
    result = summarize(query(read_records(list(logs), stats, rotated=not no_rotated), flt))
    if output in ("json", "yaml"):
        body = result.to_json()
        body["files"] = stats.files
        body["skippedLines"] = stats.skipped
        echo_document(body, output)
    else:
        click.echo("\n".join(_summary_text(result, stats)))
    _report_skipped(stats)
    _exit_when_nothing_was_readable(stats)


QUERY_COLUMNS = (("TIME", 24), ("ENDPOINT", 8), ("NODE", 34), ("DRIVER", 24), ("CHANGE", 22), ("FINAL", 10),
                 ("DECISION", 18), ("DRY-RUN", 7), ("WRITER", 28))
"""``audit query``'s table: (header, width). A longer value is cut in the middle (``ip-10-0…internal``) so that
every column stays where the header is; ``-o wide`` uses :data:`WIDE_COLUMNS`, json/yaml cut nothing. RULES is the
last column."""
WIDE_COLUMNS = (("TIME", 27), ("ENDPOINT", 8), ("NODE", 63), ("DRIVER", 48), ("CHANGE", 30), ("FINAL", 10),
                ("DECISION", 18), ("DRY-RUN", 7), ("WRITER", 63), ("POLICY", 16))


def show_count(value: Any) -> str:
    """A count of a record as the table shows it: ``-`` for none (null), else its text (``unbounded`` too)."""
    return "-" if value is None or value == "" else str(value)


def show_change(d: Mapping[str, Any]) -> str:
    """``old -> new``; ``new 25`` for a driver's first registration (no count before), ``-`` without a driver;
    a re-registration is marked (``25 -> 39 (re-registration)``)."""
    if not d.get("driver"):
        return "-"
    old, new = d.get("old"), d.get("new")
    if old is None and d.get("endpoint") != AUDIT_ENDPOINT:
        return f"new {show_count(new)}"
    text = f"{show_count(old)} -> {show_count(new)}"
    return f"{text} (re-registration)" if d.get("registration") else text


def fit(text: str, width: int) -> str:
    """``text`` padded to ``width``, or cut in the middle with an ellipsis when longer (both ends stay: node
    names differ at either)."""
    if len(text) <= width:
        return text.ljust(width)
    head = (width - 1) // 2
    return text[:head] + "\u2026" + text[len(text) - (width - 1 - head):]


def query_row(r: LogRecord, *, wide: bool = False) -> str:
    """One record as a line of the table (:data:`QUERY_COLUMNS`, or :data:`WIDE_COLUMNS` with ``wide``)."""
    d = r.data
    cells = [str(d.get("time") or "-"), str(d.get("endpoint") or "-"), str(d.get("node") or "-"),
             str(d.get("driver") or "-"), show_change(d), show_count(d.get("final")),
             str(d.get("decision") or "-"), "yes" if d.get("dryRun") else "no", str(d.get("user") or "-")]
    columns = WIDE_COLUMNS if wide else QUERY_COLUMNS
    if wide:
        cells.append(str(d.get("policyHash") or "-"))
    rules = ",".join(r.fired()) or "-"
    return " ".join(fit(c, w) for c, (_, w) in zip(cells, columns, strict=True)) + " " + rules


def query_header(*, wide: bool = False) -> str:
    """The table's header line."""
    columns = WIDE_COLUMNS if wide else QUERY_COLUMNS
    return " ".join(name.ljust(w) for name, w in columns) + " RULES"


@audit.command("query")
@_filters
@output_option(["table", "wide", "json", "yaml"],
               help="table: one line per record, fixed columns; wide: wider columns and the policy hash; json: "
               "the matching records as JSON lines, whole; yaml: as YAML documents.")
@deprecated_alias("--format", "-o/--output", dest="output", type=click.Choice(["table", "json"]))
@click.option("--limit", type=click.IntRange(min=1), help="Stop after this many records.")
def query_command(output: str, limit: int | None, logs: tuple[Path, ...], no_rotated: bool, **kwargs: Any) -> None:
    """Print the records that match the filters, oldest first. Every record kind can be selected: --endpoint
    audit and --decision standing-violation (the background audit) as well as admission's. A registration shows
    as new 25, a dry run (the apiserver's dryRun, --reconcile-dry-run) as DRY-RUN yes.

    Exit code 1 when none match, 2 when the files held no audit record at all but other lines (the wrong
    file)."""
    output = _legacy_format(kwargs, output)
    stats = ReadStats()
    flt = _build_filter(kwargs)
    if output in ("table", "wide"):
        click.echo(query_header(wide=output == "wide"))
    n = 0
    for r in query(read_records(list(logs), stats, rotated=not no_rotated), flt, limit):
        n += 1
        if output == "json":
            click.echo(json.dumps(r.data, separators=(",", ":")))
        elif output == "yaml":
            click.echo("---")
            echo_document(r.data, "yaml")
        else:
            click.echo(query_row(r, wide=output == "wide"))
    _report_skipped(stats)
    _exit_when_nothing_was_readable(stats)
    if n == 0:
        click.echo("audit: no matching records", err=True)
        sys.exit(EXIT_FINDINGS)


@audit.command("timeline")
@click.argument("logs", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--node", required=True, help="Node (CSINode) name.")
@click.option("--driver", required=True, help="CSI driver name.")
@click.option("--output-file", "output", type=click.Path(dir_okay=False, path_type=Path),
              help="Picture to write (timeline.png; the suffix picks the format). Required.")
@deprecated_alias("--output", "--output-file", dest="output", type=click.Path(dir_okay=False, path_type=Path))
@deprecated_alias("-o", "--output-file", dest="o", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--since", help="Start at this time: RFC 3339, a date, or a duration ago (2h).")
@click.option("--until", help="End before this time.")
@click.option("--no-rotated", is_flag=True, help="Read only the files given, not their rotated siblings.")
def timeline_command(logs: tuple[Path, ...], node: str, driver: str, output: Path | None, since: str | None,
                     until: str | None, no_rotated: bool, **kwargs: Any) -> None:
    """Draw one entry's count over time with clamps (each labelled with the rules that clamped it), denials,
    corrections, freezes and the count-ceiling's ceiling marked (incident review).

    The y axis fits the plausible counts: 2147483647 and counts far above the others are drawn at the top edge
    and labelled with their value (the output line lists them).

    Needs matplotlib: pip install 'csinode-guard[timeline]'.
    """
    output = output or take_deprecated(kwargs, "output") or take_deprecated(kwargs, "o")
    if output is None:
        raise click.UsageError("Missing option '--output-file' (the picture to write, e.g. timeline.png)")
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
    by_rule = clamps_by_rule(points)
    clamps = f"; clamps by rule: {', '.join(f'{k} {v}' for k, v in by_rule.items())}" if by_rule else ""
    click.echo(f"{output}: {len(points)} writes ({', '.join(f'{k} {v}' for k, v in sorted(counts.items()))}), "
               f"{sum(1 for p in points if p.frozen)} freeze(s){clamps}{edge}")
