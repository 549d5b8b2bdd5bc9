"""The automatic brake on the real apiserver (issue 35): a driver "upgrade" raises the counts on 6 nodes (kubelet
updates by ``kubelet-csinode`` as ``system:node:<node>``), attach failures appear on 3 of them (VolumeAttachments
created as admin, their status written through the status subresource as the external-attacher writes it). With
errorCode 8 the audit leader engages the brake: every further increase of the driver is held, the raised counts go
back to the last trusted ones (``reconcile: clamp``), ``status`` and ``brake list`` show the evidence, an
approver's ``brake release`` releases it and a node's attempt is refused; a shortened quiet period releases it on
its own. errorCode 9 on the same nodes engages nothing. Each test uses a driver of its own."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.k8s.attachments import attach_error
from tests.k8s.controlplane import ADMIN_USER, REPO, ControlPlane, Guard, counts, policy_file, unique, wait_until
from tests.k8s.monitoring import assert_alert_active, condition, scraped
from tests.k8s.prometheus import Prometheus
from webhook.admission.brake import BRAKES_OBJECT
from webhook.admission.state import format_time, parse_time

NAMESPACE = "csinode-guard"  # the guard's namespace: its Lease, the history records and the brakes
NODES = 6
BRAKE_APPROVERS = "csinode-guard:brake-approvers"


def brake_policy(path: Path, quiet_period: str = "1h") -> Path:
    """The bundled policy with the admin user as a writer (the guard's identity here: its repairs), a short
    change-rate interval, and the brake's quiet period."""

    def edit(doc: dict[str, Any]) -> None:
        spec = doc["spec"]
        spec["reconcile"] = "clamp"
        spec["writers"]["users"] = [ADMIN_USER]
        spec["rules"]["change-rate"]["minInterval"] = "1s"
        spec["brake"] = {
            "enabled": True,
            "lookback": "1h",
            "minNodes": 3,
            "minFraction": 0.5,
            "quietPeriod": quiet_period,
        }

    return policy_file(path, edit)


def ensure_namespace(cp: ControlPlane) -> None:
    if cp.kubectl("get", "namespace", NAMESPACE, check=False).returncode != 0:
        cp.kubectl("create", "namespace", NAMESPACE)


@pytest.fixture
def brakes_record(control_plane: ControlPlane) -> Iterator[None]:
    """The namespace exists; the brakes' ConfigMap is deleted after the test (after its guards stopped)."""
    ensure_namespace(control_plane)
    yield
    control_plane.kubectl("delete", "configmap", "-n", NAMESPACE, BRAKES_OBJECT, "--ignore-not-found")


def start_guard(guard_factory: Any, path: Path, audit_interval: str = "2") -> Guard:
    guard: Guard = guard_factory(
        path,
        extra_args=(
            "--audit-interval",
            audit_interval,
            "--lease-namespace",
            NAMESPACE,
            "--lease-name",
            unique("brake"),
            "--lease-duration",
            "6",
        ),
    )
    return guard


def stored(cp: ControlPlane, node: str, driver: str) -> int | None:
    return counts(cp.get_csinode(node)).get(driver)


def update(cp: ControlPlane, node: str, driver: str, count: int) -> None:
    out = cp.kubelet(node, "update", "--driver", driver, "--max-volumes", str(count), check=False)
    assert out.returncode == 0, out.stderr


def increase_stored(cp: ControlPlane, node: str, driver: str, count: int, what: str, timeout: float = 30) -> None:
    """The node's kubelet reports ``count`` every half second (its periodic update) until etcd holds it."""
    wait_until(lambda: update(cp, node, driver, count) or stored(cp, node, driver) == count, timeout=timeout,
               interval=0.5, what=what)


def rollout(cp: ControlPlane, driver: str) -> list[str]:
    """Six nodes register ``driver`` at 20, then the "upgraded" driver reports 30 on each: admitted increases."""
    nodes = [unique("brake") for _ in range(NODES)]
    for node in nodes:
        cp.create_node(node)
        cp.kubelet(node, "init")
        cp.kubelet(node, "install", "--driver", driver, "--node-id", f"i-{node}", "--max-volumes", "20")
    for node in nodes:
        # change-rate paces increases 1 s after the registration: the kubelet's next period writes it again.
        increase_stored(cp, node, driver, 30, f"the increase on {node}", timeout=60)
    return nodes


def brakes(guard: Guard) -> dict[str, dict[str, Any]]:
    """``csinode-guard brake list -o json`` (verified with the state key), by driver."""
    out = guard.csinode_guard(
        "brake", "list", "-o", "json", "-n", NAMESPACE, "--state-key-file", str(guard.cert_dir / "state.key")
    )
    doc = json.loads(out.stdout)
    assert doc["verified"] is True
    return {b["driver"]: b for b in doc["brakes"]}


def engaged(guard: Guard, driver: str) -> bool:
    return bool(brakes(guard).get(driver, {}).get("engaged"))


def approver_kubeconfig(cp: ControlPlane) -> Path:
    """A user in :data:`BRAKE_APPROVERS`, bound to the shipped Role csinode-guard-brake-approver."""
    role = next(
        doc
        for doc in yaml.safe_load_all((REPO / "deploy" / "base" / "rbac.yaml").read_text())
        if doc and doc["kind"] == "Role" and doc["metadata"]["name"] == "csinode-guard-brake-approver"
    )
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": "csinode-guard-brake-approvers", "namespace": NAMESPACE},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "csinode-guard-brake-approver"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": BRAKE_APPROVERS}],
    }
    cp.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": [role, binding]}))
    return cp.user_kubeconfig("bob@example.com", BRAKE_APPROVERS)


