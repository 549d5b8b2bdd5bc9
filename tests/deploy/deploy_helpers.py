"""Helpers shared by the deploy/ checks (imported by conftest.py and the test modules)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
OVERLAYS = ("default", "cert-manager", "monitoring", "vap")
KUSTOMIZATIONS = ("base", *(f"overlays/{name}" for name in OVERLAYS))
TOOLS_DIR = Path(os.environ.get("CSINODE_GUARD_TOOLS_DIR", "~/.cache/csinode-guard/tools/bin")).expanduser()
KUBERNETES_VERSIONS = ("1.34", "1.35", "1.36")
"""The Kubernetes minors whose OpenAPI schemas every rendered object must validate against."""

Objects = list[dict[str, Any]]


def find_tool(name: str, env_var: str) -> str | None:
    """Path of an external tool: ``$ENV_VAR``, then ``PATH``, then ``TOOLS_DIR``; None when nowhere."""
    explicit = os.environ.get(env_var)
    if explicit:
        return explicit
    on_path = shutil.which(name)
    if on_path:
        return on_path
    cached = TOOLS_DIR / name
    return str(cached) if cached.is_file() and os.access(cached, os.X_OK) else None


def require_tool(name: str, env_var: str, works: list[str]) -> str:
    """The tool's path when ``tool WORKS...`` succeeds; otherwise skip, or fail when tools are required."""
    path = find_tool(name, env_var)
    problem = f"{name} not found (set ${env_var}, or run: ci/deploy-checks.sh install)"
    if path is not None:
        result = subprocess.run([path, *works], capture_output=True, text=True, timeout=60, check=False)
        if result.returncode == 0:
            return path
        problem = f"{path} {' '.join(works)} failed: {result.stderr.strip()[:300]}"
    if os.environ.get("CSINODE_GUARD_REQUIRE_TOOLS") == "1":
        pytest.fail(problem)
    pytest.skip(problem)


def kustomize(kubectl: str, directory: Path) -> Objects:
    """``kubectl kustomize DIRECTORY`` parsed into objects; fails the test with kustomize's message."""
    result = subprocess.run(
        [kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=120, check=False
    )
    if result.returncode != 0:
        pytest.fail(f"kubectl kustomize {directory} failed:\n{result.stderr}")
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc is not None]


def find(objects: Objects, kind: str, name: str | None = None) -> dict[str, Any]:
    """The one object of ``kind`` (and ``name``) in ``objects``."""
    matches = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(matches) == 1, f"expected one {kind} {name or '(any name)'}, found {len(matches)}"
    return matches[0]


def load_yaml_documents(path: Path) -> Objects:
    """The non-empty YAML documents of ``path``."""
    return [doc for doc in yaml.safe_load_all(path.read_text("utf-8")) if doc is not None]
