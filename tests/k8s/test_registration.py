"""Registrations on the real apiserver: kubelet's own code (``kubelet-csinode``) registers, restarts plugins,
re-creates its CSINode, with the real guard registered through ``csinode-guard register`` (two entries per
configuration: ``failurePolicy: Fail`` for increases, ``Ignore`` for registration, removal, CREATE, decrease).

What must hold: every bypass of a wrong count at registration is held (the count stored in etcd ends within the
ceiling, or at the last count the guard trusted), and kubelet's InstallCSIDriver never fails because of the guard
— up, stopped, hanging or misconfigured. The install latencies are printed (``-s`` shows them).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from tests.k8s.controlplane import ControlPlane, Guard, counts, unique, wait_until
from tests.k8s.test_node_history import ensure_namespace, retained_count

EBS = "ebs.csi.aws.com"
M6I_LARGE = {"node.kubernetes.io/instance-type": "m6i.large"}
CEILING = 27  # the shipped policy's profile for m6i.large (an unlisted Nitro type: 28 shared slots - 1)
STATE = "csinode-guard.io/state"


def new_node(control_plane: ControlPlane, guard: Guard, prefix: str) -> str:
    """A Node with the m6i.large label, once the guard's node watch has seen it (the ceiling needs the label)."""
    node = unique(prefix)
    control_plane.create_node(node, M6I_LARGE)
    time.sleep(1.0)  # the guard's Node informer: one event away
    return node


def install(control_plane: ControlPlane, node: str, max_volumes: int, *, node_id: str = "i-1") -> float:
    """kubelet's InstallCSIDriver (a registration); asserts it succeeded and returns how long it took (s)."""
    started = time.monotonic()
    out = control_plane.kubelet(node, "install", "--driver", EBS, "--node-id", node_id,
                                "--max-volumes", str(max_volumes))
    took = time.monotonic() - started
    assert f"OK install driver={EBS}" in out.stdout, out.stdout + out.stderr
    return took


def uninstall(control_plane: ControlPlane, node: str) -> None:
    control_plane.kubelet(node, "uninstall", "--driver", EBS)


def update(control_plane: ControlPlane, node: str, max_volumes: int) -> Any:
    return control_plane.kubelet(node, "update", "--driver", EBS, "--max-volumes", str(max_volumes), check=False)


def stored_count(control_plane: ControlPlane, node: str) -> int | None:
    return counts(control_plane.get_csinode(node)).get(EBS)


def failed_open(control_plane: ControlPlane) -> float:
    """The apiserver's ``apiserver_admission_webhook_fail_open_count`` summed over the guard's registration entries
    (failurePolicy Ignore): webhook calls that failed (refused, timed out) and were let through."""
    metrics = control_plane.kubectl("get", "--raw", "/metrics").stdout
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("apiserver_admission_webhook_fail_open_count{") and "node-registrations." in line)


def report(what: str, seconds: float) -> None:
    print(f"\n[install latency] {what}: {seconds:.2f}s")


def test_a_plugin_restart_of_an_old_driver_reporting_39_ends_within_the_ceiling(
    control_plane: ControlPlane, guard: Guard
) -> None:
    node = new_node(control_plane, guard, "restart")
    report("guard up, first registration", install(control_plane, node, 25))
    assert stored_count(control_plane, node) == 25

    uninstall(control_plane, node)
    took = install(control_plane, node, 39)  # the old driver's static table (aws-ebs-csi-driver#1139)

    report("guard up, plugin restart reporting 39", took)
    # Within minInterval of the first registration: paced, the last accepted count (below the ceiling 27).
    assert stored_count(control_plane, node) == 25
    clamped = [r for r in guard.decisions() if r.get("node") == node and r.get("decision") == "clamp"]
    assert clamped, "the clamp is audited"


def test_a_reregistration_without_allocatable_stores_a_bounded_count(
    control_plane: ControlPlane, guard: Guard
) -> None:
    node = new_node(control_plane, guard, "unbounded")
    install(control_plane, node, 0)  # NodeGetInfo max_volumes_per_node 0: kubelet writes no allocatable
    assert stored_count(control_plane, node) == CEILING

    control_plane.kubelet(node, "update", "--driver", EBS, "--max-volumes", "20")
    assert stored_count(control_plane, node) == 20
    uninstall(control_plane, node)
    install(control_plane, node, 0)

    assert stored_count(control_plane, node) == 20  # the count before removal