def scrape(guard: Guard) -> str:
    import urllib.request  # noqa: PLC0415

    with urllib.request.urlopen(f"http://127.0.0.1:{guard.metrics_port}/metrics", timeout=10) as answer:
        text: str = answer.read().decode()
    return text


def passes(guard: Guard, trigger: str | None = None) -> float:
    """The guard's audit passes (``csinode_guard_audit_passes_total``), of one trigger or of all."""
    total = 0.0
    prefix = "csinode_guard_audit_passes_total{" + (f'trigger="{trigger}"}}' if trigger else "")
    for line in scrape(guard).splitlines():
        if line.startswith(prefix):
            total += float(line.rpartition(" ")[2])
    return total


def brake_events(cp: ControlPlane, driver: str, reason: str) -> list[dict[str, Any]]:
    events = cp.kubectl_json("get", "events.events.k8s.io", "-n", "default")["items"]
    return [
        e
        for e in events
        if (e.get("regarding") or {}).get("kind") == "CSIDriver"
        and e["regarding"].get("name") == driver
        and e.get("reason") == reason
    ]


@contextlib.contextmanager
def failing_rollout(cp: ControlPlane, driver: str, error_code: int) -> Iterator[tuple[list[str], list[str]]]:
    """The rollout of ``driver`` (:func:`rollout`), then attach errors with gRPC ``error_code`` on its first three
    nodes; yields (nodes, VolumeAttachment names) and deletes the VolumeAttachments afterwards."""
    nodes = rollout(cp, driver)
    vas = [attach_error(cp, node, driver, error_code) for node in nodes[:3]]
    try:
        yield nodes, vas
    finally:
        for va in vas:
            with contextlib.suppress(AssertionError):
                cp.kubectl("delete", "volumeattachment", va, "--ignore-not-found")


