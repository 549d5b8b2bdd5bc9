"""``csinode-guard policy test`` and ``policy validate``: table-driven tests over time, as operators run them."""

from __future__ import annotations

import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO
from webhook.admission.policy import load_policy
from webhook.simulation.policy_tests import run_cases, run_test_file

DEFAULT = REPO / "policies" / "default.yaml"
NODE = "ip-10-0-1-23.ec2.internal"
EBS = "ebs.csi.aws.com"


def cli(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "webhook", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=60, check=False)


def write_yaml(path: Path, doc: Any) -> Path:
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def policy_with(tmp_path: Path, name: str = "custom.yaml", **changes: Any) -> Path:
    """The default policy with ``changes`` applied (dotted paths under spec, ``__`` for ``.``)."""
    doc = yaml.safe_load(DEFAULT.read_text())
    for dotted, value in changes.items():
        node = doc["spec"]
        keys = [k.replace("_", "-") for k in dotted.split("__")]
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
    return write_yaml(tmp_path / name, doc)


def make_test_file(tmp_path: Path, cases: list[dict[str, Any]], policy: Path = DEFAULT, name: str = "t.yaml") -> Path:
    doc = {"apiVersion": "csinode-guard.io/v1alpha1", "kind": "PolicyTest", "policy": str(policy),
           "start": "2026-11-30T02:00:00Z", "cases": cases}
    return write_yaml(tmp_path / name, doc)


def one_node(steps: list[dict[str, Any]], name: str = "case", count: int = 25, **node: Any) -> dict[str, Any]:
    return {"name": name, "nodes": {NODE: {"drivers": {EBS: count}, **node}}, "steps": steps}


# -- the shipped examples ---------------------------------------------------------------------------------------


def test_the_example_tests_of_the_default_policy_pass() -> None:
    result = cli("policy", "test", "policies/tests")
    assert result.returncode == 0, result.stdout + result.stderr
    assert " 0 failed" in result.stdout
    assert "FAIL" not in result.stdout