def test_delete_and_create_of_the_csinode_as_the_node_is_held_at_the_last_trusted_count(
    control_plane: ControlPlane, guard: Guard
) -> None:
    ensure_namespace(control_plane)  # the audit leader's history records live in the guard's namespace
    node = new_node(control_plane, guard, "recreate")
    install(control_plane, node, 25)
    # The re-created object is judged from the node's history: wait until the leader has written it, so that the
    # outcome does not depend on whether the DELETE came before or after that write.
    wait_until(lambda: retained_count(control_plane, node) == 25, what=f"the history record of {node}")
    old = control_plane.get_csinode(node)
    assert STATE in old["metadata"]["annotations"]
    as_node = control_plane.node_kubeconfig(node)

    control_plane.kubectl("delete", "csinode", node, kubeconfig=as_node)
    recreated = {
        "apiVersion": "storage.k8s.io/v1",
        "kind": "CSINode",
        "metadata": {"name": node, "annotations": dict(old["metadata"]["annotations"]),
                     "ownerReferences": old["metadata"]["ownerReferences"]},
        "spec": {"drivers": [{**old["spec"]["drivers"][0], "allocatable": {"count": 128}}]},
    }
    control_plane.kubectl("create", "-f", "-", kubeconfig=as_node, input=json.dumps(recreated))

    stored = control_plane.get_csinode(node)
    # Below the ceiling (27) and at the last count the guard trusted: 25 -> 128 within minInterval is paced.
    assert counts(stored) == {EBS: 25}
    assert stored["metadata"]["uid"] != old["metadata"]["uid"]
    # Mutating admission of a CREATE sees no UID yet: no state can be signed for the new object, and the copied
    # one (another UID) is removed.
    assert STATE not in stored["metadata"]["annotations"]


def test_with_the_guard_stopped_registrations_and_decreases_pass_increases_fail_and_it_reconciles(
    control_plane: ControlPlane, guard: Guard
) -> None:
    node = new_node(control_plane, guard, "down")
    install(control_plane, node, 25)
    control_plane.kubelet(node, "update", "--driver", EBS, "--max-volumes", "24")
    guard.stop()

    assert update(control_plane, node, 23).returncode == 0, "a decrease passes (failurePolicy Ignore)"
    increase = update(control_plane, node, 26)
    assert increase.returncode != 0, "an increase fails (failurePolicy Fail)"
    assert stored_count(control_plane, node) == 23
    uninstall(control_plane, node)
    report("guard stopped, plugin restart reporting 39", install(control_plane, node, 39))
    assert stored_count(control_plane, node) == 39, "went through unjudged"
    metrics = control_plane.kubectl("get", "--raw", "/metrics").stdout
    assert 'apiserver_admission_webhook_fail_open_count{name="node-registrations.mutate.csinode-guard.io"' in metrics, (
        "the CSINodeGuardFailOpen alert's series"
    )

    guard.start()
    wait_until(lambda: guard.probe() == {"mutate", "validate"}, timeout=30, what="guard called again")
    result = update(control_plane, node, 40)

    assert result.returncode == 0, result.stderr
    # Judged from the last count the guard accepted, 24 (it never saw the unjudged 23, which the unjudged
    # re-registration replaced): clamped there by change-rate, not refused (a refusal would keep 39).
    assert stored_count(control_plane, node) == 24


def test_with_the_guard_hanging_kubelets_install_still_succeeds(
    control_plane: ControlPlane, guard: Guard
) -> None:
    node = new_node(control_plane, guard, "hang")
    before = failed_open(control_plane)
    guard.pause()
    try:
        took = install(control_plane, node, 39)
        assert stored_count(control_plane, node) == 39  # unjudged: reconciled at the node's next judged write
        after_install = failed_open(control_plane)
        started = time.monotonic()
        uninstall(control_plane, node)
        removal = time.monotonic() - started
        after_removal = failed_open(control_plane)
        restart = install(control_plane, node, 30)
        after_restart = failed_open(control_plane)
    finally:
        guard.resume()

    report("guard hanging (SIGSTOP), first registration (CREATE + UPDATE) reporting 39", took)
    report("guard hanging (SIGSTOP), plugin restart: removal", removal)
    report("guard hanging (SIGSTOP), plugin restart: registration", restart)
    # Each write's call to the hanging guard ended at the entry's own timeoutSeconds and was let through
    # (failurePolicy Ignore), as the apiserver counts it: not at kubelet's patience, whatever the machine's load.
    assert before < after_install < after_removal < after_restart, (before, after_install, after_removal, after_restart)
    assert stored_count(control_plane, node) == 30


