"""The real-cluster suite finds its binaries as envtest does, and says in one line when it cannot (a skip, or
an error under CSINODE_GUARD_REQUIRE_K8S=1). Runs pytest on tests/k8s as a subprocess; no cluster starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO


def run_k8s_suite(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "CSINODE_GUARD_REQUIRE_K8S"))}
    full.update(env)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-rs",
         "--basetemp", str(tmp_path / "base"), "tests/k8s"],
        cwd=REPO, env=full, capture_output=True, text=True, timeout=300, check=False,
    )


@pytest.mark.parametrize("assets", ["missing", "incomplete"])
def test_without_binaries_the_suite_is_skipped_with_one_line(tmp_path: Path, assets: str) -> None:
    assets_dir = tmp_path / "assets"
    if assets == "incomplete":
        assets_dir.mkdir()
        (assets_dir / "etcd").write_text("#!/bin/sh\n")
        (assets_dir / "etcd").chmod(0o755)
    result = run_k8s_suite(tmp_path, KUBEBUILDER_ASSETS=str(assets_dir))
    assert result.returncode == 0, result.stdout + result.stderr
    skipped = [line for line in result.stdout.splitlines() if line.startswith("SKIPPED")]
    assert len(skipped) == 1, result.stdout
    assert "real Kubernetes control plane unavailable" in skipped[0]
    assert f"KUBEBUILDER_ASSETS={assets_dir} lacks" in skipped[0]
    assert "kube-apiserver" in skipped[0]
    assert " passed" not in result.stdout and " error" not in result.stdout


def test_required_and_missing_is_an_error(tmp_path: Path) -> None:
    result = run_k8s_suite(tmp_path, KUBEBUILDER_ASSETS=str(tmp_path / "nowhere"), CSINODE_GUARD_REQUIRE_K8S="1")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "error" in result.stdout.splitlines()[-1]
    assert "skipped" not in result.stdout.splitlines()[-1]
    assert "CSINODE_GUARD_REQUIRE_K8S=1" in result.stdout
