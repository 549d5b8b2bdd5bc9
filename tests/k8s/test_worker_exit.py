"""A gunicorn worker that exits leaves the other processes their apiserver credentials, on the real apiserver.

The kubernetes client writes a kubeconfig's ``certificate-authority-data``/``client-*-data`` into temporary files
and deletes every file it recorded when the process exits. The workers are forked from the master, so each
inherited the master's record: the first worker to exit (a restart after a timeout, a SIGTERM) deleted the files
the master and the other worker still opened their apiserver connections with, and from then on every new
connection of theirs failed (``SSLError(FileNotFoundError)``): the audit candidate stopped renewing its Lease.
cluster.sh's admin kubeconfig carries its credentials as data, as most kubeconfigs do.

The workers also inherited the master's exit handler for its GuardPolicy follower: a worker that exited gave up
the master's status Lease, ended the master's report Lease (the replica looked gone from ``status.replicas``) and
wrote on the master's open TLS connections, which then failed with a bad record MAC."""

from __future__ import annotations

import base64
import json
import os
import re
import signal
from pathlib import Path
from typing import Any

import yaml

from tests.k8s.controlplane import CLUSTER_POLICY, REPO, ControlPlane, Guard, wait_until

NAMESPACE = "csinode-guard"  # serve's default --lease-namespace
LEASE = "csinode-guard-audit"  # held by the worker that runs the audit candidate
STATUS_LEASE = "csinode-guard-audit-policy-status"  # held by the master (it reports the GuardPolicy's status)


def workers(master: int) -> set[int]:
    """The live child processes of ``master`` (gunicorn's workers)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == master and fields[0] != "Z":
            found.add(int(stat.parent.name))
    return found


def lease(cp: ControlPlane, name: str = LEASE) -> dict[str, Any]:
    """The spec of Lease ``name``; empty while there is none."""
    found = cp.kubectl("get", "lease", "-n", NAMESPACE, name, "-o", "json", check=False)
    if found.returncode != 0:
        return {}
    spec: dict[str, Any] = json.loads(found.stdout)["spec"]
    return spec


def master_reports(cp: ControlPlane, master: int) -> list[dict[str, Any]]:
    """The specs of the GuardPolicy report Leases held by the guard's master (``csinode-guard-policy-<replica>``,
    the replica's identity ending in the master's pid)."""
    found = json.loads(cp.kubectl("get", "lease", "-n", NAMESPACE, "-o", "json").stdout)["items"]
    return [item["spec"] for item in found if item["metadata"]["name"].startswith("csinode-guard-policy-")
            and str(item["spec"].get("holderIdentity", "")).endswith(f"-{master}")]


def credential_files(directory: Path, kubeconfig: Path) -> set[Path]:
    """The files in ``directory`` holding one of ``kubeconfig``'s ``*-data`` values (what the client wrote)."""
    config = yaml.safe_load(kubeconfig.read_text())
    values = {base64.b64decode(entry[section][key])
              for group, section in (("clusters", "cluster"), ("users", "user")) for entry in config[group]
              for key in ("certificate-authority-data", "client-certificate-data", "client-key-data")
              if key in entry[section]}
    return {f for f in directory.iterdir() if f.is_file() and f.read_bytes() in values}


def test_a_worker_that_exits_leaves_the_audit_candidate_its_credentials(control_plane: ControlPlane,
                                                                        guard_factory: Any,
                                                                        tmp_path: Path) -> None:
    cp = control_plane
    if cp.kubectl("get", "namespace", NAMESPACE, check=False).returncode != 0:
        cp.kubectl("create", "namespace", NAMESPACE)
    cp.kubectl("apply", "-f", str(REPO / "deploy" / "base" / "guardpolicy-crd.yaml"))
    # Serving the cluster's GuardPolicy, the master loads the kubeconfig (and the client writes its files) before
    # it forks the workers, as in every out-of-cluster installation.
    temp = tmp_path / "tmp"
    temp.mkdir()
    guard: Guard = guard_factory(CLUSTER_POLICY, extra_env={"TMPDIR": str(temp)})
    assert guard.process is not None
    master = guard.process.pid

    def candidate() -> int | None:
        found = re.findall(r"this worker \(pid (\d+)\) runs the replica's audit candidate", guard.log.read_text())
        return int(found[-1]) if found else None

    leader = wait_until(candidate, timeout=60, what="a worker runs the audit candidate")
    wait_until(lambda: str(lease(cp).get("holderIdentity", "")).endswith(f"_{leader}"), timeout=60,
               what=f"worker {leader} holds the audit Lease")
    written = credential_files(temp, cp.kubeconfig)
    assert written, "the client wrote the kubeconfig's credentials to files"
    other = next(iter(workers(master) - {leader}))
    wait_until(lambda: master_reports(cp, master), timeout=60, what="the master's report Lease")
    logged = len(guard.log.read_text())
    os.kill(other, signal.SIGTERM)  # a clean worker exit: its atexit handlers run
    wait_until(lambda: other not in workers(master) and len(workers(master)) == 2, timeout=60,
               what="gunicorn replaced the worker")
    # The exited worker deleted only what it wrote itself: the master's and the other worker's files remain.
    assert written & credential_files(temp, cp.kubeconfig), "every credential file was deleted with the worker"

    # The candidate and the master keep renewing their Leases (each renewal may open a new connection): two
    # renewals each after the other worker exited, holders unchanged.
    for name, holder in ((LEASE, f"_{leader}"), (STATUS_LEASE, f"-{master}")):
        for _ in range(2):
            before = lease(cp, name).get("renewTime")

            def renewed(name: str = name, before: Any = before) -> dict[str, Any] | None:
                now = lease(cp, name)
                return now if now.get("renewTime") not in (None, before) else None

            spec = wait_until(renewed, timeout=60, what=f"Lease {name} renewed after a worker exited")
            assert str(spec["holderIdentity"]).endswith(holder), spec
    assert "FileNotFoundError" not in guard.log.read_text()
    # Nothing of the master's was stopped by the worker's exit: it never gave its status Lease up, its report
    # Lease was not ended (leaseDurationSeconds 1), and its TLS connections were not written on by another process.
    since = guard.log.read_text()[logged:]
    assert f"no longer holding the audit Lease {NAMESPACE}/{STATUS_LEASE}" not in since, since
    assert not any(marker in since for marker in ("BAD_RECORD_MAC", "DECRYPTION_FAILED", "SSLError")), since
    assert [spec.get("leaseDurationSeconds") for spec in master_reports(cp, master)] != [1]
