"""``kubectl csinode-guard status|preflight|restore``: the ``kubectl-csinode_guard`` console script found by the
real kubectl on PATH (the venv's bin, where pip installs console scripts), against the real apiserver, with the
cluster chosen only by ``--kubeconfig`` and ``--context`` given after the command (no $KUBECONFIG, no
~/.kube/config)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.k8s.controlplane import ControlPlane, kubectl_binary, unique

EBS = "ebs.csi.aws.com"
PLUGIN = Path(sys.executable).parent / "kubectl-csinode_guard"


def two_context_kubeconfig(cp: ControlPlane, path: Path) -> Path:
    """The admin kubeconfig with a second context, ``unreachable``, made the current one; ``admin`` works."""
    config: dict[str, Any] = yaml.safe_load(cp.kubeconfig.read_text())
    real_context = config["contexts"][0]
    cluster = dict(config["clusters"][0])
    cluster = {"name": "nowhere", "cluster": {**cluster["cluster"], "server": "https://127.0.0.1:9"}}
    config["clusters"].append(cluster)
    config["contexts"] = [
        {"name": "admin", "context": real_context["context"]},
        {"name": "unreachable", "context": {**real_context["context"], "cluster": "nowhere"}},
    ]
    config["current-context"] = "unreachable"
    path.write_text(yaml.safe_dump(config))
    return path


def kubectl_plugin(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``kubectl csinode-guard ARGS`` with only the venv's bin and the system's on PATH, HOME empty."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items()
           if k not in {"KUBECONFIG", "KUBERNETES_SERVICE_HOST"} and not k.startswith("CSINODE_GUARD_")}
    env.update(HOME=str(home), PATH=os.pathsep.join([str(PLUGIN.parent), "/usr/local/bin", "/usr/bin", "/bin"]))
    return subprocess.run([kubectl_binary(), "csinode-guard", *args], env=env, capture_output=True, text=True,
                          timeout=120, check=False)


def test_the_console_script_is_installed_where_kubectl_finds_plugins() -> None:
    assert PLUGIN.is_file() and os.access(PLUGIN, os.X_OK), f"{PLUGIN}: pip install -e . installs it"


def test_kubectl_runs_status_preflight_and_restore_as_a_plugin_on_the_given_context(
    control_plane: ControlPlane, tmp_path: Path
) -> None:
    if not PLUGIN.is_file():
        pytest.fail(f"{PLUGIN} is not installed (pip install -e .)")
    node = unique("plugin")
    control_plane.create_node(node, {"node.kubernetes.io/instance-type": "m5.large"})
    control_plane.kubelet(node, "install", "--driver", EBS, "--node-id", f"i-{node}", "--max-volumes", "25")
    kubeconfig = str(two_context_kubeconfig(control_plane, tmp_path / "two.kubeconfig"))

    listed = kubectl_plugin(tmp_path, "--help")
    assert listed.returncode == 0, listed.stderr
    assert "Usage: kubectl csinode-guard" in listed.stdout
    assert {"status", "preflight", "restore"} <= set(listed.stdout.split())

    status = kubectl_plugin(tmp_path, "status", "--kubeconfig", kubeconfig, "--context", "admin", "-o", "json",
                            "--node", node)
    assert status.returncode == 0, status.stderr
    [row] = json.loads(status.stdout)["entries"]
    assert (row["node"], row["driver"], row["allocatableCount"]) == (node, EBS, 25)
    # The current context is unreachable: without --context the plugin really uses the kubeconfig's choice.
    current = kubectl_plugin(tmp_path, "status", "--kubeconfig", kubeconfig, "--node", node)
    assert current.returncode != 0 and "127.0.0.1:9" in current.stderr + current.stdout

    preflight = kubectl_plugin(tmp_path, "preflight", "--kubeconfig", kubeconfig, "--context", "admin",
                               "-o", "json")
    assert preflight.returncode in (0, 1, 4), preflight.stderr  # pass, warnings or failures (4): it judged the cluster
    report = json.loads(preflight.stdout)
    assert report["checks"], report

    restore = kubectl_plugin(tmp_path, "restore", node, "--driver", EBS, "--reason", "plugin test", "--dry-run=server",
                             "--no-verify", "--kubeconfig", kubeconfig, "--context", "admin")
    assert node in restore.stdout + restore.stderr, restore.stderr
    assert "no cluster configured" not in restore.stderr
