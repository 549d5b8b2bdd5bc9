"""kubectl's conventions across the commands (docs/cli.md), as subprocesses: ``-o/--output`` with yaml wherever a
command prints results, ``-f/--filename`` as an input, one exit code table in every ``--help``, a ``completion``
command; ``audit query`` selects every record kind and prints no Python values in fixed columns; and each old
spelling still works for one release, with a deprecation warning on standard error."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO
from tests.test_auditlog import T0, _write_log_from_registration, guard_log
from tests.test_replay import LOG as REPLAY_LOG
from webhook.admission.policy import EnforcementAction
from webhook.admission.standing import StandingFinding, audit_record

EBS = "ebs.csi.aws.com"
LONG_NODE = "ip-10-0-1-23.eu-central-1.compute.internal"  # longer than the table's NODE column


def cli(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "webhook", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=120, check=False)


@pytest.fixture(scope="module")
def mixed_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Admission records (an incident, a dry run, a first registration) and the background audit's records (a
    standing violation and its repair) in one guard audit log."""
    work = tmp_path_factory.mktemp("mixed")
    registration = work / "registration.log"
    _write_log_from_registration(registration, [(0, 25), (120, 22)])
    finding = StandingFinding(LONG_NODE, EBS, "count-ceiling", 39, 27, "above the ceiling 27", "fix the driver",
                              EnforcementAction.CLAMP, True)
    audit = [audit_record(finding, now=T0 + timedelta(hours=1), trigger="start", policy_hash="abc",
                          policy_generation=1, decision="standing-violation", final=39),
             audit_record(finding, now=T0 + timedelta(hours=1, seconds=1), trigger="start", policy_hash="abc",
                          policy_generation=1, decision="repaired", final=27)]
    lines = [json.dumps(r) for r in guard_log()] + registration.read_text().splitlines() + \
            [json.dumps(r) for r in audit]
    path = work / "audit.log"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_audit_query_selects_the_audits_records_by_endpoint_and_decision(mixed_log: Path) -> None:
    by_endpoint = cli("audit", "query", str(mixed_log), "--endpoint", "audit", "-o", "json")
    assert by_endpoint.returncode == 0, by_endpoint.stderr
    found = [json.loads(line) for line in by_endpoint.stdout.splitlines()]
    assert [r["decision"] for r in found] == ["standing-violation", "repaired"]
    standing = cli("audit", "query", str(mixed_log), "--decision", "standing-violation", "-o", "json")
    assert [json.loads(line)["node"] for line in standing.stdout.splitlines()] == [LONG_NODE]
    summary = json.loads(cli("audit", "summary", str(mixed_log), "-o", "json").stdout)
    for endpoint, decisions in summary["byEndpoint"].items():  # whatever summary lists, query selects
        for decision in decisions:
            result = cli("audit", "query", str(mixed_log), "--endpoint", endpoint, "--decision", decision)
            assert result.returncode == 0, (endpoint, decision, result.stderr)


def test_audit_query_table_keeps_its_columns_and_prints_no_python_values(mixed_log: Path) -> None:
    result = cli("audit", "query", str(mixed_log))
    assert result.returncode == 0, result.stderr
    header, *rows = result.stdout.splitlines()
    assert "None" not in result.stdout
    starts = [header.index(name) for name in ("ENDPOINT", "NODE", "DRIVER", "CHANGE", "FINAL", "DECISION",
                                               "DRY-RUN", "WRITER", "RULES")]
    for row in rows:  # every column starts under its header, the long node name too
        assert all(row[s - 1] == " " for s in starts), row
    first_registration = [r for r in rows if "new 25" in r]
    assert first_registration, "a first registration reads new 25"
    audit_rows = [r for r in rows if " audit " in r]
    assert audit_rows and all("\u2026" in r for r in audit_rows), "the long node name is cut in the middle"
    assert all("39 -> 27" in r for r in audit_rows)
    dry = [r for r in rows if r[starts[6]:starts[7]].strip() == "yes"]
    assert dry and all("kubernetes-admin" in r for r in dry), "the dry run is marked in its column"
    wide = cli("audit", "query", str(mixed_log), "-o", "wide").stdout
    assert LONG_NODE in wide and "POLICY" in wide.splitlines()[0]


@pytest.mark.parametrize("args", [
    pytest.param(["audit", "summary", "{log}"], id="audit summary"),
    pytest.param(["audit", "query", "{log}", "--endpoint", "audit"], id="audit query"),
    pytest.param(["policy", "test", "policies/tests/default-ceiling.yaml"], id="policy test"),
])
def test_yaml_output_is_a_document(args: list[str], mixed_log: Path) -> None:
    result = cli(*[a.format(log=mixed_log) for a in args], "-o", "yaml")
    assert result.returncode == 0, result.stderr
    docs = [d for d in yaml.safe_load_all(result.stdout) if d is not None]
    assert docs and all(isinstance(d, dict) for d in docs)


