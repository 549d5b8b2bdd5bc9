"""``csinode-guard audit summary|query|timeline`` over the guard's own audit log, rotated and gzipped.

The log is written the way the server writes it: each write goes through /mutate, its patch and /validate
(``webhook.simulation.chain``), and ``webhook.admission.audit_records.build_records`` makes the records of both
endpoints.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO
from tests.kube import EBS, KUBELET, NODE, NODE_GROUPS, base_csinode, kubelet_update, with_annotation
from webhook.admission.audit_records import build_records
from webhook.admission.cluster import AttachError, StaticClusterView
from webhook.admission.evaluation import Mode
from webhook.admission.policy import load_policy
from webhook.admission.state import StateKeys
from webhook.simulation.audit_queries import ReadStats, RecordFilter, expand_rotated, parse_when, query, read_records
from webhook.simulation.chain import admit_write

T0 = datetime(2026, 11, 30, 2, 0, tzinfo=UTC)
VERSIONS = "csinode-guard.io/driver-versions"
OTHER = "ip-10-0-4-17.ec2.internal"
GKE = "gke-prod-pool-1-a1b2c3d4-x9k2"
PD = "pd.csi.storage.gke.io"


def guard_log() -> list[dict[str, Any]]:
    """Audit records of an incident on NODE (freeze, increases held at the stored count, a correction) plus a clamp
    elsewhere and a denied dry run."""
    policy = load_policy()
    keys = StateKeys([b"k" * 32])
    cluster = StaticClusterView(nodes={GKE: {"labels": {"node.kubernetes.io/instance-type": "n2-standard-8"}}},
                                driver_versions={NODE: {EBS: "v1.37.0"}})  # the EBS node pod's image tag
    records: list[dict[str, Any]] = []
    stored: dict[str, dict[str, Any]] = {}

    def write(node: str, new: dict[str, Any], minutes: float, user: str = KUBELET,
              groups: tuple[str, ...] = tuple(NODE_GROUPS), dry_run: bool = False) -> None:
        now = T0 + timedelta(minutes=minutes)
        outcome = admit_write(stored[node], new, policy=policy, cluster=cluster, keys=keys, now=now,
                              uid=f"uid-{len(records)}", username=user, groups=groups, dry_run=dry_run)
        for mode, decision in ((Mode.MUTATE, outcome.mutate), (Mode.VALIDATE, outcome.validate)):
            if decision is not None and outcome.request is not None:
                records.extend(build_records(decision, outcome.request, endpoint=mode, now=now,
                                             policy_hash=policy.hash, policy_generation=1,
                                             latency_seconds=0.0012))
        assert outcome.stored is not None
        stored[node] = outcome.stored

    def renamed(obj: dict[str, Any], name: str) -> dict[str, Any]:
        out = json.loads(json.dumps(obj))
        out["metadata"]["name"] = name
        out["metadata"]["uid"] = f"uid-of-{name}"
        return out

    stored[NODE] = with_annotation(kubelet_update(base_csinode(), EBS, 25), VERSIONS, json.dumps({EBS: "v1.37.0"}))
    stored[OTHER] = renamed(kubelet_update(base_csinode(), EBS, 25), OTHER)
    stored[GKE] = renamed(kubelet_update(base_csinode(), PD, 20), GKE)
    write(NODE, kubelet_update(stored[NODE], EBS, 24), 0)
    cluster.driver_versions[NODE] = {EBS: "v1.34.0"}  # the node plugin rolled back (pod version source)
    write(NODE, kubelet_update(stored[NODE], EBS, 22), 5)  # warn + freeze
    write(NODE, kubelet_update(stored[NODE], EBS, 23), 10)  # frozen: the node's kubelet's is held at 22 (clamp)
    cluster.attach_error_list[(NODE, EBS)] = [AttachError(8, T0 + timedelta(minutes=14), "csi-1")]
    write(NODE, kubelet_update(stored[NODE], EBS, 20), 15)  # correction
    write(NODE, kubelet_update(stored[NODE], EBS, 39), 20)  # undoes the correction: held at 20 (clamp)
    write(OTHER, kubelet_update(stored[OTHER], EBS, 39), 21,
          user=f"system:node:{OTHER}")  # clamp to 27
    write(GKE, kubelet_update(stored[GKE], PD, 30), 22, user=f"system:node:{GKE}")  # allow
    write(NODE, kubelet_update(stored[NODE], EBS, 128), 30, user="kubernetes-admin",
          groups=("system:authenticated",), dry_run=True)  # deny, dry run
    return records


@pytest.fixture(scope="module")
def records() -> list[dict[str, Any]]:
    return guard_log()


@pytest.fixture
def rotated(tmp_path: Path, records: list[dict[str, Any]]) -> Path:
    """audit.log.2.gz (oldest), audit.log.1 (as container logs: CRI prefix), audit.log (newest, with noise)."""
    lines = [json.dumps(r, separators=(",", ":")) for r in records]
    third = len(lines) // 3
    with gzip.open(tmp_path / "audit.log.2.gz", "wt") as f:
        f.write("\n".join(lines[:third]) + "\n")
    (tmp_path / "audit.log.1").write_text(
        "".join(f"2026-11-30T02:10:00.123456789Z stdout F {line}\n" for line in lines[third: 2 * third]))
    noise = [
        '{"time": "2026-11-30 02:20:01,000", "level": "INFO", "logger": "csinode_guard.policy", "message": "x"}',
        "Traceback (most recent call last):",
    ]
    (tmp_path / "audit.log").write_text("\n".join(lines[2 * third:] + noise) + "\n")
    (tmp_path / "unrelated.log").write_text("not part of the rotation\n")
    return tmp_path / "audit.log"


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "webhook", "audit", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=60, check=False, env=env)


def test_summary_over_rotated_and_gzipped_files(rotated: Path, records: list[dict[str, Any]]) -> None:
    result = cli("summary", str(rotated), "-o", "json")
    assert result.returncode == 0, result.stderr
    s = json.loads(result.stdout)
    assert s["records"] == len(records)
    assert [Path(f).name for f in s["files"]] == ["audit.log", "audit.log.1", "audit.log.2.gz"]
    assert s["skippedLines"] == 2
    assert s["byEndpoint"]["mutate"] == {"allow": 3, "clamp": 3, "deny": 1, "warn": 1}
    assert s["rules"]["count-rollback"] == {"clamp": 2, "deny": 1}
    assert s["rules"]["writer-version"] == {"warn": 1}
    assert s["frozen"] == 1
    assert s["corrections"] == {"resource-exhausted": 1}
    assert s["dryRun"] == 1
    assert s["topNodes"][0]["name"] == NODE
    assert s["policies"] == [{"hash": load_policy().hash, "generations": [1], "records": len(records),
                              "first": "2026-11-30T02:00:00.000Z", "last": "2026-11-30T02:30:00.000Z"}]
    assert s["latencyMs"]["max"] == 1.2
    assert "2 line(s) skipped" in result.stderr


def test_summary_text_and_no_rotated(rotated: Path, records: list[dict[str, Any]]) -> None:
    result = cli("summary", str(rotated))
    assert result.returncode == 0
    assert result.stdout.startswith(f"{len(records)} records from 2026-11-30T02:00:00.000Z to 2026-11-30T02:30:00")
    assert "count-rollback        3  (clamp 2, deny 1)" in result.stdout
    assert "freezes 1; corrections resource-exhausted 1" in result.stdout
    only_newest = json.loads(cli("summary", str(rotated), "--no-rotated", "-o", "json").stdout)
    assert 0 < only_newest["records"] < len(records) // 2


@pytest.mark.parametrize(
    ("args", "check"),
    [
        pytest.param(["--decision", "deny", "--endpoint", "mutate"],
                     lambda r: r["decision"] == "deny" and r["endpoint"] == "mutate", id="decision and endpoint"),
        pytest.param(["--rule", "count-ceiling"],
                     lambda r: any(x["rule"] == "count-ceiling" and x["result"] == "violation" for x in r["rules"]),
                     id="rule that found a violation"),
        pytest.param(["--node", "ip-10-0-4-*"], lambda r: r["node"] == OTHER, id="node glob"),
        pytest.param(["--driver", PD], lambda r: r["driver"] == PD, id="driver"),
        pytest.param(["--user", "kubernetes-admin", "--dry-run"],
                     lambda r: r["user"] == "kubernetes-admin" and r["dryRun"], id="user and dry run"),
        pytest.param(["--no-dry-run", "--decision", "warn"], lambda r: r["decision"] == "warn" and not r["dryRun"],
                     id="no dry run"),
        pytest.param(["--since", "2026-11-30T02:10:00Z", "--until", "2026-11-30T02:16:00Z"],
                     lambda r: "2026-11-30T02:10" <= r["time"] < "2026-11-30T02:16", id="time window"),
    ],
)
def test_query_filters(rotated: Path, records: list[dict[str, Any]], args: list[str], check: Any) -> None:
    flt = RecordFilter(
        since=parse_when(args[args.index("--since") + 1], T0) if "--since" in args else None,
        until=parse_when(args[args.index("--until") + 1], T0) if "--until" in args else None,
        nodes=tuple(a for i, a in enumerate(args) if i and args[i - 1] == "--node"),
        drivers=tuple(a for i, a in enumerate(args) if i and args[i - 1] == "--driver"),
        rules=tuple(a for i, a in enumerate(args) if i and args[i - 1] == "--rule"),
        decisions=tuple(a for i, a in enumerate(args) if i and args[i - 1] == "--decision"),
        users=tuple(a for i, a in enumerate(args) if i and args[i - 1] == "--user"),
        dry_run=True if "--dry-run" in args else False if "--no-dry-run" in args else None,
        endpoint=args[args.index("--endpoint") + 1] if "--endpoint" in args else None,
    )
    stats = ReadStats()
    found = [r.data for r in query(read_records([rotated], stats), flt)]
    assert found
    assert all(check(r) for r in found)
    assert len(found) == sum(1 for r in records if check(r))
    assert [r["time"] for r in found] == sorted(r["time"] for r in found)
    assert stats.records == len(records) and stats.skipped == 2


def test_query_command_combines_filters(rotated: Path) -> None:
    result = cli("query", str(rotated), "-o", "json", "--decision", "clamp", "--endpoint", "mutate",
                 "--node", "ip-10-0-1-*", "--driver", EBS, "--rule", "count-rollback", "--no-dry-run",
                 "--since", "2026-11-30T02:09:00Z", "--until", "2026-11-30T02:25:00Z", "--user", "system:node:*")
    assert result.returncode == 0, result.stderr
    found = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(r["time"], r["old"], r["new"], r["final"]) for r in found] == [
        ("2026-11-30T02:10:00.000Z", 22, 23, 22), ("2026-11-30T02:20:00.000Z", 20, 39, 20)]


def test_query_table_limit_and_no_match(rotated: Path) -> None:
    result = cli("query", str(rotated), "--decision", "clamp", "--limit", "1")
    assert result.returncode == 0
    header, row = result.stdout.splitlines()
    assert header.split()[:3] == ["TIME", "ENDPOINT", "NODE"]
    assert row.startswith(f"2026-11-30T02:10:00.000Z mutate   {NODE}")
    assert "22 -> 23" in row and " 22 " in row and "count-rollback" in row
    none = cli("query", str(rotated), "--node", "no-such-node")
    assert none.returncode == 1 and "no matching records" in none.stderr


def test_timeline_picture(rotated: Path, tmp_path: Path) -> None:
    out = tmp_path / "timeline.png"
    result = cli("timeline", str(rotated), "--node", NODE, "--driver", EBS, "--output-file", str(out))
    assert result.returncode == 0, result.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert result.stdout.strip() == (f"{out}: 6 writes (allow 2, clamp 2, deny 1, warn 1), 1 freeze(s); clamps by "
                                     "rule: count-ceiling 1, count-rollback 2")  # 39 held at 20: both clamped
    missing = cli("timeline", str(rotated), "--node", "nope", "--driver", EBS, "--output-file", str(out))
    assert missing.returncode == 1 and "no records for node 'nope'" in missing.stderr


def test_timeline_names_the_rule_of_each_clamp_and_draws_the_ceiling(tmp_path: Path, records: list[dict[str, Any]]
                                                                     ) -> None:
    log = tmp_path / "audit.log"
    log.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    out = tmp_path / "timeline.svg"  # matplotlib's SVG keeps each text in a comment: the labels can be read back
    result = cli("timeline", str(log), "--node", OTHER, "--driver", EBS, "--output-file", str(out))
    assert result.returncode == 0, result.stderr
    assert "clamps by rule: count-ceiling 1" in result.stdout
    svg = out.read_text()
    assert "<!-- count-ceiling -->" in svg, "the clamp is labelled with its rule"
    assert "<!-- ceiling 27 -->" in svg and "<!-- ceiling (count-ceiling) -->" in svg, "the ceiling drawn and named"


def test_timeline_without_matplotlib_says_how_to_install_it(rotated: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "blocked"
    (blocker / "matplotlib").mkdir(parents=True)
    (blocker / "matplotlib" / "__init__.py").write_text("raise ImportError('No module named matplotlib')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(blocker), str(REPO)]))
    result = cli("timeline", str(rotated), "--node", NODE, "--driver", EBS, "--output-file", str(tmp_path / "t.png"),
                 env=env)
    assert result.returncode == 1
    assert "needs matplotlib" in result.stderr and "pip install 'csinode-guard[timeline]'" in result.stderr
    assert not (tmp_path / "t.png").exists()


def test_rotated_siblings(tmp_path: Path) -> None:
    for name in ["audit.log", "audit.log.1", "audit.log.2.gz", "audit.log-20261129.gz", "audit.log.bak",
                 "audit.logger", "audit-2026.log"]:
        (tmp_path / name).write_text("")
    found = [p.name for p in expand_rotated([tmp_path / "audit.log"])]
    assert found == ["audit.log", "audit.log-20261129.gz", "audit.log.1", "audit.log.2.gz"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("2h", datetime(2026, 11, 30, 10, 0, tzinfo=UTC), id="a duration is back from now"),
        pytest.param("2026-11-29", datetime(2026, 11, 29, tzinfo=UTC), id="a date is its midnight UTC"),
        pytest.param("2026-11-30T02:00:00+01:00", datetime(2026, 11, 30, 1, 0, tzinfo=UTC), id="an offset"),
    ],
)
def test_times_for_since_and_until(text: str, expected: datetime) -> None:
    assert parse_when(text, datetime(2026, 11, 30, 12, 0, tzinfo=UTC)) == expected


# -- the timeline's picture, read back pixel by pixel -------------------------------------------------------------


def _mask(png: Path, color: str, tolerance: int = 30) -> Any:
    """Boolean (rows, columns) array: where the PNG's pixels have ``color`` (#rrggbb)."""
    import numpy as np  # noqa: PLC0415 - matplotlib's dependency, like PIL
    from PIL import Image  # noqa: PLC0415

    pixels = np.asarray(Image.open(png).convert("RGB")).astype(int)
    rgb = np.array([int(color[i:i + 2], 16) for i in (1, 3, 5)])
    return (np.abs(pixels - rgb) <= tolerance).all(axis=2)


