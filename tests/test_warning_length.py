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
    assert warning_line(line, ADVICE) == line


def test_a_long_warning_shortens_its_reason_and_keeps_its_advice_whole() -> None:
    line = f"[count-ceiling] {'n' * 180}/ebs.csi.aws.com: 25 -> 39 (clamped to 27): above the ceiling 27; {ADVICE}"
    fitted = warning_line(line, ADVICE)
    assert len(fitted) <= MAX_WARNING_LENGTH
    assert fitted.endswith("...; " + ADVICE)
    assert fitted.index(ADVICE) <= ADVICE_WITHIN
    assert fitted.startswith("[count-ceiling] nnn")


def test_a_node_with_a_long_name_gets_the_advice_in_its_clamp_warning(tmp_path: Path) -> None:
    """Node names go up to 253 characters: the clamp warning of such a node still says what to do."""
    node = "ip-10-0-1-23." + "x" * 180 + ".internal"
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
    assert warning.startswith(f"[count-ceiling] ip-10-0-1-23.{'x' * 20}")
    assert warning.endswith("...; " + ADVICE), warning
    assert warning.index(ADVICE) <= ADVICE_WITHIN