@pytest.mark.parametrize(("old", "new", "warning"), [
    pytest.param(["audit", "summary", "{log}", "--format", "json"], ["audit", "summary", "{log}", "-o", "json"],
                 "--format is deprecated", id="audit summary --format json"),
    pytest.param(["audit", "summary", "{log}", "--format", "text"], ["audit", "summary", "{log}"],
                 "--format is deprecated", id="audit summary --format text"),
    pytest.param(["audit", "query", "{log}", "--format", "json"], ["audit", "query", "{log}", "-o", "json"],
                 "--format is deprecated", id="audit query --format"),
    pytest.param(["replay", "--audit-log", "{replay}", "--format", "json", "--no-progress"],
                 ["replay", "--audit-log", "{replay}", "-o", "json", "--no-progress"], "--format is deprecated",
                 id="replay --format"),
    pytest.param(["policy", "test", "policies/tests/default-ceiling.yaml", "--output", "text"],
                 ["policy", "test", "policies/tests/default-ceiling.yaml", "-o", "table"],
                 "--output text is deprecated", id="policy test --output text"),
    pytest.param(["policy", "export", "--policy", "policies/default.yaml"],
                 ["policy", "export", "-f", "policies/default.yaml"], "--policy is deprecated",
                 id="policy export --policy"),
    pytest.param(["register", "--cert-dir", "{certs}", "--dry-run"],
                 ["register", "--cert-dir", "{certs}", "--dry-run=client"],
                 "--dry-run without a value is deprecated", id="register --dry-run"),
])
def test_a_deprecated_spelling_works_and_warns(old: list[str], new: list[str], warning: str, mixed_log: Path,
                                               tmp_path: Path) -> None:
    from webhook.serving import dev_certs  # noqa: PLC0415

    dev_certs.ensure_dev_certs(tmp_path / "certs")
    values = {"log": mixed_log, "certs": tmp_path / "certs", "replay": REPLAY_LOG}
    before = cli(*[a.format(**values) for a in old])
    after = cli(*[a.format(**values) for a in new])
    assert before.returncode == after.returncode == 0, before.stderr + after.stderr
    assert before.stdout == after.stdout
    assert warning in before.stderr and "will be removed in 0.3.0" in before.stderr, before.stderr
    assert "is deprecated" not in after.stderr


def test_timeline_takes_output_file_and_the_old_output_still_works(mixed_log: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    base = ["audit", "timeline", str(mixed_log), "--node", "ip-10-0-1-23.ec2.internal", "--driver", EBS]
    new = cli(*base, "--output-file", str(tmp_path / "new.png"))
    assert new.returncode == 0, new.stderr
    for flag in ("--output", "-o"):
        old = cli(*base, flag, str(tmp_path / "old.png"))
        assert old.returncode == 0 and f"{flag} is deprecated" in old.stderr, old.stderr
    assert cli(*base).returncode == 2


def test_policy_commands_take_files_with_f_and_positionally(tmp_path: Path) -> None:
    for args in (["policy", "validate", "-f", "policies/default.yaml"], ["policy", "validate", "policies/default.yaml"],
                 ["policy", "test", "-f", "policies/tests/default-ceiling.yaml"]):
        result = cli(*args)
        assert result.returncode == 0, (args, result.stderr)
    by_f = cli("policy", "export", "-f", "policies/default.yaml").stdout
    assert by_f == cli("policy", "export", "policies/default.yaml").stdout
    assert cli("policy", "export", "--output-file", str(tmp_path / "floor.yaml")).returncode == 0
    assert (tmp_path / "floor.yaml").read_text() == by_f
    assert cli("policy", "validate").returncode == 2, "no input is a usage error"


def _commands(group: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    import click  # noqa: PLC0415

    ctx = click.Context(group)
    out = []
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        out.append((*prefix, name))
        if isinstance(command, click.Group):
            out += _commands(command, (*prefix, name))
    return out


@pytest.mark.parametrize("path", [("",), ("status",), ("preflight",), ("audit", "query"), ("policy", "export"),
                                  ("uninstall",), ("unregister",)], ids=" ".join)
def test_every_help_ends_with_the_exit_code_table(path: tuple[str, ...]) -> None:
    result = cli(*[p for p in path if p], "--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    assert "Exit codes (every command): 0 ok; 1 findings or failure; 2 usage; 3 no cluster" in text, text


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_completion_prints_clicks_script_that_completes_the_commands(shell: str, tmp_path: Path) -> None:
    result = cli("completion", shell)
    assert result.returncode == 0, result.stderr
    assert "_CSINODE_GUARD_COMPLETE" in result.stdout
    script = Path(sys.executable).parent / "csinode-guard"  # the console script: completion keys on its name
    answer = subprocess.run([str(script)], capture_output=True, text=True, cwd=REPO, timeout=60,
                            check=False, env={"_CSINODE_GUARD_COMPLETE": f"{shell}_complete", "COMP_WORDS":
                                              "csinode-guard unin", "PATH": "/usr/bin:/bin",
                                              "COMP_CWORD": "unin" if shell == "fish" else "1"})  # fish: the word
    assert "uninstall" in answer.stdout, answer.stdout + answer.stderr
