"""A real Kubernetes control plane for the tests, envtest-style: etcd, kube-apiserver, kube-scheduler, and
``kubelet-csinode`` (kubelet's own CSINode code), started with ``cluster.sh`` of ``../shared/k8s``.

Binary discovery follows controller-runtime's envtest: ``KUBEBUILDER_ASSETS`` names a directory holding the
uncompressed ``kube-apiserver``, ``etcd``, ``kube-scheduler`` and ``kubelet-csinode`` (handed to ``cluster.sh``
as ``K8S_BIN_DIR``); without it the ``cluster.sh`` of ``<repo>/../shared/k8s`` unpacks its own. ``cluster.sh``
itself is looked up in ``KUBEBUILDER_ASSETS`` first, then in ``<repo>/../shared/k8s``.

Also here: :class:`Guard`, a real ``csinode-guard serve --kubeconfig`` subprocess registered with the real
``csinode-guard register --url``, and small helpers the tests share (:func:`wait_until`, :func:`counts`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]
SHARED_K8S = REPO.parent / "shared" / "k8s"
REQUIRED_BINARIES = ("kube-apiserver", "etcd", "kube-scheduler", "kubelet-csinode")
REQUIRE_ENV = "CSINODE_GUARD_REQUIRE_K8S"
ASSETS_ENV = "KUBEBUILDER_ASSETS"

APPROVERS = "csinode-guard:approvers"
KUBELET_VERSION = "v1.36.2"
"""The kubelet version the Nodes created here report in ``status.nodeInfo`` (the binaries' version)."""


class ControlPlaneUnavailable(Exception):  # noqa: N818 - a reason, not an error: the suite skips on it
    """The binaries or ``cluster.sh`` were not found; the message says what is missing."""


def discover() -> tuple[Path, dict[str, str]]:
    """``(cluster.sh, extra environment)`` for starting a cluster, or :class:`ControlPlaneUnavailable`.

    ``KUBEBUILDER_ASSETS`` (envtest) must hold every one of :data:`REQUIRED_BINARIES`, executable; it becomes
    ``K8S_BIN_DIR``. Otherwise ``../shared/k8s`` with its ``bin/*.xz`` is used.
    """
    assets = os.environ.get(ASSETS_ENV)
    if assets:
        assets_dir = Path(assets)
        missing = [b for b in REQUIRED_BINARIES if not os.access(assets_dir / b, os.X_OK)]
        if missing:
            raise ControlPlaneUnavailable(f"{ASSETS_ENV}={assets} lacks {', '.join(missing)}")
        for candidate in (assets_dir / "cluster.sh", SHARED_K8S / "cluster.sh"):
            if candidate.is_file():
                return candidate, {"K8S_BIN_DIR": str(assets_dir)}
        raise ControlPlaneUnavailable(f"no cluster.sh in {ASSETS_ENV}={assets} nor in {SHARED_K8S}")
    cluster_sh = SHARED_K8S / "cluster.sh"
    if not cluster_sh.is_file() or not (SHARED_K8S / "bin" / "SHA256SUMS").is_file():
        raise ControlPlaneUnavailable(f"no {ASSETS_ENV} and no {cluster_sh} (with bin/SHA256SUMS)")
    return cluster_sh, {}


@contextlib.contextmanager
def running_control_plane(directory: Path) -> Iterator[ControlPlane]:
    """A control plane started in ``directory`` (see :func:`discover`), stopped when the block ends; for the scripts
    that run one of their own (``benchmarks.apiserver``, ``tests.k8s.record_reviews``). Raises
    :class:`ControlPlaneUnavailable` when there is none to start."""
    cluster_sh, start_env = discover()
    cp = ControlPlane(directory, cluster_sh, start_env)
    cp.start()
    try:
        yield cp
    finally:
        cp.stop()


def kubectl_binary() -> str:
    """The ``kubectl`` in ``$CSINODE_GUARD_TOOLS_DIR``, else the machine's, else the one ``ci/deploy-checks.sh
    install`` put in its default directory (``~/.cache/csinode-guard/tools/bin``); else
    :class:`ControlPlaneUnavailable`."""
    tools = os.environ.get("CSINODE_GUARD_TOOLS_DIR")
    if tools and os.access(Path(tools) / "kubectl", os.X_OK):
        return str(Path(tools) / "kubectl")
    found = shutil.which("kubectl")
    if found:
        return found
    default = Path.home() / ".cache" / "csinode-guard" / "tools" / "bin" / "kubectl"
    if os.access(default, os.X_OK):
        return str(default)
    raise ControlPlaneUnavailable("no kubectl on PATH (run: ci/deploy-checks.sh install)")


def unique(prefix: str) -> str:
    """``prefix`` with a short random suffix: node names (DNS-1123) that no other test uses."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def wait_until(predicate: Callable[[], Any], timeout: float = 20.0, interval: float = 0.1, what: str = "") -> Any:
    """Poll ``predicate`` until it returns a truthy value (returned); AssertionError after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not met within {timeout}s: {what or predicate}")
        time.sleep(interval)


def counts(csinode: dict[str, Any]) -> dict[str, int | None]:
    """``{driver: allocatable.count or None}`` of a CSINode as JSON (``kubelet-csinode get`` or kubectl)."""
    drivers = (csinode.get("spec") or {}).get("drivers") or []
    return {d["name"]: (d.get("allocatable") or {}).get("count") for d in drivers}


@dataclass
class ControlPlane:
    """One running cluster of ``cluster.sh start DIR``; read ``DIR/env`` for where everything is."""

    dir: Path
    cluster_sh: Path
    start_env: dict[str, str]
    env: dict[str, str] = field(default_factory=dict)
    _node_kubeconfigs: dict[str, Path] = field(default_factory=dict)
    _user_kubeconfigs: dict[tuple[str, ...], Path] = field(default_factory=dict)
    _api_client: Any = None
    _probe_ready: bool = False

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """``cluster.sh start DIR`` (a few seconds; more on a busy machine); RuntimeError with its output."""
        proc = subprocess.run(
            ["bash", str(self.cluster_sh), "start", str(self.dir)],
            env={**os.environ, **self.start_env},
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )
        if proc.returncode != 0:
            self.stop()
            raise RuntimeError(f"cluster.sh start failed ({proc.returncode}): {proc.stdout}{proc.stderr}")
        self.env = dict(
            line.split("=", 1) for line in (self.dir / "env").read_text().splitlines() if "=" in line
        )
        self._create_probe()  # before any webhook is registered, whatever it would judge

    def _create_probe(self) -> None:
        if not self._probe_ready:
            self.kubectl("apply", "-f", "-", input=json.dumps(self._probe_csinode(2)))
            self._probe_ready = True

    def stop(self) -> None:
        """``cluster.sh stop DIR`` (SIGTERM, SIGKILL after 10 s); safe on a half-started cluster."""
        if self._api_client is not None:
            with contextlib.suppress(Exception):
                self._api_client.close()
            self._api_client = None
        subprocess.run(
            ["bash", str(self.cluster_sh), "stop", str(self.dir)],
            env={**os.environ, **self.start_env},
            capture_output=True,
            timeout=60,
            check=False,
        )

    # ---------------------------------------------------------------- where things are
    @property
    def kubeconfig(self) -> Path:
        """The admin kubeconfig (O=system:masters)."""
        return Path(self.env["KUBECONFIG"])

    @property
    def kas_url(self) -> str:
        """``https://127.0.0.1:PORT`` of kube-apiserver."""
        return self.env["KAS_URL"]

    @property
    def ca_crt(self) -> Path:
        """The cluster CA: it signs the apiserver's, the users' and :meth:`serving_cert`'s certificates."""
        return Path(self.env["CA_CRT"])

    @property
    def audit_log(self) -> Path:
        """kube-apiserver's audit log (JSON lines; csinodes at RequestResponse, the rest at Metadata)."""
        return Path(self.env["AUDIT_LOG"])

    @property
    def kubelet_csinode(self) -> Path:
        """The ``kubelet-csinode`` binary."""
        return Path(self.env["KUBELET_CSINODE"])

    def _cluster_sh(self, *args: str) -> str:
        proc = subprocess.run(
            ["bash", str(self.cluster_sh), *args],
            env={**os.environ, **self.start_env},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"cluster.sh {' '.join(args)}: {proc.stderr}")
        return proc.stdout.strip().splitlines()[-1]

    def node_kubeconfig(self, node: str) -> Path:
        """A kubeconfig for ``system:node:<node>`` (group system:nodes), minted once per node."""
        if node not in self._node_kubeconfigs:
            self._node_kubeconfigs[node] = Path(self._cluster_sh("node-kubeconfig", str(self.dir), node))
        return self._node_kubeconfigs[node]

    def user_kubeconfig(self, name: str, *groups: str) -> Path:
        """A kubeconfig for user ``name`` in ``groups`` (client certificate: O=group), minted once."""
        key = (name, *groups)
        if key not in self._user_kubeconfigs:
            self._user_kubeconfigs[key] = Path(self._cluster_sh("user-kubeconfig", str(self.dir), name, *groups))
        return self._user_kubeconfigs[key]

    @property
    def state_key(self) -> Path:
        """The cluster's one state key (as Secret csinode-guard-state-key is in a real cluster): every guard of
        this control plane signs and verifies with it unless a test gives one its own ``certs/state.key``."""
        path = self.dir / "state.key"
        if not path.exists():
            path.write_text(uuid.uuid4().hex + uuid.uuid4().hex + "\n")
            path.chmod(0o600)
        return path

    def serving_cert(self, name: str) -> tuple[Path, Path]:
        """``(crt, key)`` of a serving certificate for 127.0.0.1/localhost signed by the cluster CA."""
        crt = self.dir / "pki" / f"{name}.crt"
        key = self.dir / "pki" / f"{name}.key"
        if not (crt.exists() and key.exists()):
            crt = Path(self._cluster_sh("serving-cert", str(self.dir), name))
        return crt, key

    # ---------------------------------------------------------------- clients
    def kubectl(
        self, *args: str, kubeconfig: Path | None = None, check: bool = True, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run ``kubectl --kubeconfig <admin or given> *args``; with ``check`` a non-zero exit raises
        AssertionError showing stderr."""
        proc = subprocess.run(
            [kubectl_binary(), "--kubeconfig", str(kubeconfig or self.kubeconfig), *args],
            capture_output=True,
            text=True,
            input=input,
            timeout=120,
            check=False,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} -> {proc.returncode}: {proc.stderr}{proc.stdout}")
        return proc

    def kubectl_json(self, *args: str, kubeconfig: Path | None = None) -> Any:
        """``kubectl ... -o json`` parsed."""
        return json.loads(self.kubectl(*args, "-o", "json", kubeconfig=kubeconfig).stdout)

    def kubelet(
        self, node: str, *args: str, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """``kubelet-csinode --kubeconfig <node's> --node <node> *args`` (writes as ``system:node:<node>``).

        With ``check`` a non-zero exit raises AssertionError showing stderr (kubelet's error text).
        """
        proc = subprocess.run(
            [str(self.kubelet_csinode), "--kubeconfig", str(self.node_kubeconfig(node)), "--node", node, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"kubelet-csinode {' '.join(args)} -> {proc.returncode}: {proc.stderr}")
        return proc

    def get_csinode(self, node: str) -> dict[str, Any]:
        """The stored CSINode as JSON, read back from etcd with one GET (as admin)."""
        result: dict[str, Any] = self.kubectl_json("get", "csinode", node)
        return result

    def replace_count(
        self, node: str, driver: str, count: int | None, *, kubeconfig: Path | None = None, check: bool = True,
        annotations: dict[str, str] | None = None, dry_run: bool = False,
    ) -> subprocess.CompletedProcess[str]:
        """GET the CSINode and PUT it back (``kubectl replace``, with its resourceVersion) with ``driver``'s
        ``allocatable.count`` set (None: ``allocatable`` removed) and ``annotations`` merged, as the identity of
        ``kubeconfig`` (default: the node's own, ``system:node:<node>``); ``dry_run``: a server-side dry run that
        every webhook judges and nothing stores. For counts kubelet's code cannot
        write (0: kubelet drops ``allocatable`` for ``max_volumes_per_node`` 0) and for other writers."""
        kubeconfig = kubeconfig or self.node_kubeconfig(node)
        stored = self.kubectl_json("get", "csinode", node, kubeconfig=kubeconfig)
        for entry in stored["spec"]["drivers"]:
            if entry["name"] == driver:
                if count is None:
                    entry.pop("allocatable", None)
                else:
                    entry["allocatable"] = {"count": count}
        if annotations:
            stored["metadata"].setdefault("annotations", {}).update(annotations)
        return self.kubectl(
            "replace", "-f", "-", *(["--dry-run=server"] if dry_run else []),
            kubeconfig=kubeconfig, check=check, input=json.dumps(stored),
        )

    def approver_kubeconfig(self, name: str = "alice@example.com") -> Path:
        """A kubeconfig for ``name`` in group ``csinode-guard:approvers`` (the default policy's justifiers), bound
        to deploy/base/rbac.yaml's ClusterRole csinode-guard-approver."""
        import yaml  # noqa: PLC0415

        role = next(
            doc for doc in yaml.safe_load_all((REPO / "deploy" / "base" / "rbac.yaml").read_text())
            if doc and doc["kind"] == "ClusterRole" and doc["metadata"]["name"] == "csinode-guard-approver"
        )
        binding = {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": "csinode-guard-approvers"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": "csinode-guard-approver"},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": APPROVERS}],
        }
        self.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                           "items": [role, binding]}))
        return self.user_kubeconfig(name, APPROVERS)

    def api_client(self) -> Any:
        """A ``kubernetes.client.ApiClient`` for the admin kubeconfig (shared, closed at stop)."""
        if self._api_client is None:
            from kubernetes import config  # noqa: PLC0415

            self._api_client = config.new_client_from_config(config_file=str(self.kubeconfig))
        return self._api_client

    def create_node(self, name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
        """Create Node ``name`` as admin with a full ``status.nodeInfo`` (what kubelet reports, so the Python
        client's models accept it) and without the ``node.kubernetes.io/not-ready`` taint that admission adds
        (no kubelet will ever clear it here). Returns the stored Node."""
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})}},
            "status": {
                "capacity": {"cpu": "8", "memory": "32Gi", "pods": "110"},
                "allocatable": {"cpu": "8", "memory": "32Gi", "pods": "110"},
                "conditions": [
                    {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "test node"}
                ],
                "nodeInfo": {
                    "architecture": "amd64",
                    "bootID": str(uuid.uuid4()),
                    "containerRuntimeVersion": "containerd://2.1.0",
                    "kernelVersion": "6.8.0",
                    "kubeProxyVersion": "",
                    "kubeletVersion": KUBELET_VERSION,
                    "machineID": uuid.uuid4().hex,
                    "operatingSystem": "linux",
                    "osImage": "test",
                    "systemUUID": str(uuid.uuid4()),
                },
            },
        }
        self.kubectl("create", "-f", "-", input=json.dumps(node))  # a Node's create keeps its status, as kubelet's
        self.kubectl("patch", "node", name, "--type=merge", "-p", '{"spec":{"taints":null}}')
        stored: dict[str, Any] = self.kubectl_json("get", "node", name)
        return stored

    PROBE_NODE = "csinode-guard-probe"
    PROBE_DRIVER = "ebs.csi.aws.com"

    def probe_write(self, marker: str | None = None) -> subprocess.CompletedProcess[str]:
        """A server-side dry-run UPDATE of CSINode :data:`PROBE_NODE` by that node, lowering a count 2 -> 1: it
        reaches every registered webhook of the guard and changes nothing. The CSINode is created (by admin) when
        the cluster starts. Used to wait until the apiserver calls (or stops calling) a newly (un)registered guard;
        ``marker`` goes into an annotation, to find the request's audit event."""
        self._create_probe()
        probe = self._probe_csinode(1)
        if marker is not None:  # to find this request's event in the audit log
            probe["metadata"]["annotations"] = {"test.csinode-guard.io/probe": marker}
        return self.kubectl(
            "replace", "--dry-run=server", "-f", "-", check=False,
            kubeconfig=self.node_kubeconfig(self.PROBE_NODE), input=json.dumps(probe),
        )

    def _probe_csinode(self, count: int) -> dict[str, Any]:
        return {
            "apiVersion": "storage.k8s.io/v1",
            "kind": "CSINode",
            "metadata": {"name": self.PROBE_NODE},
            "spec": {"drivers": [{"name": self.PROBE_DRIVER, "nodeID": "probe", "allocatable": {"count": count}}]},
        }

    def audit_events(self, predicate: Callable[[dict[str, Any]], bool] | None = None) -> list[dict[str, Any]]:
        """The audit events logged so far (parsed lines of :attr:`audit_log`), filtered by ``predicate``.

        The apiserver writes an event just after it answered, so poll: ``wait_until(lambda: cp.audit_events(p))``.
        A half-written last line is left out.
        """
        events = []
        if not self.audit_log.exists():
            return []
        for line in self.audit_log.read_text().splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if predicate is None or predicate(event):
                events.append(event)
        return events


