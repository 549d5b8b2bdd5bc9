"""What a replay found: one row per judged count change, the problems met, and the summary's counters.

:mod:`webhook.simulation.replay` fills them; ``csinode-guard replay`` prints the rows (table, JSON lines, CSV) and the
summary. Pure.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from webhook.admission.brake import describe
from webhook.admission.cluster import Brake
from webhook.admission.state import format_time

MAX_PROBLEMS_KEPT = 100
MAX_BRAKES_KEPT = 100
"""The summary keeps this many brake engagements and releases (the first ones)."""
BUSIEST_MINUTES_SHOWN = 5
"""The summary lists only this many of the minutes with the most changes (the busiest first)."""
FACT_RESOURCES = ("nodes", "csidrivers", "volumeattachments")
"""Resources whose events are read as cluster facts (labels, kubelet version, update periods, attach errors)."""


@dataclass(frozen=True)
class Problem:
    """A line or file that could not be read: ``source`` file, 1-based ``line`` (0: the file), ``reason``."""

    source: str
    line: int
    reason: str

    def __str__(self) -> str:
        where = f"{self.source}:{self.line}" if self.line else self.source
        return f"{where}: {self.reason}"


@dataclass(frozen=True)
class Row:
    """What the guard would have done with one count change (or one judged write without a change).

    ``driver`` None: a write that reached the guard but changed no count (an annotation, a justification).
    """

    time: str
    node: str
    driver: str | None
    old: int | str | None
    new: int | str | None
    final: int | str | None
    decision: str
    rules: tuple[str, ...]
    user: str
    verb: str
    audit_id: str
    dry_run: bool = False
    message: str = ""

    def to_json(self) -> dict[str, Any]:
        """The row as a JSON object (counts: int or "unbounded")."""
        return {
            "time": self.time,
            "node": self.node,
            "driver": self.driver,
            "old": self.old,
            "new": self.new,
            "final": self.final,
            "decision": self.decision,
            "rules": list(self.rules),
            "user": self.user,
            "verb": self.verb,
            "auditID": self.audit_id,
            "dryRun": self.dry_run,
            **({"message": self.message} if self.message else {}),
        }


@dataclass
class Summary:
    """Counters of one replay (all bounded by nodes, drivers and minutes, not by the size of the log)."""

    files: list[str] = field(default_factory=list)
    lines: int = 0
    bad_lines: int = 0
    events: int = 0
    not_audit_events: int = 0
    other_resources: int = 0
    other_stages: int = 0
    reads: int = 0
    csinode_writes: int = 0
    metadata_level: int = 0
    no_previous_version: int = 0
    failed_in_cluster: int = 0
    unreadable: int = 0
    not_called: int = 0
    judged: int = 0
    changes: int = 0
    reordered: int = 0
    late: int = 0
    duplicates: int = 0
    cluster_facts: Counter[str] = field(default_factory=Counter)
    fact_objects: Counter[str] = field(default_factory=Counter)
    """Per fact resource, the events that carry an object (``Request``/``RequestResponse`` level)."""
    audit_ids: int = 0
    """Lines with an ``auditID``: 0 in a file that is no kube-apiserver audit log (the guard's own, say)."""
    first_event: str | None = None
    last_event: str | None = None
    by_decision: Counter[str] = field(default_factory=Counter)
    by_rule: dict[str, Counter[str]] = field(default_factory=dict)
    nodes: dict[str, Counter[str]] = field(default_factory=dict)
    drivers: dict[str, Counter[str]] = field(default_factory=dict)
    per_minute: Counter[str] = field(default_factory=Counter)
    problems: list[Problem] = field(default_factory=list)
    brakes: list[dict[str, Any]] = field(default_factory=list)
    """The brakes that engaged or released during the replay, in time order (at most :data:`MAX_BRAKES_KEPT`):
    ``time`` of the leader's decision, ``driver``, ``engaged`` and ``message`` (the evidence, or who released it)."""

    def add_brake(self, brake: Brake, now: datetime) -> None:
        """Record that ``brake`` engaged or released at ``now`` (UTC)."""
        if len(self.brakes) >= MAX_BRAKES_KEPT:
            return
        if brake.engaged:
            message = describe(brake)
        else:
            message = f"the brake on {brake.driver} released by {brake.released_by}: {brake.release_reason}"
        self.brakes.append(
            {"time": format_time(now), "driver": brake.driver, "engaged": brake.engaged, "message": message}
        )

    def add_problem(self, problem: Problem) -> None:
        """Count a problem, keeping the first :data:`MAX_PROBLEMS_KEPT` for the report."""
        self.bad_lines += 1
        if len(self.problems) < MAX_PROBLEMS_KEPT:
            self.problems.append(problem)

    def add_row(self, row: Row) -> None:
        """Count one change row."""
        if row.driver is None:
            return
        self.changes += 1
        self.nodes.setdefault(row.node, Counter())[row.decision] += 1
        self.drivers.setdefault(row.driver, Counter())[row.decision] += 1
        self.per_minute[row.time[:16]] += 1

    def top(self, table: Mapping[str, Counter[str]], n: int = 10) -> list[dict[str, Any]]:
        """The ``n`` keys with the most refused or rewritten changes (deny, clamp, warn), then the most changes."""
        def key(item: tuple[str, Counter[str]]) -> tuple[int, int, str]:
            name, counts = item
            flagged = counts["deny"] + counts["clamp"] + counts["warn"] + counts["invalid"]
            return (-flagged, -sum(counts.values()), name)

        out = []
        for name, counts in sorted(table.items(), key=key)[:n]:
            out.append({"name": name, "changes": sum(counts.values()), **dict(sorted(counts.items()))})
        return out

    def minute_stats(self) -> dict[str, Any]:
        """Changes per minute: the peak, the mean over minutes with changes, and only the
        :data:`BUSIEST_MINUTES_SHOWN` busiest minutes (``busiestShown`` says how many at most)."""
        if not self.per_minute:
            return {"peak": 0, "meanOverActiveMinutes": 0.0, "activeMinutes": 0,
                    "busiestShown": BUSIEST_MINUTES_SHOWN, "busiest": []}
        busiest = sorted(self.per_minute.items(), key=lambda kv: (-kv[1], kv[0]))[:BUSIEST_MINUTES_SHOWN]
        return {
            "peak": busiest[0][1],
            "meanOverActiveMinutes": round(sum(self.per_minute.values()) / len(self.per_minute), 2),
            "activeMinutes": len(self.per_minute),
            "busiestShown": BUSIEST_MINUTES_SHOWN,
            "busiest": [{"minute": m, "changes": c} for m, c in busiest],
        }

    def accounted_events(self) -> int:
        """Audit events the summary puts somewhere: skipped, cluster facts or CSINode writes. Equals ``events``."""
        return (self.other_resources + self.other_stages + self.reads + self.csinode_writes
                + sum(self.cluster_facts.values()))

    def to_json(self) -> dict[str, Any]:
        """The summary as a JSON object."""
        return {
            "files": self.files,
            "lines": self.lines,
            "badLines": self.bad_lines,
            "auditEvents": self.events,
            "duplicateEvents": self.duplicates,
            "firstEvent": self.first_event,
            "lastEvent": self.last_event,
            "skipped": {
                "notAuditEvents": self.not_audit_events,
                "otherResources": self.other_resources,
                "otherStages": self.other_stages,
                "reads": self.reads,
            },
            "clusterFacts": {resource: self.cluster_facts[resource] for resource in FACT_RESOURCES},
            "csinodeWrites": self.csinode_writes,
            "notJudgeable": {
                "metadataLevel": self.metadata_level,
                "noPreviousVersion": self.no_previous_version,
                "failedInCluster": self.failed_in_cluster,
                "unreadable": self.unreadable,
            },
            "notCalled": self.not_called,
            "judged": self.judged,
            "changes": self.changes,
            "byDecision": dict(sorted(self.by_decision.items())),
            "byRule": {rule: dict(sorted(c.items())) for rule, c in sorted(self.by_rule.items())},
            "topNodes": self.top(self.nodes),
            "topDrivers": self.top(self.drivers),
            "changesPerMinute": self.minute_stats(),
            "order": {"reordered": self.reordered, "late": self.late},
            "problems": [str(p) for p in self.problems],
            "brakes": list(self.brakes),
        }
