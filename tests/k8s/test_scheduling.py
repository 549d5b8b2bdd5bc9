"""Scheduling consistency, end to end, with the real kube-scheduler: the reason the guard exists.

A node's EBS driver first reports its real limit, 27 (an unlabelled node: the profile's default for Nitro
instances), then a bogus 39. With the guard the stored count stays 27 and the scheduler places at most 27
volume-using pods there; without it the 39 is stored and the scheduler places more than the node can attach.
"""

from __future__ import annotations

from tests.k8s.controlplane import ControlPlane, Guard, counts, unique
from tests.k8s.scheduling import create, settle, volume_pods

EBS = "ebs.csi.aws.com"
REAL_LIMIT = 27
BOGUS = 39
PODS = 30


def test_with_the_guard_at_most_the_real_limit_of_volume_pods_lands_on_the_node(
    control_plane: ControlPlane, guard: Guard
) -> None:
    cp = control_plane
    guarded, unguarded = unique("guarded"), unique("unguarded")
    cp.create_node(guarded)
    cp.create_node(unguarded)

    cp.kubelet(guarded, "install", "--driver", EBS, "--node-id", "i-g", "--max-volumes", str(REAL_LIMIT))
    cp.kubelet(guarded, "update", "--driver", EBS, "--max-volumes", str(BOGUS))
    assert counts(cp.get_csinode(guarded)) == {EBS: REAL_LIMIT}

    guard.unregister()
    guard.stop()  # without the guard at all: a running one's audit (reconcile: clamp) would lower the 39 as well
    cp.kubelet(unguarded, "install", "--driver", EBS, "--node-id", "i-u", "--max-volumes", str(REAL_LIMIT))
    cp.kubelet(unguarded, "update", "--driver", EBS, "--max-volumes", str(BOGUS))
    assert counts(cp.get_csinode(unguarded)) == {EBS: BOGUS}

    namespace = unique("volumes")
    create(cp, namespace, volume_pods(namespace, guarded, EBS, PODS) + volume_pods(namespace, unguarded, EBS, PODS))

    bound, unschedulable, messages = settle(cp, namespace, guarded, PODS)
    print(f"with the guard: {bound} of {PODS} pods bound, {unschedulable} unschedulable: {messages[:1]}")
    assert bound == REAL_LIMIT
    assert unschedulable == PODS - REAL_LIMIT
    assert all("exceed max volume count" in m for m in messages)

    bound, unschedulable, _ = settle(cp, namespace, unguarded, PODS)
    print(f"without the guard: {bound} of {PODS} pods bound, {unschedulable} unschedulable")
    assert bound == PODS > REAL_LIMIT