def csinode_writes(node: str) -> Callable[[dict[str, Any]], bool]:
    """Audit predicate: the completed (ResponseComplete) create/update/patch of CSINode ``node``."""

    def match(event: dict[str, Any]) -> bool:
        ref = event.get("objectRef") or {}
        return (
            event.get("stage") == "ResponseComplete"
            and ref.get("resource") == "csinodes"
            and ref.get("name") == node
            and event.get("verb") in {"create", "update", "patch"}
        )

    return match


# ==================================================================== the guard
DEFAULT_POLICY = REPO / "policies" / "default.yaml"


def policy_file(path: Path, edit: Callable[[dict[str, Any]], None] | None = None) -> Path:
    """Write ``policies/default.yaml``, changed by ``edit(doc)``, to ``path``; returns ``path``."""
    import yaml  # noqa: PLC0415

    doc = yaml.safe_load(DEFAULT_POLICY.read_text())
    if edit is not None:
        edit(doc)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


ADMIN_USER = "test-admin"
"""The admin kubeconfig's user (cluster.sh): the version reporter of :func:`fast_policy` with ``reporter``."""


CLUSTER_POLICY = Path("<the cluster's GuardPolicy>")
"""``guard_factory(CLUSTER_POLICY, extra_args=("--guard-policy", NAME))``: a guard that serves the cluster's
GuardPolicy NAME instead of a policy file (webhook/serving/cluster_policy.py)."""


