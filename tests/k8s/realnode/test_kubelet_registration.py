"""Registration on the real kubelet: its plugin watcher registers the csi-driver-host-path node plugin (a
DaemonSet pod's node-driver-registrar) and writes the CSINode; a DaemonSet rollout replaces the pod.

Why the real kubelet: the guard's promise at registration is about what the kubelet *decides* when its write is
clamped — that its plugin registration still succeeds (it answers the registrar with ``PluginRegistered:true``;
on a failure the registrar exits and kubelet marks the node NotReady after its retries), that the node stays
Ready and the driver registered, and in which order it writes across a rollout (removal, then registration). The
``kubelet-csinode`` tests in ``tests/k8s/test_registration.py`` make the same writes at chosen moments, but
cannot show these decisions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.k8s.controlplane import ADMIN_USER, Guard, unique, wait_until
from tests.k8s.realnode.cluster import DRIVER, NOT_REGISTERED, REGISTERED, KubeletWrite, RealNode
from tests.k8s.realnode.policy import hostpath_policy

CEILING = 6


def registrar_restarts(pod: dict[str, Any]) -> int:
    statuses = pod.get("status", {}).get("containerStatuses") or []
    return sum(int(s.get("restartCount", 0)) for s in statuses)


def test_a_first_registration_and_a_rollout_above_the_ceiling_are_clamped_and_the_node_stays_ready(
    real_node: RealNode, guard_factory: Any, tmp_path: Path
) -> None:
    """The driver reports 9, then after a rollout 12, against a ceiling of 6: both registrations are clamped to 6,
    kubelet's plugin registration succeeds both times, the node stays Ready, the driver stays registered."""
    node = real_node
    guard: Guard = guard_factory(hostpath_policy(tmp_path / "policy.yaml", ceiling=CEILING))

    node.deploy_driver(attach_limit=9)
    first = node.wait_registered()
    wait_until(lambda: node.count() == CEILING, timeout=30, what="the first registration stored, clamped")
    writes = node.kubelet_writes()
    assert [w.verb for w in writes[:2]] == ["create", "update"], [w.line for w in writes]
    create, registration = writes[:2]
    assert create.sent == {} and registration.sent == {DRIVER: 9}, [w.line for w in writes]
    assert registration.stored == {DRIVER: CEILING}

    node.roll_out(attach_limit=12)
    second = node.wait_registered(replacing=first)

    def after_removal() -> list[KubeletWrite] | None:
        """kubelet's writes from the rollout's removal on, once the registration and one refresh followed it."""
        later = node.kubelet_writes()[len(writes):]
        removals = [i for i, w in enumerate(later) if w.sent == {}]
        return later[removals[0]:] if removals and len(later) >= removals[0] + 3 else None

    # kubelet's order across the rollout: the old pod's socket goes (removal), the new pod registers, then its
    # periodic NodeGetInfo refresh writes the 12 the driver keeps reporting (held at 6).
    removal, reregistration, refresh = wait_until(after_removal, timeout=60, what="removal, registration and one "
                                                  "periodic refresh after the rollout")[:3]
    print("\n" + "\n".join(w.line for w in node.kubelet_writes()))
    assert (removal.sent, removal.stored) == ({}, {}), removal.line
    assert (reregistration.sent, reregistration.stored) == ({DRIVER: 12}, {DRIVER: CEILING}), reregistration.line
    assert (refresh.sent, refresh.stored) == ({DRIVER: 12}, {DRIVER: CEILING}), refresh.line
    assert all(w.stored in ({DRIVER: CEILING}, {}) for w in node.kubelet_writes()[1:]), "never above the ceiling"
    assert all(w.code < 300 for w in node.kubelet_writes()), "no kubelet write failed"

    assert node.count() == CEILING
    assert node.ready()
    # (the first pod's log went with the pod; wait_registered read its success)
    log = node.registrar_log(second)
    assert REGISTERED in log and NOT_REGISTERED not in log, log[-2000:]
    [running] = [p for p in node.driver_pods() if "deletionTimestamp" not in p["metadata"]]
    assert running["metadata"]["uid"] == second["metadata"]["uid"]
    assert registrar_restarts(running) == 0, "the registrar never had to register again"

    mine = [r for r in guard.decisions() if r.get("node") == node.name and r.get("endpoint") == "mutate"]
    registrations = [r for r in mine if r.get("registration")]
    assert [(r["new"], r["final"], r["decision"]) for r in registrations] == [(9, CEILING, "clamp"),
                                                                            (12, CEILING, "clamp")], registrations


