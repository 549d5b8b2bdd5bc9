"""End to end with cluster context: the real server, its watch caches on a local API server, kubelet reviews.

The server reads Node labels, driver pods (versionSource: pod), the CSIDriver's update period and
VolumeAttachment attach errors from a fake API server speaking the wire format, through the real kubernetes
client — never per request.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from tests.apiserver import FakeApiServer
from tests.conftest import REPO, RunningServer
from tests.kube import CLUSTER_DATA, EBS, apply_response, base_csinode, cluster_object, kubelet_update, review

APISERVER_DATA = CLUSTER_DATA
"""The fake API server of tests/conftest.py holds these objects in this module."""
STATE = "csinode-guard.io/state"


def wait_until(predicate: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError("condition not met in time")


def cluster_policy(tmp_path: Path) -> Path:
    doc = yaml.safe_load((REPO / "policies" / "default.yaml").read_text())
    doc["spec"]["drivers"][EBS]["versionSource"] = {
        "type": "pod",
        "namespace": "kube-system",
        "selector": {"matchLabels": {"app": "ebs-csi-node"}},
        "container": "ebs-plugin",
    }
    doc["spec"]["drivers"][EBS]["minVersion"] = "v1.35.0"
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def mutate_then_store(
    server: RunningServer, stored: dict[str, Any], new: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    answer = json.loads(server.post("/mutate", review(stored, new)).data)
    if not answer["response"]["allowed"]:
        return stored, answer["response"]
    return apply_response(new, answer), answer["response"]


def test_the_guard_judges_with_facts_from_its_watch_caches(
    server_factory: Any, apiserver: FakeApiServer, tmp_path: Path
) -> None:
    kubeconfig = apiserver.write_kubeconfig(tmp_path / "kubeconfig")
    server = server_factory("--kubeconfig", kubeconfig, "--policy", str(cluster_policy(tmp_path)), offline=False)
    wait_until(lambda: server.get("/readyz").status == 200)
    assert json.loads(server.get("/readyz").data)["cluster"] == "synced"

    # A fresh ResourceExhausted attach error backs the decrease: it becomes a correction in the state.
    attachment = copy.deepcopy(apiserver.get("volumeattachments", cluster_object(
        "volumeattachment-exhausted.json")["metadata"]["name"]))
    assert attachment is not None
    attachment["status"]["attachError"]["time"] = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    apiserver.update("volumeattachments", attachment)
    time.sleep(1.0)  # let both workers' watches deliver the update
    stored = kubelet_update(base_csinode(), EBS, 25)
    stored, answer = mutate_then_store(server, stored, kubelet_update(stored, EBS, 23))
    assert answer["allowed"] is True
    entry = json.loads(stored["metadata"]["annotations"][STATE])["drivers"][EBS]
    assert entry["correction"]["basis"] == "resource-exhausted"
    assert entry["writerVersion"] == "v1.37.0"  # from the ebs-plugin image tag of the node's Running pod

    # Going back up to the pre-correction count within the window needs a justification: the node's kubelet's
    # increase is held at the stored count.
    stored, answer = mutate_then_store(server, stored, kubelet_update(stored, EBS, 25))
    assert answer["allowed"] is True
    # count-rollback and change-rate both hold it: each line says what its own rule allows.
    assert answer["warnings"][0].startswith(
        f"[count-rollback] ip-10-0-1-23.ec2.internal/{EBS}: 23 -> 25 (this rule allows 23): ")
    assert any(w.startswith(f"ip-10-0-1-23.ec2.internal/{EBS}: 23 -> 25 clamped to 23, what every one of ")
               for w in answer["warnings"]), answer["warnings"]
    assert [d["allocatable"]["count"] for d in stored["spec"]["drivers"] if d["name"] == EBS] == [23]

    # The driver pod is rolled back to a version below minVersion: the watch brings it, increases are denied.
    pod = copy.deepcopy(apiserver.get("pods", "ebs-csi-node-7xk2p", "kube-system"))
    assert pod is not None
    for container in pod["spec"]["containers"]:
        if container["name"] == "ebs-plugin":
            container["image"] = "public.ecr.aws/ebs-csi-driver/aws-ebs-csi-driver:v1.30.0"
    for status in pod["status"]["containerStatuses"]:
        if status["name"] == "ebs-plugin":
            status["image"] = "public.ecr.aws/ebs-csi-driver/aws-ebs-csi-driver:v1.30.0"
    apiserver.update("pods", pod, "kube-system")

    def denied_for_version() -> bool:
        answer = json.loads(server.post("/validate", review(stored, kubelet_update(stored, EBS, 24))).data)
        return "[writer-version]" in answer["response"].get("status", {}).get("message", "")

    wait_until(denied_for_version)
    records = server.audit_records()
    assert any(r.get("writerVersion") == "v1.30.0" for r in records)
