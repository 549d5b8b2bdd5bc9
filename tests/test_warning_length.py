"""A warning the apiserver keeps (at most 256 characters) keeps its advice whole: a long one has its reason
shortened before the advice, which then starts within 200 characters (webhook/admission/evaluation/wording.py).
The denial message and the audit record keep the whole reason."""

from __future__ import annotations

import json
from pathlib import Path

from tests.clirun import run_cli
from webhook.admission.evaluation.wording import ADVICE_WITHIN, warning_line
from webhook.admission.review import MAX_WARNING_LENGTH

REVIEW = Path(__file__).parent / "data" / "review-report-39.json"
ADVICE = "fix the driver's volume limit (e.g. --volume-attach-limit), or raise the ceiling in the policy"


def test_a_warning_that_fits_is_left_as_it_is() -> None:
    line = f"[count-ceiling] node-a/ebs.csi.aws.com: 25 -> 39 (clamped to 27): above the ceiling 27; {ADVICE}"
    assert warning_line(line, "above the ceiling 27", ADVICE) == line


def test_a_long_warning_shortens_its_reason_and_keeps_its_advice_whole() -> None:
    why = "above the ceiling 27 (ceiling for node.kubernetes.io/instance-type=m6i.large, the EBS profile's table)"
    line = f"[count-ceiling] node-a/ebs.csi.aws.com: 25 -> 39 (clamped to 27): {why}; {ADVICE}"
    fitted = warning_line(line, why, ADVICE)
    assert len(line) > MAX_WARNING_LENGTH >= len(fitted)
    assert fitted.startswith("[count-ceiling] node-a/ebs.csi.aws.com: 25 -> 39 (clamped to 27): above the ceiling 27")
    assert fitted.endswith("...; " + ADVICE)
    assert fitted.index(ADVICE) <= ADVICE_WITHIN


def test_the_rule_node_driver_and_change_are_never_cut() -> None:
    """A long advice leaves no room for the reason: the reason goes, never where the change happened."""
    advice = "a" * 180
    line = f"[change-rate] node-a/ebs.csi.aws.com: 23 -> 24 (clamped to 23): too soon after the last change; {advice}"
    fitted = warning_line(line, "too soon after the last change", advice)
    assert fitted.startswith("[change-rate] node-a/ebs.csi.aws.com: 23 -> 24 (clamped to 23): ")


def test_a_node_with_a_long_name_gets_the_advice_in_its_clamp_warning(tmp_path: Path) -> None:
    """A node with a long name (82 characters here): its clamp warning keeps the node, the change and what to do."""
    node = "ip-10-0-1-23." + "x" * 60 + ".internal"
    review = json.loads(REVIEW.read_text("utf-8"))
    request = review["request"]
    request["name"] = node
    request["userInfo"]["username"] = f"system:node:{node}"
    for side in ("object", "oldObject"):
        request[side]["metadata"]["name"] = node
    path = tmp_path / "review.json"
    path.write_text(json.dumps(review), "utf-8")

    result = run_cli("evaluate", "--review", str(path), "--now", "2026-11-30T02:00:00Z", cwd=tmp_path)

    assert result.returncode == 0, result.stderr
    response = json.loads(result.stdout)["response"]
    (warning,) = response["warnings"]
    assert len(warning) <= MAX_WARNING_LENGTH
    assert warning.startswith(f"[count-ceiling] {node}/ebs.csi.aws.com: 25 -> 39 (clamped to 27): ")
    assert warning.endswith("...; " + ADVICE), warning
    assert warning.index(ADVICE) <= ADVICE_WITHIN
