"""A denial names every rule that found something, each once, through the real server over HTTPS.

An operator who fixes the rule in the denial's message must not be surprised next by a rule the denial kept
quiet (the clamp of a ceiling). The message lists the denying rules; the warnings name the others.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from tests.conftest import REPO
from tests.kube import EBS, apply_response, base_csinode, kubelet_update, review, with_annotation

VERSIONS = "csinode-guard.io/driver-versions"
REPORTER = "version-reporter"
WRITER = "count-operator"  # a writer the policy lists: its denials stay denials (the node's kubelet's act as clamps)


def policy_file(tmp_path: Path) -> Path:
    doc = yaml.safe_load((REPO / "policies" / "default.yaml").read_text())
    doc["spec"]["drivers"][EBS] = {"ceiling": {"max": 27}, "minVersion": "v1.40.0",
                                   "versionSource": {"type": "annotation"}}
    doc["spec"]["versionReporters"] = {"users": [REPORTER]}
    doc["spec"]["writers"] = {"users": [WRITER]}
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def rules_named(text: str) -> list[str]:
    return re.findall(r"\[([a-z-]+)\]", text)


def test_the_denial_of_an_outdated_driver_also_names_the_ceiling(server_factory: Any, tmp_path: Path) -> None:
    server = server_factory("--policy", str(policy_file(tmp_path)))
    registered = kubelet_update(base_csinode(), EBS, 25)
    declared = with_annotation(registered, VERSIONS, json.dumps({EBS: "v1.19.0"}))  # a version reporter's write
    answer = json.loads(server.post("/mutate", review(registered, declared, user=REPORTER)).data)
    assert answer["response"]["allowed"] is True
    stored = apply_response(declared, answer)  # the declaration recorded in the signed state

    answer = json.loads(server.post("/mutate", review(stored, kubelet_update(stored, EBS, 39), user=WRITER)).data)[
        "response"
    ]

    assert answer["allowed"] is False and answer["status"]["code"] == 403
    message = answer["status"]["message"]
    warnings = answer.get("warnings", [])
    assert rules_named(message) == ["writer-version"], message
    assert message.startswith(f"[writer-version] ip-10-0-1-23.ec2.internal/{EBS}: 25 -> 39: driver version v1.19.0 "
                              "is below minVersion v1.40.0")
    named = rules_named(message) + [r for w in warnings for r in rules_named(w)]
    assert sorted(named) == ["count-ceiling", "writer-version"], (message, warnings)
    assert answer["auditAnnotations"]["rules"] == "writer-version,count-ceiling"
    (ceiling,) = warnings
    assert ceiling.startswith(f"[count-ceiling] ip-10-0-1-23.ec2.internal/{EBS}: 25 -> 39")
    assert "27" in ceiling
    assert all(len(w) <= 256 and "\n" not in w for w in warnings)

    # The same write by the node's own kubelet: the minVersion deny acts as a clamp to the stored count.
    answer = json.loads(server.post("/mutate", review(stored, kubelet_update(stored, EBS, 39))).data)["response"]
    assert answer["allowed"] is True
    assert answer["auditAnnotations"]["decision"] == "clamp"
    # Both rules clamp: each line says what its own rule allows, and one line what was applied.
    assert any(w.startswith(f"[writer-version] ip-10-0-1-23.ec2.internal/{EBS}: 25 -> 39 (this rule allows 25)")
               for w in answer["warnings"]), answer["warnings"]
    assert any(w.startswith(f"ip-10-0-1-23.ec2.internal/{EBS}: 25 -> 39 clamped to 25, what every one of ")
               for w in answer["warnings"]), answer["warnings"]
