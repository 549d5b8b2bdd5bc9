"""Running the CLI as a subprocess, as an operator would: ``python -m webhook ARGS``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_cli(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m webhook ARGS`` without the caller's KUBECONFIG, in-cluster or CSINODE_GUARD_* settings."""
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("CSINODE_GUARD_") and k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST")
    }
    clean["PYTHONPATH"] = os.pathsep.join([str(REPO), clean.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    clean.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "webhook", *args],
        cwd=cwd,
        env=clean,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
