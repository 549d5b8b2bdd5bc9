"""replay reproduces the automatic brake from a kube-apiserver audit log: the increases the guard would have
admitted (CSINode writes) and the attach errors the external-attacher wrote (``volumeattachments/status`` at
RequestResponse level, docs/apiserver-audit-policy.yaml) go into the leader's decision at the time of each replayed
write, so an increase after the evidence is held as the guard held it. Through the CLI, as an operator runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from tests.conftest import REPO

EBS = "ebs.csi.aws.com"
NODES = [f"ip-10-0-1-{i}.ec2.internal" for i in range(1, 5)]
BASE = "2026-12-04T12"


def stamp(seconds: int) -> str:
    return f"{BASE}:{seconds // 60:02d}:{seconds % 60:02d}.000000Z"


def csinode(node: str, count: int) -> dict[str, Any]:
    return {
        "kind": "CSINode",
        "apiVersion": "storage.k8s.io/v1",
        "metadata": {"name": node, "uid": f"uid-{node}", "resourceVersion": "1"},
        "spec": {"drivers": [{"name": EBS, "nodeID": f"i-{node}", "allocatable": {"count": count}}]},
    }


def audit_event(
    seconds: int, verb: str, ref: dict[str, Any], user: str, groups: tuple[str, ...] = (), **objects: Any
) -> dict[str, Any]:
    """One ResponseComplete audit event at RequestResponse level."""
    path = "/".join(filter(None, [ref["resource"], ref.get("name"), ref.get("subresource")]))
    return {
        "kind": "Event",
        "apiVersion": "audit.k8s.io/v1",
        "level": "RequestResponse",
        "auditID": f"id-{verb}-{path}-{seconds}",
        "stage": "ResponseComplete",
        "requestURI": f"/apis/storage.k8s.io/v1/{path}",
        "verb": verb,
        "user": {"username": user, "groups": [*groups, "system:authenticated"]},
        "objectRef": {"apiGroup": "storage.k8s.io", "apiVersion": "v1", **ref},
        "responseStatus": {"metadata": {}, "code": 201 if verb == "create" else 200},
        "requestReceivedTimestamp": stamp(seconds),
        "stageTimestamp": stamp(seconds),
        **objects,
    }


def kubelet_write(seconds: int, node: str, count: int, verb: str = "update") -> dict[str, Any]:
    obj = csinode(node, count)
    ref = {"resource": "csinodes", "name": node}
    return audit_event(
        seconds, verb, ref, f"system:node:{node}", ("system:nodes",), requestObject=obj, responseObject=obj
    )


def attach_error(seconds: int, node: str, code: int) -> dict[str, Any]:
    """The external-attacher's status patch of a VolumeAttachment whose ControllerPublishVolume failed."""
    name = f"csi-{node}-{seconds}"
    error = {"time": stamp(seconds).replace(".000000", ""), "errorCode": code, "message": f"rpc error: code {code}"}
    response = {
        "kind": "VolumeAttachment",
        "apiVersion": "storage.k8s.io/v1",
        "metadata": {"name": name, "uid": f"uid-{name}", "resourceVersion": "7"},
        "spec": {"attacher": EBS, "nodeName": node, "source": {"persistentVolumeName": f"pv-{name}"}},
        "status": {"attached": False, "attachError": error},
    }
    ref = {"resource": "volumeattachments", "name": name, "subresource": "status"}
    return audit_event(
        seconds,
        "patch",
        ref,
        "system:serviceaccount:kube-system:ebs-csi-controller-sa",
        requestObject={"status": {"attachError": error}},
        responseObject=response,
    )


def rollout_log(tmp_path: Path, code: int) -> Path:
    """Four CSINodes at 20; an upgrade raises three to 25 and one to 24; attach errors with ``code`` on two raised
    nodes ten minutes later; then the fourth node reports 26 and a fresh node 22 at 40 minutes."""
    events = [kubelet_write(i, node, 20, "create") for i, node in enumerate(NODES)]
    events += [kubelet_write(60 + i, node, 24 if i == 3 else 25) for i, node in enumerate(NODES)]
    events += [attach_error(600, NODES[0], code), attach_error(660, NODES[1], code)]
    events += [kubelet_write(720, NODES[3], 26), kubelet_write(2400, NODES[2], 26)]
    path = tmp_path / f"audit-{code}.log"
    path.write_text("".join(json.dumps(e) + "\n" for e in events), "utf-8")
    return path


