"""The guard up, stopped or hanging, through the real apiserver: which writes still succeed, what
``failurePolicy: Fail`` and ``timeoutSeconds: 5`` do to the others (measured), and ``unregister`` as the
emergency switch.

Measured here (2026-12-01, 2 busy CPUs; the tests print their times with ``-s``): a registration and a removal
reach the guard only through the ``failurePolicy: Ignore`` entries, so both succeed whether the guard is up
(judged: 39 clamped to 27), stopped (failed open) or hung (failed open after ``timeoutSeconds`` for the mutating
and again for the validating call of each write); with the guard stopped, kubelet's count increase (the ``Fail``
entry) is refused at once (connection refused); with it hung, one PUT is refused after 5.2 s (timeoutSeconds 5)
and kubelet's update gives up after its tries of ~5 s each.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from tests.k8s.controlplane import ControlPlane, Guard, counts, csinode_writes, fast_policy, unique, wait_until

EBS = "ebs.csi.aws.com"
EFS = "efs.csi.aws.com"
TIMEOUT_SECONDS = 5  # webhook.kube.registration.TIMEOUT_SECONDS, what `register` sends


def set_state(guard: Guard, state: str) -> None:
    if state == "stopped":
        guard.stop()
    elif state == "hanging":
        guard.pause()


def webhook_calls(event: dict[str, Any]) -> list[tuple[str, str]]:
    """The apiserver's audit annotations of an event as (what, webhook entry): ``called``/``mutated`` for a
    mutating call, ``failed-open`` for a call that failed under ``failurePolicy: Ignore``."""
    out = []
    for key, value in (event.get("annotations") or {}).items():
        if key.startswith("failed-open."):
            out.append(("failed-open", value))
        elif key.startswith("mutation.webhook.admission.k8s.io/"):
            call = json.loads(value)
            out.append(("mutated" if call["mutated"] else "called", call["webhook"]))
    return sorted(out)


MUTATE_IGNORE = "node-registrations.mutate.csinode-guard.io"
VALIDATE_IGNORE = "node-registrations.validate.csinode-guard.io"


@pytest.mark.parametrize("state", ["up", "stopped", "hanging"])
def test_registration_and_removal_succeed_whatever_the_guard_state(
    control_plane: ControlPlane, guard: Guard, state: str
) -> None:
    cp = control_plane
    node = unique(f"reg-{state}")
    cp.create_node(node, labels={"node.kubernetes.io/instance-type": "m6i.large"})  # the EBS profile: 27
    cp.kubelet(node, "install", "--driver", EFS, "--node-id", "fs-1")  # an unbounded driver already there
    before = len([r for r in guard.decisions() if r.get("node") == node])
    set_state(guard, state)

    started = time.monotonic()
    cp.kubelet(node, "install", "--driver", EBS, "--node-id", "i-1", "--max-volumes", "39")
    # Up, the guard judges the registration (never refused) and clamps it; down, it goes through unjudged.
    assert counts(cp.get_csinode(node)) == {EFS: None, EBS: 27 if state == "up" else 39}
    cp.kubelet(node, "uninstall", "--driver", EBS)
    assert counts(cp.get_csinode(node)) == {EFS: None}
    elapsed = time.monotonic() - started
    print(f"guard {state}: install + uninstall in {elapsed:.2f}s")

    # Both reach the guard through the failurePolicy Ignore entries only: a stopped or hung guard fails open.
    events = wait_until(lambda: [e for e in cp.audit_events(csinode_writes(node)) if e["verb"] == "update"][-2:],
                        what="both writes audited")
    assert len(events) == 2
    assert [e["responseStatus"]["code"] for e in events] == [200, 200]
    calls = [webhook_calls(e) for e in events]
    if state == "up":
        assert calls[0] == [("mutated", MUTATE_IGNORE)]
        assert calls[1] in ([("called", MUTATE_IGNORE)], [("mutated", MUTATE_IGNORE)])
        judged = [r for r in guard.decisions() if r.get("node") == node][before:]
        registration = [r for r in judged if r["endpoint"] == "mutate" and r.get("new") == 39]
        assert [(r["driver"], r["final"], r["decision"], r["allowed"]) for r in registration] == [
            (EBS, 27, "clamp", True)
        ]
    else:
        failed_open = [("called", MUTATE_IGNORE), ("failed-open", MUTATE_IGNORE), ("failed-open", VALIDATE_IGNORE)]
        assert calls == [failed_open, failed_open]
        assert [r for r in guard.decisions() if r.get("node") == node][before:] == []
    if state == "hanging":  # timeoutSeconds for the mutating and again for the validating call of each write
        assert elapsed >= 4 * (TIMEOUT_SECONDS - 0.2)


def test_a_count_change_with_the_guard_stopped_is_refused_at_once_until_unregister(
    control_plane: ControlPlane, guard: Guard
) -> None:
    cp = control_plane
    node = unique("stopped")
    cp.create_node(node)
    cp.kubelet(node, "install", "--driver", EBS, "--node-id", "i-1", "--max-volumes", "25")
    guard.stop()

    # An increase goes to the failurePolicy Fail entry (a decrease would go to the Ignore one and succeed).
    started = time.monotonic()
    refused = cp.kubelet(node, "update", "--driver", EBS, "--max-volumes", "27", check=False)
    elapsed = time.monotonic() - started
    print(f"guard stopped: kubelet's update refused after {elapsed:.2f}s")
    assert refused.returncode == 1
    assert 'failed calling webhook "increases-and-other-writers.mutate.csinode-guard.io"' in refused.stderr
    assert "connection refused" in refused.stderr
    assert counts(cp.get_csinode(node)) == {EBS: 25}

    # The emergency switch: afterwards the change succeeds, unjudged; the state keeps the registration's 25.
    guard.unregister()
    cp.kubelet(node, "update", "--driver", EBS, "--max-volumes", "27")
    stored = cp.get_csinode(node)
    assert counts(stored) == {EBS: 27}
    assert json.loads(stored["metadata"]["annotations"]["csinode-guard.io/state"])["drivers"][EBS]["count"] == 25
    before = len(guard.decisions())

    # Started again on the same port and registered again: its audit's first pass judges what changed unjudged
    # meanwhile and lowers the increase back to the 25 it trusted (the bundled policy reconciles with clamp).
    port = guard.port
    guard.start()
    guard.register()
    assert guard.port == port
    repaired = wait_until(lambda: [r for r in guard.decisions()[before:]
                                   if r.get("node") == node and r["endpoint"] == "audit"
                                   and r["decision"] == "repaired"], timeout=60, what="the audit's repair")
    assert [(r["driver"], r["old"], r["final"], r["trigger"]) for r in repaired] == [(EBS, 27, 25, "start")]
    assert counts(cp.get_csinode(node)) == {EBS: 25}
    # And admission judges the next change.
    judged_from = len(guard.decisions())
    cp.kubelet(node, "update", "--driver", EBS, "--max-volumes", "22")
    assert counts(cp.get_csinode(node)) == {EBS: 22}
    judged = [r for r in guard.decisions()[judged_from:] if r.get("node") == node]
    assert [(r["endpoint"], r["old"], r["new"], r["allowed"]) for r in judged] == [
        ("mutate", 25, 22, True), ("validate", 25, 22, True)]


def test_a_count_change_with_the_guard_hanging_waits_timeout_seconds_then_is_refused(
    control_plane: ControlPlane, guard_factory: Any, tmp_path: Path
) -> None:
    cp = control_plane
    # change-rate at 2s: the registration's accepted count starts its interval, the resumed increase follows
    guard: Guard = guard_factory(fast_policy(tmp_path / "policy.yaml"))
    node = unique("hanging")
    cp.create_node(node)
    cp.kubelet(node, "install", "--driver", EBS, "--node-id", "i-1", "--max-volumes", "25")
    guard.pause()

    # One PUT by the node: the apiserver waits timeoutSeconds for the mutating webhook, then fails it (Fail).
    started = time.monotonic()
    put = cp.replace_count(node, EBS, 27, check=False)  # an increase: the failurePolicy Fail entry
    one_put = time.monotonic() - started
    print(f"guard hanging: one PUT refused after {one_put:.2f}s")
    assert put.returncode != 0
    assert 'failed calling webhook "increases-and-other-writers.mutate.csinode-guard.io"' in put.stderr
    assert "context deadline exceeded" in put.stderr or "timeout" in put.stderr.lower()
    assert one_put >= TIMEOUT_SECONDS - 0.2

    # kubelet's code: each of its tries waits the timeout, then it gives up.
    before = len(cp.audit_events(csinode_writes(node)))
    started = time.monotonic()
    refused = cp.kubelet(node, "update", "--driver", EBS, "--max-volumes", "27", check=False)
    kubelet_elapsed = time.monotonic() - started
    assert refused.returncode == 1
    assert 'failed calling webhook "increases-and-other-writers.mutate.csinode-guard.io"' in refused.stderr
    tries = wait_until(lambda: [e for e in cp.audit_events(csinode_writes(node))[before:] if e["verb"] == "update"],
                       what="kubelet's tries audited")
    print(f"guard hanging: kubelet gave up after {kubelet_elapsed:.2f}s and {len(tries)} tries")
    assert kubelet_elapsed >= len(tries) * (TIMEOUT_SECONDS - 0.2)
    assert {e["responseStatus"]["code"] for e in tries} == {500}
    assert counts(cp.get_csinode(node)) == {EBS: 25}

    # Resumed, the guard judges the same change again.
    guard.resume()
    cp.kubelet(node, "update", "--driver", EBS, "--max-volumes", "27")
    assert counts(cp.get_csinode(node)) == {EBS: 27}
