"""``csinode-guard replay``: apiserver audit logs (audit.k8s.io/v1 Event lines) through the policy.

``tests/data/audit/kube-apiserver-audit.log`` is a log as kube-apiserver's log backend writes it, for one node:
a Metadata-level pod read, kubelet's Node status patch (RequestResponse, the full Node in the response), a
CSIDriver create, kubelet's CSINode create and PUTs (RequestResponse, managedFields included; one at Request
level; a RequestReceived stage), the external-attacher's VolumeAttachment status patch with ResourceExhausted
(errorCode 8), a Metadata-level CSINode update, another node's kubelet, an admin's dry run, a PUT of 02:03:20
written before one of 02:03:12, a glog line in the middle (line 12) and a truncated last line (line 17).
"""

from __future__ import annotations

import copy
import fcntl
import gzip
import json
import os
import pty
import struct
import subprocess
import sys
import termios
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO
from webhook.admission.policy import load_policy
from webhook.simulation.replay import replay
from webhook.simulation.replay_results import Row

LOG = REPO / "tests" / "data" / "audit" / "kube-apiserver-audit.log"
NODE = "ip-10-0-1-23.ec2.internal"
EBS = "ebs.csi.aws.com"
EFS = "efs.csi.aws.com"

# time, old, new, final, decision, rules, writer of every judged change in LOG, in requestReceivedTimestamp order
EXPECTED = [
    # kubelet's CREATE of its CSINode with the EFS driver (no limit): judged through the never-refused entry
    ("2026-11-30T02:00:01.001Z", "registered", "unbounded", "unbounded", "allow", [], f"system:node:{NODE}"),
    ("2026-11-30T02:00:02.101Z", "registered", 25, 25, "allow", [], f"system:node:{NODE}"),  # a registration
    ("2026-11-30T02:01:00.001Z", 25, 23, 23, "allow", [], f"system:node:{NODE}"),
    ("2026-11-30T02:02:11.001Z", 23, 20, 20, "allow", [], f"system:node:{NODE}"),
    ("2026-11-30T02:03:12.001Z", 20, 21, 21, "allow", [], f"system:node:{NODE}"),
    # The node's own kubelet: the count rules' deny acts as a clamp to the stored count, 21.
    ("2026-11-30T02:03:20.001Z", 21, 39, 21, "clamp", ["count-ceiling", "count-rollback", "change-rate"],
     f"system:node:{NODE}"),
    # The Metadata-level update before it (not judgeable) stored 22 above the trusted 21: judged from 21 (its
    # message says so), refused, so 22 stays.
    ("2026-11-30T02:06:40.001Z", 22, 24, 22, "deny", ["writer-identity", "count-rollback"],
     "system:node:ip-10-0-2-51.ec2.internal"),
    ("2026-11-30T02:07:50.001Z", 24, 128, 24, "deny", ["writer-identity", "count-ceiling", "count-rollback"],
     "kubernetes-admin"),
]


def cli(*args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "webhook", "replay", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=60, check=False, **kwargs)


