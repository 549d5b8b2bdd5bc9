"""Benchmark of the cluster watch caches (webhook.kube.watch): memory when full, and the cost of one read.

Fills the caches through the real kubernetes client from tests.apiserver (run in a child process, so that only
the caches' process is measured) with 5,000 Nodes (the m6i.large fixture, ~6.5 KB of JSON each), 5,000
aws-ebs-csi-driver node pods (~13 KB each), 20,000 VolumeAttachments (4 per node, 1 in 10 with an attach error)
and one CSIDriver, then reports:

* process RSS once synced (target: < 150 MB), the peak RSS while listing, and the RSS of the imports alone;
* the cost of each ClusterView read on the admission path (target: < 5 µs per read).

Usage: ``python benchmarks/bench_caches.py [--nodes 5000] [--attachments-per-node 4]``. Not a test: it prints.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import timeit
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DATA = REPO / "tests" / "data" / "cluster"
EBS = "ebs.csi.aws.com"
RSS_TARGET_MB = 150.0
READ_TARGET_US = 5.0


def node_name(i: int) -> str:
    return f"ip-10-{i // 65536 % 256}-{i // 256 % 256}-{i % 256}.ec2.internal"


def generate(nodes: int, attachments_per_node: int) -> list[dict[str, Any]]:
    """Objects shaped like the fixtures, one driver pod per node."""
    node_t = json.loads((DATA / "node-m6i-large.json").read_text())
    pod_t = json.loads((DATA / "pod-ebs-csi-node.json").read_text())
    va_t = json.loads((DATA / "volumeattachment-attached.json").read_text())
    err_t = json.loads((DATA / "volumeattachment-exhausted.json").read_text())
    objects: list[dict[str, Any]] = [json.loads((DATA / "csidriver-ebs.json").read_text())]
    zones = ["us-east-1a", "us-east-1b", "us-east-1c"]
    for i in range(nodes):
        name = node_name(i)
        zone = zones[i % 3]
        node = copy.deepcopy(node_t)
        node["metadata"].update(name=name, uid=f"00000000-0000-4000-8000-{i:012d}")
        labels = node["metadata"]["labels"]
        labels["kubernetes.io/hostname"] = name
        for key in (
            "topology.kubernetes.io/zone",
            "failure-domain.beta.kubernetes.io/zone",
            "topology.ebs.csi.aws.com/zone",
        ):
            labels[key] = zone
        node["status"]["nodeInfo"]["bootID"] = f"boot-{i}"
        objects.append(node)
        pod = copy.deepcopy(pod_t)
        pod["metadata"].update(name=f"ebs-csi-node-{i:05d}", uid=f"00000000-0000-4000-9000-{i:012d}")
        pod["spec"]["nodeName"] = name
        objects.append(pod)
        for j in range(attachments_per_node):
            failed = (i * attachments_per_node + j) % 10 == 0
            va = copy.deepcopy(err_t if failed else va_t)
            va["metadata"].update(name=f"csi-{i:06d}{j:02d}" + "0" * 56, uid=f"00000000-0000-4000-a{j:03d}-{i:012d}")
            va["spec"]["nodeName"] = name
            va["spec"]["source"]["persistentVolumeName"] = f"pvc-{i:06d}-{j:02d}"
            objects.append(va)
    return objects


def serve(args: argparse.Namespace) -> None:
    """Child process: fill a fake API server and serve it until stdin closes."""
    from tests.apiserver import FakeApiServer  # noqa: PLC0415

    server = FakeApiServer()
    server.load(generate(args.nodes, args.attachments_per_node), copy_objects=False)
    server.start()
    kubeconfig = server.write_kubeconfig(args.serve)
    print(json.dumps({"url": server.url, "kubeconfig": kubeconfig}), flush=True)
    sys.stdin.read()
    server.stop()


def rss_mb() -> tuple[float, float]:
    """(current, peak) resident set size of this process in MB, from /proc/self/status."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def measure(args: argparse.Namespace) -> int:
    import kubernetes.client.api_client  # noqa: F401, PLC0415 - what load_api_client imports, counted as imports

    from webhook.admission.cluster import PodVersionSource  # noqa: PLC0415
    from webhook.kube.watch import CacheSettings, KubernetesClusterView, load_api_client  # noqa: PLC0415

    rss_imports, _ = rss_mb()
    with tempfile.TemporaryDirectory() as tmp:
        child = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--serve",
                str(Path(tmp) / "kubeconfig"),
                "--nodes",
                str(args.nodes),
                "--attachments-per-node",
                str(args.attachments_per_node),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdout is not None and child.stdin is not None
        started = time.monotonic()
        info = json.loads(child.stdout.readline())
        print(f"fake API server ready in {time.monotonic() - started:.1f} s at {info['url']}")
        source = PodVersionSource(
            driver=EBS, namespace="kube-system", match_labels=(("app", "ebs-csi-node"),), container="ebs-plugin"
        )
        view = KubernetesClusterView(load_api_client(info["kubeconfig"]), [source], CacheSettings())
        started = time.monotonic()
        view.start()
        while not view.synced():
            time.sleep(0.05)
        sync_seconds = time.monotonic() - started
        gc.collect()
        time.sleep(0.5)
        rss, peak = rss_mb()
        status = view.status()

        names = [node_name(random.randrange(args.nodes)) for _ in range(1024)]
        since = datetime(2000, 1, 1, tzinfo=UTC)
        reads: dict[str, Any] = {
            "node_labels(node)": view.node_labels,
            "kubelet_version(node)": view.kubelet_version,
            "driver_update_period(driver)": lambda n: view.driver_update_period(EBS),
            "driver_version(node, driver)": lambda n: view.driver_version(n, EBS),
            "attached_volumes(node, driver)": lambda n: view.attached_volumes(n, EBS),
            "attach_errors(node, driver, since)": lambda n: view.attach_errors(n, EBS, since),
        }
        assert view.driver_version(names[0], EBS) == "v1.37.0"
        assert view.attached_volumes(names[0], EBS) is not None
        timings: dict[str, float] = {}
        loops = 100
        for label, read in reads.items():

            def run(read: Any = read) -> None:
                for n in names:
                    read(n)

            best = min(timeit.repeat(run, number=loops, repeat=5))
            timings[label] = best / (loops * len(names)) * 1e6
        view.stop()
        child.stdin.close()
        child.wait(10)

    objects = {kind: state["objects"] for kind, state in status.items()}
    print(f"\ncaches synced in {sync_seconds:.1f} s: {objects}")
    print(f"python {sys.version.split()[0]}, pid {os.getpid()}")
    print("\nmemory (whole process)")
    print(f"  RSS after imports          {rss_imports:7.1f} MB")
    print(
        f"  RSS with caches synced     {rss:7.1f} MB   (target < {RSS_TARGET_MB:.0f} MB)"
        f"  {'OK' if rss < RSS_TARGET_MB else 'OVER'}"
    )
    print(f"  peak RSS while listing     {peak:7.1f} MB")
    print(f"  caches alone (approx.)     {rss - rss_imports:7.1f} MB")
    print("\none read on the admission path (best of 5 x 102,400 reads, random existing nodes)")
    for label, micros in timings.items():
        print(f"  {label:36s} {micros:6.2f} µs  {'OK' if micros < READ_TARGET_US else 'OVER'}")
    ok = rss < RSS_TARGET_MB and all(m < READ_TARGET_US for m in timings.values())
    print(f"\n{'all targets met' if ok else 'some targets missed'}")
    return 0 if ok else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=5000, help="Nodes, and as many driver pods")
    parser.add_argument("--attachments-per-node", type=int, default=4)
    parser.add_argument("--serve", metavar="KUBECONFIG", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args)
        return
    sys.exit(measure(args))


if __name__ == "__main__":
    main()