def test_capacity_failures_after_a_rollout_engage_the_brake_hold_and_restore_until_an_approver_releases_it(
    control_plane: ControlPlane, brakes_record: None, guard_factory: Any, prometheus: Prometheus, tmp_path: Path
) -> None:
    cp = control_plane
    driver = f"{unique('brake')}.csi.example.com"
    guard = start_guard(guard_factory, brake_policy(tmp_path / "policy.yaml"))
    with failing_rollout(cp, driver, 8) as (nodes, vas), scraped(prometheus, guard) as namespace:
        engage_hold_restore_release(cp, guard, prometheus, namespace, driver, nodes, vas)


def engage_hold_restore_release(
    cp: ControlPlane,
    guard: Guard,
    prometheus: Prometheus,
    namespace: str,
    driver: str,
    nodes: list[str],
    vas: list[str],
) -> None:
    """The engage test's body: the guard's metrics port is scraped by the real Prometheus as ``namespace``."""
    wait_until(lambda: engaged(guard, driver), timeout=60, interval=1, what="the brake to engage")
    record = brakes(guard)[driver]
    assert sorted(e["node"] for e in record["evidence"]) == sorted(nodes[:3])
    assert {e["volumeAttachment"] for e in record["evidence"]} == set(vas)
    assert {(e["from"], e["to"], e["code"]) for e in record["evidence"]} == {(20, 30, 8)}
    assert record["raisedNodes"] == NODES

    # reconcile: clamp puts every count raised inside the window back to the count trusted before it.
    for node in nodes:
        wait_until(
            lambda n=node: stored(cp, n, driver) == 20, timeout=60, interval=0.5, what=f"the count of {node} restored"
        )
    # Further increases are held on every node, the failed ones and the others.
    for node in nodes:
        update(cp, node, driver, 34)
        assert stored(cp, node, driver) == 20
    # A decrease passes.
    update(cp, nodes[5], driver, 18)
    assert stored(cp, nodes[5], driver) == 18
    # A node that joins now registers at most the count trusted before the failed increases, not the driver's 40.
    joined = unique("brake-joined")
    cp.create_node(joined)
    cp.kubelet(joined, "init")
    cp.kubelet(joined, "install", "--driver", driver, "--node-id", f"i-{joined}", "--max-volumes", "40")
    assert stored(cp, joined, driver) == 20

    status = json.loads(
        guard.csinode_guard(
            "status", "-o", "json", "-n", NAMESPACE, "--state-key-file", str(guard.cert_dir / "state.key")
        ).stdout
    )
    shown = [b for b in status["brakes"] if b["driver"] == driver]
    assert shown and shown[0]["engaged"] and len(shown[0]["evidence"]) == 3
    table = guard.csinode_guard("status", "-n", NAMESPACE).stdout
    assert "Brakes engaged" in table and driver in table and nodes[0] in table
    assert 'csinode_guard_brake_engaged{driver="other"} 1.0' in scrape(
        guard
    ) or f'csinode_guard_brake_engaged{{driver="{driver}"}} 1.0' in scrape(guard)
    wait_until(lambda: brake_events(cp, driver, "BrakeEngaged"), what="the BrakeEngaged Event")
    assert any(r.get("decision") == "brake-engaged" and r.get("driver") == driver for r in guard.decisions())
    # The shipped alert fires on the guard's gauge, on a real Prometheus with the overlay's rules.
    assert_alert_active(prometheus, "CSINodeGuardBrakeEngaged", namespace)

    # A node cannot release it: no access to the record, and the CLI says so.
    node_kubeconfig = str(cp.node_kubeconfig(nodes[0]))
    refused = cp.kubectl(
        "annotate",
        "configmap",
        "-n",
        NAMESPACE,
        BRAKES_OBJECT,
        "csinode-guard.io/brake-release={}",
        kubeconfig=cp.node_kubeconfig(nodes[0]),
        check=False,
    )
    assert refused.returncode != 0 and "forbidden" in refused.stderr.lower()
    by_node = guard.csinode_guard(
        "brake", "release", driver, "--reason", "mine", "-n", NAMESPACE, "--kubeconfig", node_kubeconfig, check=False
    )
    assert by_node.returncode != 0
    assert engaged(guard, driver)

    # An approver's release is honoured by the leader and audited.
    approver = approver_kubeconfig(cp)
    asked = guard.csinode_guard(
        "brake",
        "release",
        driver,
        "--reason",
        "driver v1.38.1 reports 20 again",
        "-n",
        NAMESPACE,
        "--kubeconfig",
        str(approver),
    )
    assert "bob@example.com" in asked.stdout
    wait_until(lambda: not engaged(guard, driver), timeout=30, interval=0.5, what="the approver's release")
    released = brakes(guard)[driver]
    assert released["releasedBy"] == "bob@example.com"
    assert released["releaseReason"] == "driver v1.38.1 reports 20 again"
    wait_until(
        lambda: any(
            r.get("decision") == "brake-released" and r.get("user") == "bob@example.com" for r in guard.decisions()
        ),
        what="the release's audit record",
    )
    wait_until(lambda: brake_events(cp, driver, "BrakeReleased"), what="the BrakeReleased Event")
    wait_until(
        lambda: condition(prometheus, "CSINodeGuardBrakeEngaged", namespace) == [],
        timeout=30,
        interval=1,
        what="the alert's condition to end with the release",
    )
    # Increases pass again (the failures before the release do not engage it again).
    increase_stored(cp, nodes[0], driver, 24, "an increase after the release")


