"""Registrations and CREATE through the real HTTPS server (``csinode-guard serve --offline``, CA-verified client).

Each write goes to /mutate, its JSONPatch is applied, the final object goes to /validate and is stored, as the
apiserver does with the two webhook configurations. A registration is clamped and audited, never refused — by
neither endpoint — and a forged driver-versions annotation on it is put back by the patch.
"""

from __future__ import annotations

import json
from typing import Any

from kube import EBS, apply_response, base_csinode, count_of, kubelet_update, review, with_annotation, without_driver

STATE = "csinode-guard.io/state"
VERSIONS = "csinode-guard.io/driver-versions"
CEILING = 27  # the shipped policy's EBS ceiling for a node the guard does not know (offline: no node labels)


def put(server: Any, stored: dict[str, Any], new: dict[str, Any], operation: str = "UPDATE") -> tuple[
    dict[str, Any], dict[str, Any], dict[str, Any]
]:
    """/mutate, the patch, /validate: (mutate response, validate response, the object stored afterwards)."""
    old = None if operation == "CREATE" else stored
    mutated = json.loads(server.post("/mutate", review(old, new, operation=operation)).data)
    assert mutated["response"]["allowed"] is True, mutated["response"]
    final = apply_response(new, mutated)
    checked = json.loads(server.post("/validate", review(old, final, operation=operation)).data)
    assert "patch" not in checked["response"]
    return mutated["response"], checked["response"], final


def test_a_plugin_restart_reporting_39_with_a_forged_version_is_clamped_and_audited(server_factory: Any) -> None:
    server = server_factory()
    _, _, stored = put(server, base_csinode(), kubelet_update(base_csinode(), EBS, 25))
    assert count_of(stored, EBS) == 25 and STATE in stored["metadata"]["annotations"]

    removal, _, stored = put(server, stored, without_driver(stored, EBS))
    assert removal["auditAnnotations"]["decision"] == "allow" and "patch" not in removal
    forged = with_annotation(kubelet_update(stored, EBS, 39), VERSIONS, json.dumps({EBS: "v9.9.9"}))
    mutated, validated, stored = put(server, stored, forged)

    assert mutated["auditAnnotations"]["decision"] == "clamp"
    assert count_of(stored, EBS) == 25, "inside minInterval a registration keeps the last accepted count"
    assert VERSIONS not in stored["metadata"]["annotations"], "the forged annotation is put back (it was absent)"
    assert any(w.startswith(f"[count-ceiling] ip-10-0-1-23.ec2.internal/{EBS} (registration): 25 -> 39")
               for w in mutated["warnings"])
    assert any("not a version reporter" in w for w in mutated["warnings"])
    assert validated["allowed"] is True and "warnings" not in validated
    records = [r for r in server.audit_records() if r.get("endpoint") == "mutate"]
    assert records[-1]["decision"] == "clamp"


def test_validate_never_refuses_a_registration_mutate_did_not_see(server_factory: Any) -> None:
    server = server_factory()
    stored = base_csinode()

    answer = json.loads(server.post("/validate", review(stored, kubelet_update(stored, EBS, 128))).data)["response"]

    assert answer["allowed"] is True
    assert answer["auditAnnotations"]["decision"] == "warn"
    assert any("above the ceiling 27" in w for w in answer["warnings"])


def test_a_create_with_128_and_a_copied_state_is_clamped(server_factory: Any) -> None:
    server = server_factory()
    _, _, old = put(server, base_csinode(), kubelet_update(base_csinode(), EBS, 25))
    recreated = kubelet_update(old, EBS, 128)
    del recreated["metadata"]["uid"]  # mutating admission of a CREATE sees no UID yet

    mutated, validated, stored = put(server, old, recreated, operation="CREATE")

    assert mutated["auditAnnotations"]["decision"] == "clamp"
    assert count_of(stored, EBS) == CEILING
    assert STATE not in stored["metadata"]["annotations"]
    assert validated["allowed"] is True
