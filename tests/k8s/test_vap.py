"""The exported ValidatingAdmissionPolicy floor on the real kube-apiserver, with kubelet's own writes.

With the guard unregistered and stopped, the floor alone refuses a kubelet's 2147483647, a bounded count that
turns unbounded, a jump above maxStepUp and a count change by another principal, and lets a decrease, a
registration (even one carrying 2147483647), a removal, DELETE and CREATE through. With the guard up, every
write the guard admits (clamped or not) is stored: the floor never refuses what the guard would admit.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.k8s.controlplane import DEFAULT_POLICY, ControlPlane, Guard, counts, unique, wait_until

EBS = "ebs.csi.aws.com"
OTHER = "example.csi.io"
INSTANCE_TYPE = {"node.kubernetes.io/instance-type": "m7i.48xlarge"}  # ebs profile: 128
INT32_MAX = 2147483647
JUSTIFICATION = "csinode-guard.io/justification"


def _policy(tmp_path: Path) -> Path:
    """The default policy with change-rate in dryrun, so that the test's quick writes are judged on the rest."""
    doc = yaml.safe_load(DEFAULT_POLICY.read_text("utf-8"))
    doc["spec"]["rules"]["change-rate"]["enforcementAction"] = "dryrun"
    # The runbook's restore is tested: the running guard's audit must not lower the unjudged 39 first.
    doc["spec"]["reconcile"] = "report"
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False), "utf-8")
    (tmp_path / "profiles").symlink_to(DEFAULT_POLICY.parent / "profiles")
    return path


def _export(policy: Path, name: str, target: Path) -> None:
    import subprocess  # noqa: PLC0415

    subprocess.run([sys.executable, "-m", "webhook", "policy", "export", "--format", "vap", "-f", str(policy),
                    "--name", name, "--output-file", str(target)], check=True, capture_output=True, text=True,
                   timeout=60)


