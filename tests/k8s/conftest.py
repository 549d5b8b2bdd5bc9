"""Fixtures of the real-cluster suite: one control plane per test process, guards registered on it.

- ``control_plane`` (session scope, so one cluster per pytest-xdist worker): a real etcd + kube-apiserver +
  kube-scheduler of ``cluster.sh`` (see :mod:`tests.k8s.controlplane` for binary discovery). Every test in
  ``tests/k8s`` uses it (autouse): when no binaries are found, all of them are skipped with one line; with
  ``CSINODE_GUARD_REQUIRE_K8S=1`` that is an error instead.
- ``guard`` (function scope): a real ``csinode-guard serve --kubeconfig <admin>`` on the bundled default policy,
  registered with ``csinode-guard register --url``; unregistered and stopped after the test.
- ``guard_factory`` (function scope): ``guard_factory(policy=path, register=True, extra_args=(), ...)`` for
  tests that need their own policy, several guards, or one not registered yet; all are cleaned up.
- ``full_facts_cluster`` (function scope): a control plane of the test's own whose apiserver logs with
  ``docs/apiserver-audit-policy.yaml`` (Nodes, VolumeAttachments, CSIDrivers with their objects), for replay tests.
- ``prometheus`` (session scope): a real Prometheus with the monitoring overlay's rules (:mod:`tests.k8s.prometheus`).

kubelet's CSINode writes are made with ``kubelet-csinode`` (kubelet's own ``nodeinfomanager`` code in a harness)
wherever a test needs a write at a moment, with a count, or from a node a real driver cannot be made to give (a
registration racing a repair, a count of 39 then 20, an install over a registered entry); what
the kubelet itself decides (its plugin watcher, its periodic refresh, a DaemonSet rollout) is tested on a real
kubelet in ``tests/k8s/realnode``, whose tests say why.

Tests share their worker's cluster: each uses its own node names (:func:`tests.k8s.controlplane.unique`) and
leaves no webhook configuration behind (the guard fixtures remove theirs even when the test fails).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.k8s.controlplane import (
    REPO,
    REQUIRE_ENV,
    ControlPlane,
    ControlPlaneUnavailable,
    Guard,
    discover,
    kubectl_binary,
    running_guard,
)
from tests.k8s.prometheus import Prometheus, prometheus_binary

UNAVAILABLE = "real Kubernetes control plane unavailable"
GUARD_NAMESPACE = "csinode-guard"  # serve's default --lease-namespace
AUDIT_POLICY = REPO / "docs" / "apiserver-audit-policy.yaml"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[pytest.TestReport]:
    """Report the skip of a missing control plane at this file, not at each test: ``-rs`` then folds all of
    them into one line."""
    report: pytest.TestReport = yield
    longrepr = report.longrepr
    if report.skipped and isinstance(longrepr, tuple) and str(longrepr[2]).startswith(f"Skipped: {UNAVAILABLE}"):
        report.longrepr = (__file__, 1, longrepr[2])
    return report


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """A running cluster for this test process; stopped at the end of the session."""
    try:
        cluster_sh, start_env = discover()
        kubectl_binary()
    except ControlPlaneUnavailable as exc:
        message = f"{UNAVAILABLE}: {exc}"
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{message} ({REQUIRE_ENV}=1)", pytrace=False)
        pytest.skip(message)
    cluster = ControlPlane(tmp_path_factory.mktemp("k8s") / "cluster", cluster_sh, start_env)
    cluster.start()
    try:
        # The guard's own namespace exists wherever it is installed: its audit Lease, history records and Events
        # live there. Present from the start, so that no test's outcome depends on whether an earlier test in
        # this worker created it (the audit leader writes history records only where it can).
        cluster.kubectl("create", "namespace", GUARD_NAMESPACE)
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(autouse=True)
def _needs_control_plane(control_plane: ControlPlane) -> None:
    """Every test here needs the cluster: skip (or fail) them all on one reason."""


@pytest.fixture
def guard_factory(control_plane: ControlPlane, tmp_path: Path) -> Iterator[Any]:
    """``guard_factory(policy=None, register=True, name=None, extra_args=(), extra_env=None, workers=2)``
    starts a :class:`Guard` (and registers it); every guard is unregistered and stopped after the test."""
    with contextlib.ExitStack() as stack:
        made: list[Guard] = []

        def factory(policy: Path | None = None, **kwargs: Any) -> Guard:
            work = tmp_path / f"guard{len(made)}"
            guard = stack.enter_context(running_guard(control_plane, work, policy, **kwargs))
            made.append(guard)
            return guard

        yield factory


@pytest.fixture
def guard(guard_factory: Any) -> Guard:
    """The guard on the bundled default policy, registered (both webhook configurations)."""
    result: Guard = guard_factory()
    return result


@pytest.fixture
def full_facts_cluster() -> Iterator[ControlPlane]:
    """A control plane of its own whose apiserver logs with docs/apiserver-audit-policy.yaml (Nodes,
    VolumeAttachments and CSIDrivers with their objects: what ``replay`` needs to decide as the guard does),
    without kube-scheduler; stopped after the test. The session's ``control_plane`` logs them at Metadata level."""
    try:
        cluster_sh, start_env = discover()
    except ControlPlaneUnavailable as exc:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"no control plane: {exc} ({REQUIRE_ENV}=1)")
        pytest.skip(f"no control plane: {exc}")
    directory = Path(tempfile.mkdtemp(dir="/tmp", prefix="gp-"))
    plane = ControlPlane(
        directory / "k8s",
        cluster_sh,
        {
            **start_env,
            "K8S_SCHEDULER": "0",
            "KAS_EXTRA_ARGS": f"--audit-policy-file={AUDIT_POLICY}",
        },
    )
    plane.start()
    try:
        yield plane
    finally:
        plane.stop()
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="session")
def prometheus(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    """A real Prometheus (Debian's binary) for this test process, the monitoring overlay's rules loaded, 1 s
    scrape and evaluation intervals; tests add guards with :meth:`Prometheus.scrape`. Missing binary: skipped,
    or an error with ``CSINODE_GUARD_REQUIRE_TOOLS=1``."""
    try:
        binary = prometheus_binary()
    except ControlPlaneUnavailable as exc:
        if os.environ.get("CSINODE_GUARD_REQUIRE_TOOLS") == "1":
            pytest.fail(f"{exc} (CSINODE_GUARD_REQUIRE_TOOLS=1)", pytrace=False)
        pytest.skip(str(exc))
    server = Prometheus(tmp_path_factory.mktemp("prometheus"), binary)
    server.start()
    try:
        yield server
    finally:
        server.stop()
