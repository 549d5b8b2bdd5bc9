"""A driver's first registration is its own kind of change: it has no old count (not "unbounded"), so it is
neither an increase nor a decrease, in the audit record over HTTPS and in ``evaluate``'s explanation."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from tests.conftest import REPO
from tests.kube import EBS, apply_response, base_csinode, kubelet_update, review

REVIEW = REPO / "tests" / "data" / "review-register.json"


def test_the_audit_record_of_a_first_registration_has_no_old_count(server_factory: Any) -> None:
    server = server_factory()
    stored = base_csinode()
    answer = json.loads(server.post("/mutate", review(stored, kubelet_update(stored, EBS, 25))).data)["response"]
    assert answer["allowed"] is True
    [record] = [r for r in server.audit_records() if r.get("driver") == EBS]
    assert record["change"] == "registration"
    assert record["registration"] is True
    assert record["old"] is None, "no count before the registration: not 'unbounded'"
    assert (record["new"], record["final"]) == (25, 25)
    messages = {r["rule"]: r.get("message", "") for r in record["rules"]}
    assert "decrease" not in messages["count-rollback"], messages
    assert "decrease" not in messages["change-rate"], messages


def test_a_registration_after_a_removal_is_judged_from_the_retained_count(server_factory: Any) -> None:
    """Re-registered with the count the state kept: a change from that count, not a first registration."""
    server = server_factory()

    def write(stored: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
        return apply_response(new, json.loads(server.post("/mutate", review(stored, new)).data))

    stored = write(base_csinode(), kubelet_update(base_csinode(), EBS, 25))
    removed = json.loads(json.dumps(stored))
    removed["spec"]["drivers"] = [d for d in removed["spec"]["drivers"] if d["name"] != EBS]
    stored = write(stored, removed)
    write(stored, kubelet_update(stored, EBS, 20))
    last = [r for r in server.audit_records() if r.get("driver") == EBS][-1]
    assert last["registration"] is True and last["change"] == "decrease" and last["old"] == 25


def test_evaluate_explains_a_first_registration_as_a_registration() -> None:
    result = subprocess.run([sys.executable, "-m", "webhook", "evaluate", "--review", str(REVIEW)],
                            capture_output=True, text=True, cwd=REPO, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    lines = {line.split()[1]: line for line in result.stderr.splitlines() if line.startswith("# ") and ": pass" in line}
    assert lines["count-rollback"].endswith("pass - first registration: no earlier count to roll back to")
    assert lines["change-rate"].endswith("pass - registrations are exempt")
    assert "decrease" not in lines["writer-version"]