def _plot_area(png: Path) -> tuple[slice, slice]:
    """(rows, columns) inside the axes' frame: between the dark spines that run across most of the picture."""
    dark = _mask(png, "#000000", tolerance=90)
    height, width = dark.shape
    columns = [c for c in range(width) if _longest_run(dark[:, c]) > 0.4 * height]
    rows = [r for r in range(height) if _longest_run(dark[r]) > 0.4 * width]
    assert len(columns) >= 2 and len(rows) >= 2, (columns, rows)
    return slice(min(rows) + 2, max(rows) - 1), slice(min(columns) + 2, max(columns) - 1)


def _longest_run(column: Any) -> int:
    best = run = 0
    for on in column:
        run = run + 1 if on else 0
        best = max(best, run)
    return best


def _centres(columns: list[int]) -> list[int]:
    """The middle column of each group of adjacent columns."""
    groups: list[list[int]] = []
    for c in columns:
        if groups and c - groups[-1][-1] <= 2:
            groups[-1].append(c)
        else:
            groups.append([c])
    return [g[len(g) // 2] for g in groups]


def _write_log(path: Path, node_writes: list[tuple[float, int]]) -> list[str]:
    """A guard audit log of kubelet writes of EBS on NODE (minutes after T0, count); returns the decisions."""
    policy = load_policy()
    keys = StateKeys([b"k" * 32])
    cluster = StaticClusterView()
    stored = kubelet_update(base_csinode(), EBS, 25)
    lines: list[str] = []
    decisions = []
    for i, (minutes, count) in enumerate(node_writes):
        now = T0 + timedelta(minutes=minutes)
        outcome = admit_write(stored, kubelet_update(stored, EBS, count), policy=policy, cluster=cluster, keys=keys,
                              now=now, uid=f"uid-{i}", username=KUBELET, groups=tuple(NODE_GROUPS))
        for mode, decision in ((Mode.MUTATE, outcome.mutate), (Mode.VALIDATE, outcome.validate)):
            if decision is not None and outcome.request is not None:
                lines += [json.dumps(r) for r in build_records(decision, outcome.request, endpoint=mode, now=now,
                                                                policy_hash=policy.hash, policy_generation=1,
                                                                latency_seconds=0.001)]
        decisions.append(outcome.decision.value)
        assert outcome.stored is not None
        stored = outcome.stored
    path.write_text("\n".join(lines) + "\n")
    return decisions


STORED = "#1f5fa8"  # the stored-count line (webhook.simulation.count_timeline.STORED_COLOR)
DENY = "#c62828"


def test_one_write_of_2147483647_leaves_the_real_counts_readable(tmp_path: Path) -> None:
    log = tmp_path / "audit.log"
    decisions = _write_log(log, [(0, 24), (5, 20), (10, 2147483647), (15, 15), (25, 18)])
    assert decisions[2] in ("clamp", "deny")  # the implausible write is never stored as it is
    out = tmp_path / "timeline.png"
    result = cli("timeline", str(log), "--node", NODE, "--driver", EBS, "--output-file", str(out))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("off the scale, marked at the top edge: 2147483647"), result.stdout

    inside = _plot_area(out)
    stored = _mask(out, STORED)[inside]
    height = stored.shape[0]
    rows = [r for r in range(height) if stored[r].sum() >= 3]
    # The stored count goes 25 -> 24 -> 20 -> 15 -> 18: a tenth of 25..15 must be many pixel rows apart, not one.
    assert rows, "no stored-count line in the picture"
    assert max(rows) - min(rows) >= 0.15 * height, (min(rows), max(rows), height)
    # The outlier is marked above every real count (at the top edge of the plot), not far off the picture.
    marker = _mask(out, "#e08a00" if decisions[2] == "clamp" else DENY)[inside]
    marker_rows = [r for r in range(height) if marker[r].sum() >= 2]
    assert marker_rows and min(marker_rows) < min(rows) - 0.1 * height, (marker_rows[:3], min(rows))


def test_on_replay_output_the_stored_count_never_steps_at_a_denial(tmp_path: Path) -> None:
    """A Metadata-level write (no objects) changed 4 -> 20 unseen; the next judged write, denied, starts at 20.
    The line must not jump up at that denial: the unseen change is a dashed join, the denial leaves it flat."""
    from tests.test_replay import csinode, event  # noqa: PLC0415

    node = "ip-10-0-1-23.ec2.internal"
    apiserver_log = tmp_path / "kube-apiserver-audit.log"
    events = [
        event("create", 0, request=csinode(10), response=csinode(10), code=201),
        event("update", 90, request=csinode(4), response=csinode(4)),
        event("update", 180, level="Metadata"),
        event("update", 270, request=csinode(20), response=csinode(20)),
        event("update", 360, request=csinode(30), response=csinode(20), user="kubernetes-admin", code=403),
        event("update", 450, request=csinode(35), response=csinode(20), user="kubernetes-admin", code=403),
    ]
    apiserver_log.write_text("".join(json.dumps(e) + "\n" for e in events))
    guard_log = tmp_path / "guard-audit.log"
    replayed = subprocess.run([sys.executable, "-m", "webhook", "replay", "--audit-log", str(apiserver_log),
                               "--guard-audit-out", str(guard_log), "-o", "json"],
                              capture_output=True, text=True, cwd=REPO, timeout=60, check=False)
    assert replayed.returncode == 0, replayed.stderr
    rows = [(e["old"], e["new"], e["decision"]) for e in json.loads(replayed.stdout)["events"]]
    assert rows == [("registered", 10, "allow"), (10, 4, "allow"), (20, 30, "deny"), (20, 35, "deny")]
    out = tmp_path / "timeline.png"
    result = cli("timeline", str(guard_log), "--node", node, "--driver", EBS, "--output-file", str(out))
    assert result.returncode == 0, result.stderr

    inside = _plot_area(out)
    stored, deny = _mask(out, STORED)[inside], _mask(out, DENY)[inside]
    width = stored.shape[1]
    steps = [c for c in range(width) if _longest_run(stored[:, c]) > 10]  # a vertical stretch of the line
    denials = _centres([c for c in range(width) if deny[:, c].sum() >= 2])
    assert len(denials) >= 2, denials
    assert steps, "the stored count's first step (10 -> 4) is not in the picture"
    assert all(abs(s - d) > 8 for s in steps for d in denials), (steps, denials)


@pytest.mark.parametrize("command", [pytest.param(["summary"], id="summary"),
                                     pytest.param(["summary", "-o", "json"], id="summary as JSON"),
                                     pytest.param(["query"], id="query")])
def test_a_file_with_no_audit_record_but_other_lines_exits_2_like_replay(tmp_path: Path, command: list[str]) -> None:
    garbage = tmp_path / "garbage.txt"
    garbage.write_text("this is not an audit log\n{\"also\": \"not a record\"}\n")
    result = cli(*command, str(garbage))
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "no csinode-guard audit record could be read, and 2 line(s) were not records" in result.stderr
    assert "Traceback" not in result.stderr
    empty = tmp_path / "empty.log"
    empty.write_text("")
    assert cli(*command, str(empty)).returncode == (1 if command == ["query"] else 0)


def test_timeline_to_a_format_there_is_none_of_exits_2_listing_the_formats(rotated: Path, tmp_path: Path) -> None:
    out = tmp_path / "t.weird"
    result = cli("timeline", str(rotated), "--node", NODE, "--driver", EBS, "--output-file", str(out))
    assert result.returncode == 2, result.stderr
    assert f"{out}: '.weird' is not a picture format matplotlib writes; use one of " in result.stderr
    assert ".png" in result.stderr and ".svg" in result.stderr and ".pdf" in result.stderr
    assert "Traceback" not in result.stderr
    assert not out.exists()


def test_timeline_ticks_of_a_short_incident_are_distinct(records: list[dict[str, Any]], tmp_path: Path) -> None:
    """Six writes within 75 seconds: every x tick label differs (the date is said once, not on every tick)."""
    mine = [r for r in records if r.get("node") == NODE and r.get("driver") == EBS]
    times = sorted({r["time"] for r in mine})
    moved = {t: (T0 + timedelta(seconds=15 * i)).strftime("%Y-%m-%dT%H:%M:%S.000Z") for i, t in enumerate(times)}
    log = tmp_path / "audit.log"
    log.write_text("".join(json.dumps(dict(r, time=moved[r["time"]])) + "\n" for r in mine))
    out = tmp_path / "timeline.svg"
    result = cli("timeline", str(log), "--node", NODE, "--driver", EBS, "--output-file", str(out))
    assert result.returncode == 0, result.stderr
    svg = out.read_text()
    x_axis = svg[svg.index('<g id="matplotlib.axis_1">'):svg.index('<g id="matplotlib.axis_2">')]
    texts = re.findall(r"<!-- (.*?) -->", x_axis)  # the tick labels, the axis label, the offset (the date)
    labels = texts[:texts.index("time (UTC)")]
    assert len(labels) >= 3, texts
    assert len(set(labels)) == len(labels), labels
    assert any("2026" in t for t in texts[texts.index("time (UTC)"):]), texts


def _write_log_from_registration(path: Path, writes: list[tuple[float, int]]) -> None:
    """A guard audit log of NODE's kubelet registering EBS (the first write) and updating it (seconds after T0,
    count)."""
    policy = load_policy()
    keys = StateKeys([b"k" * 32])
    stored = base_csinode()
    lines: list[str] = []
    for i, (seconds, count) in enumerate(writes):
        now = T0 + timedelta(seconds=seconds)
        outcome = admit_write(stored, kubelet_update(stored, EBS, count), policy=policy, cluster=StaticClusterView(),
                              keys=keys, now=now, uid=f"uid-{i}", username=KUBELET, groups=tuple(NODE_GROUPS))
        for mode, decision in ((Mode.MUTATE, outcome.mutate), (Mode.VALIDATE, outcome.validate)):
            if decision is not None and outcome.request is not None:
                lines += [json.dumps(r) for r in build_records(decision, outcome.request, endpoint=mode, now=now,
                                                                policy_hash=policy.hash, policy_generation=1,
                                                                latency_seconds=0.001)]
        assert outcome.stored is not None
        stored = outcome.stored
    path.write_text("\n".join(lines) + "\n")


ALLOWED = "#4a8fd4"  # the marker of an allowed write


def test_a_first_registration_starts_the_line_instead_of_a_spike_from_unbounded(tmp_path: Path) -> None:
    log = tmp_path / "audit.log"
    _write_log_from_registration(log, [(0, 25), (120, 22), (240, 24), (360, 21)])
    first = json.loads(log.read_text().splitlines()[0])
    assert (first["change"], first["old"]) == ("registration", None)
    svg, png = tmp_path / "t.svg", tmp_path / "t.png"
    for out in (svg, png):
        result = cli("timeline", str(log), "--node", NODE, "--driver", EBS, "--output-file", str(out))
        assert result.returncode == 0, result.stderr
    assert "unbounded" not in svg.read_text(), "no unbounded band: nothing here was ever unbounded"
    inside = _plot_area(png)
    stored, marks = _mask(png, STORED)[inside], _mask(png, ALLOWED)[inside]
    line_top = min(r for r in range(stored.shape[0]) if stored[r].sum() >= 1)
    marker_top = min(r for r in range(marks.shape[0]) if marks[r].sum() >= 1)
    assert line_top >= marker_top - 2, "the stored line rises above the registered count (a spike)"


def test_the_first_seconds_writes_are_spread_in_an_inset_not_piled_at_the_left_edge(tmp_path: Path) -> None:
    log = tmp_path / "audit.log"
    _write_log_from_registration(log, [(0, 25), (0.3, 24), (0.6, 23), (0.9, 22), (120, 20), (240, 21), (360, 19)])
    svg, png = tmp_path / "t.svg", tmp_path / "t.png"
    for out in (svg, png):
        result = cli("timeline", str(log), "--node", NODE, "--driver", EBS, "--output-file", str(out))
        assert result.returncode == 0, result.stderr
    assert "the first 4 writes, within 0.9 s of 02:00:00" in svg.read_text()
    marks = _mask(png, ALLOWED)
    centres = _centres([c for c in range(marks.shape[1]) if marks[:, c].sum() >= 2])
    # The main plot: the burst at one x, then three later writes; the inset: the burst's four writes apart.
    assert len(centres) >= 8, centres

    spread = tmp_path / "spread.log"
    _write_log_from_registration(spread, [(0, 25), (60, 24), (120, 23), (180, 22)])
    calm = tmp_path / "calm.svg"
    assert cli("timeline", str(spread), "--node", NODE, "--driver", EBS, "--output-file", str(calm)).returncode == 0
    assert "the first" not in calm.read_text(), "no inset without a burst"