def test_the_examples_cover_every_rule_and_outcome() -> None:
    """Every rule fires somewhere, and every decision the guard makes on a write is expected somewhere."""
    rules: set[str] = set()
    decisions: set[str] = set()
    state_keys: set[str] = set()
    for path in sorted((REPO / "policies" / "tests").glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        assert doc["policy"] == "../default.yaml"
        for case in doc["cases"]:
            for step in case["steps"]:
                expect = step.get("expect") or {}
                rules.update(expect.get("rules") or ())
                if "decision" in expect:
                    decisions.add(expect["decision"])
                for entry in (expect.get("state") or {}).values():
                    state_keys.update(k for k, v in entry.items() if v not in (None, False))
    assert rules == {"writer-identity", "writer-version", "count-ceiling", "count-rollback", "change-rate",
                     "state-integrity"}
    assert decisions >= {"allow", "warn", "clamp", "deny", "skip"}
    assert {"frozen", "correction"} <= state_keys


def test_junit_output_for_ci(tmp_path: Path) -> None:
    report = tmp_path / "policy-tests.xml"
    result = cli("policy", "test", "policies/tests", "--output", "junit", "--output-file", str(report))
    assert result.returncode == 0, result.stderr
    root = ET.parse(report).getroot()
    assert root.tag == "testsuites"
    assert root.get("failures") == "0" and root.get("errors") == "0"
    suites = root.findall("testsuite")
    assert {Path(s.get("name", "")).name for s in suites} >= {"default-ceiling.yaml", "default-version.yaml"}
    assert int(root.get("tests", "0")) == sum(len(s.findall("testcase")) for s in suites) >= 20
    assert "passed, 0 failed" in result.stderr


# -- failures are readable --------------------------------------------------------------------------------------


def failing_file(tmp_path: Path) -> Path:
    return make_test_file(tmp_path, [
        one_node([
            {"drivers": {EBS: 39}, "expect": {"decision": "clamp", "final": {EBS: 27}}},
            {"name": "wrong on purpose", "after": "10s", "user": "kubelet:ip-10-0-2-51.ec2.internal",
             "drivers": {EBS: 26},
             "expect": {"decision": "allow", "rules": ["count-ceiling"], "final": {EBS: 26},
                        "warnings": ["no such warning"]}},
        ], name="a wrong expectation"),
        one_node([{"drivers": {EBS: 24}, "expect": {"decision": "allow"}}], name="a right one"),
    ], name="failing.yaml")


def test_a_failing_case_exits_non_zero_with_expected_versus_actual(tmp_path: Path) -> None:
    result = cli("policy", "test", str(failing_file(tmp_path)))
    assert result.returncode == 1
    out = result.stdout
    assert "FAIL  a wrong expectation" in out
    assert "PASS  a right one" in out
    assert "step 2 'wrong on purpose' at +10s" in out
    assert "UPDATE ebs.csi.aws.com 27 -> 26 by system:node:ip-10-0-2-51.ec2.internal -> deny [writer-identity]" in out
    assert "decision: expected allow, got deny" in out
    assert "rules: expected [count-ceiling], got [writer-identity]  (-count-ceiling +writer-identity)" in out
    assert "final ebs.csi.aws.com: expected 26, got 27" in out
    assert "warnings: expected one containing 'no such warning', got: (none)" in out
    assert "denied: [writer-identity] ip-10-0-1-23.ec2.internal/ebs.csi.aws.com: 27 -> 26: written by another" in out
    assert "why:" in out and "writer-identity  ebs.csi.aws.com: violation (deny -> deny)" in out
    assert "2 cases: 1 passed, 1 failed" in out


def test_junit_reports_the_failure_with_its_diff(tmp_path: Path) -> None:
    result = cli("policy", "test", str(failing_file(tmp_path)), "--output", "junit")
    assert result.returncode == 1
    root = ET.fromstring(result.stdout)
    cases = {c.get("name"): c for c in root.iter("testcase")}
    failure = cases["a wrong expectation"].find("failure")
    assert failure is not None
    assert failure.get("message") == "step 2: decision: expected allow, got deny"
    assert "final ebs.csi.aws.com: expected 26, got 27" in (failure.text or "")
    assert cases["a right one"].find("failure") is None
    assert root.get("failures") == "1"


def test_policy_option_runs_the_same_tests_against_another_policy(tmp_path: Path) -> None:
    strict = policy_with(tmp_path, rules__count_ceiling__enforcementAction="deny")
    result = cli("policy", "test", "policies/tests/default-ceiling.yaml", "--policy", str(strict))
    assert result.returncode == 1
    assert f"(policy {strict}," in result.stdout
    # For the node's own kubelet a ceiling set to deny holds the stored count (its deny acts as a clamp to it),
    # where the default policy's clamp lowers the count to the ceiling.
    assert "final ebs.csi.aws.com: expected 27, got 25" in result.stdout


@pytest.mark.parametrize(
    ("broken", "where", "problem"),
    [
        pytest.param({"decison": "allow"}, "$.cases[0].steps[0].expect", "'decison' was unexpected",
                     id="a typo in expect is an error, not a silent pass"),
        pytest.param({"rules": ["count-cieling"]}, "$.cases[0].steps[0].expect.rules[0]", "is not one of",
                     id="an unknown rule id is an error"),
    ],
)
def test_a_broken_test_file_is_reported_with_its_path(tmp_path: Path, broken: dict[str, Any], where: str,
                                                      problem: str) -> None:
    path = make_test_file(tmp_path, [one_node([{"drivers": {EBS: 24}, "expect": broken}])])
    result = cli("policy", "test", str(path))
    assert result.returncode == 1
    assert f"ERROR {path}" in result.stdout
    assert where in result.stdout and problem in result.stdout


def test_a_test_file_of_random_bytes_is_reported_like_validate_reports_it(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_bytes(b"\xff\xfe\x81\x00garbage\x9c")
    result = cli("policy", "test", str(path))
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert f"ERROR {path}" in result.stdout
    assert f"{path}: at byte 0: not UTF-8 text" in result.stdout
    assert "1 could not run" in result.stdout


def test_a_step_on_an_undeclared_node_stops_the_case(tmp_path: Path) -> None:
    path = make_test_file(tmp_path, [one_node([{"node": "nope", "drivers": {EBS: 24}}])])
    (result,) = run_test_file(path).cases
    assert result.error is not None
    assert "$.cases[0].steps[0].node" in result.error and "not declared" in result.error


# -- policy validate --------------------------------------------------------------------------------------------


def test_validate_reports_file_path_and_constraint(tmp_path: Path) -> None:
    broken = policy_with(tmp_path, "broken.yaml", rules__change_rate__minInterval="fast")
    result = cli("policy", "validate", str(broken), "policies/default.yaml")
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert lines[0] == (f"{broken}: invalid: at $.spec.rules.change-rate.minInterval: 'fast' is not a duration "
                        "like 30s, 15m or 2h (or a number of seconds)")
    assert lines[1].startswith("policies/default.yaml: ok (GuardPolicy 'default', hash ")
    assert "1 invalid file" in result.stderr


@pytest.mark.parametrize(
    ("setting", "value", "path"),
    [
        pytest.param("ceiling", {"max": "27"}, "$.spec.drivers['ebs.csi.aws.com'].ceiling.max",
                     id="schema violation under a dotted driver name"),
        pytest.param("ceiling", {"max": 27, "values": {"m6i.large": 39}},
                     "$.spec.drivers['ebs.csi.aws.com'].ceiling.values['m6i.large']",
                     id="a dotted value name under a dotted driver name"),
        pytest.param("minVersion", "1.2.3-01", "$.spec.drivers['ebs.csi.aws.com'].minVersion",
                     id="a semantic check under a dotted driver name"),
    ],
)
def test_validate_writes_paths_through_dotted_names_with_brackets(tmp_path: Path, setting: str, value: Any,
                                                                  path: str) -> None:
    doc = yaml.safe_load(DEFAULT.read_text())
    doc["spec"]["drivers"][EBS] = {setting: value}
    broken = write_yaml(tmp_path / "dotted.yaml", doc)
    result = cli("policy", "validate", str(broken))
    assert result.returncode == 1
    assert result.stdout.startswith(f"{broken}: invalid: at {path}: "), result.stdout


def test_validate_a_directory_tells_policies_profiles_and_tests_apart() -> None:
    result = cli("policy", "validate", "policies")
    assert result.returncode == 0, result.stdout
    assert "default.yaml: ok (GuardPolicy" in result.stdout
    assert "profiles/ebs.csi.aws.com.yaml: ok (DriverProfile" in result.stdout
    assert "tests/default-ceiling.yaml: ok (PolicyTest" in result.stdout


def test_validate_an_unreadable_file(tmp_path: Path) -> None:
    result = cli("policy", "validate", str(tmp_path / "missing.yaml"))
    assert result.returncode == 1
    assert f"{tmp_path / 'missing.yaml'}: invalid: at (document): cannot read" in result.stdout


# -- semantics (in process) -------------------------------------------------------------------------------------


def run(cases: list[dict[str, Any]], policy: Path = DEFAULT) -> list[Any]:
    doc = {"start": "2026-11-30T02:00:00Z", "cases": cases}
    return run_cases(doc, load_policy(policy))


def assert_passed(results: list[Any]) -> None:
    for case in results:
        assert case.error is None, case.error
        for step in case.steps:
            assert step.passed, (case.name, step.index, step.failures, step.explanation)


def test_the_cluster_wide_increase_budget_spans_the_nodes_of_a_case(tmp_path: Path) -> None:
    policy = policy_with(tmp_path, rules__change_rate__clusterBudget={"increasesPerSecond": 1, "burst": 2})
    nodes = {f"node-{i}": {"drivers": {EBS: 10}} for i in range(4)}
    steps = [{"node": f"node-{i}", "drivers": {EBS: 11}, "expect": {"decision": "allow"}} for i in range(2)]
    steps.append({"node": "node-2", "drivers": {EBS: 11},
                  "expect": {"decision": "clamp", "rules": ["change-rate"], "final": {EBS: 10},
                             "warnings": ["cluster-wide increase budget",
                                          "change-rate deny acts as clamp for the node's kubelet"]}})
    steps.append({"node": "node-3", "after": "1s", "drivers": {EBS: 11}, "expect": {"decision": "allow"}})
    assert_passed(run([{"name": "budget", "nodes": nodes, "steps": steps}], policy))


def test_min_version_and_the_pod_version_source(tmp_path: Path) -> None:
    policy = policy_with(tmp_path, drivers__ebs_csi_aws_com={
        "minVersion": "v1.30.0",
        "versionSource": {"type": "pod", "namespace": "kube-system",
                          "selector": {"matchLabels": {"app": "ebs-csi-node"}}, "container": "ebs-plugin"},
        "ceiling": {"max": 128},
    })
    doc = yaml.safe_load(policy.read_text())
    doc["spec"]["drivers"]["ebs.csi.aws.com"] = doc["spec"]["drivers"].pop("ebs-csi-aws-com")
    write_yaml(policy, doc)
    assert_passed(run([one_node([
        {"driverVersions": {EBS: "v1.29.3"}, "drivers": {EBS: 26},
         "expect": {"decision": "clamp", "rules": ["writer-version"], "final": {EBS: 25},
                    "warnings": ["(clamped to 25): driver version v1.29.3 is below minVersion v1.30.0"]}},
        {"after": "1m", "driverVersions": {EBS: "v1.37.0"}, "drivers": {EBS: 26},
         "expect": {"decision": "allow", "state": {EBS: {"writerVersion": "v1.37.0"}}}},
    ])], policy))


def test_a_whole_object_step_and_a_clamp_back_to_the_stored_object_leave_it_byte_identical() -> None:
    results = run([one_node([
        {"drivers": {EBS: 23}, "expect": {"written": True}},
        {"after": "2m", "drivers": {EBS: "unbounded"},
         "expect": {"decision": "clamp", "written": False, "final": {EBS: 23}}},
    ])])
    assert_passed(results)
    doc = {"start": "2026-11-30T02:00:00Z", "cases": [{
        "name": "object", "nodes": {NODE: {"object": {
            "apiVersion": "storage.k8s.io/v1", "kind": "CSINode",
            "metadata": {"name": NODE, "uid": "0b7c", "resourceVersion": "7"},
            "spec": {"drivers": [{"name": EBS, "nodeID": "i-1", "allocatable": {"count": 20}}]}}}},
        "steps": [{"object": {
            "apiVersion": "storage.k8s.io/v1", "kind": "CSINode",
            "metadata": {"name": NODE, "uid": "0b7c", "resourceVersion": "7"},
            "spec": {"drivers": [{"name": EBS, "nodeID": "i-1", "allocatable": {"count": 30}}]}},
            "expect": {"decision": "clamp", "final": {EBS: 27}, "state": {EBS: {"count": 27}}}}],
    }]}
    assert_passed(run_cases(doc, load_policy()))


def test_time_is_at_from_the_start_or_after_the_previous_step() -> None:
    results = run([one_node([
        {"at": "10m", "drivers": {EBS: 26}},
        {"after": "30s", "drivers": {EBS: 27}, "expect": {"decision": "clamp", "final": {EBS: 26}}},
        {"at": "11m", "drivers": {EBS: 27}, "expect": {"decision": "allow"}},
    ])])
    assert_passed(results)
    assert [s.offset for s in results[0].steps] == [600.0, 630.0, 660.0]


def test_a_justification_with_an_absolute_expiry_that_has_passed_is_not_recorded() -> None:
    assert_passed(run([one_node([
        {"user": "alice", "groups": ["csinode-guard:approvers"],
         "justification": [{"driver": EBS, "minCount": 0, "maxCount": 0, "expires": "2026-11-30T01:00:00Z"}],
         "expect": {"decision": "allow", "warnings": ["expired at 2026-11-30T01:00:00+00:00; not recorded"]}},
        {"after": "1m", "drivers": {EBS: 0}, "expect": {"decision": "warn", "rules": ["count-rollback"]}},
    ])]))


def test_a_step_with_only_facts_may_not_expect_a_decision() -> None:
    (case,) = run([one_node([{"resourceExhausted": [EBS], "expect": {"decision": "allow"}}])])
    assert case.error is not None and "a step without a write has no decision" in case.error


def _why_lines(stdout: str) -> list[str]:
    """The explanation lines ``policy test`` prints under a failed step (one per rule outcome)."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "why:")
    return [line.strip() for line in lines[start + 1:] if line.startswith("            ")]


def test_a_change_rate_pass_lifted_by_a_justification_names_the_justification(tmp_path: Path) -> None:
    """An approver's justification (20..27), then kubelet raises the count 45 s after the last accepted change:
    admitted, and the change-rate outcome says the justification lifted the minimum interval."""
    path = make_test_file(tmp_path, [one_node([
        {"drivers": {EBS: 2}, "expect": {"decision": "allow"}},
        {"after": "10s", "user": "alice", "groups": ["csinode-guard:approvers", "system:authenticated"],
         "justification": [{"driver": EBS, "reason": "more volumes", "minCount": 20, "maxCount": 27,
                            "expires": "2h", "ticket": "OPS-4711"}],
         "expect": {"decision": "allow", "approvals": 1}},
        # "called: false" is deliberately wrong: the failed step prints every rule outcome.
        {"after": "35s", "drivers": {EBS: 20}, "expect": {"decision": "allow", "final": {EBS: 20}, "called": False}},
    ], count=1)])
    result = cli("policy", "test", str(path))
    assert "called: expected false, got true" in result.stdout, result.stdout
    assert [f for f in result.stdout.splitlines() if f.strip().startswith(("decision:", "final:"))] == []
    [rate] = [line for line in _why_lines(result.stdout) if line.startswith("change-rate")]
    assert ": pass - 45s since the last accepted change (minimum 60s); the minimum is lifted by the " \
           "justification by alice (OPS-4711) for counts 20..27" in rate, rate


@pytest.mark.parametrize(("version", "expected"), [
    pytest.param("banana", "pass - driver version banana (annotation source) cannot be compared: not a semantic "
                 "version; writer-version.onUnknown: allow applied", id="a version that is not semantic"),
    pytest.param("v1.37.0", "pass - driver version v1.37.0 (annotation source)", id="a comparable version"),
])
def test_a_writer_version_pass_says_when_the_version_could_not_be_compared(
    tmp_path: Path, version: str, expected: str
) -> None:
    policy = policy_with(tmp_path, defaults__minVersion="v1.30.0", rules__writer_version__onUnknown="allow")
    path = make_test_file(tmp_path, [one_node([
        {"drivers": {EBS: 26}, "expect": {"decision": "allow", "called": False}},
    ], driverVersions={EBS: version})], policy=policy)
    result = cli("policy", "test", str(path))
    assert "called: expected false, got true" in result.stdout, result.stdout + result.stderr
    [line] = [line for line in _why_lines(result.stdout) if line.startswith("writer-version")]
    # The source (annotation, pod, kubelet) is the driver profile's; the rest of the sentence is the point.
    assert re.search(re.escape(expected).replace(re.escape("(annotation source)"), r"\(\w+ source\)"), line), line


# -- the automatic brake ----------------------------------------------------------------------------------------


def rollout_with_failures(code: int, expect_engaged: bool) -> dict[str, Any]:
    """Three nodes raised 20 -> 25, then attach errors with ``code`` on two of them, then an increase on the third
    that expects the brake ``expect_engaged`` and the matching decision."""
    nodes = {f"node-{i}": {"drivers": {EBS: 20}} for i in (1, 2, 3)}
    steps: list[dict[str, Any]] = [
        {"node": n, "after": "1s", "drivers": {EBS: 25}, "expect": {"decision": "allow"}} for n in nodes
    ]
    steps += [{"node": n, "at": "10m", "attachErrors": [{"driver": EBS, "code": code}]} for n in ("node-1", "node-2")]
    held = {"decision": "clamp", "rules": ["count-rollback"], "final": {EBS: 20}}
    steps.append(
        {
            "node": "node-3",
            "after": "1m",
            "drivers": {EBS: 26},
            "expect": {"brake": {EBS: expect_engaged}, **(held if expect_engaged else {"decision": "allow"})},
        }
    )
    return {"name": f"errorCode {code}", "nodes": nodes, "steps": steps}


def test_a_brake_expectation_is_checked_against_the_leaders_decision(tmp_path: Path) -> None:
    passing = cli(
        "policy",
        "test",
        str(make_test_file(tmp_path, [rollout_with_failures(8, True), rollout_with_failures(9, False)])),
    )
    assert passing.returncode == 0, passing.stdout + passing.stderr
    wrong = cli("policy", "test", str(make_test_file(tmp_path, [rollout_with_failures(9, True)], name="w.yaml")))
    assert wrong.returncode == 1
    assert "brake ebs.csi.aws.com: expected engaged, got not engaged" in wrong.stdout
    assert "decision: expected clamp, got allow" in wrong.stdout


def test_a_policy_without_the_brake_engages_none(tmp_path: Path) -> None:
    off = policy_with(tmp_path, brake__enabled=False)
    result = cli("policy", "test", str(make_test_file(tmp_path, [rollout_with_failures(8, False)], policy=off)))
    assert result.returncode == 0, result.stdout + result.stderr
    engaged = cli(
        "policy", "test", str(make_test_file(tmp_path, [rollout_with_failures(8, True)], policy=off, name="e.yaml"))
    )
    assert "brake ebs.csi.aws.com: expected engaged, got not engaged" in engaged.stdout
