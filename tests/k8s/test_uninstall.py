"""``csinode-guard uninstall`` on the real apiserver: one command that exits 0 and leaves nothing of the guard
(webhook configurations, the ValidatingAdmissionPolicy floor, every ``csinode-guard.io/`` annotation on CSINodes,
the audit Lease, its Secrets and Events), changes no count, and exits 0 again when run a second time.

The sequence is docs/operations.md's: ``unregister``, the deployment removed (here: the guard stopped; a running
guard would renew its Lease and write Events again), then ``uninstall``."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tests.k8s.controlplane import ControlPlane, counts, unique, wait_until
from tests.k8s.test_audit import EBS, install, new_node

ANNOTATION_PREFIX = "csinode-guard.io/"


def _guard_annotations(control_plane: ControlPlane) -> dict[str, list[str]]:
    found = control_plane.kubectl_json("get", "csinodes")
    out = {}
    for item in found["items"]:
        keys = [k for k in (item["metadata"].get("annotations") or {}) if k.startswith(ANNOTATION_PREFIX)]
        if keys:
            out[item["metadata"]["name"]] = keys
    return out


def _exists(control_plane: ControlPlane, *args: str) -> bool:
    return control_plane.kubectl("get", *args, check=False).returncode == 0


def _event(namespace: str, name: str, node: str) -> dict[str, Any]:
    return {
        "apiVersion": "events.k8s.io/v1", "kind": "Event",
        "metadata": {"name": name, "namespace": namespace, "labels": {"csinode-guard.io/audit": "standing"}},
        "eventTime": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.000000Z"),
        "reportingController": "csinode-guard.io/audit", "reportingInstance": "test", "action": "Audit",
        "reason": "StandingViolation", "type": "Warning", "note": "test",
        "regarding": {"apiVersion": "storage.k8s.io/v1", "kind": "CSINode", "name": node},
    }


def test_uninstall_leaves_nothing_of_the_guard_and_runs_twice(
    control_plane: ControlPlane, guard_factory: Any, tmp_path: Path
) -> None:
    namespace = unique("guard-ns")
    control_plane.kubectl("create", "namespace", namespace)
    lease = unique("audit")
    for secret in ("csinode-guard-tls", "csinode-guard-state-key"):
        control_plane.kubectl("create", "secret", "generic", secret, "-n", namespace, "--from-literal=key=x")
    guard = guard_factory(extra_args=("--lease-namespace", namespace, "--lease-name", lease,
                                      "--audit-interval", "1"))
    node = new_node(control_plane, "uninstall")
    install(control_plane, node, 25)
    justification = ('csinode-guard.io/justification=[{"driver":"ebs.csi.aws.com","reason":"r","minCount":1,'
                     '"maxCount":2,"expires":"2099-01-01T00:00:00Z"}]')
    control_plane.kubectl("annotate", "csinode", node, justification, kubeconfig=control_plane.approver_kubeconfig())
    floor = unique("floor")
    exported = tmp_path / "floor.yaml"
    subprocess.run([sys.executable, "-m", "webhook", "policy", "export", "--name", floor,
                    "--output-file", str(exported)], check=True, capture_output=True, timeout=60)
    control_plane.kubectl("apply", "-f", str(exported))
    control_plane.kubectl("apply", "-f", "-", input=json.dumps(_event("default", unique("ev"), node)))
    wait_until(lambda: _exists(control_plane, "lease", lease, "-n", namespace), timeout=30, what="the audit Lease")
    assert set(_guard_annotations(control_plane)[node]) == {"csinode-guard.io/state",
                                                           "csinode-guard.io/justification"}
    before = counts(control_plane.get_csinode(node))

    args = ("uninstall", "--name", guard.name, "--vap-name", floor, "--namespace", namespace,
            "--lease-name", lease)
    dry = guard.csinode_guard(*args, "--dry-run=client")
    assert dry.returncode == 0, dry.stderr
    assert "would be deleted (client dry run)" in dry.stdout and guard.webhook_configurations_exist()
    assert set(_guard_annotations(control_plane)[node]) == {"csinode-guard.io/state",
                                                           "csinode-guard.io/justification"}

    # docs/operations.md, Uninstall: unregister, remove the deployment (here: stop the guard), uninstall.
    assert guard.csinode_guard("unregister", "--name", guard.name).returncode == 0
    guard.registered = False
    guard.stop()
    first = guard.csinode_guard(*args)

    assert first.returncode == 0, first.stderr + first.stdout
    assert "removing the guard's annotations from every CSINode" in first.stderr, "progress on standard error"
    assert f"mutatingwebhookconfigurations.admissionregistration.k8s.io/{guard.name} not found" in first.stdout
    assert f"validatingadmissionpolicies.admissionregistration.k8s.io/{floor} deleted" in first.stdout
    assert not guard.webhook_configurations_exist()
    assert not _exists(control_plane, "validatingadmissionpolicy", floor)
    assert not _exists(control_plane, "validatingadmissionpolicybinding", floor)
    assert _guard_annotations(control_plane) == {}
    assert counts(control_plane.get_csinode(node)) == before == {EBS: 25}
    assert not _exists(control_plane, "lease", lease, "-n", namespace)
    assert not _exists(control_plane, "secret", "csinode-guard-tls", "-n", namespace)
    assert not _exists(control_plane, "secret", "csinode-guard-state-key", "-n", namespace)
    events = control_plane.kubectl_json("get", "events.events.k8s.io", "-n", "default", "-l", "csinode-guard.io/audit")
    assert events["items"] == []

    second = guard.csinode_guard(*args)
    assert second.returncode == 0, second.stderr
    assert "not found (already removed)" in second.stdout and "FAILED" not in second.stdout
    assert "no guard annotation on any CSINode" in second.stdout
