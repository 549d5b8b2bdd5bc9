"""Benchmark of the background audit on the real apiserver: CSINodes x 3 drivers, objects only (no kubelets).

Starts a throwaway control plane (``tests.k8s.controlplane.running_control_plane``), creates ``--nodes`` CSINodes
with three drivers each (EBS, EFS, a third one), ``--over`` of the EBS entries above the bundled policy's ceiling
for an unknown node (27), every state signed with one key, then in this process:

* the CSINode watch cache (:class:`webhook.kube.watch.KubernetesClusterView` with the state keys): time to sync,
  and the process RSS it adds (target: <= 150 MB at 5,000 nodes);
* one full audit pass (:meth:`webhook.serving.audit_loop.AuditLoop.judge_all`, every entry judged; target <= 10 s);
* the repair of every over-ceiling entry through the apiserver (:func:`webhook.kube.repair.repair_csinode`, GET +
  PUT with resourceVersion) at the default client-side rate limit (10/s, burst 20): time, writes per second,
  conflicts left.

Usage: ``python benchmarks/bench_audit.py [--nodes 5000] [--over 1000]``. Not a test: it prints (and the load
average, since a shared 2-core machine changes every figure).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

EBS = "ebs.csi.aws.com"
DRIVERS = (EBS, "efs.csi.aws.com", "fsx.csi.aws.com")


def rss_mb() -> float:
    """This process's resident set (MB) from /proc."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 1e6


def csinode(i: int, over: bool, keys: Any) -> dict[str, Any]:
    from webhook.admission.state import STATE_ANNOTATION, EntryState, GuardState, encode_state  # noqa: PLC0415

    name = f"bench-{i:05d}"
    counts = {EBS: 39 if over else 25, "efs.csi.aws.com": 100, "fsx.csi.aws.com": 16}
    # The state's UID must be the object's: created first, the state is signed on a second write below.
    obj = {"apiVersion": "storage.k8s.io/v1", "kind": "CSINode", "metadata": {"name": name},
           "spec": {"drivers": [{"name": d, "nodeID": f"i-{i}", "allocatable": {"count": c}}
                                for d, c in counts.items()]}}
    obj["_state"] = lambda uid: encode_state(GuardState(uid=uid, entries={
        d: EntryState(count=25 if d == EBS else c, changed_at=datetime.now(UTC) - timedelta(hours=1))
        for d, c in counts.items()}), keys)
    obj["_annotation"] = STATE_ANNOTATION
    return obj


def create_all(client: Any, nodes: int, over: int, keys: Any) -> None:
    from webhook.kube.kubeapi import CSINODES  # noqa: PLC0415

    def one(i: int) -> None:
        obj = csinode(i, i < over, keys)
        state, annotation = obj.pop("_state"), obj.pop("_annotation")
        stored = client.create(CSINODES, obj)
        stored["metadata"]["annotations"] = {annotation: state(stored["metadata"]["uid"])}
        client.replace(CSINODES, stored)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(nodes)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=5000)
    parser.add_argument("--over", type=int, default=1000, help="EBS entries above the ceiling (repaired)")
    args = parser.parse_args()
    from tests.k8s.controlplane import running_control_plane  # noqa: PLC0415
    from webhook.admission.policy import load_policy  # noqa: PLC0415
    from webhook.admission.state import StateKeys  # noqa: PLC0415
    from webhook.kube.kubeapi import KubeClient  # noqa: PLC0415
    from webhook.kube.watch import KubernetesClusterView, load_api_client  # noqa: PLC0415
    from webhook.kube.watch.settings import CacheSettings  # noqa: PLC0415
    from webhook.serving.audit_loop import AuditLoop  # noqa: PLC0415
    from webhook.serving.audit_settings import AuditSettings  # noqa: PLC0415

    print(f"load average before: {os.getloadavg()}; {os.cpu_count()} CPUs")
    keys = StateKeys([os.urandom(32)])
    policy = load_policy()
    with tempfile.TemporaryDirectory() as tmp, running_control_plane(Path(tmp) / "cluster") as cp:
        client = KubeClient(load_api_client(str(cp.kubeconfig)))
        started = time.perf_counter()
        create_all(client, args.nodes, args.over, keys)
        print(f"created {args.nodes} CSINodes x {len(DRIVERS)} drivers in {time.perf_counter() - started:.1f}s")

        before = rss_mb()
        view = KubernetesClusterView(load_api_client(str(cp.kubeconfig)), (), CacheSettings(), state_keys=keys)
        started = time.perf_counter()
        view.start()
        while not view.csinodes_fresh() or not view.nodes.synced:
            time.sleep(0.05)
        synced = time.perf_counter() - started
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"CSINode cache synced in {synced:.2f}s: {len(view.csinode_store)} objects, "
              f"RSS +{rss_mb() - before:.1f} MB (process {rss_mb():.1f} MB, peak {peak:.1f} MB)")

        loop = AuditLoop(view, None, keys, None, client, AuditSettings())
        now = datetime.now(UTC)
        timings = []
        for _ in range(3):
            started = time.perf_counter()
            judgements = loop.judge_all(policy, now)
            timings.append(time.perf_counter() - started)
        targets = [j for j in judgements if j.targets]
        print(f"full audit pass: {min(timings):.3f}s best of 3 ({', '.join(f'{t:.3f}' for t in timings)}); "
              f"{sum(len(j.findings) for j in judgements)} findings, {len(targets)} to repair")

        from webhook.kube.repair import RepairRateLimiter, RepairResult, repair_csinode  # noqa: PLC0415

        settings = AuditSettings()
        limiter = RepairRateLimiter(settings.repair_rate, settings.repair_burst)
        judge = loop._judge_fresh(policy)
        results: dict[str, int] = {}
        started = time.perf_counter()
        for j in targets:
            outcome = repair_csinode(client, j.node, judge, limiter=limiter)
            key = outcome.result.value if outcome.result else "nothing"
            results[key] = results.get(key, 0) + 1
        took = time.perf_counter() - started
        print(f"repaired {len(targets)} entries in {took:.1f}s ({len(targets) / took:.1f}/s at the default "
              f"{settings.repair_rate:g}/s, burst {settings.repair_burst}): {results}")
        print(f"conflicts left: {results.get(RepairResult.CONFLICT.value, 0)}")
        view.stop()
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
