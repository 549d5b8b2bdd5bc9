"""Benchmark of ``csinode-guard status`` on a 5,000-node cluster made on the real kube-apiserver (objects only).

Starts a throwaway control plane with ``../shared/k8s/cluster.sh`` (etcd + kube-apiserver v1.36.2, no scheduler,
no kubelets), creates through the API 5,000 Nodes shaped like the m6i.large fixture (~6.5 KB of JSON each,
instance types cycling over four EBS profile entries), 5,000 CSINodes with the EBS driver and a state annotation
signed with a test key (as the guard writes it), and 2 VolumeAttachments per node (``status.attached: true``
through the status subresource; 1 node in 10 also has one with a ResourceExhausted attach error). Then runs the
real command as a subprocess, three times each:

* ``csinode-guard status -o json --state-key-file KEY`` (every entry verified) and the default table;
* and, in process, the four paged LISTs and :func:`webhook.admission.capacity.build_report` apart.

Target (issue 14): an answer in seconds on 5,000 nodes (one LIST per kind, never a call per node).
Usage: ``python benchmarks/bench_status.py [--nodes 5000] [--keep DIR]``. Not a test: it prints. The cluster is
stopped at the end (also on errors).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from webhook.admission.capacity import build_report  # noqa: E402
from webhook.admission.policy import load_policy  # noqa: E402
from webhook.admission.state import EntryState, GuardState, StateKeys, encode_state, format_time  # noqa: E402
from webhook.commands.status import read_cluster  # noqa: E402
from webhook.kube import kubeapi  # noqa: E402

CLUSTER_SH = REPO.parent / "shared" / "k8s" / "cluster.sh"
DATA = REPO / "tests" / "data" / "cluster"
EBS = "ebs.csi.aws.com"
INSTANCE_TYPES = ("m6i.large", "m7i.48xlarge", "c5.xlarge", "r6id.8xlarge")
STATE_KEY = "5e" * 32
TARGET_SECONDS = 10.0
THREADS = 8


def node_name(i: int) -> str:
    return f"ip-10-{i // 65536 % 256}-{i // 256 % 256}-{i % 256}.ec2.internal"


def make_node(template: dict[str, Any], i: int) -> dict[str, Any]:
    node = copy.deepcopy(template)
    name = node_name(i)
    meta = node["metadata"]
    for key in ("uid", "resourceVersion", "creationTimestamp"):
        meta.pop(key, None)
    meta["name"] = name
    meta["labels"]["kubernetes.io/hostname"] = name
    meta["labels"]["node.kubernetes.io/instance-type"] = INSTANCE_TYPES[i % len(INSTANCE_TYPES)]
    meta["labels"]["beta.kubernetes.io/instance-type"] = INSTANCE_TYPES[i % len(INSTANCE_TYPES)]
    node["spec"] = {"providerID": f"aws:///us-east-1a/i-{i:017x}"}
    node["status"]["nodeInfo"].pop("swap", None)  # capacity 0 is refused by this apiserver's validation
    return node


def make_csinode(name: str, count: int) -> dict[str, Any]:
    return {
        "apiVersion": "storage.k8s.io/v1",
        "kind": "CSINode",
        "metadata": {"name": name},
        "spec": {"drivers": [{"name": EBS, "nodeID": f"i-{name}", "allocatable": {"count": count},
                              "topologyKeys": ["topology.ebs.csi.aws.com/zone"]}]},
    }


def make_va(name: str, node: str) -> dict[str, Any]:
    return {
        "apiVersion": "storage.k8s.io/v1",
        "kind": "VolumeAttachment",
        "metadata": {"name": name},
        "spec": {"attacher": EBS, "nodeName": node, "source": {"persistentVolumeName": f"pv-{name}"}},
    }


def parallel(label: str, items: Iterable[Any], work: Callable[[Any], Any], clients: list[kubeapi.KubeClient]) -> None:
    started = time.perf_counter()
    listed = list(items)
    with concurrent.futures.ThreadPoolExecutor(len(clients)) as pool:
        futures = [pool.submit(work, clients[i % len(clients)], item) for i, item in enumerate(listed)]
        for future in futures:
            future.result()
    print(f"  {label}: {len(listed)} in {time.perf_counter() - started:.1f} s", flush=True)


def populate(kubeconfig: str, nodes: int, key: StateKeys) -> None:
    clients = [kubeapi.KubeClient(kubeapi.load_api_client(kubeconfig)) for _ in range(THREADS)]
    template = json.loads((DATA / "node-m6i-large.json").read_text())
    try:
        parallel("Nodes", range(nodes), lambda c, i: c.create(kubeapi.NODES, make_node(template, i)), clients)

        def csinode(client: kubeapi.KubeClient, i: int) -> None:
            name = node_name(i)
            created = client.create(kubeapi.CSINODES, make_csinode(name, 20 + i % 7))
            state = GuardState(uid=created["metadata"]["uid"], entries={
                EBS: EntryState(count=20 + i % 7, changed_at=datetime.now(UTC) - timedelta(minutes=i % 90),
                                writer_version="v1.37.0",
                                frozen_until=datetime.now(UTC) + timedelta(hours=1) if i % 100 == 0 else None)})
            created["metadata"]["annotations"] = {"csinode-guard.io/state": encode_state(state, key)}
            client.replace(kubeapi.CSINODES, created)

        parallel("CSINodes (create, then the signed state)", range(nodes), csinode, clients)

        def attachments(client: kubeapi.KubeClient, i: int) -> None:
            node = node_name(i)
            for j in range(2):
                va = client.create(kubeapi.VOLUMEATTACHMENTS, make_va(f"csi-{i:05d}-{j}", node))
                va["status"] = {"attached": True}
                client.send(kubeapi.ApiRequest("PUT", kubeapi.VOLUMEATTACHMENTS.object_path(va["metadata"]["name"])
                                               + "/status", (), va))
            if i % 10 == 0:
                va = client.create(kubeapi.VOLUMEATTACHMENTS, make_va(f"csi-{i:05d}-err", node))
                va["status"] = {"attached": False, "attachError": {
                    "time": format_time(datetime.now(UTC)), "message": "ResourceExhausted", "errorCode": 8}}
                client.send(kubeapi.ApiRequest("PUT", kubeapi.VOLUMEATTACHMENTS.object_path(va["metadata"]["name"])
                                               + "/status", (), va))

        parallel("VolumeAttachments (2 per node + errors, with status)", range(nodes), attachments, clients)
    finally:
        for client in clients:
            client.close()


def run_status(kubeconfig: str, key_file: Path, *args: str) -> tuple[float, str]:
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "webhook", "status", *args], capture_output=True, text=True,
                          env={**os.environ, "KUBECONFIG": kubeconfig, "CSINODE_GUARD_STATE_KEY_FILE": str(key_file)},
                          timeout=600, check=True, cwd=REPO)
    return time.perf_counter() - started, proc.stdout


def in_process(kubeconfig: str, key: StateKeys) -> dict[str, float]:
    """The status command's reads (the four LISTs at once, as it makes them), then each LIST alone, then the
    report."""
    times: dict[str, float] = {}
    with kubeapi.KubeClient(kubeapi.load_api_client(kubeconfig)) as client:
        started = time.perf_counter()
        nodes, csinodes, attachments, pending = read_cluster(client, None)
        times["the four LISTs, as status makes them"] = time.perf_counter() - started
        for label, call in (
            (f"LIST Nodes, metadata only ({len(nodes)})",
             lambda: client.list_all(kubeapi.NODES, metadata_only=True)),
            (f"LIST Nodes, whole objects ({len(nodes)})", lambda: client.list_all(kubeapi.NODES)),
            (f"LIST CSINodes ({len(csinodes)})", lambda: client.list_all(kubeapi.CSINODES)),
            (f"LIST VolumeAttachments ({len(attachments)})", lambda: client.list_all(kubeapi.VOLUMEATTACHMENTS)),
        ):
            started = time.perf_counter()
            call()
            times[label] = time.perf_counter() - started
    policy = load_policy()
    started = time.perf_counter()
    report = build_report(csinodes, nodes, attachments, pending, policy=policy, now=datetime.now(UTC), keys=key)
    times[f"build_report ({len(report.rows)} rows, state verified)"] = time.perf_counter() - started
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=5000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-status-"))
    cluster = work / "cluster"
    env = {**os.environ, "K8S_SCHEDULER": "0"}
    subprocess.run(["bash", str(CLUSTER_SH), "start", str(cluster)], env=env, check=True, capture_output=True,
                   text=True, timeout=600)
    try:
        kubeconfig = str(cluster / "admin.kubeconfig")
        key_file = work / "state.key"
        key_file.write_text(STATE_KEY + "\n")
        key = StateKeys([bytes.fromhex(STATE_KEY)])
        print(f"populating {args.nodes} nodes on the real kube-apiserver ...", flush=True)
        populate(kubeconfig, args.nodes, key)
        results: dict[str, list[float]] = {"status -o json --state-key-file": [], "status (table)": []}
        summary = ""
        for _ in range(args.runs):
            seconds, out = run_status(kubeconfig, key_file, "-o", "json")
            results["status -o json --state-key-file"].append(seconds)
            doc = json.loads(out)
            assert doc["summary"]["entries"] == args.nodes, doc["summary"]
            assert all(e["state"] == "verified" for e in doc["entries"])
            seconds, out = run_status(kubeconfig, key_file)
            results["status (table)"].append(seconds)
            summary = out.splitlines()[0]
        print(f"\n{summary}\n")
        print(f"| what | median of {args.runs} runs | min | max |")
        print("|---|---|---|---|")
        for label, values in results.items():
            print(f"| `csinode-guard {label}` (subprocess, {args.nodes} nodes) | {statistics.median(values):.2f} s "
                  f"| {min(values):.2f} s | {max(values):.2f} s |")
        for label, seconds in in_process(kubeconfig, key).items():
            print(f"| in process: {label} | {seconds:.2f} s | | |")
        worst = max(max(v) for v in results.values())
        print(f"\ntarget: under {TARGET_SECONDS:.0f} s -> {'met' if worst < TARGET_SECONDS else 'MISSED'}")
        print(f"load average: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    finally:
        subprocess.run(["bash", str(CLUSTER_SH), "stop", str(cluster)], capture_output=True, timeout=120,
                       check=False)


if __name__ == "__main__":
    main()
