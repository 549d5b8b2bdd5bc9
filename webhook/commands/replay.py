"""``csinode-guard replay``: what the guard would have done with the CSINode writes in an apiserver audit log."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import IO, Any

import click
import yaml

from webhook.admission.durations import parse_duration
from webhook.admission.facts import FactsError, view_from_facts
from webhook.admission.safe_yaml import load_yaml
from webhook.commands.options import (
    EXIT_USAGE,
    cluster_options,
    deprecated_alias,
    echo_document,
    guard_policy_option,
    output_option,
    served_policy_for,
    take_deprecated,
)
from webhook.simulation.replay import replay
from webhook.simulation.replay_facts import missing_facts, not_an_apiserver_audit_log
from webhook.simulation.replay_input import Progress, describe_input
from webhook.simulation.replay_results import FACT_RESOURCES, MAX_PROBLEMS_KEPT, Problem, Row, Summary

_COLUMNS = (("TIME", 24), ("NODE", 34), ("DRIVER", 24), ("OLD -> NEW", 24), ("FINAL", 10), ("DECISION", 9))
RULES_WIDTH = 30
"""Width of the table's RULES column: a longer list of rules goes on to continuation lines, broken after a comma
(the whole list is also in ``--format json``'s ``rules``)."""
PROBLEMS_SHOWN = 5
"""Bad lines named one by one on standard error (and in the table's summary); the rest are counted."""
_FACT_KINDS = {"nodes": "Node", "csidrivers": "CSIDriver", "volumeattachments": "VolumeAttachment"}


class _Bar(Progress):
    """A tqdm progress bar on standard error (bytes of input read)."""

    def __init__(self, total: int) -> None:
        tqdm = importlib.import_module("tqdm").tqdm
        self._bar: Any = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                              desc="replay", leave=False, dynamic_ncols=True)

    def advance(self, n: int) -> None:
        """Move the bar by ``n`` bytes."""
        if n > 0:
            self._bar.update(n)

    def close(self) -> None:
        """Remove the bar."""
        self._bar.close()

    def write(self, text: str, *, err: bool = False) -> None:
        """Print a line above the bar (standard output, or standard error with ``err``)."""
        self._bar.write(text, file=sys.stderr if err else sys.stdout)


def _cell(value: Any, width: int) -> str:
    text = "-" if value is None else str(value)
    return text.ljust(width)


def wrap_rules(rules: tuple[str, ...], width: int = RULES_WIDTH) -> list[str]:
    """The comma-separated ``rules`` in lines of at most ``width`` characters, each broken after a comma (a name
    longer than ``width`` alone is cut into ``width``-long pieces). ``["-"]`` when there are none."""
    if not rules:
        return ["-"]
    lines: list[str] = []
    current = ""
    for i, rule in enumerate(rules):
        piece = rule + ("," if i < len(rules) - 1 else "")
        if current and len(current) + len(piece) > width:
            lines.append(current)
            current = ""
        while len(piece) > width:
            lines.append(piece[:width])
            piece = piece[width:]
        current += piece
    if current:
        lines.append(current)
    return lines


def _table_row(row: Row) -> list[str]:
    """The table lines of one row: the first with every column, then the RULES column's continuation lines."""
    change = "-" if row.driver is None else f"{row.old} -> {row.new}"
    rules = wrap_rules(row.rules)
    cells = [row.time, row.node, row.driver or "(annotations)", change, row.final, row.decision]
    text = " ".join(_cell(v, w) for v, (_, w) in zip(cells, _COLUMNS, strict=True))
    dry = " (dry run)" if row.dry_run else ""
    indent = " " * (len(text) + 1)
    return [f"{text} {rules[0].ljust(RULES_WIDTH)}  {row.user}{dry}"] + [f"{indent}{r}".rstrip() for r in rules[1:]]


