"""The background audit and reconciler on the real apiserver: what is already stored is judged, reported and
(``spec.reconcile: clamp``) repaired by exactly one replica, the one holding the audit Lease.

The counts enter the way they do in production: kubelet's own code (``kubelet-csinode``) registers a driver while
the guard is down (the registration entry is ``failurePolicy: Ignore``), or a policy reload lowers a ceiling under
counts already stored. Every guard runs as the admin kubeconfig's user (``test-admin``), listed as a writer in its
policy, as the guard's ServiceAccount is in ``deploy/``; its Lease lives in ``default`` under a name of its own.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import signal
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from tests.k8s.controlplane import (
    ADMIN_USER,
    ControlPlane,
    Guard,
    counts,
    csinode_writes,
    policy_file,
    unique,
    wait_until,
)

EBS = "ebs.csi.aws.com"
M6I_LARGE = {"node.kubernetes.io/instance-type": "m6i.large"}
CEILING = 27  # the shipped profile's value for m6i.large (an unlisted Nitro type)
INTERVAL = "2"  # --audit-interval of these tests (seconds)
SPACING = 0.3  # seconds between the increases of the shared-budget burst


def audit_policy(path: Path, reconcile: str, *, ceiling: int | None = None, budget: tuple[float, int] | None = None,
                 min_interval: str = "1s") -> Path:
    """The bundled policy with ``spec.reconcile``, the admin user as a writer (the guard's identity here), and
    optionally a lower EBS ``ceiling.max`` and another cluster budget."""

    def edit(doc: dict[str, Any]) -> None:
        spec = doc["spec"]
        spec["reconcile"] = reconcile
        spec["writers"]["users"] = [ADMIN_USER]
        spec["rules"]["change-rate"]["minInterval"] = min_interval
        if ceiling is not None:
            spec["drivers"][EBS].setdefault("ceiling", {}).update({"max": ceiling, "unknown": ceiling})
        if budget is not None:
            spec["rules"]["change-rate"]["clusterBudget"] = {"increasesPerSecond": budget[0], "burst": budget[1]}

    return policy_file(path, edit)


def micro_time(value: str) -> dt.datetime:
    """A Lease's MicroTime (``2026-12-04T19:13:00.123456Z``) as an aware datetime."""
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00"))


def audit_args(lease: str, *extra: str) -> tuple[str, ...]:
    return ("--audit-interval", INTERVAL, "--lease-namespace", "default", "--lease-name", lease,
            "--lease-duration", "6", *extra)


def scrape(guard: Guard) -> dict[str, float]:
    """The guard's merged metrics: ``name{labels}`` -> value."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{guard.metrics_port}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def metric(guard: Guard, name: str, **labels: str) -> float:
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return scrape(guard).get(f"{name}{{{inner}}}" if labels else name, 0.0)


def stored(control_plane: ControlPlane, node: str) -> int | None:
    return counts(control_plane.get_csinode(node)).get(EBS)


def install(control_plane: ControlPlane, node: str, max_volumes: int) -> None:
    out = control_plane.kubelet(node, "install", "--driver", EBS, "--node-id", "i-1", "--max-volumes",
                                str(max_volumes))
    assert f"OK install driver={EBS}" in out.stdout, out.stdout + out.stderr


def restart_plugin_while_down(control_plane: ControlPlane, guard: Guard, node: str) -> None:
    """First registration (25) with the guard up, then the guard stopped and a plugin restart reporting 39 (the
    old driver's static table): stored, as the registration entry is failurePolicy Ignore."""
    install(control_plane, node, 25)
    assert stored(control_plane, node) == 25
    guard.stop()
    control_plane.kubelet(node, "uninstall", "--driver", EBS)
    install(control_plane, node, 39)
    assert stored(control_plane, node) == 39


@contextlib.contextmanager
def budgeted_driver(control_plane: ControlPlane) -> Any:
    """A CSIDriver object for :data:`EBS` while the block runs: the cluster budget counts only drivers the cluster
    has a CSIDriver for (a node can invent driver names at will; docs/budget.md), as a cluster running the EBS
    CSI driver has. Removed afterwards, so that the other tests of this worker's cluster see none."""
    driver = {"apiVersion": "storage.k8s.io/v1", "kind": "CSIDriver", "metadata": {"name": EBS},
              "spec": {"attachRequired": True}}
    control_plane.kubectl("apply", "-f", "-", input=json.dumps(driver))
    try:
        yield
    finally:
        control_plane.kubectl("delete", "csidriver", EBS, "--ignore-not-found")


@contextlib.contextmanager
def replicas_behind_one_address(control_plane: ControlPlane, guard_factory: Any, tmp_path: Path, policy: Path,
                                replicas: int, nodes: int, prefix: str) -> Any:
    """``replicas`` guards on ``policy`` behind one round-robin TCP proxy (as behind one Service; one webhook
    configuration, a new connection and so a replica per request), sharing one state key as from the deployment's
    Secret, with :func:`budgeted_driver`; ``nodes`` new nodes with EBS registered at 10 whose minInterval has
    passed. Yields ``(guards, node names)``; unregisters and stops the proxy afterwards."""
    key = uuid.uuid4().hex + uuid.uuid4().hex + "\n"
    for i in range(replicas):  # guard_factory's work directories
        certs = tmp_path / f"guard{i}" / "certs"
        certs.mkdir(parents=True)
        (certs / "state.key").write_text(key)
    with budgeted_driver(control_plane):
        guards = [guard_factory(policy, register=False, extra_args=("--no-audit", "--connection-max-age", "0.001"))
                  for _ in range(replicas)]
        proxy = RoundRobinProxy([g.port for g in guards])
        proxy.start()
        try:
            guards[0].csinode_guard("register", "--url", f"https://127.0.0.1:{proxy.port}", "--cert-dir",
                                    str(guards[0].cert_dir), "--name", guards[0].name)
            guards[0].registered = True
            wait_until(lambda: control_plane.probe_write().returncode == 0
                       and any(r.get("node") == ControlPlane.PROBE_NODE for g in guards for r in g.decisions()),
                       timeout=30, what="the proxy's guards called")
            names = [new_node(control_plane, prefix) for _ in range(nodes)]
            for node in names:
                install(control_plane, node, 10)
            time.sleep(2.0)  # minInterval 1s since each registration
            yield guards, names
        finally:
            guards[0].unregister(check=False, wait=False)
            proxy.stop()


def new_node(control_plane: ControlPlane, prefix: str) -> str:
    node = unique(prefix)
    control_plane.create_node(node, M6I_LARGE)
    return node


def audit_events_about(control_plane: ControlPlane, node: str) -> list[dict[str, Any]]:
    """The events.k8s.io/v1 Events about CSINode ``node``."""
    found = control_plane.kubectl_json("get", "events.events.k8s.io", "-n", "default",
                                       "-l", "csinode-guard.io/audit")
    return [e for e in found["items"] if (e.get("regarding") or {}).get("name") == node]


def writers_of(control_plane: ControlPlane, node: str) -> list[str]:
    return [str((e.get("user") or {}).get("username")) for e in control_plane.audit_events(csinode_writes(node))
            if (e.get("responseStatus") or {}).get("code", 200) < 300]


def test_a_count_stored_while_the_guard_was_down_is_lowered_to_the_ceiling_by_the_guard(
    control_plane: ControlPlane, guard_factory: Any, tmp_path: Path
) -> None:
    node = new_node(control_plane, "outage")
    lease = unique("audit")
    guard = guard_factory(audit_policy(tmp_path / "clamp.yaml", "clamp"), extra_args=audit_args(lease))
    restart_plugin_while_down(control_plane, guard, node)
    kubelet_writes = len(writers_of(control_plane, node))

    guard.start()
    wait_until(lambda: stored(control_plane, node) == CEILING, timeout=30, what="the audit repairs 39 -> 27")

    writes = writers_of(control_plane, node)
    assert writes[kubelet_writes:] == [ADMIN_USER], "one repair, by the guard's identity, no kubelet write"
    events = wait_until(lambda: audit_events_about(control_plane, node), timeout=20, what="an Event")
    notes = " ".join(e.get("note", "") for e in events)
    assert "above the ceiling 27" in notes and "lowered ebs.csi.aws.com to 27" in notes, notes
    assert {e["reason"] for e in events} >= {"StandingViolation", "Reconciled"}
    wait_until(lambda: metric(guard, "csinode_guard_reconcile_repairs_total", driver=EBS, result="repaired") == 1,
               timeout=10, what="the repair counted")
    assert metric(guard, "csinode_guard_leader") == 1
    assert metric(guard, "csinode_guard_audit_passes_total", trigger="start") >= 1
    wait_until(lambda: metric(guard, "csinode_guard_standing_violations", rule="count-ceiling", driver=EBS) == 0,
               timeout=15, what="the next pass finds nothing standing")
    records = [r for r in guard.decisions() if r.get("source") == "audit" and r.get("node") == node]
    assert {r["decision"] for r in records} == {"standing-violation", "repaired"}, records
    assert all(r["uid"] is None and r["endpoint"] == "audit" for r in records)
    repaired = next(r for r in records if r["decision"] == "repaired")
    assert (repaired["old"], repaired["new"], repaired["final"]) == (39, CEILING, CEILING)


def relabel_as_the_node(control_plane: ControlPlane, node: str, instance_type: str) -> None:
    """The node labels itself (``system:node:<node>``: NodeRestriction lets a kubelet set its own
    ``node.kubernetes.io/instance-type``), as a node taken over may."""
    control_plane.kubectl("label", "node", node, f"node.kubernetes.io/instance-type={instance_type}", "--overwrite",
                          kubeconfig=control_plane.node_kubeconfig(node))


def test_a_node_that_relabels_itself_while_the_guard_is_down_is_lowered_to_its_pinned_ceiling_by_the_default(
    control_plane: ControlPlane, guard_factory: Any, tmp_path: Path
) -> None:
    """Attack 4 of the third review, replayed. The EBS ceiling is pinned at m6i.large (27) by a first registration
    the guard judged; the guard goes down; each node labels itself c7i.48xlarge (the profile's 128) and its plugin
    registers again with 40 (one node) or 128 (the other), stored under failurePolicy Ignore. The guard comes
    back on the bundled policy, ``spec.reconcile`` left unsaid: its default clamps. The audit judges each entry
    as admission does (the pinned ceiling, not today's label): both are lowered to 27 by the first pass, and
    the audit records and Events give 27, the count etcd holds -- not 43 (the accepted 27 plus maxStepUp 16,
    which the audit's own copy of the rules once reported while admission held 27)."""
    nodes = {new_node(control_plane, "relabel"): reported for reported in (40, 128)}

    def defaults(doc: dict[str, Any]) -> None:
        doc["spec"].pop("reconcile", None)  # the default applies
        doc["spec"]["writers"]["users"] = [ADMIN_USER]  # the guard's identity here, as its ServiceAccount in deploy/

    guard = guard_factory(policy_file(tmp_path / "defaults.yaml", defaults), extra_args=audit_args(unique("audit")))
    for node in nodes:
        install(control_plane, node, CEILING)  # judged with the guard up: the ceiling is pinned at m6i.large
    guard.stop()
    for node, reported in nodes.items():
        relabel_as_the_node(control_plane, node, "c7i.48xlarge")
        control_plane.kubelet(node, "uninstall", "--driver", EBS)
        install(control_plane, node, reported)
        assert stored(control_plane, node) == reported, "stored while the guard was down"

    guard.start()
    wait_until(lambda: all(stored(control_plane, n) == CEILING for n in nodes), timeout=60,
               what="both entries lowered to the pinned ceiling")

    records = wait_until(lambda: [r for r in guard.decisions() if r.get("source") == "audit"
                                  and r.get("node") in nodes and r.get("decision") == "repaired"] or None,
                         timeout=20, what="the repairs' audit records")
    for node, reported in nodes.items():
        mine = [r for r in records if r["node"] == node]
        assert mine, f"a repaired record for {node}"
        assert {(r["old"], r["final"], r["trigger"]) for r in mine} == {(reported, CEILING, "start")}, mine
        events = wait_until(lambda n=node: [e for e in audit_events_about(control_plane, n)
                                            if e["reason"] == "Reconciled"] or None,
                            timeout=20, what=f"the Reconciled Event of {node}")
        notes = " ".join(e.get("note", "") for e in events)
        assert f"lowered {EBS} to {CEILING} " in notes and "to 43" not in notes, notes
    assert stored(control_plane, next(iter(nodes))) == CEILING, "the repair stands: admission agrees with it"


def test_report_mode_reports_and_writes_nothing(
    control_plane: ControlPlane, guard_factory: Any, tmp_path: Path
) -> None:
    node = new_node(control_plane, "report")
    guard = guard_factory(audit_policy(tmp_path / "report.yaml", "report"), extra_args=audit_args(unique("audit")))
    restart_plugin_while_down(control_plane, guard, node)
    writes = len(writers_of(control_plane, node))

    guard.start()
    wait_until(lambda: metric(guard, "csinode_guard_standing_violations", rule="count-ceiling", driver=EBS) >= 1,
               timeout=30, what="the standing violation reported")
    wait_until(lambda: audit_events_about(control_plane, node), timeout=20, what="an Event")
    time.sleep(2 * float(INTERVAL) + 1)  # two more passes

    assert stored(control_plane, node) == 39
    assert len(writers_of(control_plane, node)) == writes
    assert metric(guard, "csinode_guard_reconcile_repairs_total", driver=EBS, result="repaired") == 0
    records = [r for r in guard.decisions() if r.get("source") == "audit" and r.get("node") == node]
    assert [r["decision"] for r in records] == ["standing-violation"], "reported once, not every pass"
    status = ("status", "--node", node, "--policy", str(guard.policy_path),
              "--state-key-file", str(guard.cert_dir / "state.key"))
    table = guard.csinode_guard(*status).stdout
    assert "standing violations (1;" in table and "above the ceiling 27" in table, table
    doc = json.loads(guard.csinode_guard(*status, "-o", "json").stdout)
    [standing] = doc["standingViolations"]
    assert {k: standing[k] for k in ("node", "driver", "rule", "stored", "allowed", "repairable")} == {
        "node": node, "driver": EBS, "rule": "count-ceiling", "stored": 39, "allowed": CEILING, "repairable": True}
    first_event = min(e["eventTime"] for e in audit_events_about(control_plane, node))
    assert standing["since"] == first_event, "since: when the audit first reported it"


def test_a_policy_reload_with_a_lower_ceiling_repairs_the_nodes_already_stored(
    control_plane: ControlPlane, guard_factory: Any, tmp_path: Path
) -> None:
    nodes = [new_node(control_plane, "reload") for _ in range(2)]
    path = audit_policy(tmp_path / "policy.yaml", "clamp")
    guard = guard_factory(path, extra_args=audit_args(unique("audit"), "--audit-interval", "0"))
    for node in nodes:
        install(control_plane, node, 25)
    assert [stored(control_plane, n) for n in nodes] == [25, 25]

    audit_policy(path, "clamp", ceiling=20)  # the reload is the only trigger (--audit-interval 0)

    wait_until(lambda: [stored(control_plane, n) for n in nodes] == [20, 20], timeout=30,
               what="both nodes lowered to the new ceiling")
    assert metric(guard, "csinode_guard_audit_passes_total", trigger="policy-reload") >= 1
    assert metric(guard, "csinode_guard_audit_passes_total", trigger="interval") == 0


def lease_holder(control_plane: ControlPlane, lease: str) -> str:
    found = control_plane.kubectl_json("get", "lease", lease, "-n", "default")
    return str(found["spec"].get("holderIdentity") or "")


def test_two_replicas_only_the_lease_holder_repairs_and_the_other_takes_over_when_it_is_killed(
    control_plane: ControlPlane, guard_factory: Any, tmp_path: Path
) -> None:
    """Two replicas of one deployment (neither registered here: the counts enter unjudged, as during an outage)."""
    lease = unique("audit")
    path = audit_policy(tmp_path / "policy.yaml", "clamp")
    replicas = [guard_factory(path, extra_args=audit_args(lease), register=False) for _ in range(2)]
    holder = wait_until(lambda: lease_holder(control_plane, lease), timeout=20, what="a Lease holder")
    wait_until(lambda: sum(metric(g, "csinode_guard_leader") for g in replicas) == 1, timeout=10,
               what="exactly one leader")
    leader, follower = replicas if metric(replicas[0], "csinode_guard_leader") == 1 else replicas[::-1]
    node = new_node(control_plane, "ha")
    install(control_plane, node, 39)
    wait_until(lambda: stored(control_plane, node) == CEILING, timeout=30, what="repaired")
    time.sleep(2 * float(INTERVAL))
    assert metric(leader, "csinode_guard_reconcile_repairs_total", driver=EBS, result="repaired") == 1
    assert metric(follower, "csinode_guard_reconcile_repairs_total", driver=EBS, result="repaired") == 0
    assert metric(follower, "csinode_guard_audit_passes_total", trigger="start") == 0

    assert leader.process is not None
    os.killpg(leader.process.pid, signal.SIGKILL)  # no release: the Lease must expire
    leader.process.wait(10)
    killed = time.monotonic()
    last_renewal = control_plane.kubectl_json("get", "lease", lease, "-n", "default")["spec"]
    # Taken over once expired (20 s: only reached when nobody takes it over), and never before: the new holder's
    # acquireTime is at least one Lease duration after the dead leader's last renewTime. The Lease's own times
    # decide, not how long this test's kubectl calls took on a loaded machine.
    wait_until(lambda: lease_holder(control_plane, lease) not in ("", holder), timeout=20,
               what="the other replica takes the Lease")
    took = time.monotonic() - killed
    print(f"\n[lease] takeover after SIGKILL of the leader: {took:.1f}s (lease duration 6s, retry 1.2s)")
    taken = control_plane.kubectl_json("get", "lease", lease, "-n", "default")["spec"]
    assert last_renewal["holderIdentity"] == holder and taken["holderIdentity"] != holder
    assert taken["leaseTransitions"] == last_renewal.get("leaseTransitions", 0) + 1
    expired_at = micro_time(last_renewal["renewTime"]) + dt.timedelta(seconds=last_renewal["leaseDurationSeconds"])
    assert micro_time(taken["acquireTime"]) >= expired_at, (last_renewal, taken)
    wait_until(lambda: metric(follower, "csinode_guard_leader") == 1, timeout=10, what="follower leads")

    other = new_node(control_plane, "ha")
    install(control_plane, other, 39)
    wait_until(lambda: stored(control_plane, other) == CEILING, timeout=30, what="the new leader repairs")
    assert metric(follower, "csinode_guard_reconcile_repairs_total", driver=EBS, result="repaired") == 1


def test_a_conflict_during_a_repair_loses_no_newer_write(
    control_plane: ControlPlane, guard_factory: Any, tmp_path: Path
) -> None:
    """A repair races kubelet: kubelet's newer write lands between the guard's GET and its PUT, the PUT gets 409,
    the guard reads again and judges the newer object: kubelet's lower count (20) is kept, never overwritten."""
    node = new_node(control_plane, "conflict")
    guard = guard_factory(audit_policy(tmp_path / "policy.yaml", "clamp"),
                          extra_args=audit_args(unique("audit"), "--reconcile-rate", "0.2", "--reconcile-burst", "1"))
    install(control_plane, node, 25)
    # use up the repair burst on another node, so the next repair waits ~5 s between its GET and its PUT
    spare = new_node(control_plane, "conflict")
    install(control_plane, spare, 25)
    guard.stop()
    for n in (spare, node):
        control_plane.kubelet(n, "uninstall", "--driver", EBS)
        install(control_plane, n, 39)
    guard.start()
    wait_until(lambda: CEILING in (stored(control_plane, spare), stored(control_plane, node)), timeout=30,
               what="the first repair")
    waiting = node if stored(control_plane, spare) == CEILING else spare
    out = control_plane.kubelet(waiting, "update", "--driver", EBS, "--max-volumes", "20")  # a decrease: admitted
    assert "OK update" in out.stdout
    conflicts = wait_until(lambda: [e for e in control_plane.audit_events(csinode_writes(waiting))
                                    if (e.get("user") or {}).get("username") == ADMIN_USER
                                    and (e.get("responseStatus") or {}).get("code") == 409],
                           timeout=20, what="the repair's PUT on the older resourceVersion refused with 409")
    assert conflicts
    time.sleep(2 * float(INTERVAL) + 1)
    assert stored(control_plane, waiting) == 20, "kubelet's newer, lower count stands"
    assert metric(guard, "csinode_guard_reconcile_repairs_total", driver=EBS, result="conflict") == 0


def test_three_replicas_share_one_cluster_budget(
    control_plane: ControlPlane, guard_factory: Any, tmp_path: Path
) -> None:
    """Three replicas behind one Service (a round-robin TCP proxy in front of them; one webhook configuration)
    take a burst of increases at once. A budget per replica would admit three bursts; the watched budget admits
    one burst plus what the replicas admit within the watch delay."""
    burst = 6
    path = audit_policy(tmp_path / "policy.yaml", "report", budget=(0.05, burst), min_interval="1s")
    with replicas_behind_one_address(control_plane, guard_factory, tmp_path, path, 3, 3 * burst,
                                     "budget") as (guards, nodes):
        threads = [threading.Thread(target=control_plane.kubelet, args=(n, "update", "--driver", EBS,
                                                                         "--max-volumes", "12"),
                                    kwargs={"check": False}) for n in nodes]
        for t in threads:  # one burst, spread over the replicas, a little slower than the watch shows each
            t.start()
            time.sleep(SPACING)
        for t in threads:
            t.join()
        raised = sum(1 for n in nodes if stored(control_plane, n) == 12)
        judged = [sum(1 for r in g.decisions() if r.get("endpoint") == "mutate" and r.get("node") in nodes
                      and r.get("change") == "increase") for g in guards]
    print(f"\n[budget] increases judged per replica: {judged}")
    assert sum(1 for j in judged if j) >= 2, "the burst spread over the replicas"
    print(f"\n[budget] 3 replicas, burst {burst}, {len(nodes)} increases {SPACING}s apart: {raised} admitted "
          f"(overshoot {raised - burst}; a budget per replica admits up to {3 * burst})")
    assert burst <= raised <= burst + 2, "one budget, not one per replica (overshoot: the watch delay)"


class RoundRobinProxy:
    """A TCP proxy on 127.0.0.1 that sends each new connection to the next backend port (a Service's spread)."""

    def __init__(self, ports: list[int]) -> None:
        import socket  # noqa: PLC0415

        self.ports = ports
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._next = 0
        self._stop = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._accept, daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        self._listener.close()

    def _accept(self) -> None:
        import socket  # noqa: PLC0415

        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            port = self.ports[self._next % len(self.ports)]
            self._next += 1
            try:
                upstream = socket.create_connection(("127.0.0.1", port))
            except OSError:
                client.close()
                continue
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: Any, dst: Any) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(2)



def test_attack_7_a_strangers_never_renewed_lease_is_taken_back_after_the_guards_own_lease_duration(
    control_plane: ControlPlane, guard_factory: Any, tmp_path: Path
) -> None:
    """Issue 32, attack 7: a user who may update Leases in the guard's namespace writes the audit Lease as
    ``mallory`` with ``leaseDurationSeconds: 999999`` and never renews it. The guard waits its own
    ``--lease-duration`` (6 s here), not mallory's, takes the Lease and repairs the count stored meanwhile."""
    cp = control_plane
    lease = unique("audit")
    mallory = unique("mallory")
    role = f"{mallory}-leases"
    cp.kubectl("create", "role", role, "-n", "default", "--verb=get,create,update",
               "--resource=leases.coordination.k8s.io")
    cp.kubectl("create", "rolebinding", role, "-n", "default", f"--role={role}", f"--user={mallory}")
    forged = {
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": lease, "namespace": "default"},
        "spec": {"holderIdentity": "mallory", "leaseDurationSeconds": 999999,
                 "renewTime": "2026-12-04T00:00:00.000000Z", "acquireTime": "2026-12-04T00:00:00.000000Z"},
    }
    cp.kubectl("create", "-f", "-", kubeconfig=cp.user_kubeconfig(mallory), input=json.dumps(forged))
    node = new_node(cp, "lease")
    install(cp, node, 39)  # no guard registered: stored unjudged, as during an outage
    assert stored(cp, node) == 39

    started = time.monotonic()
    guard = guard_factory(audit_policy(tmp_path / "clamp.yaml", "clamp"), extra_args=audit_args(lease),
                          register=False)
    holder = wait_until(lambda: lease_holder(cp, lease) not in ("", "mallory") and lease_holder(cp, lease),
                        timeout=40, what="the guard takes the Lease back")
    took = time.monotonic() - started
    print(f"\n[attack 7] the Lease taken back from mallory {took:.1f}s after the guard started "
          "(its own lease duration 6 s; mallory wrote 999999 s)")
    assert holder != "mallory"
    assert cp.kubectl_json("get", "lease", lease, "-n", "default")["spec"]["leaseDurationSeconds"] == 6
    wait_until(lambda: stored(cp, node) == CEILING, timeout=30, what="the audit repairs 39 -> 27")
    assert metric(guard, "csinode_guard_leader") == 1
    assert metric(guard, "csinode_guard_audit_lease_unrenewed_seconds") == 0


def test_attack_9_thirty_kubelets_raise_at_once_on_three_replicas(
    control_plane: ControlPlane, guard_factory: Any, tmp_path: Path
) -> None:
    """Issue 32, attack 9: three replicas behind one Service, burst 10, thirty kubelets raise at the same moment
    (no spacing: every replica judges its share before the watch shows any other replica's increases). The
    overshoot is measured (docs/budget.md has the figures); its bound is one burst per serving process (each
    gunicorn worker keeps its own watch and stops at the burst counting its own admitted increases)."""
    burst, replicas, workers = 10, 3, 2
    path = audit_policy(tmp_path / "policy.yaml", "report", budget=(0.05, burst), min_interval="1s")
    with replicas_behind_one_address(control_plane, guard_factory, tmp_path, path, replicas, 3 * burst,
                                     "burst") as (guards, nodes):
        start = threading.Event()

        def raise_count(node: str) -> None:
            start.wait()
            control_plane.kubelet(node, "update", "--driver", EBS, "--max-volumes", "12", check=False)

        threads = [threading.Thread(target=raise_count, args=(n,)) for n in nodes]
        for t in threads:
            t.start()
        start.set()  # all thirty at once
        for t in threads:
            t.join()
        raised = sum(1 for n in nodes if stored(control_plane, n) == 12)
        judged = [sum(1 for r in g.decisions() if r.get("endpoint") == "mutate" and r.get("node") in nodes
                      and r.get("change") == "increase") for g in guards]
    print(f"\n[attack 9] 3 replicas, burst {burst}, {len(nodes)} increases at once: {raised} admitted "
          f"(overshoot {raised - burst}); increases judged per replica {judged}")
    assert sum(1 for j in judged if j) >= 2, "the flood spread over the replicas"
    assert burst <= raised <= replicas * workers * burst, "at most one burst per serving process"