def fast_policy(
    path: Path, min_interval: str = "2s", *, reporter: str | None = None, reconcile: str | None = None
) -> Path:
    """The default policy with change-rate's ``minInterval`` shortened (as tests/test_e2e.py does).

    With ``reporter``, EBS driver versions come from the ``csinode-guard.io/driver-versions`` annotation as that
    user declares it (``spec.versionReporters``): no node plugin pods run here for ``versionSource: pod``. With
    ``reconcile``, ``spec.reconcile`` (``report``: the audit repairs nothing, for tests of what an operator does
    while the guard is unregistered but running).
    """

    def edit(doc: dict[str, Any]) -> None:
        doc["spec"]["rules"]["change-rate"]["minInterval"] = min_interval
        if reconcile is not None:
            doc["spec"]["reconcile"] = reconcile
        if reporter is not None:
            doc["spec"]["versionReporters"] = {"users": [reporter]}
            doc["spec"]["drivers"]["ebs.csi.aws.com"]["versionSource"] = {"type": "annotation"}

    return policy_file(path, edit)


@dataclass
class Guard:
    """A real ``csinode-guard serve --kubeconfig <admin>`` on 127.0.0.1:``port``, registered with the real
    ``csinode-guard register --url`` under configuration name ``name``.

    Its TLS certificate is :meth:`ControlPlane.serving_cert` (cluster CA, SAN 127.0.0.1); ``cert_dir`` holds
    ``tls.crt``, ``tls.key``, ``ca.crt`` (the cluster CA, the caBundle ``register`` sends) and ``state.key`` (the
    control plane's :attr:`ControlPlane.state_key`, unless the test wrote one of its own first).
    """

    control_plane: ControlPlane
    work: Path
    policy_path: Path
    name: str
    extra_args: tuple[str, ...] = ()
    extra_env: dict[str, str] = field(default_factory=dict)
    workers: int = 2
    port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    registered: bool = False
    paused: bool = False

    @property
    def cert_dir(self) -> Path:
        """tls.crt/tls.key/ca.crt/state.key of this guard."""
        return self.work / "certs"

    @property
    def url(self) -> str:
        """``https://127.0.0.1:PORT``, the base URL ``register --url`` got (``/mutate``, ``/validate`` appended)."""
        return f"https://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        """The guard's stderr (its JSON logs)."""
        return self.work / "serve.log"

    @property
    def decisions_log(self) -> Path:
        """The guard's decision audit log (``--audit-log``)."""
        return self.work / "decisions.log"

    def decisions(self) -> list[dict[str, Any]]:
        """The guard's audit records so far (one dict per judged AdmissionRequest)."""
        if not self.decisions_log.exists():
            return []
        out = []
        for line in self.decisions_log.read_text().splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
        return out

    def _prepare_certs(self) -> None:
        self.cert_dir.mkdir(parents=True, exist_ok=True)
        crt, key = self.control_plane.serving_cert("csinode-guard")
        shutil.copyfile(crt, self.cert_dir / "tls.crt")
        shutil.copyfile(key, self.cert_dir / "tls.key")
        shutil.copyfile(self.control_plane.ca_crt, self.cert_dir / "ca.crt")
        state_key = self.cert_dir / "state.key"
        if not state_key.exists():
            shutil.copyfile(self.control_plane.state_key, state_key)
            state_key.chmod(0o600)

    def csinode_guard(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run the ``csinode-guard`` CLI (this interpreter's ``-m webhook``) against the cluster as admin."""
        proc = subprocess.run(
            [sys.executable, "-m", "webhook", *args],
            env={**os.environ, "KUBECONFIG": str(self.control_plane.kubeconfig)},
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            cwd=self.work,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"csinode-guard {' '.join(args)} -> {proc.returncode}: {proc.stderr}{proc.stdout}")
        return proc

    def _policy_args(self) -> tuple[str, ...]:
        """``--policy FILE``, or for :data:`CLUSTER_POLICY` none: the guard serves the cluster's GuardPolicy (the
        one ``--guard-policy`` in ``extra_args`` names)."""
        return () if self.policy_path == CLUSTER_POLICY else ("--policy", str(self.policy_path))

    def start(self, timeout: float = 90.0) -> None:
        """Start serve (same port as before) and wait for /readyz (its watch caches synced)."""
        if self.process is not None and self.process.poll() is None:
            return
        self._prepare_certs()
        cmd = [
            sys.executable, "-m", "webhook", "serve",
            "--host", "127.0.0.1", "--port", str(self.port), "--metrics-port", str(self.metrics_port),
            "--cert-dir", str(self.cert_dir), "--no-generate-certs",
            "--kubeconfig", str(self.control_plane.kubeconfig),
            *self._policy_args(), "--policy-reload-interval", "0.5",
            "--state-key-file", str(self.cert_dir / "state.key"),
            "--audit-log", str(self.decisions_log),
            "--workers", str(self.workers), *self.extra_args,
        ]
        env = {k: v for k, v in os.environ.items() if k not in {"PROMETHEUS_MULTIPROC_DIR", "KUBECONFIG"}}
        env.update(self.extra_env)
        with self.log.open("ab") as err:
            self.process = subprocess.Popen(
                cmd, stdout=err, stderr=err, env=env, cwd=self.work, start_new_session=True
            )
        self.paused = False
        deadline = time.monotonic() + timeout
        context = ssl.create_default_context(cafile=str(self.control_plane.ca_crt))
        last_answer = "no answer"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"serve exited {self.process.returncode}: {self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/readyz", context=context, timeout=2) as answer:
                    if answer.status == 200:
                        return
            except urllib.error.HTTPError as error:  # 503 while not ready: its body says what it waits for
                last_answer = f"{error.code} {error.read()[:1000]!r}"
            except OSError as error:
                last_answer = repr(error)
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"serve not ready within {timeout}s (last /readyz: {last_answer}): "
                           f"{self.log.read_text()[-3000:]}")

    def stop(self, wait: bool = True) -> None:
        """SIGTERM the process group (SIGCONT first if paused), SIGKILL after 20 s. Without ``wait``, return at
        once and let a background thread finish the shutdown (a test's teardown: gunicorn keeps the apiserver's
        idle keep-alive connections open for 2 s after SIGTERM, so that a request arriving meanwhile is still
        answered; nothing after the test needs to wait for that)."""
        if self.process is None or self.process.poll() is not None:
            return
        pgid = self.process.pid
        with contextlib.suppress(ProcessLookupError):
            if self.paused:
                os.killpg(pgid, signal.SIGCONT)
                self.paused = False
            os.killpg(pgid, signal.SIGTERM)
        if wait:
            _reap(self.process, pgid)
        else:
            threading.Thread(target=_reap, args=(self.process, pgid), name=f"reap-{pgid}", daemon=True).start()

    def pause(self) -> None:
        """SIGSTOP the whole process group: connections are accepted by the kernel, nothing answers."""
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGCONT)
        self.paused = False

    def register(self, *extra: str, wait: bool = True) -> subprocess.CompletedProcess[str]:
        """``csinode-guard register --url <url> --cert-dir <certs> --name <name>`` as admin; with ``wait``,
        return once the apiserver calls both webhooks (its configuration informer lags the write a little).
        With ``--validation cel`` the probe's decrease is decided by CEL: once the apiserver calls /mutate and
        no longer /validate for it."""
        if not any(a == "--validation" or a.startswith("--validation=") for a in extra):
            # The scenarios here were written for the two-call registration and say so; `register`'s default
            # (auto: one call unless another mutator matches CSINodes, and every other guard a test registers
            # on this cluster is one) is tested in test_one_call.py and test_install.py.
            extra = ("--validation", "webhook", *extra)
        proc = self.csinode_guard(
            "register", "--url", self.url, "--cert-dir", str(self.cert_dir), "--name", self.name, *extra
        )
        self.registered = True
        chosen = re.search(r"^validation (\w+):", proc.stdout, re.MULTILINE)
        want = {"mutate"} if chosen and chosen.group(1) == "cel" else {"mutate", "validate"}
        if wait:
            wait_until(lambda: self.probe() == want, timeout=30, what=f"{self.name} called")
        return proc

    def unregister(self, check: bool = True, wait: bool = True) -> subprocess.CompletedProcess[str]:
        """``csinode-guard unregister --name <name>`` as admin; with ``wait`` (and the guard running), return
        once a write no longer reaches it."""
        proc = self.csinode_guard("unregister", "--name", self.name, check=check)
        self.registered = False
        if not wait:
            return proc
        if self.process is not None and self.process.poll() is None and not self.paused:
            wait_until(lambda: self.probe() == set(), timeout=30, what=f"{self.name} no longer called")
        else:  # down: the configuration's failurePolicy Fail refuses the probe until the apiserver drops it
            wait_until(lambda: self.control_plane.probe_write().returncode == 0, timeout=30,
                       what=f"{self.name} no longer called")
        return proc
        return proc

    def probe(self) -> set[str] | None:
        """The endpoints of this guard one :meth:`ControlPlane.probe_write` reached (``{"mutate", "validate"}``
        when registered and effective, empty when not); None when the write failed (e.g. guard unreachable
        under failurePolicy Fail)."""

        def probes() -> list[dict[str, Any]]:
            return [r for r in self.decisions() if r.get("node") == ControlPlane.PROBE_NODE]

        before = len(probes())
        if self.control_plane.probe_write().returncode != 0:
            return None
        return {str(r.get("endpoint")) for r in probes()[before:]}

    def close(self) -> None:
        """Unregister (whatever state the test left) and stop."""
        if self.paused:
            self.resume()
        try:
            if self.registered or self.webhook_configurations_exist():
                self.unregister(check=False)
        finally:
            self.stop(wait=False)

    def webhook_configurations_exist(self) -> bool:
        """Whether either configuration named :attr:`name` is stored."""
        for kind in ("mutatingwebhookconfiguration", "validatingwebhookconfiguration"):
            if self.control_plane.kubectl("get", kind, self.name, check=False).returncode == 0:
                return True
        return False


