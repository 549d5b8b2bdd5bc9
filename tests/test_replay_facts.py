"""replay on files that cannot give the guard's decisions: the guard's own audit log (refused, exit code 2) and an
apiserver log whose Nodes and VolumeAttachments are logged at Metadata level (a warning per kind of fact); and
the policy replay judged with, named in its output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.conftest import REPO
from webhook.admission.policy import load_policy

LOG = REPO / "tests" / "data" / "audit" / "kube-apiserver-audit.log"


def cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """replay with no cluster configured (no KUBECONFIG, an empty home): the bundled default, or --policy."""
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "CSINODE_GUARD_KUBECONFIG")}
    env["HOME"] = str(tmp_path)
    return subprocess.run([sys.executable, "-m", "webhook", "replay", "--no-progress", *args], capture_output=True,
                          text=True, cwd=REPO, timeout=60, check=False, env=env)


def _metadata_level(tmp_path: Path, resources: tuple[str, ...]) -> Path:
    """LOG as an apiserver whose audit policy logs ``resources`` at Metadata level writes it."""
    out = []
    for line in LOG.read_text("utf-8").splitlines():
        try:
            event: dict[str, Any] = json.loads(line)
        except ValueError:  # the log's broken lines stay as they are
            out.append(line)
            continue
        if (event.get("objectRef") or {}).get("resource") in resources:
            event["level"] = "Metadata"
            event.pop("requestObject", None)
            event.pop("responseObject", None)
        out.append(json.dumps(event))
    path = tmp_path / "metadata.log"
    path.write_text("\n".join(out) + "\n", "utf-8")
    return path


def test_a_full_log_gets_no_warning_and_names_the_policy(tmp_path: Path) -> None:
    result = cli(tmp_path, "--audit-log", str(LOG))
    assert result.returncode == 0, result.stderr
    assert "warning" not in result.stderr
    bundled = load_policy(None)
    assert f"Judged with policy default (hash {bundled.hash}, the bundled default)" in result.stdout
    as_json = cli(tmp_path, "--audit-log", str(LOG), "--format", "json", "--policy", str(REPO / "policies" /
                                                                                          "default.yaml"))
    summary = json.loads(as_json.stdout)["summary"]
    assert summary["missingFacts"] == []
    assert summary["policy"] == {"name": "default", "hash": bundled.hash, "origin": "file",
                                 "source": str(REPO / "policies" / "default.yaml")}


def test_metadata_level_facts_are_warned_about_by_kind_and_change_decisions(tmp_path: Path) -> None:
    path = _metadata_level(tmp_path, ("nodes", "volumeattachments"))
    result = cli(tmp_path, "--audit-log", str(path), "--format", "json")
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("replay: warning: ")]
    assert len(warnings) == 2, result.stderr
    assert any("nodes are logged at Metadata level only" in w and "Node labels" in w for w in warnings)
    assert any("volumeattachments are logged at Metadata level only" in w and "attach errors" in w
               for w in warnings)
    assert all("docs/apiserver-audit-policy.yaml" in w for w in warnings)
    assert len(json.loads(result.stdout)["summary"]["missingFacts"]) == 2
    full = json.loads(cli(tmp_path, "--audit-log", str(LOG), "--format", "json").stdout)["events"]
    blind = json.loads(result.stdout)["events"]
    # without the ResourceExhausted attach error the 21 -> 39 at 02:03:20 is no longer held by count-rollback
    [held] = [e for e in full if e["time"] == "2026-11-30T02:03:20.001Z"]
    [unheld] = [e for e in blind if e["time"] == "2026-11-30T02:03:20.001Z"]
    assert "count-rollback" in held["rules"] and "count-rollback" not in unheld["rules"]


def test_a_log_without_node_events_is_warned_about(tmp_path: Path) -> None:
    path = tmp_path / "csinodes-only.log"
    path.write_text("".join(line for line in LOG.read_text("utf-8").splitlines(keepends=True)
                            if '"resource":"nodes"' not in line.replace(" ", "")), "utf-8")
    result = cli(tmp_path, "--audit-log", str(path))
    assert result.returncode == 0, result.stderr
    assert "the log has no nodes events" in result.stderr


def test_the_guards_own_audit_log_is_refused(tmp_path: Path) -> None:
    record = {"time": "2026-11-30T02:00:01Z", "uid": "u", "endpoint": "mutate", "node": "n", "decision": "allow",
              "policyHash": "0123", "kind": "CSINode", "rules": []}
    path = tmp_path / "decisions.log"
    path.write_text("\n".join(json.dumps({**record, "uid": f"u{i}"}) for i in range(47)) + "\n", "utf-8")
    result = cli(tmp_path, "--audit-log", str(path))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "not an apiserver audit log" in result.stderr and "csinode-guard audit" in result.stderr
