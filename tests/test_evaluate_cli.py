"""``csinode-guard evaluate`` as a subprocess: the AdmissionReview on standard output, the explanation apart."""

from __future__ import annotations

import json
import subprocess
import sys

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