def test_the_quiet_period_releases_the_brake(
    control_plane: ControlPlane, brakes_record: None, guard_factory: Any, tmp_path: Path
) -> None:
    cp = control_plane
    driver = f"{unique('quiet')}.csi.example.com"
    path = brake_policy(tmp_path / "policy.yaml")
    guard = start_guard(guard_factory, path)
    with failing_rollout(cp, driver, 8) as (nodes, _):
        wait_until(lambda: engaged(guard, driver), timeout=60, interval=1, what="the brake to engage")
        update(cp, nodes[4], driver, 34)
        assert stored(cp, nodes[4], driver) == 20
        # brake list says when the quiet period of the policy the guard serves releases it.
        key = ("--state-key-file", str(guard.cert_dir / "state.key"))
        listed = json.loads(guard.csinode_guard("brake", "list", "-o", "json", "-n", NAMESPACE, "--policy", str(path),
                                                *key).stdout)
        [shown] = [b for b in listed["brakes"] if b["driver"] == driver]
        releases = parse_time(shown["lastFailureAt"]) + timedelta(hours=1)  # brake_policy's quiet period
        assert parse_time(shown["releasesAt"]) == releases
        assert listed["policy"]["origin"] == "file"
        table = guard.csinode_guard("brake", "list", "-n", NAMESPACE, "--policy", str(path), *key).stdout
        assert f"releases it at {format_time(releases)}" in table, table
        assert "Quiet period from policy" in table, table
        brake_policy(path, quiet_period="5s")  # hot reload: the failures are older than that
        wait_until(lambda: not engaged(guard, driver), timeout=60, interval=1, what="the quiet period release")
        assert brakes(guard)[driver]["releasedBy"] == "quiet-period"


def test_failures_of_another_class_engage_nothing(
    control_plane: ControlPlane, brakes_record: None, guard_factory: Any, tmp_path: Path
) -> None:
    cp = control_plane
    driver = f"{unique('precond')}.csi.example.com"
    guard = start_guard(guard_factory, brake_policy(tmp_path / "policy.yaml"))
    with failing_rollout(cp, driver, 9) as (nodes, _):
        seen = passes(guard)
        wait_until(lambda: passes(guard) >= seen + 3, timeout=60, interval=0.5, what="three more audit passes")
        assert driver not in brakes(guard)
        assert [stored(cp, node, driver) for node in nodes] == [30] * NODES
        increase_stored(cp, nodes[0], driver, 34, "an increase with only FailedPrecondition errors around")


