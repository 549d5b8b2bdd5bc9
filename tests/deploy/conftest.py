"""Fixtures for the deploy/ checks: the kustomize renders and the external tools (kubectl, promtool).

External tools are looked up in ``$KUBECTL``/``$PROMTOOL``, then ``PATH``, then ``$CSINODE_GUARD_TOOLS_DIR``
(default ``~/.cache/csinode-guard/tools/bin``, where ``ci/deploy-checks.sh install`` puts them). A missing tool
skips the tests that need it, unless ``CSINODE_GUARD_REQUIRE_TOOLS=1`` (set by ``ci/deploy-checks.sh``) makes it a
failure.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from deploy_helpers import DEPLOY, KUSTOMIZATIONS, Objects, kustomize, require_tool


@pytest.fixture(scope="session")
def kubectl() -> str:
    """kubectl with its built-in kustomize."""
    return require_tool("kubectl", "KUBECTL", ["kustomize", "--help"])


@pytest.fixture(scope="session")
def promtool() -> str:
    """Prometheus' promtool (from Debian's prometheus package)."""
    return require_tool("promtool", "PROMTOOL", ["--version"])


@pytest.fixture(scope="session")
def deploy_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of deploy/ as a fresh clone has it: no certificate or key anywhere (nothing to run first)."""
    root = tmp_path_factory.mktemp("deploy") / "deploy"
    shutil.copytree(DEPLOY, root, ignore=shutil.ignore_patterns("*.crt", "*.key", "certs"))
    return root


@pytest.fixture(scope="session")
def rendered(kubectl: str, deploy_copy: Path) -> dict[str, Objects]:
    """Every kustomization rendered: ``{"base": [...], "overlays/default": [...], ...}``."""
    return {name: kustomize(kubectl, deploy_copy / name) for name in KUSTOMIZATIONS}