def _table_summary(s: Summary) -> list[str]:
    lines = ["", "Summary"]
    lines.append(f"  input:        {s.lines} lines in {len(s.files)} file(s); {s.events} audit events "
                 f"from {s.first_event or '-'} to {s.last_event or '-'}")
    lines.append(f"  csinodes:     {s.csinode_writes} writes; {s.judged} would reach the guard, {s.not_called} would "
                 "not (delete, no count or guard annotation change)")
    lines.append(f"  not judgeable: {s.metadata_level} at Metadata level (no objects), {s.no_previous_version} "
                 f"without an earlier version, {s.failed_in_cluster} failed in the cluster, {s.unreadable} "
                 "unreadable")
    lines.append(f"  skipped:      {s.other_resources} other resources, {s.other_stages} other stages, "
                 f"{s.reads} reads, {s.not_audit_events} not audit events")
    facts = ", ".join(f"{s.cluster_facts[r]} {_FACT_KINDS[r]}" for r in FACT_RESOURCES)
    lines.append(f"  cluster events in the input: {facts} (read for labels, kubelet versions, update periods, "
                 "attach errors)")
    lines.append(f"  duplicates:   {s.duplicates} events seen before (same auditID and stage), skipped")
    lines.append(f"  order:        {s.reordered} events reordered, {s.late} later than the reorder window")
    lines.append(f"  bad lines:    {s.bad_lines}")
    decisions = ", ".join(f"{k} {v}" for k, v in sorted(s.by_decision.items())) or "-"
    lines.append(f"  decisions:    {decisions} (per judged write)")
    lines.append(f"  changes:      {s.changes}")
    if s.by_rule:
        lines.append("  rules (violations by effective enforcement):")
        for rule, counts in sorted(s.by_rule.items()):
            parts = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
            lines.append(f"    {rule:16} {sum(counts.values()):6}  ({parts})")
    for title, table in (("top nodes", s.nodes), ("top drivers", s.drivers)):
        top = s.top(table)
        if top:
            lines.append(f"  {title}:")
            for t in top:
                parts = ", ".join(f"{k} {v}" for k, v in t.items() if k not in ("name", "changes"))
                lines.append(f"    {t['name']:40} {t['changes']:6} changes  ({parts})")
    stats = s.minute_stats()
    lines.append(f"  changes per minute: peak {stats['peak']}, mean {stats['meanOverActiveMinutes']} over "
                 f"{stats['activeMinutes']} active minutes; busiest minutes (top {stats['busiestShown']} only):")
    for b in stats["busiest"]:
        lines.append(f"    {b['minute']}  {b['changes']}")
    for b in s.brakes:
        lines.append(f"  brake {'engaged' if b['engaged'] else 'released'} at {b['time']}: {b['message']}")
    if s.problems:
        shown = s.problems[:PROBLEMS_SHOWN]
        lines.append(f"  first problems ({len(shown)} of {s.bad_lines}):")
        lines += [f"    {p}" for p in shown]
        if s.bad_lines > len(shown):
            lines.append(f"    and {s.bad_lines - len(shown)} more")
    return lines