def test_with_a_wrong_ca_bundle_kubelets_install_still_succeeds(
    control_plane: ControlPlane, guard: Guard, tmp_path: Path
) -> None:
    other_ca = tmp_path / "other-ca"
    guard.csinode_guard("certs", "generate", "--cert-dir", str(other_ca))
    guard.csinode_guard("register", "--url", guard.url, "--cert-dir", str(other_ca), "--name", guard.name)
    node = new_node(control_plane, guard, "wrongca")
    time.sleep(2)  # the apiserver's webhook configuration informer

    took = install(control_plane, node, 39)

    report("guard misconfigured (wrong caBundle), first registration reporting 39", took)
    assert stored_count(control_plane, node) == 39
    assert update(control_plane, node, 40).returncode != 0, "the increases entry still fails closed"


@pytest.mark.parametrize("guard_state", ["stopped"])
def test_install_latency_with_the_guard_stopped(control_plane: ControlPlane, guard: Guard, guard_state: str) -> None:
    node = new_node(control_plane, guard, "latency")
    guard.stop()
    before = failed_open(control_plane)

    took = install(control_plane, node, 25)

    report(f"guard {guard_state}, first registration", took)
    # Through, because the apiserver let the refused calls fail open (failurePolicy Ignore); its speed is measured,
    # not asserted (benchmarks/).
    assert stored_count(control_plane, node) == 25
    assert failed_open(control_plane) > before


def test_an_install_over_a_registered_entry_with_the_same_node_id_succeeds_and_keeps_the_count(
    control_plane: ControlPlane, guard: Guard
) -> None:
    """kubelet restarted while the plugin kept running: InstallCSIDriver again, same nodeID and topology, another
    count (kubelet rewrites the entry when anything differs, the count included). That PUT is a periodic update's
    (the failurePolicy Fail entry); change-rate's deny acts as a clamp for the node's kubelet: the registration
    succeeds and the count stays."""
    node = new_node(control_plane, guard, "reinstall")
    install(control_plane, node, 20)
    before = control_plane.get_csinode(node)
    validated = [r for r in guard.decisions() if r.get("node") == node and r.get("endpoint") == "validate"]

    took = install(control_plane, node, 39)

    report("guard up, install again over the registered entry reporting 39", took)
    after = control_plane.get_csinode(node)
    assert counts(after) == {EBS: 20}, "the count the denial would have kept"
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"], (
        "the clamp's result is the stored object: the PUT is a no-op"
    )
    records = [r for r in guard.decisions()
               if r.get("node") == node and r.get("endpoint") == "mutate" and r.get("operation") == "UPDATE"]
    last = records[-1]
    assert last["decision"] == "clamp", last
    outcome = next(o for o in last["rules"] if o["rule"] == "change-rate" and o["result"] == "violation")
    assert (outcome["enforcement"], outcome["effective"]) == ("deny", "clamp"), outcome
    assert any("change-rate deny acts as clamp for the node's kubelet" in n for n in last.get("notes", [])), last
    assert [r for r in guard.decisions() if r.get("node") == node and r.get("endpoint") == "validate"] == validated, (
        "the clamped write changes no count: neither /validate entry's matchConditions match it"
    )


def test_an_install_over_a_registered_entry_with_a_higher_count_fails_while_the_guard_is_down_and_succeeds_after(
    control_plane: ControlPlane, guard: Guard
) -> None:
    """The one registration the guard's outage can fail (docs/registration.md, "Decided"): kubelet restarted
    while the node plugin kept running, InstallCSIDriver over the entry that is still there, same nodeID and
    topology, a higher count. That PUT is byte for byte a periodic update's increase, so it reaches the
    ``failurePolicy: Fail`` entry; kubelet's plugin manager retries the registration, and once the guard is back
    it succeeds, held at the stored count (a too-fast increase by the node's kubelet)."""
    node = new_node(control_plane, guard, "reinstall-down")
    install(control_plane, node, 20)
    guard.stop()
    try:
        refused = control_plane.kubelet(node, "install", "--driver", EBS, "--node-id", "i-1", "--max-volumes", "24",
                                        check=False)
        assert refused.returncode != 0, "an increase while the guard is down fails closed"
        assert "increases-and-other-writers.mutate.csinode-guard.io" in refused.stderr, refused.stderr
        assert stored_count(control_plane, node) == 20
    finally:
        guard.start()
    wait_until(lambda: guard.probe() == {"mutate", "validate"}, timeout=30, what="guard called again")

    took = install(control_plane, node, 24)

    report("guard back, the retried install over the registered entry reporting 24", took)
    assert stored_count(control_plane, node) == 20, "held at the stored count: within the default minInterval"
    last = [r for r in guard.decisions() if r.get("node") == node and r.get("endpoint") == "mutate"][-1]
    assert (last["new"], last["final"], last["decision"]) == (24, 20, "clamp"), last