@pytest.fixture
def floor(control_plane: ControlPlane, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """The floor exported from the test policy, applied under a unique name; deleted afterwards."""
    policy = _policy(tmp_path)
    name = unique("floor")
    exported = tmp_path / "floor.yaml"
    _export(policy, name, exported)
    control_plane.kubectl("apply", "-f", str(exported))
    try:
        yield name, policy
    finally:
        control_plane.kubectl("delete", "-f", str(exported), "--ignore-not-found", check=False)


def _kubelet_update(cp: ControlPlane, node: str, count: int) -> Any:
    return cp.kubelet(node, "update", "--driver", EBS, "--max-volumes", str(count), check=False)


def _refused_by_floor(name: str, stderr: str) -> bool:
    return f"ValidatingAdmissionPolicy '{name}'" in stderr


def wait_for_floor(cp: ControlPlane, name: str, node: str) -> None:
    """Wait until the apiserver's policy informer has the floor: a server-side dry run of the node's own write of
    2147483647 is refused by it (a dry run stores nothing, so waiting changes no count)."""
    stored = cp.get_csinode(node)
    stored["spec"]["drivers"][0]["allocatable"] = {"count": INT32_MAX}

    def refused() -> bool:
        result = cp.kubectl("replace", "--dry-run=server", "-f", "-", input=json.dumps(stored), check=False,
                            kubeconfig=cp.node_kubeconfig(node))
        return _refused_by_floor(name, result.stderr)

    wait_until(refused, timeout=30, what="the floor in effect")


def test_the_floor_holds_while_the_guard_is_unregistered_and_stopped(
    control_plane: ControlPlane, guard_factory: Any, floor: tuple[str, Path]
) -> None:
    name, policy = floor
    guard: Guard = guard_factory(policy=policy)
    guard.unregister()
    guard.stop()
    node = unique("floor")
    control_plane.create_node(node, INSTANCE_TYPE)
    control_plane.kubelet(node, "install", "--driver", EBS, "--node-id", "i-floor", "--max-volumes", "25")

    wait_for_floor(control_plane, name, node)
    result = _kubelet_update(control_plane, node, 99999999999)
    assert result.returncode == 1 and "2147483647 is kubelet's cut-off" in result.stderr
    assert counts(control_plane.get_csinode(node)) == {EBS: 25}

    decrease = _kubelet_update(control_plane, node, 20)
    assert decrease.returncode == 0, decrease.stderr
    assert counts(control_plane.get_csinode(node)) == {EBS: 20}

    unbounded = _kubelet_update(control_plane, node, 0)
    assert _refused_by_floor(name, unbounded.stderr) and "unbounded" in unbounded.stderr
    jump = _kubelet_update(control_plane, node, 37)
    assert _refused_by_floor(name, jump.stderr) and "maxStepUp" in jump.stderr
    step = _kubelet_update(control_plane, node, 36)
    assert step.returncode == 0, step.stderr

    registration = control_plane.kubelet(node, "install", "--driver", OTHER, "--node-id", "x",
                                         "--max-volumes", "99999999999", check=False)
    assert registration.returncode == 0, registration.stderr
    assert counts(control_plane.get_csinode(node)) == {EBS: 36, OTHER: INT32_MAX}
    removal = control_plane.kubelet(node, "uninstall", "--driver", OTHER, check=False)
    assert removal.returncode == 0, removal.stderr

    stored = control_plane.get_csinode(node)
    stored["spec"]["drivers"][0]["allocatable"]["count"] = 30
    by_admin = control_plane.kubectl("replace", "-f", "-", input=json.dumps(stored), check=False)
    assert by_admin.returncode != 0 and _refused_by_floor(name, by_admin.stderr)
    assert "[writer-identity]" in by_admin.stderr
    assert counts(control_plane.get_csinode(node)) == {EBS: 36}

    # The node's own DELETE and the kubelet's CREATE (with a count) pass.
    control_plane.kubectl("delete", "csinode", node, kubeconfig=control_plane.node_kubeconfig(node))
    recreated = control_plane.kubelet(node, "install", "--driver", EBS, "--node-id", "i-floor",
                                      "--max-volumes", "99999999999", check=False)
    assert recreated.returncode == 0, recreated.stderr
    assert counts(control_plane.get_csinode(node)) == {EBS: INT32_MAX}


def test_with_the_guard_up_the_floor_never_refuses_what_the_guard_admits(
    control_plane: ControlPlane, guard_factory: Any, floor: tuple[str, Path]
) -> None:
    name, policy = floor
    node = unique("agree")
    control_plane.create_node(node, INSTANCE_TYPE)
    control_plane.kubelet(node, "install", "--driver", EBS, "--node-id", "i-agree", "--max-volumes", "25")
    wait_for_floor(control_plane, name, node)
    guard: Guard = guard_factory(policy=policy)

    # (kubelet reports, count stored afterwards): the guard admits each one, clamping where its rules say so.
    writes = [
        (30, 30),  # an increase within maxStepUp
        (99999999999, 30),  # 2147483647: clamped back to the old count
        (0, 30),  # unbounded after bounded: clamped back
        (60, 46),  # above maxStepUp: clamped to old + 16
        (200, 62),  # above the m7i.48xlarge ceiling 128 and the step: clamped to the step
        (20, 20),  # a decrease
    ]
    for reported, stored in writes:
        result = _kubelet_update(control_plane, node, reported)
        assert result.returncode == 0, (reported, result.stderr)
        assert not _refused_by_floor(name, result.stderr)
        assert counts(control_plane.get_csinode(node)) == {EBS: stored}, reported
    judged = [r for r in guard.decisions() if r.get("node") == node]
    assert judged and all(r["allowed"] is True for r in judged)

    # Where the guard refuses (another principal), the write is refused before the floor is asked.
    current = control_plane.get_csinode(node)
    current["spec"]["drivers"][0]["allocatable"]["count"] = 10
    by_admin = control_plane.kubectl("replace", "-f", "-", input=json.dumps(current), check=False)
    assert by_admin.returncode != 0 and "writer-identity" in by_admin.stderr


def _justify(cp: ControlPlane, node: str, kubeconfig: Path, *, low: int, high: int, expires: str) -> Any:
    value = json.dumps([{"driver": EBS, "reason": "test", "minCount": low, "maxCount": high, "expires": expires}])
    return cp.kubectl("annotate", "--overwrite", "csinode", node, f"{JUSTIFICATION}={value}", kubeconfig=kubeconfig,
                      check=False)


def _admin_count(cp: ControlPlane, node: str, count: int) -> Any:
    return cp.replace_count(node, EBS, count, kubeconfig=cp.kubeconfig, check=False)



def test_after_restore_nothing_left_lifts_the_floor_and_only_a_covering_unexpired_justification_does(
    control_plane: ControlPlane, guard_factory: Any, floor: tuple[str, Path]
) -> None:
    cp = control_plane
    name, policy = floor
    node = unique("vaprestore")
    cp.create_node(node, INSTANCE_TYPE)
    cp.kubelet(node, "install", "--driver", EBS, "--node-id", "i-vr", "--max-volumes", "25")
    wait_for_floor(cp, name, node)
    guard: Guard = guard_factory(policy=policy)
    cp.kubelet(node, "update", "--driver", EBS, "--max-volumes", "23")

    # The runbook: unregister, a bogus 39 is stored (within the floor's step), register, restore the trusted 23.
    guard.unregister()
    assert _kubelet_update(cp, node, 39).returncode == 0
    guard.register()
    alice = cp.approver_kubeconfig()
    guard.csinode_guard("restore", node, "--driver", EBS, "--reason", "bogus limit", "--state-key-file",
                        str(guard.cert_dir / "state.key"), "--kubeconfig", str(alice))
    restored = cp.get_csinode(node)
    assert counts(restored) == {EBS: 23}
    assert "approvedBy" in restored["metadata"]["annotations"]["csinode-guard.io/state"]
    assert JUSTIFICATION in restored["metadata"]["annotations"]  # covering exactly 23, unexpired

    # The floor alone: the guard unregistered and stopped; what restore left behind lifts nothing.
    guard.unregister()
    guard.stop()
    assert _kubelet_update(cp, node, 39).returncode == 0
    jump = _admin_count(cp, node, 100)  # the apiserver names the first check that fails: maxStepUp
    assert jump.returncode != 0 and _refused_by_floor(name, jump.stderr) and "maxStepUp" in jump.stderr, jump.stderr
    small = _admin_count(cp, node, 50)  # within the step: the writer check holds too
    assert small.returncode != 0 and _refused_by_floor(name, small.stderr) and "[writer-identity]" in small.stderr, (
        small.stderr)
    assert counts(cp.get_csinode(node)) == {EBS: 39}

    # Only a justifier sets a justification: the admin and the node itself are refused.
    for kubeconfig in (cp.kubeconfig, cp.node_kubeconfig(node)):
        forged = _justify(cp, node, kubeconfig, low=0, high=128, expires="2099-01-01T00:00:00Z")
        assert forged.returncode != 0 and "only a justifier the policy lists" in forged.stderr, forged.stderr

    # An approver's justification: expired, or a range without the new count, lifts nothing; covering does.
    for low, high, expires in ((40, 60, "2020-01-01T00:00:00Z"), (60, 100, "2099-01-01T00:00:00Z")):
        assert _justify(cp, node, alice, low=low, high=high, expires=expires).returncode == 0
        refused = _admin_count(cp, node, 50)
        assert refused.returncode != 0 and "[writer-identity]" in refused.stderr, (low, high, expires, refused.stderr)
        assert counts(cp.get_csinode(node)) == {EBS: 39}
    assert _justify(cp, node, alice, low=40, high=60, expires="2099-01-01T00:00:00+02:00").returncode == 0
    covered = _admin_count(cp, node, 50)
    assert covered.returncode == 0, covered.stderr
    assert counts(cp.get_csinode(node)) == {EBS: 50}
    # It never lifts the highest ceiling (128 for ebs).
    assert _justify(cp, node, alice, low=0, high=500, expires="2099-01-01T00:00:00Z").returncode == 0
    assert _kubelet_update(cp, node, 60).returncode == 0  # the step lifted for the kubelet too (50 -> 60 is within)
    above = _kubelet_update(cp, node, 129)
    assert _refused_by_floor(name, above.stderr) and "highest possible ceiling" in above.stderr, above.stderr