@click.command("replay")
@click.option("--audit-log", "audit_logs", multiple=True, required=True,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="apiserver audit log (JSON lines of audit.k8s.io/v1 Event; .gz too). Repeat for rotated files.")
@click.option("--policy", "policy_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="A policy file (default: the GuardPolicy the guard serves, read from the cluster when one is "
              "configured, see --guard-policy; else the bundled policy).")
@output_option(["table", "json", "yaml"], help="table: one row per count change and a summary; json or yaml: "
               "every row and the summary, whole (json is streamed as it is judged).")
@deprecated_alias("--format", "-o/--output", dest="output", type=click.Choice(["table", "json"]))
@click.option("--cluster-facts", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="YAML with facts the log lacks: node labels, driver periods, attach errors "
                   "(webhook/admission/facts.py).")
@click.option("--reorder-window", default="5m", show_default=True,
              help="Events are put in requestReceivedTimestamp order within this window (e.g. 30s, 5m).")
@click.option("--guard-audit-out", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write the guard audit records the server would have written (for `audit` commands).")
@click.option("--progress/--no-progress", default=None,
              help="Progress bar on standard error (default: when it is a terminal).")
@guard_policy_option
@cluster_options
def replay_command(audit_logs: tuple[Path, ...], policy_path: Path | None, output: str, cluster_facts: Path | None,
                   reorder_window: str, guard_audit_out: Path | None, progress: bool | None, guard_policy: str,
                   kubeconfig: str | None, context: str | None, **kwargs: Any) -> None:
    """Replay the CSINode writes of an apiserver audit log through a policy, and report what it would have done.

    One row per count change (time, node, driver, old -> new, final, decision, rules, writer), then a summary
    by decision and rule, top nodes and drivers, and changes per minute. Each write is judged with its own
    requestReceivedTimestamp as the clock and its user as the writer, against the previous version rebuilt from
    earlier events. Try a policy against your own cluster's history before enforcing it.

    The table's RULES column is 30 characters wide; a longer list continues on the next lines (the
    whole list is in -o json). The summary's "cluster events in the input" counts the Node, CSIDriver and
    VolumeAttachment events of the log read as facts (labels, kubelet versions, update periods, attach errors):
    events, not the cluster's size.

    Lines that are not JSON are reported with their line number on standard error (the first 5, then how many
    more) and skipped. Events seen before (same auditID and stage: a log given twice) are counted once. Exit code
    2 when some lines were bad and no write could be judged (not an audit log, or the wrong file), so that a
    script does not take it for a clean replay.
    """
    fmt = take_deprecated(kwargs, "output") or output
    rows: list[dict[str, Any]] = []  # -o yaml: the whole document at the end
    try:
        window = parse_duration(reorder_window)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--reorder-window") from None
    served = served_policy_for(policy_path, guard_policy, kubeconfig=kubeconfig, context=context)
    loaded = served.policy
    facts = None
    if cluster_facts is not None:
        try:
            facts = view_from_facts(load_yaml(cluster_facts.read_text("utf-8")))
        except UnicodeDecodeError as exc:
            raise click.ClickException(f"{cluster_facts}: not UTF-8 text (byte {exc.start}); cluster facts are "
                                       "YAML or JSON") from None
        except (FactsError, yaml.YAMLError, OSError) as exc:
            raise click.ClickException(f"{cluster_facts}: {exc}") from None
    show_bar = sys.stderr.isatty() if progress is None else progress
    bar = _Bar(describe_input(audit_logs)) if show_bar else None
    out = sys.stdout

    def emit(text: str) -> None:
        if bar is not None:
            bar.write(text)
        else:
            out.write(text + "\n")

    def say(message: str) -> None:
        if bar is not None:
            bar.write(message, err=True)
        else:
            click.echo(message, err=True)

    reported = 0

    def report(problem: Problem) -> None:
        nonlocal reported
        if reported < PROBLEMS_SHOWN:
            say(f"replay: {problem}")
        reported += 1

    first = True

    def on_row(row: Row) -> None:
        nonlocal first
        if fmt == "json":
            emit(("" if first else ",") + json.dumps(row.to_json(), separators=(",", ":")))
        elif fmt == "yaml":
            rows.append(row.to_json())
        else:
            for line in _table_row(row):
                emit(line)
        first = False

    if fmt == "json":
        emit('{"events":[')
    elif fmt == "table":
        header = " ".join(name.ljust(w) for name, w in _COLUMNS)
        emit(f"{header} {'RULES'.ljust(RULES_WIDTH)}  WRITER")
    sink_file: IO[str] | None = guard_audit_out.open("w", encoding="utf-8") if guard_audit_out else None

    def sink(records: list[dict[str, Any]]) -> None:
        assert sink_file is not None
        for r in records:
            sink_file.write(json.dumps(r, separators=(",", ":"), default=str) + "\n")

    try:
        summary = replay(list(audit_logs), loaded, on_row, on_problem=report, progress=bar, cluster=facts,
                         audit_sink=sink if sink_file else None, reorder_window=window)
    finally:
        if sink_file is not None:
            sink_file.close()
    if fmt in ("json", "yaml"):
        body = summary.to_json()
        body["policy"] = served.to_json()
        body["missingFacts"] = [] if facts is not None else missing_facts(summary)
        if fmt == "json":
            emit("],\"summary\":" + json.dumps(body, indent=None, separators=(",", ":")) + "}")
        else:
            echo_document({"events": rows, "summary": body}, "yaml")
    else:
        for line in _table_summary(summary):
            emit(line)
        emit(f"Judged with {served.describe()}")
    if reported > PROBLEMS_SHOWN:
        click.echo(f"replay: and {reported - PROBLEMS_SHOWN} more bad line(s) (-o json lists the first "
                   f"{MAX_PROBLEMS_KEPT})", err=True)
    if summary.bad_lines and not summary.judged:
        click.echo(f"replay: nothing could be judged, and {summary.bad_lines} line(s) were not audit events: "
                   "is this a kube-apiserver audit log (JSON lines of audit.k8s.io/v1 Event)?", err=True)
        sys.exit(EXIT_USAGE)
    not_audit_log = not_an_apiserver_audit_log(summary)
    if not_audit_log is not None:
        click.echo(f"replay: {not_audit_log}", err=True)
        sys.exit(EXIT_USAGE)
    if facts is None:
        for warning in missing_facts(summary):
            click.echo(f"replay: warning: {warning}", err=True)