def test_a_registration_while_the_guard_is_down_is_repaired_by_the_audit_without_a_write_fight(
    real_node: RealNode, guard_factory: Any, tmp_path: Path
) -> None:
    """The guard is down during a rollout: the new pod's registration (12, above the ceiling 6) goes through the
    ``Ignore`` entry. The guard comes back with ``reconcile: clamp``: its audit lowers the count once, and the
    real kubelet, which keeps running and keeps reporting 12 every period, neither undoes the repair nor gets the
    guard to write again.

    Why the real kubelet: the write fight is a question of what kubelet's refresh loop does after someone else
    lowered its count (it reads, sees 6 where NodeGetInfo says 12, and writes 12 again each period)."""
    node = real_node
    policy = hostpath_policy(tmp_path / "policy.yaml", ceiling=CEILING, reconcile="clamp")
    guard: Guard = guard_factory(policy, extra_args=(
        "--audit-interval", "2", "--lease-namespace", "default", "--lease-name", unique("audit"),
        "--lease-duration", "6"))
    node.deploy_driver(attach_limit=5)
    first = node.wait_registered()
    wait_until(lambda: node.count() == 5, timeout=30, what="registered at 5")

    guard.stop()
    node.roll_out(attach_limit=12)
    node.wait_registered(replacing=first)
    wait_until(lambda: node.count() == 12, timeout=30, what="the registration stored unjudged (Ignore)")
    assert node.ready()
    unjudged = node.kubelet_writes()[-1]
    assert (unjudged.sent, unjudged.stored) == ({DRIVER: 12}, {DRIVER: 12}), unjudged.line
    # kubelet's refresh finds NodeGetInfo's 12 stored: it reads, and writes nothing the guard could judge
    wait_until(lambda: [t for t in node.kubelet_reads() if t > unjudged.time], timeout=40,
               what="a periodic read after the unjudged registration")

    guard.start()
    wait_until(lambda: node.count() == CEILING, timeout=60, what="the audit repairs 12 -> 6")
    repaired_at = len(node.kubelet_writes())
    assert node.kubelet_writes()[repaired_at - 1] == unjudged, "no kubelet write between the two: only the audit"
    wait_until(lambda: len(node.kubelet_writes()) >= repaired_at + 3, timeout=60,
               what="three periodic refreshes after the repair")

    refreshes = node.kubelet_writes()[repaired_at:]
    print("\n" + "\n".join(w.line for w in node.kubelet_writes()))
    assert all((w.sent, w.stored) == ({DRIVER: 12}, {DRIVER: CEILING}) for w in refreshes), [w.line for w in refreshes]
    assert len({w.resource_version for w in refreshes}) == 1, "no refresh stored anything"
    assert node.count() == CEILING
    repairs = [e for e in node.cp.audit_events(lambda e: (
        e.get("stage") == "ResponseComplete" and (e.get("objectRef") or {}).get("resource") == "csinodes"
        and (e.get("objectRef") or {}).get("name") == node.name and e.get("verb") == "update"
        and (e.get("user") or {}).get("username") == ADMIN_USER))]
    assert len(repairs) == 1, "one repair, then no fight"
    assert refreshes[0].resource_version == repairs[0]["responseObject"]["metadata"]["resourceVersion"]
    assert node.ready()