def test_the_restore_follows_the_brakes_record_into_the_watch_without_waiting_for_an_interval(
    control_plane: ControlPlane, brakes_record: None, guard_factory: Any, tmp_path: Path
) -> None:
    """With ``--audit-interval 0`` a policy reload starts the pass that engages the brake, and no interval pass
    follows. The leader restores the raised counts once the record has reached its own watch: later in that pass
    when the watch is quick (an idle machine), else in the pass the record's arrival starts (trigger ``brake``;
    which of the two is timing, the unit tests in tests/test_audit_brake_view.py pin the second). Either way
    admission, which reads the same record, judges every repair write as the restore it is."""
    cp = control_plane
    driver = f"{unique('follow')}.csi.example.com"
    path = brake_policy(tmp_path / "policy.yaml")
    guard = start_guard(guard_factory, path, audit_interval="0")
    with failing_rollout(cp, driver, 8) as (nodes, _):
        assert not engaged(guard, driver)  # no pass since the failures: the start pass ran before the rollout
        brake_policy(path, quiet_period="2h")  # the policy reload is a trigger
        wait_until(lambda: engaged(guard, driver), timeout=60, interval=1, what="the brake to engage")
        wait_until(lambda: [stored(cp, node, driver) for node in nodes] == [20] * NODES, timeout=60, interval=1,
                   what="the raised counts restored")
        assert passes(guard, "interval") == 0
        repaired = {r["node"]: r["trigger"] for r in guard.decisions()
                    if r.get("source") == "audit" and r.get("decision") == "repaired"}
        assert set(repaired) == set(nodes) and set(repaired.values()) <= {"policy-reload", "brake"}, repaired
        repairs = [r for r in guard.decisions() if r.get("user") == "test-admin" and r.get("node") in nodes
                   and r["endpoint"] == "mutate"]
        assert {r["node"] for r in repairs} == set(nodes) and all(r["decision"] == "allow" for r in repairs), repairs
        assert all(r.get("driver") is None for r in repairs), "admission judged a repair without the brake"


def test_a_deleted_or_edited_brake_record_is_written_again_while_the_brake_holds(
    control_plane: ControlPlane, brakes_record: None, guard_factory: Any, tmp_path: Path
) -> None:
    """Someone who may edit ConfigMaps in the guard's namespace deletes the record, then edits it (an unsigned
    record reads as no brake): the leader writes it again at its next pass although no brake changed, and the
    increases stay held."""
    cp = control_plane
    driver = f"{unique('rewrite')}.csi.example.com"
    guard = start_guard(guard_factory, brake_policy(tmp_path / "policy.yaml"))
    with failing_rollout(cp, driver, 8) as (nodes, _):
        wait_until(lambda: engaged(guard, driver), timeout=60, interval=1, what="the brake to engage")
        wait_until(
            lambda: [stored(cp, node, driver) for node in nodes] == [20] * NODES,
            timeout=60,
            interval=1,
            what="the raised counts restored",
        )
        engaged_at = brakes(guard)[driver]["engagedAt"]

        def record_back() -> bool:
            try:  # a record that does not verify fails brakes()'s check
                return engaged(guard, driver) and brakes(guard)[driver]["engagedAt"] == engaged_at
            except AssertionError:
                return False

        cp.kubectl("delete", "configmap", "-n", NAMESPACE, BRAKES_OBJECT)
        wait_until(record_back, timeout=60, interval=1, what="the deleted record written again")
        patch = {"data": {"record": "{}"}}
        cp.kubectl("patch", "configmap", "-n", NAMESPACE, BRAKES_OBJECT, "--type=merge", "-p", json.dumps(patch))
        wait_until(record_back, timeout=60, interval=1, what="the edited record written again")
        update(cp, nodes[4], driver, 34)
        assert stored(cp, nodes[4], driver) == 20
