"""A control plane with kube-controller-manager and real nodes on it, for the real-node scenarios.

:class:`RealCluster` is ``K8S_CONTROLLER_MANAGER=1 cluster.sh start DIR`` (so the DaemonSet controller makes the
driver pods, the PV binder binds claims, the garbage collector follows ownerReferences) in a short directory under
``/tmp``: kubelet dials unix sockets below ``DIR/nodes/NODE/k/plugins_registry``, and a socket path holds 107 bytes,
so ``DIR`` may have at most 46 characters for a node named ``node-a`` (``../shared/k8s/README.md``, "A real node";
pytest's ``tmp_path`` is longer). :meth:`RealCluster.start_node` runs ``node.sh start DIR NODE``: a real kubelet
v1.36.2 with its own containerd, Ready in ~3 s, ~180 MB. :meth:`RealNode.deploy_driver` gives the node its own
copy of the shared csi-driver-host-path DaemonSet (``manifests/hostpath-node-daemonset.yaml``), restricted to it,
so that every test has a node, a CSINode and a driver history of its own.

Requirements (:func:`require_real_node`): root, ``containerd``, ``runc``, ``ctr`` and the CNI ``loopback`` plugin
(Debian: ``apt-get install -y containerd runc containernetworking-plugins``; ``.ci/run`` installs them).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from tests.k8s.controlplane import ControlPlane, ControlPlaneUnavailable, wait_until

DRIVER = "hostpath.csi.k8s.io"
"""The CSI driver the node plugin registers (csi-driver-host-path's ``--drivername``)."""
NAMESPACE = "kube-system"
IMAGE = "localhost/hostpathplugin"
NEW_TAG = "v1.18.0-8-g1f2b2e64"
"""The hostpathplugin build's own version; the image carries it and :data:`OLD_TAG` (the same image ID)."""
OLD_TAG = "v1.17.0"
"""The second tag of the same image: setting it on the DaemonSet models a rollback to an older driver."""
PLUGIN_LABELS = {"app.kubernetes.io/name": "csi-hostpathplugin", "app.kubernetes.io/part-of": "csi-driver-host-path"}
"""Labels every node's driver pods carry (the upstream chart's): what a ``versionSource: pod`` selects."""
NODE_LABEL = "csinode-guard.io/test-node"
"""The label that keeps each test's DaemonSet selector apart from the others'."""
REGISTERED = "plugin_registered:true"
"""node-driver-registrar's log line when kubelet's plugin watcher answered its registration with success."""
NOT_REGISTERED = "plugin_registered:false"
"""... and when kubelet reported the registration failed (the registrar then exits and its container restarts)."""


NODE_BINARIES = ("kube-controller-manager", "kubelet", "hostpathplugin", "csi-node-driver-registrar", "pause")
"""What a real node needs besides the control plane's binaries, in ``K8S_BIN_DIR`` when one is given."""


def require_real_node(cluster_sh: Path, start_env: dict[str, str]) -> Path:
    """``node.sh`` next to ``cluster_sh`` when this machine can run a real node, else
    :class:`ControlPlaneUnavailable` naming what is missing (root, containerd, runc, ctr, the CNI loopback plugin,
    :data:`NODE_BINARIES` in ``start_env``'s ``K8S_BIN_DIR``)."""
    node_sh = cluster_sh.parent / "node.sh"
    missing = []
    if not node_sh.is_file():
        missing.append(str(node_sh))
    bin_dir = start_env.get("K8S_BIN_DIR")
    if bin_dir:
        missing += [f"{bin_dir}/{b}" for b in NODE_BINARIES if not os.access(Path(bin_dir) / b, os.X_OK)]
    if os.geteuid() != 0:
        missing.append("root")
    search = f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin"
    missing += [tool for tool in ("containerd", "runc", "ctr") if shutil.which(tool, path=search) is None]
    if not any(os.access(Path(d) / "loopback", os.X_OK) for d in ("/usr/lib/cni", "/opt/cni/bin")):
        missing.append("the CNI loopback plugin (/usr/lib/cni/loopback)")
    if missing:
        raise ControlPlaneUnavailable(
            f"no real node possible: missing {', '.join(missing)} (Debian: apt-get install -y containerd runc "
            "containernetworking-plugins, as root; the binaries: ../shared/k8s/bin)"
        )
    return node_sh


def leftovers(directory: Path) -> list[str]:
    """What processes and mounts still name ``directory`` (empty after a clean stop)."""
    found = []
    prefix = f"{directory}/"
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if prefix in cmdline:
                found.append(f"process {proc.name}: {cmdline[:160]}")
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        mount_point = line.split()[4]
        if mount_point == str(directory) or mount_point.startswith(prefix):
            found.append(f"mount {mount_point}")
    return found


def settled_leftovers(directory: Path, wait: float = 30.0) -> list[str]:
    """:func:`leftovers`, polled for up to ``wait`` s: the guards of the last test (whose ``--kubeconfig`` names the
    directory) finish their shutdown in the background, SIGKILLed after 20 s."""
    deadline = time.monotonic() + wait
    while True:
        left = leftovers(directory)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def cpu_seconds(*pids: str) -> float:
    """User + system CPU seconds the processes ``pids`` have used so far (``/proc/PID/stat``; 0 for a gone one)."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))
    return total / os.sysconf("SC_CLK_TCK")


def audit_time(event: dict[str, Any]) -> datetime:
    """An audit event's ``stageTimestamp`` (``2026-12-04T18:45:25.790123Z``) as an aware datetime."""
    return datetime.fromisoformat(str(event["stageTimestamp"]).replace("Z", "+00:00"))


def drivers_of(obj: dict[str, Any] | None) -> dict[str, int | None]:
    """``{driver: allocatable.count or None}`` of a CSINode as JSON (empty for None)."""
    entries = ((obj or {}).get("spec") or {}).get("drivers") or []
    return {d["name"]: (d.get("allocatable") or {}).get("count") for d in entries}


@dataclass
class KubeletWrite:
    """One CSINode write of a node's kubelet as the apiserver's audit log shows it (stage ResponseComplete)."""

    time: datetime
    verb: str
    code: int
    sent: dict[str, int | None]
    """The drivers and counts kubelet sent (``requestObject``)."""
    stored: dict[str, int | None]
    """... and what the apiserver answered with (``responseObject``: after the guard's patch)."""
    resource_version: str | None
    """``responseObject.metadata.resourceVersion``: unchanged from the object kubelet read when nothing was
    written to etcd."""
    line: str
    """The audit line, shortened to what docs/registration.md quotes."""


@dataclass
class RealCluster:
    """A running ``cluster.sh`` control plane with kube-controller-manager, and the real nodes started on it."""

    control_plane: ControlPlane
    node_sh: Path
    nodes: dict[str, RealNode] = field(default_factory=dict)
    node_cpu: list[float] = field(default_factory=list)
    """CPU seconds each stopped node's kubelet and containerd used."""

    @classmethod
    @contextlib.contextmanager
    def running(cls, cluster_sh: Path, start_env: dict[str, str]) -> Iterator[RealCluster]:
        """Start one in ``mkdtemp(dir="/tmp")`` (16 characters), apply the hostpath CSIDriver
        (``nodeAllocatableUpdatePeriodSeconds: 10``), and on exit stop it (``cluster.sh stop`` stops every node
        first), check that no process or mount names the directory (AssertionError listing them, and the directory
        is kept for a look) and remove it."""
        node_sh = require_real_node(cluster_sh, start_env)
        directory = Path(tempfile.mkdtemp(prefix="k8s", dir="/tmp"))
        cp = ControlPlane(directory, cluster_sh, {**start_env, "K8S_CONTROLLER_MANAGER": "1"})
        cluster = cls(cp, node_sh)
        try:
            cp.start()
            cp.kubectl("apply", "-f", str(cluster_sh.parent / "manifests" / "csidriver-hostpath.yaml"))
            yield cluster
        finally:
            if cp.env:
                used = cpu_seconds(*(cp.env.get(k, "") for k in ("ETCD_PID", "KAS_PID", "SCHED_PID", "KCM_PID")))
                print(f"\n[real cluster] control plane CPU {used:.1f}s, nodes' kubelet + containerd CPU "
                      f"{sum(cluster.node_cpu):.1f}s ({len(cluster.node_cpu)} nodes)")
            cp.stop()
            left = settled_leftovers(directory)
            if left:
                raise AssertionError(f"cluster.sh stop left behind in {directory}: {left}")
            shutil.rmtree(directory, ignore_errors=True)

    @property
    def dir(self) -> Path:
        """The cluster directory (``DIR/nodes/NODE`` holds each node)."""
        return self.control_plane.dir

    def node_sh_run(self, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
        """``node.sh *args``; RuntimeError with its output on failure."""
        proc = subprocess.run(
            ["bash", str(self.node_sh), *args], env={**os.environ, **self.control_plane.start_env},
            capture_output=True, text=True, timeout=timeout, check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"node.sh {' '.join(args)} -> {proc.returncode}: {proc.stdout}{proc.stderr}")
        return proc

    def start_node(self, name: str) -> RealNode:
        """``node.sh start DIR NAME``: returns once the Node is Ready (kubelet has created its CSINode by then)."""
        started = time.monotonic()
        self.node_sh_run("start", str(self.dir), name)
        node_dir = self.dir / "nodes" / name
        env = dict(line.split("=", 1) for line in (node_dir / "env").read_text().splitlines()
                   if "=" in line and not line.startswith("export"))
        node = RealNode(self, name, env, started_in=time.monotonic() - started)
        self.nodes[name] = node
        return node

    def daemonset_manifest(self) -> dict[str, Any]:
        """The shared hostpath DaemonSet, rendered for this cluster (``node.sh render``)."""
        manifest = self.node_sh.parent / "manifests" / "hostpath-node-daemonset.yaml"
        rendered = self.node_sh_run("render", str(self.dir), str(manifest)).stdout
        doc: dict[str, Any] = yaml.safe_load(rendered)
        return doc


@dataclass
class RealNode:
    """One ``node.sh`` node: a real kubelet and containerd; ``env`` is its ``DIR/nodes/NODE/env``."""

    cluster: RealCluster
    name: str
    env: dict[str, str]
    started_in: float
    """Seconds ``node.sh start`` took (to Ready)."""

    @property
    def cp(self) -> ControlPlane:
        """The control plane the node joined."""
        return self.cluster.control_plane

    @property
    def dir(self) -> Path:
        """``DIR/nodes/NODE``."""
        return Path(self.env["NODE_DIR"])

    @property
    def daemonset(self) -> str:
        """This node's own DaemonSet (in :data:`NAMESPACE`)."""
        return f"csi-hostpath-{self.name}"

    # ------------------------------------------------------------------ the driver
    def deploy_driver(self, attach_limit: int, tag: str = NEW_TAG) -> None:
        """Create this node's DaemonSet of the csi-driver-host-path node plugin (+ node-driver-registrar): the
        shared manifest restricted to this node (``nodeSelector``, and :data:`NODE_LABEL` in its selector), whose
        NodeGetInfo reports ``attach_limit`` as ``max_volumes_per_node``, image tag ``tag``."""
        ds = copy.deepcopy(self.cluster.daemonset_manifest())
        ds["metadata"]["name"] = self.daemonset
        ds["spec"]["selector"]["matchLabels"][NODE_LABEL] = self.name
        template = ds["spec"]["template"]
        template["metadata"]["labels"][NODE_LABEL] = self.name
        template["spec"]["nodeSelector"] = {"kubernetes.io/hostname": self.name}
        [plugin] = [c for c in template["spec"]["containers"] if c["name"] == "hostpath"]
        plugin["image"] = f"{IMAGE}:{tag}"
        for env in plugin["env"]:
            if env["name"] == "ATTACH_LIMIT":
                env["value"] = str(attach_limit)
        self.cp.kubectl("create", "-f", "-", input=json.dumps(ds))

    def roll_out(self, *, attach_limit: int | None = None, tag: str | None = None) -> None:
        """Change the DaemonSet's template in one patch (one rollout: the DaemonSet controller deletes the pod and
        creates its replacement): ``ATTACH_LIMIT`` and/or the hostpath image tag."""
        container: dict[str, Any] = {"name": "hostpath"}
        if tag is not None:
            container["image"] = f"{IMAGE}:{tag}"
        if attach_limit is not None:
            container["env"] = [{"name": "ATTACH_LIMIT", "value": str(attach_limit)}]
        patch = {"spec": {"template": {"spec": {"containers": [container]}}}}
        self.cp.kubectl("patch", "daemonset", "-n", NAMESPACE, self.daemonset, "-p", json.dumps(patch))

    def driver_pods(self) -> list[dict[str, Any]]:
        """This node's driver pods (any phase, terminating ones included)."""
        found: list[dict[str, Any]] = self.cp.kubectl_json(
            "get", "pods", "-n", NAMESPACE, "-l", f"{NODE_LABEL}={self.name}")["items"]
        return found

    def registrar_log(self, pod: dict[str, Any]) -> str:
        """node-driver-registrar's log of ``pod`` (kubelet's ``podLogsDir``: ``pod-logs/NS_POD_UID/CONTAINER``;
        ``kubectl logs`` does not reach these kubelets)."""
        meta = pod["metadata"]
        pod_dir = f"{meta['namespace']}_{meta['name']}_{meta['uid']}"
        directory = self.dir / "pod-logs" / pod_dir / "node-driver-registrar"
        if not directory.is_dir():
            return ""
        return "".join(p.read_text(errors="replace") for p in sorted(directory.glob("*.log")))

    def wait_registered(
        self, *, tag: str = NEW_TAG, replacing: dict[str, Any] | None = None, timeout: float = 120
    ) -> dict[str, Any]:
        """Wait until this node's only driver pod (another than ``replacing``, after a rollout) has image ``tag``
        and kubelet answered its registrar's registration with success (:data:`REGISTERED`); returns the pod."""
        old_uid = replacing["metadata"]["uid"] if replacing else None

        def registered() -> dict[str, Any] | None:
            pods = [p for p in self.driver_pods() if "deletionTimestamp" not in p["metadata"]]
            if len(pods) != 1 or pods[0]["metadata"]["uid"] == old_uid:
                return None
            [pod] = pods
            [plugin] = [c for c in pod["spec"]["containers"] if c["name"] == "hostpath"]
            if plugin["image"] != f"{IMAGE}:{tag}" or REGISTERED not in self.registrar_log(pod):
                return None
            return pod

        found: dict[str, Any] = wait_until(registered, timeout=timeout, interval=0.25,
                                           what=f"{self.name}: a {tag} driver pod registered by kubelet")
        return found

    # ------------------------------------------------------------------ what the node stores and does
    def count(self) -> int | None:
        """The stored ``allocatable.count`` of :data:`DRIVER` (None: absent or unbounded)."""
        return drivers_of(self.cp.get_csinode(self.name)).get(DRIVER)

    def ready(self) -> bool:
        """Whether the Node's ``Ready`` condition is ``True`` (kubelet's heartbeat, every 10 s here)."""
        node = self.cp.kubectl_json("get", "node", self.name)
        return any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"].get("conditions", []))

    def kubelet_writes(self) -> list[KubeletWrite]:
        """kubelet's CSINode writes so far (create/update as ``system:node:NAME``, ResponseComplete), oldest
        first. The audit log has them at RequestResponse: what kubelet sent and what was stored."""
        user = f"system:node:{self.name}"
        out = []
        for event in self.cp.audit_events(lambda e: (
            e.get("stage") == "ResponseComplete"
            and (e.get("objectRef") or {}).get("resource") == "csinodes"
            and (e.get("objectRef") or {}).get("name") == self.name
            and (e.get("user") or {}).get("username") == user
            and e.get("verb") in {"create", "update", "patch"}
        )):
            response = event.get("responseObject") or {}
            code = int((event.get("responseStatus") or {}).get("code", 0))
            sent = drivers_of(event.get("requestObject"))
            stored = drivers_of(response) if code < 300 else {}
            rv = (response.get("metadata") or {}).get("resourceVersion") if code < 300 else None
            line = (f'{event["stageTimestamp"]} {user} {event["verb"]} csinodes/{self.name} {code} '
                    f'sent={sent} stored={stored} resourceVersion={rv}')
            out.append(KubeletWrite(audit_time(event), event["verb"], code, sent, stored, rv, line))
        return out

    def kubelet_reads(self) -> list[datetime]:
        """When kubelet GET its CSINode (ResponseComplete), oldest first: its periodic NodeGetInfo refresh reads
        the object every period and writes only when the count differs."""
        user = f"system:node:{self.name}"
        return [audit_time(e) for e in self.cp.audit_events(lambda e: (
            e.get("stage") == "ResponseComplete"
            and (e.get("objectRef") or {}).get("resource") == "csinodes"
            and (e.get("objectRef") or {}).get("name") == self.name
            and (e.get("user") or {}).get("username") == user
            and e.get("verb") == "get"
        ))]

    def kubelet_log(self) -> str:
        """kubelet's own log (``--v=2``)."""
        return Path(self.env["KUBELET_LOG"]).read_text(errors="replace")

    def stop(self) -> None:
        """Delete its DaemonSet, ``node.sh stop`` (kubelet, containerd, the pods' processes, mounts, cgroups), delete
        the Node (the garbage collector deletes its CSINode); AssertionError when a process or mount is left."""
        self.cp.kubectl("delete", "daemonset", "-n", NAMESPACE, self.daemonset, "--wait=false", "--ignore-not-found",
                        check=False)
        self.cluster.node_cpu.append(cpu_seconds(self.env["KUBELET_PID"], self.env["CONTAINERD_PID"]))
        self.cluster.node_sh_run("stop", str(self.cluster.dir), self.name)
        self.cp.kubectl("delete", "node", self.name, "--wait=false", "--ignore-not-found", check=False)
        self.cluster.nodes.pop(self.name, None)
        left = leftovers(self.dir)
        if left:
            raise AssertionError(f"node.sh stop left behind: {left}")
