"""The guard up, stopped or hanging, through the real apiserver: which writes still succeed, what
``failurePolicy: Fail`` and ``timeoutSeconds: 5`` do to the others (measured), and ``unregister`` as the
emergency switch.

Measured here (2026-12-01, 2 busy CPUs; the tests print their times with ``-s``): a registration plus a removal
take 0.3-0.5 s whether the guard is up, stopped or hung (the apiserver never calls it for them); with the guard
stopped, kubelet's count update is refused after 0.4 s (connection refused, failurePolicy Fail); with it hung,
one PUT is refused after 5.2 s (timeoutSeconds 5) and kubelet's update gives up after 20.5 s and 4 tries.

The tests named ``test_today_...`` pin today's registration behaviour (a driver registration or removal never
reaches the guard: rules and matchConditions); the registration work changes what reaches it and updates them.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.k8s.controlplane import ControlPlane, Guard, counts, csinode_writes, unique, wait_until

EBS = "ebs.csi.aws.com"
EFS = "efs.csi.aws.com"
TIMEOUT_SECONDS = 5  # webhook.registration.TIMEOUT_SECONDS, what `register` sends


def set_state(guard: Guard, state: str) -> None:
    if state == "stopped":
        guard.stop()
    elif state == "hanging":
        guard.pause()


def webhook_annotations(event: dict[str, Any]) -> dict[str, str]:
    return {k: v for k, v in (event.get("annotations") or {}).items() if "webhook.admission.k8s.io" in k
            or k.startswith(("mutate.csinode-guard.io/", "validate.csinode-guard.io/"))}


@pytest.mark.parametrize("state", ["up", "stopped", "hanging"])
def test_today_registration_and_removal_succeed_whatever_the_guard_state(
    control_plane: ControlPlane, guard: Guard, state: str
) -> None:
    cp = control_plane
    node = unique(f"reg-{state}")
    cp.create_node(node)
    cp.kubelet(node, "install", "--driver", EFS, "--node-id", "fs-1")  # an unbounded driver already there
    set_state(guard, state)

    started = time.monotonic()
    cp.kubelet(node, "install", "--driver", EBS, "--node-id", "i-1", "--max-volumes", "25")
    assert counts(cp.get_csinode(node)) == {EFS: None, EBS: 25}
    cp.kubelet(node, "uninstall", "--driver", EBS)
    assert counts(cp.get_csinode(node)) == {EFS: None}
    elapsed = time.monotonic() - started
    print(f"guard {state}: install + uninstall in {elapsed:.2f}s")

    # The apiserver never called the guard for them (no webhook annotation in its audit events), so neither a
    # stopped nor a hung guard could fail or delay them.
    events = wait_until(lambda: [e for e in cp.audit_events(csinode_writes(node)) if e["verb"] == "update"][-2:],
                        what="both writes audited")
    assert len(events) == 2
    assert [e["responseStatus"]["code"] for e in events] == [200, 200]
    assert [webhook_annotations(e) for e in events] == [{}, {}]
    assert [r for r in guard.decisions() if r.get("node") == node] == []


def test_a_count_change_with_the_guard_stopped_is_refused_at_once_until_unregister(
    control_plane: ControlPlane, guard: Guard
) -> None:
    cp = control_plane
    node = unique("stopped")
    cp.create_node(node)
    cp.kubelet(node, "install", "--driver", EBS, "--node-id", "i-1", "--max-volumes", "25")
    guard.stop()

    started = time.monotonic()
    refused = cp.kubelet(node, "update", "--driver", EBS, "--max-volumes", "23", check=False)
    elapsed = time.monotonic() - started
    print(f"guard stopped: kubelet's update refused after {elapsed:.2f}s")
    assert refused.returncode == 1
    assert 'failed calling webhook "mutate.csinode-guard.io"' in refused.stderr
    assert "connection refused" in refused.stderr
    assert counts(cp.get_csinode(node)) == {EBS: 25}

    # The emergency switch: afterwards the change succeeds, unjudged.
    guard.unregister()
    cp.kubelet(node, "update", "--driver", EBS, "--max-volumes", "23")
    stored = cp.get_csinode(node)
    assert counts(stored) == {EBS: 23}
    assert "csinode-guard.io/state" not in (stored["metadata"].get("annotations") or {})

    # Started again on the same port and registered again, it judges the next change.
    port = guard.port
    guard.start()
    guard.register()
    assert guard.port == port
    cp.kubelet(node, "update", "--driver", EBS, "--max-volumes", "22")
    assert counts(cp.get_csinode(node)) == {EBS: 22}
    assert [(r["old"], r["new"]) for r in guard.decisions() if r.get("node") == node] == [(23, 22), (23, 22)]


def test_a_count_change_with_the_guard_hanging_waits_timeout_seconds_then_is_refused(
    control_plane: ControlPlane, guard: Guard
) -> None:
    cp = control_plane
    node = unique("hanging")
    cp.create_node(node)
    cp.kubelet(node, "install", "--driver", EBS, "--node-id", "i-1", "--max-volumes", "25")
    guard.pause()

    # One PUT by the node: the apiserver waits timeoutSeconds for the mutating webhook, then fails it (Fail).
    started = time.monotonic()
    put = cp.replace_count(node, EBS, 23, check=False)
    one_put = time.monotonic() - started
    print(f"guard hanging: one PUT refused after {one_put:.2f}s")
    assert put.returncode != 0
    assert 'failed calling webhook "mutate.csinode-guard.io"' in put.stderr
    assert "context deadline exceeded" in put.stderr or "timeout" in put.stderr.lower()
    assert one_put >= TIMEOUT_SECONDS - 0.2

    # kubelet's code: each of its tries waits the timeout, then it gives up.
    before = len(cp.audit_events(csinode_writes(node)))
    started = time.monotonic()
    refused = cp.kubelet(node, "update", "--driver", EBS, "--max-volumes", "23", check=False)
    kubelet_elapsed = time.monotonic() - started
    assert refused.returncode == 1
    assert 'failed calling webhook "mutate.csinode-guard.io"' in refused.stderr
    tries = wait_until(lambda: [e for e in cp.audit_events(csinode_writes(node))[before:] if e["verb"] == "update"],
                       what="kubelet's tries audited")
    print(f"guard hanging: kubelet gave up after {kubelet_elapsed:.2f}s and {len(tries)} tries")
    assert kubelet_elapsed >= len(tries) * (TIMEOUT_SECONDS - 0.2)
    assert {e["responseStatus"]["code"] for e in tries} == {500}
    assert counts(cp.get_csinode(node)) == {EBS: 25}

    # Resumed, the guard judges the same change again.
    guard.resume()
    cp.kubelet(node, "update", "--driver", EBS, "--max-volumes", "23")
    assert counts(cp.get_csinode(node)) == {EBS: 23}
