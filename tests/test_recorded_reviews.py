"""AdmissionReviews recorded from the real kube-apiserver (tests/data/apiserver, see its README.md), sent again
to the real server: the answers equal the ones the live guard gave, and the recordings show what the apiserver
really sends for kubelet's writes."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO

RECORDED = REPO / "tests" / "data" / "apiserver"
TIME_INDEPENDENT = ("register-25", "eni-25-to-23", "report-39", "unbounded")
"""Steps whose decision does not depend on when they are judged (the too-fast increase does: change-rate)."""


def load(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((RECORDED / f"{name}.json").read_text())
    return loaded


def policy(tmp_path: Path) -> Path:
    doc = yaml.safe_load((REPO / "policies" / "default.yaml").read_text())
    doc["spec"]["rules"]["change-rate"]["minInterval"] = "2s"
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def patch_paths(answer: dict[str, Any]) -> list[tuple[str, str]]:
    raw = answer["response"].get("patch")
    return [(op["op"], op["path"]) for op in json.loads(base64.b64decode(raw))] if raw else []


def test_the_recordings_show_kubelets_real_writes() -> None:
    review = load("eni-25-to-23-mutate")["review"]
    request = review["request"]
    assert request["userInfo"]["username"] == "system:node:ip-10-0-1-23.ec2.internal"
    assert request["operation"] == "UPDATE"
    assert request["options"]["kind"] == "UpdateOptions"
    assert request["object"]["metadata"]["managedFields"][0]["manager"] == "kubelet"
    drivers = request["object"]["spec"]["drivers"]
    assert drivers[-1]["name"] == "ebs.csi.aws.com"  # kubelet re-appends the driver it updates
    assert drivers[-1]["topologyKeys"] is None
    assert drivers[-1]["allocatable"] == {"count": 23}
    unbounded = load("unbounded-mutate")["review"]["request"]["object"]["spec"]["drivers"][-1]
    assert "allocatable" not in unbounded  # max_volumes_per_node 0: kubelet drops allocatable
    # A registration reaches the guard (the never-refused entry): judged, and it starts the entry's state.
    registration = load("register-25-mutate")
    assert registration["review"]["request"]["oldObject"]["spec"]["drivers"][-1]["name"] == "efs.csi.aws.com"
    assert registration["review"]["request"]["object"]["spec"]["drivers"][-1]["name"] == "ebs.csi.aws.com"
    assert registration["answer"]["response"]["allowed"] is True
    assert ("add", "/metadata/annotations/csinode-guard.io~1state") in patch_paths(registration["answer"])
    # The clamp back to the stored count leaves no count change: the validating webhook's matchConditions are
    # false for the final object, so the apiserver does not call it.
    assert not (RECORDED / "unbounded-validate.json").exists()
    # kubelet's tries of a denied increase: each is a new AdmissionReview (new uid) of the same change.
    tries = sorted(RECORDED.glob("too-fast-24-*-mutate.json"))
    assert len(tries) >= 2
    assert len({json.loads(p.read_text())["review"]["request"]["uid"] for p in tries}) == len(tries)
    assert {json.loads(p.read_text())["answer"]["response"]["allowed"] for p in tries} == {False}


@pytest.mark.parametrize("step", TIME_INDEPENDENT)
def test_the_server_answers_a_recorded_review_as_the_live_guard_did(
    server_factory: Any, tmp_path: Path, step: str
) -> None:
    server = server_factory("--policy", str(policy(tmp_path)), "--state-key-file", str(RECORDED / "state.key"))
    endpoints = ("mutate",) if step == "unbounded" else ("mutate", "validate")
    for endpoint in endpoints:
        recorded = load(f"{step}-{endpoint}")
        answer = json.loads(server.post(f"/{endpoint}", recorded["review"]).data)
        live = recorded["answer"]
        assert answer["response"]["uid"] == live["response"]["uid"]
        assert answer["response"]["allowed"] == live["response"]["allowed"]
        assert answer["response"].get("auditAnnotations", {}).get("decision") == live["response"].get(
            "auditAnnotations", {}).get("decision")
        assert patch_paths(answer) == patch_paths(live)
        # offline, the server does not know the Node ("ceiling for unknown node"); live it knew it had no
        # instance-type label: the same ceiling, worded for what was known
        assert [w.split(" (ceiling for")[0] for w in answer["response"].get("warnings", [])] == [
            w.split(" (ceiling for")[0] for w in live["response"].get("warnings", [])]


def test_the_recording_switch_writes_each_review_with_its_answer(server_factory: Any, tmp_path: Path) -> None:
    plain = server_factory()
    review = load("eni-25-to-23-mutate")["review"]
    plain.post("/mutate", review)
    record = tmp_path / "recorded"
    server = server_factory(env={"CSINODE_GUARD_RECORD_REVIEWS_DIR": str(record)})
    answer = json.loads(server.post("/mutate", review).data)
    files = sorted(record.glob("*-mutate.json"))
    assert len(files) == 1
    written = json.loads(files[0].read_text())
    assert written == {"review": review, "answer": answer}
    assert not (tmp_path / "server0" / "recorded").exists()
