"""Fixtures of the real-node scenarios.

- ``real_cluster`` (session scope: one per pytest-xdist worker that runs a test of this folder, started by the
  first one): a control plane with kube-controller-manager in a short ``/tmp`` directory
  (:class:`tests.k8s.realnode.cluster.RealCluster`); stopped at the end of the session, and then checked: no
  process and no mount may be left that names its directory.
- ``control_plane`` is overridden here to be that cluster's control plane, so the parent folder's ``guard`` and
  ``guard_factory`` register their guards on it, and the parent's autouse check skips (or, with
  ``CSINODE_GUARD_REQUIRE_K8S=1``, fails) these tests on one reason. A worker that runs only these tests starts no
  second control plane.
- ``real_node`` (function scope): a fresh real node (``node.sh start``) for the test, under a name of its own;
  its DaemonSet deleted, the node stopped and checked for leftovers, and its Node deleted after the test.

Missing requirements (root, containerd, runc, ctr, the CNI loopback plugin): skipped, or an error with
``CSINODE_GUARD_REQUIRE_K8S=1`` (CI), as for the control plane.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.k8s.conftest import UNAVAILABLE
from tests.k8s.controlplane import REQUIRE_ENV, ControlPlane, ControlPlaneUnavailable, discover, kubectl_binary, unique
from tests.k8s.realnode.cluster import RealCluster, RealNode, require_real_node


@pytest.fixture(scope="session")
def real_cluster() -> Iterator[RealCluster]:
    """A control plane with kube-controller-manager for this test process, for real nodes."""
    try:
        cluster_sh, start_env = discover()
        kubectl_binary()
        require_real_node(cluster_sh, start_env)
    except ControlPlaneUnavailable as exc:
        message = f"{UNAVAILABLE}: {exc}"
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{message} ({REQUIRE_ENV}=1)", pytrace=False)
        pytest.skip(message)
    with RealCluster.running(cluster_sh, start_env) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def control_plane(real_cluster: RealCluster) -> ControlPlane:
    """The real cluster's control plane: ``guard``/``guard_factory`` register on it."""
    return real_cluster.control_plane


@pytest.fixture
def real_node(real_cluster: RealCluster) -> Iterator[RealNode]:
    """A real node of its own for the test, Ready; stopped (and checked) after it."""
    node = real_cluster.start_node(unique("rn"))
    print(f"\n[real node] {node.name} Ready in {node.started_in:.1f}s")
    try:
        yield node
    finally:
        node.stop()