def rows_of(events: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [(e["time"], e["old"], e["new"], e["final"], e["decision"], e["rules"], e["user"]) for e in events]


def test_replay_reports_what_the_guard_would_have_done_per_event_and_in_summary() -> None:
    result = cli("--audit-log", str(LOG), "-o", "json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert rows_of(doc["events"]) == [tuple(e) for e in EXPECTED]
    assert {e["node"] for e in doc["events"]} == {NODE}
    assert [e["driver"] for e in doc["events"]] == [EFS] + [EBS] * 7
    assert [e["dryRun"] for e in doc["events"]] == [False] * 7 + [True]
    s = doc["summary"]
    assert s["lines"] == 17 and s["badLines"] == 2
    assert s["csinodeWrites"] == 10
    assert s["notCalled"] == 0  # kubelet's create and its registration of ebs.csi.aws.com are judged now
    assert s["judged"] == 8
    assert s["notJudgeable"] == {"metadataLevel": 1, "noPreviousVersion": 1, "failedInCluster": 0, "unreadable": 0}
    assert s["skipped"] == {"notAuditEvents": 0, "otherResources": 1, "otherStages": 1, "reads": 0}
    assert s["byDecision"] == {"allow": 5, "clamp": 1, "deny": 2}
    assert s["byRule"]["writer-identity"] == {"deny": 2}
    assert s["byRule"]["change-rate"] == {"clamp": 1}
    assert s["topNodes"] == [{"name": NODE, "changes": 8, "allow": 5, "clamp": 1, "deny": 2}]
    assert s["changesPerMinute"]["peak"] == 2
    assert s["changesPerMinute"]["busiest"][:2] == [
        {"minute": "2026-11-30T02:00", "changes": 2}, {"minute": "2026-11-30T02:03", "changes": 2}
    ]
    assert s["order"] == {"reordered": 1, "late": 0}
    assert s["firstEvent"] == "2026-11-30T02:00:00.201Z"
    assert doc["summary"]["policy"]["hash"] == load_policy().hash
    assert s["problems"] == [
        f"{LOG}:12: not a JSON object (truncated or corrupt line)",
        f"{LOG}:17: not JSON (Expecting ',' delimiter: line 1 column 1867 (char 1866))",
    ]
    assert f"replay: {LOG}:12: not a JSON object" in result.stderr
    assert f"replay: {LOG}:17: not JSON" in result.stderr


def test_the_summary_accounts_for_every_audit_event_and_says_it_lists_only_the_busiest_minutes() -> None:
    result = cli("--audit-log", str(LOG), "-o", "json")
    s = json.loads(result.stdout)["summary"]
    assert s["clusterFacts"] == {"nodes": 1, "csidrivers": 1, "volumeattachments": 1}
    skipped = s["skipped"]
    accounted = (skipped["otherResources"] + skipped["otherStages"] + skipped["reads"] + s["csinodeWrites"]
                 + sum(s["clusterFacts"].values()))
    assert s["auditEvents"] == accounted == 15
    assert s["changesPerMinute"]["busiestShown"] == 5
    text = cli("--audit-log", str(LOG)).stdout
    assert "cluster events in the input: 1 Node, 1 CSIDriver, 1 VolumeAttachment (read for" in text
    assert "cluster facts" not in text  # counts of events, not of the cluster's objects
    assert "busiest minutes (top 5 only):" in text


@pytest.mark.parametrize("second", ["the same path", "a gzipped copy"])
def test_a_log_given_twice_is_counted_once(tmp_path: Path, second: str) -> None:
    once = json.loads(cli("--audit-log", str(LOG), "-o", "json").stdout)
    again = LOG
    if second == "a gzipped copy":
        again = tmp_path / "copy.log.gz"
        again.write_bytes(gzip.compress(LOG.read_bytes()))
    result = cli("--audit-log", str(LOG), "--audit-log", str(again), "-o", "json")
    assert result.returncode == 0, result.stderr
    twice = json.loads(result.stdout)
    assert rows_of(twice["events"]) == rows_of(once["events"]) == [tuple(e) for e in EXPECTED]
    for key in ("auditEvents", "csinodeWrites", "judged", "changes", "byDecision", "byRule", "clusterFacts",
                "skipped", "notJudgeable", "topNodes"):
        assert twice["summary"][key] == once["summary"][key], key
    assert twice["summary"]["duplicateEvents"] == (15 if second == "a gzipped copy" else 0)


@pytest.mark.parametrize(
    "content",
    [pytest.param("garbage\n{\"broken\n\u00ff\u00fe\n", id="garbage"),
     pytest.param("<html>404 Not Found</html>\n", id="an error page instead of the log")],
)
def test_a_file_with_nothing_judgeable_and_bad_lines_exits_non_zero(tmp_path: Path, content: str) -> None:
    path = tmp_path / "audit.log"
    path.write_text(content)
    for fmt in ("table", "json"):
        result = cli("--audit-log", str(path), "-o", fmt)
        assert result.returncode == 2, (fmt, result.stdout, result.stderr)
        assert "nothing could be judged" in result.stderr


def test_a_log_without_csinode_writes_and_without_bad_lines_exits_zero(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    path.write_bytes(LOG.read_bytes().splitlines(keepends=True)[0])  # a pod read: nothing to judge, nothing bad
    result = cli("--audit-log", str(path))
    assert result.returncode == 0, result.stderr


def test_the_cluster_facts_come_from_the_log() -> None:
    """m6i.large from the Node object, ResourceExhausted from the VolumeAttachment: the ceiling is the
    instance type's, and the 23 -> 20 decrease is a correction (hence count-rollback at 02:03:20)."""
    rows: list[Row] = []
    records: list[dict[str, Any]] = []
    replay([LOG], load_policy(), rows.append, audit_sink=records.extend)
    held = rows[5]
    assert (held.time, held.decision, held.final) == ("2026-11-30T02:03:20.001Z", "clamp", 21)
    assert "count-rollback" in held.rules
    [record] = [r for r in records if r["time"] == held.time and r["endpoint"] == "mutate"]
    [rollback] = [o for o in record["rules"] if o["rule"] == "count-rollback"]
    assert "undoes the correction 23 -> 20" in rollback["message"]


def test_table_format_streams_rows_then_the_summary() -> None:
    result = cli("--audit-log", str(LOG))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split()[:5] == ["TIME", "NODE", "DRIVER", "OLD", "->"]
    row = lines[6]
    assert row.startswith(f"2026-11-30T02:03:20.001Z {NODE}")
    assert "21 -> 39" in row and " clamp " in row and "count-ceiling,count-rollback," in row
    assert lines[7].strip() == "change-rate"  # the RULES column's continuation line
    assert lines[9].endswith("kubernetes-admin (dry run)")
    assert "Summary" in lines
    text = result.stdout
    assert "8 would reach the guard, 0 would not" in text
    assert "1 at Metadata level (no objects)" in text
    assert "bad lines:    2" in text
    assert "changes per minute: peak 2" in text


def test_table_columns_line_up_and_long_rule_lists_wrap_in_the_rules_column() -> None:
    """Every row's RULES and WRITER start at the header's columns, whatever the counts ("registered ->
    unbounded") and however many rules; a list wider than the column continues under it, broken after a comma,
    and the whole list is in -o json."""
    lines = cli("--audit-log", str(LOG)).stdout.split("\n\nSummary")[0].splitlines()
    header, rows = lines[0], lines[1:]
    for name in ("FINAL", "DECISION", "RULES", "WRITER"):
        column = header.index(name)
        for line in rows:
            if line.startswith("2026-"):
                assert line[column - 1] == " " and line[column] != " ", (name, line)
    rules_at, writer_at = header.index("RULES"), header.index("WRITER")
    continued = [line for line in rows if not line.startswith("2026-")]
    assert [line.strip() for line in continued] == ["change-rate", "count-rollback"]
    for line in continued:
        assert line[:rules_at].strip() == "" and len(line) <= writer_at
    for line in rows:
        if line.startswith("2026-"):
            rules = line[rules_at:writer_at]
            assert rules.endswith("  ") and len(rules.rstrip()) <= writer_at - rules_at - 2, line
    events = json.loads(cli("--audit-log", str(LOG), "-o", "json").stdout)["events"]
    assert events[7]["rules"] == ["writer-identity", "count-ceiling", "count-rollback"]


def test_a_file_of_many_bad_lines_names_the_first_five_and_counts_the_rest(tmp_path: Path) -> None:
    path = tmp_path / "app.log"
    path.write_text("".join(f"2026-11-30 02:00:{i % 60:02d} INFO not an audit event {i}\n" for i in range(501)))
    for fmt in ("table", "json"):
        result = cli("--audit-log", str(path), "-o", fmt)
        assert result.returncode == 2, (fmt, result.stderr)
        lines = result.stderr.splitlines()
        assert lines == [f"replay: {path}:{n}: not a JSON object (truncated or corrupt line)"
                         for n in range(1, 6)] + [
            "replay: and 496 more bad line(s) (-o json lists the first 100)",
            "replay: nothing could be judged, and 501 line(s) were not audit events: is this a kube-apiserver "
            "audit log (JSON lines of audit.k8s.io/v1 Event)?"], fmt
        if fmt == "json":
            summary = json.loads(result.stdout)["summary"]
            assert summary["badLines"] == 501 and len(summary["problems"]) == 100
        else:
            text = result.stdout
            assert "  first problems (5 of 501):" in text and "    and 496 more" in text
            assert f"{path}:6:" not in text


def test_gzip_rotated_files_in_any_order_and_a_truncated_gzip(tmp_path: Path) -> None:
    lines = LOG.read_bytes().splitlines(keepends=True)
    older = tmp_path / "audit-2026-11-30T02-03-00.000.log.gz"
    newer = tmp_path / "audit.log"
    with gzip.open(older, "wb") as f:
        f.writelines(lines[:9])
    newer.write_bytes(b"".join(lines[9:]))
    result = cli("--audit-log", str(newer), "--audit-log", str(older), "-o", "json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert rows_of(doc["events"]) == [tuple(e) for e in EXPECTED]
    assert doc["summary"]["lines"] == 17

    broken = tmp_path / "broken.log.gz"
    broken.write_bytes(gzip.compress(b"".join(lines))[:-200])
    result = cli("--audit-log", str(broken), "-o", "json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert "compressed stream broken" in result.stderr
    assert 0 < len(doc["events"]) < len(EXPECTED)


def test_events_later_than_the_reorder_window_are_replayed_as_they_come_and_counted() -> None:
    result = cli("--audit-log", str(LOG), "-o", "json", "--reorder-window", "0s")
    doc = json.loads(result.stdout)
    assert doc["summary"]["order"] == {"reordered": 1, "late": 1}
    assert [e["time"][11:19] for e in doc["events"]][4:6] == ["02:03:20", "02:03:12"]  # after the registration


def test_guard_audit_records_for_the_audit_commands(tmp_path: Path) -> None:
    out = tmp_path / "guard-audit.log"
    result = cli("--audit-log", str(LOG), "--guard-audit-out", str(out), "-o", "json")
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["endpoint"] for r in records].count("mutate") == 8  # the CREATE and the registration are judged too
    denied = [r for r in records if r["decision"] == "deny"]
    assert [r["new"] for r in denied] == [24, 128]
    held = [r for r in records if r["decision"] == "clamp"]
    assert [(r["new"], r["final"]) for r in held] == [(39, 21)], "the node's kubelet's 39 is held at the stored 21"
    assert denied[-1]["dryRun"] is True
    assert all(r["policyGeneration"] == 1 for r in records)


def test_a_progress_bar_on_a_terminal_and_none_otherwise() -> None:
    main, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    try:
        process = subprocess.run([sys.executable, "-m", "webhook", "replay", "--audit-log", str(LOG)], cwd=REPO,
                                 stdout=subprocess.DEVNULL, stderr=secondary, timeout=60, check=False)
        os.close(secondary)
        chunks = []
        while True:
            try:
                chunk = os.read(main, 65536)
            except OSError:
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(main)
    assert process.returncode == 0
    err = b"".join(chunks).decode(errors="replace")
    assert "replay:" in err and "%|" in err
    plain = cli("--audit-log", str(LOG))
    assert "%|" not in plain.stderr


# -- in process: patches, levels, memory ------------------------------------------------------------------------


def event(verb: str, seconds: int, *, level: str = "RequestResponse", request: Any = None, response: Any = None,
          user: str = f"system:node:{NODE}", code: int = 200) -> dict[str, Any]:
    ev: dict[str, Any] = {
        "kind": "Event", "apiVersion": "audit.k8s.io/v1", "level": level, "auditID": f"id-{verb}-{seconds}",
        "stage": "ResponseComplete", "requestURI": f"/apis/storage.k8s.io/v1/csinodes/{NODE}", "verb": verb,
        "user": {"username": user, "groups": ["system:nodes", "system:authenticated"]},
        "objectRef": {"resource": "csinodes", "name": NODE, "apiGroup": "storage.k8s.io", "apiVersion": "v1"},
        "responseStatus": {"metadata": {}, "code": code},
        "requestReceivedTimestamp": f"2026-11-30T03:{seconds // 60:02d}:{seconds % 60:02d}.000000Z",
        "stageTimestamp": f"2026-11-30T03:{seconds // 60:02d}:{seconds % 60:02d}.004000Z",
    }
    if level != "Metadata":
        if request is not None:
            ev["requestObject"] = request
        if response is not None and level == "RequestResponse":
            ev["responseObject"] = response
    return ev


def csinode(count: int | None) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": EBS, "nodeID": "i-0a1b2c3d4e5f60718", "topologyKeys": None}
    if count is not None:
        entry["allocatable"] = {"count": count}
    return {"kind": "CSINode", "apiVersion": "storage.k8s.io/v1",
            "metadata": {"name": NODE, "uid": "9f1c2a7e", "resourceVersion": "1"}, "spec": {"drivers": [entry]}}


def run_events(tmp_path: Path, events: list[dict[str, Any]]) -> tuple[list[Row], Any]:
    path = tmp_path / "audit.log"
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    rows: list[Row] = []
    summary = replay([path], load_policy(), rows.append)
    return rows, summary


@pytest.mark.parametrize(
    "patch",
    [
        pytest.param([{"op": "replace", "path": "/spec/drivers/0/allocatable/count", "value": 40}],
                     id="a JSON patch is applied to the previous version"),
        pytest.param({"spec": {"drivers": [{"name": EBS, "allocatable": {"count": 40}}]}},
                     id="a merge patch merges spec.drivers by name"),
    ],
)
def test_patch_events_at_request_level(tmp_path: Path, patch: Any) -> None:
    rows, _ = run_events(tmp_path, [
        event("create", 0, request=csinode(20), response=csinode(20), code=201),
        event("patch", 90, level="Request", request=patch, user="system:serviceaccount:kube-system:tuner"),
    ])
    created, row = rows  # kubelet's CREATE is judged too (a registration at 20)
    assert (created.old, created.new, created.final, created.decision) == ("registered", 20, 20, "allow")
    assert (row.old, row.new, row.final, row.decision) == (20, 40, 20, "deny")
    assert row.rules[0] == "writer-identity"


def test_a_metadata_level_write_makes_the_next_event_unjudgeable_but_seeds_the_object(tmp_path: Path) -> None:
    rows, summary = run_events(tmp_path, [
        event("create", 0, request=csinode(20), response=csinode(20), code=201),
        event("update", 90, level="Metadata"),
        event("update", 180, request=csinode(21), response=csinode(21)),
        event("update", 270, request=csinode(unbounded := None), response=csinode(unbounded)),
        event("update", 360, request=csinode(30), code=409),
    ])
    assert summary.metadata_level == 1 and summary.no_previous_version == 1 and summary.failed_in_cluster == 1
    created, row = rows
    assert (created.old, created.new, created.decision) == ("registered", 20, "allow")
    assert (row.old, row.new, row.final, row.decision) == (21, "unbounded", 21, "clamp")


def test_the_guard_state_carries_from_event_to_event(tmp_path: Path) -> None:
    """Two increases 30 s apart: the second breaks change-rate only if the first one's state was kept."""
    created = csinode(20)
    created["metadata"]["annotations"] = {"csinode-guard.io/state": "a real guard's state, replaced"}
    rows, _ = run_events(tmp_path, [
        event("create", 0, request=created, response=created, code=201),
        event("update", 90, request=csinode(21), response=csinode(21)),
        event("update", 120, request=csinode(22), response=csinode(22)),
    ])
    # The CREATE (judged, carrying no state of its own), the first increase, the second one too soon after it
    # (the node's kubelet's: held at the stored 21).
    assert [(r.decision, r.rules, r.final) for r in rows] == [
        ("allow", (), 20), ("allow", (), 21), ("clamp", ("change-rate",), 21)]


def test_memory_stays_flat_as_the_log_grows(tmp_path: Path) -> None:
    """Constant memory: the peak for a log 8 times larger is about the same (streamed, nothing kept per line)."""
    other = json.dumps({
        "kind": "Event", "apiVersion": "audit.k8s.io/v1", "level": "Metadata", "auditID": "x", "stage":
        "ResponseComplete", "requestURI": "/api/v1/namespaces/default/pods/web-0", "verb": "get",
        "user": {"username": "system:serviceaccount:default:web", "groups": ["system:authenticated"]},
        "objectRef": {"resource": "pods", "namespace": "default", "name": "web-0", "apiVersion": "v1"},
        "responseStatus": {"metadata": {}, "code": 200}, "requestReceivedTimestamp": "2026-11-30T03:00:00.000000Z",
        "stageTimestamp": "2026-11-30T03:00:00.001000Z"}) + "\n"

    policy = load_policy()

    def peak(copies: int) -> int:
        path = tmp_path / f"audit-{copies}.log.gz"
        with gzip.open(path, "wt", compresslevel=1) as f:
            for i in range(copies):
                f.write(other * 300)
                count = 20 + (i % 2)
                f.write(json.dumps(event("update", 60 + i * 61, request=csinode(count),
                                         response=copy.deepcopy(csinode(count)))) + "\n")
        rows: list[Row] = []
        tracemalloc.start()
        try:
            summary = replay([path], policy, rows.append)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
            assert summary.lines == copies * 301

    small, large = peak(6), peak(48)
    assert large < small * 1.5 + 256 * 1024, (small, large)
    assert large < 4 * 1024 * 1024
