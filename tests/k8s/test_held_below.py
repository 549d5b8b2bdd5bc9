"""The guard too conservative, made visible (issue 35, item 4), on the real apiserver with the real kube-scheduler: a
node whose driver reports more than the guard lets it store, and pods Pending because of the volume limit there.

kubelet's own code registers the driver with a report above the policy's ceiling (the registration is clamped, never
refused); the scheduler's NodeVolumeLimits plugin then binds as many pods as the stored count allows and marks the
rest Unschedulable (``node(s) exceed max volume count``). The guard's metrics and ``csinode-guard status`` show the
node held below the report (held/reported) and the pods Pending for the volume limit. Nothing raises the count.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.k8s.controlplane import ControlPlane, Guard, counts, policy_file, unique, wait_until
from tests.k8s.scheduling import create, settle, volume_pods
from tests.k8s.test_audit import scrape

EBS = "ebs.csi.aws.com"
HELD = 3
REPORTED = 5
HELD_METRIC = "csinode_guard_held_below_reported_nodes"
PENDING_METRIC = "csinode_guard_volume_limit_pending_pods"


def status(cp: ControlPlane, guard: Guard, *args: str) -> subprocess.CompletedProcess[str]:
    """``csinode-guard status`` as the admin, verifying the guard's state with its key."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "webhook",
            "status",
            "--policy",
            str(guard.policy_path),
            "--state-key-file",
            str(guard.cert_dir / "state.key"),
            *args,
        ],
        env={**os.environ, "KUBECONFIG": str(cp.kubeconfig)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result


def test_a_node_held_below_its_drivers_report_shows_next_to_the_pods_pending_on_volume_limits(
    control_plane: ControlPlane, guard_factory: Any, tmp_path: Path
) -> None:
    cp = control_plane

    def edit(doc: dict[str, Any]) -> None:
        doc["spec"]["drivers"][EBS]["ceiling"] = {"max": HELD}

    guard: Guard = guard_factory(policy_file(tmp_path / "policy.yaml", edit))
    node = unique("held")
    cp.create_node(node)
    cp.kubelet(node, "install", "--driver", EBS, "--node-id", f"i-{node}", "--max-volumes", str(REPORTED))
    stored = cp.get_csinode(node)
    assert counts(stored) == {EBS: HELD}, "the registration is clamped to the ceiling"
    state = json.loads(stored["metadata"]["annotations"]["csinode-guard.io/state"])
    assert state["drivers"][EBS]["reported"] == REPORTED, "the state records what the driver reported"

    namespace = unique("volumes")
    objects = volume_pods(namespace, node, EBS, REPORTED)
    create(cp, namespace, objects)
    try:
        bound, unschedulable, messages = settle(cp, namespace, node, REPORTED)
        assert (bound, unschedulable) == (HELD, REPORTED - HELD)
        assert all("exceed max volume count" in m for m in messages), messages

        text = status(cp, guard, "--node", node).stdout
        assert f"held {HELD}/{REPORTED} reported" in text, text
        assert f"  {EBS}: 1 node(s): {node} {HELD}/{REPORTED}\n" in text, text
        assert "hint: pods wait Pending on volume limits while the guard holds these nodes below" in text, text

        last: list[Any] = []

        def metrics_match_status() -> bool:
            # Both are cluster-wide (other tests' nodes and pods share this cluster): the guard's watch caches
            # count what one LIST per kind shows.
            held = json.loads(status(cp, guard, "-o", "json").stdout)["heldBelowReported"]
            mine = [h for nodes in held["drivers"].values() for h in nodes if h["node"] == node]
            values = scrape(guard)
            held_metric = sum(v for k, v in values.items() if k.startswith(HELD_METRIC + "{"))
            last[:] = [held, held_metric, values.get(PENDING_METRIC)]
            return (
                mine == [{"node": node, "held": HELD, "reported": REPORTED}]
                and held["pendingOnVolumeLimits"] >= REPORTED - HELD
                and values.get(PENDING_METRIC) == held["pendingOnVolumeLimits"]
                and held_metric == sum(len(nodes) for nodes in held["drivers"].values())
            )

        try:
            wait_until(metrics_match_status, timeout=60, what="the guard's metrics showing what status shows")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; last: {last}") from None
        assert counts(cp.get_csinode(node)) == {EBS: HELD}, "nothing raised the count"
    finally:
        cp.kubectl("delete", "namespace", namespace, "--wait=false", "--ignore-not-found")
        names = [o["metadata"]["name"] for o in objects if o["kind"] == "PersistentVolume"]
        cp.kubectl("delete", "pv", *names, "--wait=false", "--ignore-not-found")