def replay(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "CSINODE_GUARD_KUBECONFIG")}
    env["HOME"] = str(tmp_path)
    return subprocess.run(
        [sys.executable, "-m", "webhook", "replay", "--no-progress", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        check=False,
        env=env,
    )


def test_an_increase_after_capacity_failures_on_half_the_raised_nodes_is_held(tmp_path: Path) -> None:
    out = tmp_path / "guard-audit.log"
    result = replay(tmp_path, "--audit-log", str(rollout_log(tmp_path, 8)), "-o", "json", "--guard-audit-out", str(out))
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    rows = {(e["time"], e["node"]): e for e in doc["events"]}
    assert [rows[(f"{BASE}:01:0{i}.000Z", n)]["decision"] for i, n in enumerate(NODES)] == ["allow"] * 4
    held = rows[(f"{BASE}:12:00.000Z", NODES[3])]
    # 24 judged from the count trusted before the rollout (20) and held there: the guard's clamp for its kubelet
    assert (held["old"], held["new"], held["final"], held["decision"]) == (24, 26, 20, "clamp"), held
    assert held["rules"] == ["count-rollback"]
    later = rows[(f"{BASE}:40:00.000Z", NODES[2])]
    assert (later["final"], later["decision"]) == (20, "clamp"), "still engaged 29 minutes after the last failure"
    [engaged] = doc["summary"]["brakes"]
    assert engaged["driver"] == EBS and engaged["engaged"] is True
    assert engaged["time"] == f"{BASE}:11:00.000Z"  # the second failure completes the evidence
    assert "on 2 of 4 nodes" in engaged["message"] and f"csi-{NODES[0]}-600" in engaged["message"]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    [record] = [r for r in records if r["decision"] == "brake-engaged"]
    assert record["driver"] == EBS and record["trigger"] == "brake"
    assert {e["node"] for e in record["brake"]["evidence"]} == set(NODES[:2])
    [mutate] = [r for r in records if r["uid"] == held["auditID"] and r["endpoint"] == "mutate"]
    assert "increases of ebs.csi.aws.com are held cluster-wide" in json.dumps(mutate)
    table = replay(tmp_path, "--audit-log", str(rollout_log(tmp_path, 8)))
    assert f"brake engaged at {BASE}:11:00.000Z: the brake on {EBS} engaged" in table.stdout


def test_errorcode_9_after_the_same_rollout_holds_nothing(tmp_path: Path) -> None:
    result = replay(tmp_path, "--audit-log", str(rollout_log(tmp_path, 9)), "-o", "json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    rows = {(e["time"], e["node"]): e for e in doc["events"]}
    assert (rows[(f"{BASE}:12:00.000Z", NODES[3])]["final"], rows[(f"{BASE}:12:00.000Z", NODES[3])]["decision"]) == (
        26,
        "allow",
    )
    assert doc["summary"]["brakes"] == []


def test_a_policy_without_the_brake_replays_no_brake(tmp_path: Path) -> None:
    policy = (
        (REPO / "policies" / "default.yaml")
        .read_text("utf-8")
        .replace("  brake:\n    enabled: true", "  brake:\n    enabled: false")
    )
    assert "enabled: false" in policy
    (tmp_path / "policy.yaml").write_text(policy, "utf-8")
    result = replay(
        tmp_path, "--audit-log", str(rollout_log(tmp_path, 8)), "-o", "json", "--policy", str(tmp_path / "policy.yaml")
    )
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["summary"]["brakes"] == []
    held = [e for e in doc["events"] if e["time"] == f"{BASE}:12:00.000Z"]
    assert [e["decision"] for e in held] == ["allow"]


def level_for(policy: dict[str, Any], group: str, resource: str, verb: str) -> str:
    """The level the first matching rule of an audit Policy gives a request (the apiserver's first-match rule)."""
    for rule in policy["rules"]:
        if "verbs" in rule and verb not in rule["verbs"]:
            continue
        kinds = rule.get("resources")
        if kinds is not None and not any(
            k.get("group", "") == group and resource in k.get("resources", [resource]) for k in kinds
        ):
            continue
        return str(rule["level"])
    return "None"


def test_the_shipped_audit_policy_logs_the_attach_errors_with_their_objects() -> None:
    policy = yaml.safe_load((REPO / "docs" / "apiserver-audit-policy.yaml").read_text("utf-8"))
    for verb in ("patch", "update"):
        assert level_for(policy, "storage.k8s.io", "volumeattachments/status", verb) in ("Request", "RequestResponse")
        assert level_for(policy, "storage.k8s.io", "csinodes", verb) == "RequestResponse"
    assert level_for(policy, "storage.k8s.io", "volumeattachments", "watch") == "None"
