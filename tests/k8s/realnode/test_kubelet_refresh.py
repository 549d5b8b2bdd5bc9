"""The periodic refresh on the real kubelet (KEP-4876): every ``CSIDriver.spec.nodeAllocatableUpdatePeriodSeconds``
(10 s here) kubelet calls NodeGetInfo, reads its CSINode and writes the count when it differs.

Why the real kubelet: the write-amplification claim (DESIGN.md, README "deny acts as clamp") is about how often
kubelet's own loop writes when the guard holds the count below what the driver reports, and whether it retries:
``kubelet-csinode update`` makes one write when the test calls it and cannot show the loop's pace.
"""

from __future__ import annotations

import base64
import itertools
import json
import urllib.request
from pathlib import Path
from typing import Any

from tests.k8s.controlplane import ControlPlane, Guard, wait_until
from tests.k8s.realnode.cluster import DRIVER, RealNode
from tests.k8s.realnode.policy import hostpath_policy

CEILING = 6
REPORTED = 9
PERIODS = 3


def etcd_revision(cp: ControlPlane, node: str) -> int:
    """``mod_revision`` of the CSINode's key, read from etcd's v3 JSON gateway (not through the apiserver)."""
    key = base64.b64encode(f"/registry/csinodes/{node}".encode()).decode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{cp.env['ETCD_CLIENT_PORT']}/v3/kv/range", data=json.dumps({"key": key}).encode()
    )
    (kv,) = json.loads(urllib.request.urlopen(request, timeout=10).read())["kvs"]
    return int(kv["mod_revision"])


def test_a_driver_that_keeps_reporting_more_than_the_guard_allows_costs_one_noop_write_per_period(
    real_node: RealNode, guard_factory: Any, tmp_path: Path
) -> None:
    """The driver reports 9 for good, the ceiling is 6: each period kubelet reads its CSINode, sees 6, writes 9
    once, gets 6 back (a clamp, not a denial: no quick retries), and etcd is not written."""
    node = real_node
    guard: Guard = guard_factory(hostpath_policy(tmp_path / "policy.yaml", ceiling=CEILING))
    node.deploy_driver(attach_limit=REPORTED)
    node.wait_registered()
    wait_until(lambda: node.count() == CEILING, timeout=30, what="registered, clamped to the ceiling")
    registered = len(node.kubelet_writes())
    revision = etcd_revision(node.cp, node.name)
    reads_before = len(node.kubelet_reads())

    wait_until(lambda: len(node.kubelet_writes()) >= registered + PERIODS, timeout=PERIODS * 10 + 60,
               what=f"{PERIODS} periodic refreshes")
    writes = node.kubelet_writes()
    refreshes = writes[registered:]
    reads = node.kubelet_reads()[reads_before:]
    print("\n" + "\n".join(w.line for w in writes))
    gaps = [round((b.time - a.time).total_seconds(), 2) for a, b in itertools.pairwise(refreshes)]
    print(f"[refresh] seconds between kubelet's writes: {gaps}")

    assert all(w.verb == "update" and w.code == 200 for w in refreshes), [w.line for w in refreshes]
    assert all((w.sent, w.stored) == ({DRIVER: REPORTED}, {DRIVER: CEILING}) for w in refreshes)
    assert {w.resource_version for w in refreshes} == {writes[registered - 1].resource_version}, (
        "every refresh answered with the stored object's resourceVersion: nothing stored")
    assert etcd_revision(node.cp, node.name) == revision, "etcd's key was not written"
    # one write per period, no retry: each write follows a read of its own (kubelet's loop reads, compares, writes)
    last_write = refreshes[PERIODS - 1].time
    reads_until = [t for t in reads if t <= last_write]
    assert len(reads_until) == PERIODS, (reads_until, [w.time for w in refreshes])
    for read, write, following in zip(reads_until, refreshes, [*reads_until[1:], last_write], strict=False):
        assert read <= write.time <= following

    mine = [r for r in guard.decisions() if r.get("node") == node.name and not r.get("registration")
            and r.get("new") == REPORTED]
    judged = [(r["endpoint"], r["decision"], r["final"]) for r in mine]
    assert judged[:PERIODS] == [("mutate", "clamp", CEILING)] * PERIODS, judged
    assert {r["endpoint"] for r in mine} == {"mutate"}, "the clamp back to the stored count is never sent to /validate"
    assert node.ready() and node.count() == CEILING
