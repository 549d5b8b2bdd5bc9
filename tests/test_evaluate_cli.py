"""``csinode-guard evaluate`` as a subprocess: the AdmissionReview on standard output, the explanation apart."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

REVIEW = REPO / "tests" / "data" / "review-report-39.json"


def test_standard_output_is_only_the_json_answer_and_the_explanation_goes_to_standard_error() -> None:
    evaluate = subprocess.run(
        [sys.executable, "-m", "webhook", "evaluate", "--review", str(REVIEW), "--now", "2026-11-30T02:00:00Z"],
        cwd=REPO, capture_output=True, timeout=60, check=False,
    )
    assert evaluate.returncode in (0, 1), evaluate.stderr
    tool = subprocess.run([sys.executable, "-m", "json.tool"], input=evaluate.stdout, capture_output=True,
                          timeout=60, check=False)
    assert tool.returncode == 0, tool.stderr
    answer = json.loads(evaluate.stdout)
    assert answer["kind"] == "AdmissionReview" and answer["apiVersion"] == "admission.k8s.io/v1"
    explanation = evaluate.stderr.decode().splitlines()
    assert explanation[0].startswith("# decision: ")
    assert any(line.startswith("# count-ceiling") for line in explanation), explanation
    assert "#" not in evaluate.stdout.decode()


def _evaluate_with_facts(facts: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "webhook", "evaluate", "--review", str(REVIEW), "--now", "2026-11-30T02:00:00Z",
         "--cluster-facts", str(facts)],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=False,
    )


@pytest.mark.parametrize(("content", "expected"), [
    pytest.param(b"\xff\xfe\x00\x81random\x9c", "not UTF-8 text", id="random bytes are not UTF-8 text"),
    pytest.param(b"nodes: 5\n", "$.nodes: 5 is not of type 'object'", id="nodes that are not a mapping"),
    pytest.param(b"nodes:\n  ip-10-0-1-23.ec2.internal:\n    labels: 7\n",
                 "$.nodes['ip-10-0-1-23.ec2.internal'].labels: 7 is not of type", id="labels that are a number"),
    pytest.param(b"nodes:\n  n1:\n    labels: {zone: 3}\n", "$.nodes.n1.labels.zone: 3 is not of type 'string'",
                 id="a label value that is not a string"),
    pytest.param(b"attached:\n  - {node: n1, driver: d, count: many}\n", "$.attached[0].count: 'many'",
                 id="an attached count that is not a number"),
    pytest.param(b"node:\n  n1: {}\n", "'node' was unexpected", id="a misspelt top-level key"),
])
def test_unusable_cluster_facts_exit_2_with_a_message_naming_the_problem(
    tmp_path: Path, content: bytes, expected: str
) -> None:
    facts = tmp_path / "facts.yaml"
    facts.write_bytes(content)
    result = _evaluate_with_facts(facts)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert f"Error: {facts}: " in result.stderr
    assert expected in result.stderr
    assert result.stdout == ""


def test_well_formed_cluster_facts_are_used(tmp_path: Path) -> None:
    facts = tmp_path / "facts.yaml"
    facts.write_text("nodes:\n  ip-10-0-1-23.ec2.internal:\n    labels: {node.kubernetes.io/instance-type: m6i.large}\n"
                     "    kubeletVersion: v1.35.0\ndriverPeriods: {ebs.csi.aws.com: 60}\n")
    result = _evaluate_with_facts(facts)
    assert result.returncode in (0, 1), result.stderr
    assert json.loads(result.stdout)["kind"] == "AdmissionReview"