def judged_dry_run(cp: ControlPlane, guard: Guard, node: str, driver: str, count: int) -> dict[str, Any]:
    """The guard's mutate record of a server-side dry-run PUT of ``count`` by the node's own identity."""
    before = len(guard.decisions())
    cp.replace_count(node, driver, count, dry_run=True, check=False)
    records = [r for r in guard.decisions()[before:] if r.get("node") == node and r["endpoint"] == "mutate"]
    assert records and records[-1]["dryRun"] is True
    return records[-1]


def _reap(process: subprocess.Popen[bytes], pgid: int) -> None:
    """Wait for a SIGTERMed guard to exit; SIGKILL its process group after 20 s."""
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        process.wait(timeout=10)


@contextlib.contextmanager
def running_guard(
    control_plane: ControlPlane, work: Path, policy: Path | None = None, *, register: bool = True,
    name: str | None = None, extra_args: tuple[str, ...] = (), extra_env: dict[str, str] | None = None,
    workers: int = 2,
) -> Iterator[Guard]:
    """A started (and by default registered) :class:`Guard`; unregistered and stopped on exit."""
    work.mkdir(parents=True, exist_ok=True)
    guard = Guard(
        control_plane, work, policy or DEFAULT_POLICY, name or unique("csinode-guard"),
        extra_args=extra_args, extra_env=extra_env or {}, workers=workers,
    )
    try:
        guard.start()
        if register:
            guard.register()
        yield guard
    finally:
        guard.close()
