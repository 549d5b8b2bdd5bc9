"""The commands that talk to the cluster share ``--kubeconfig``/``--context`` and how a cluster that cannot be
reached from them is reported (webhook/commands/options.py): as subprocesses, the message and exit code of each
for a kubeconfig the kubernetes client refuses, for no cluster at all, and for ``--context`` inside a cluster
without a kubeconfig."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.clirun import run_cli
from webhook.serving import dev_certs

BROKEN_KUBECONFIG = "apiVersion: v1\nkind: Config\nclusters: []\ncontexts: []\nusers: []\n"
"""A kubeconfig that parses but has no current-context: the client's ConfigException."""

COMMANDS = [
    pytest.param(["register", "--cert-dir", "certs"], 3, 2, id="register"),
    pytest.param(["unregister"], 3, 2, id="unregister"),
    pytest.param(["restore", "node-1", "--driver", "ebs.csi.aws.com", "--reason", "r", "--no-verify"], 3, 2,
                 id="restore"),
    pytest.param(["status"], 3, 2, id="status"),
    pytest.param(["preflight"], 3, 2, id="preflight"),
    pytest.param(["uninstall"], 3, 2, id="uninstall"),
]
"""(arguments, exit code for a configuration that cannot be loaded, for --context without a kubeconfig): the
one table of docs/cli.md, the same for every command (3 no cluster, 2 usage)."""


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with ``certs/`` (for register) and the broken kubeconfig ``broken.yaml``."""
    root = tmp_path_factory.mktemp("cluster-options")
    dev_certs.ensure_dev_certs(root / "certs")
    (root / "broken.yaml").write_text(BROKEN_KUBECONFIG)
    return root


@pytest.mark.parametrize(("args", "broken_exit", "usage_exit"), COMMANDS)
def test_a_kubeconfig_the_client_refuses_is_reported_with_its_message(
    workdir: Path, args: list[str], broken_exit: int, usage_exit: int
) -> None:
    path = workdir / "broken.yaml"
    result = run_cli(*args, "--kubeconfig", str(path), cwd=workdir)

    assert result.returncode == broken_exit, result.stderr
    assert (
        f"Error: cannot load the cluster configuration: Invalid kube-config file. Expected key current-context in "
        f"{path}" in result.stderr
    ), result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(("args", "broken_exit", "usage_exit"), COMMANDS)
def test_a_kubeconfig_that_is_not_yaml_is_reported_where_it_breaks(
    workdir: Path, args: list[str], broken_exit: int, usage_exit: int
) -> None:
    path = workdir / "not-yaml.yaml"
    path.write_text("apiVersion: v1\nclusters: [\n  - name: a\n")
    result = run_cli(*args, "--kubeconfig", str(path), cwd=workdir)

    assert result.returncode == broken_exit, result.stderr
    assert "Error: cannot load the cluster configuration: the kubeconfig is not valid YAML: " in result.stderr, (
        result.stderr)
    assert "line " in result.stderr and "column " in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(("args", "broken_exit", "usage_exit"), COMMANDS)
def test_a_context_inside_a_cluster_without_a_kubeconfig_is_a_usage_error(
    workdir: Path, args: list[str], broken_exit: int, usage_exit: int
) -> None:
    result = run_cli(*args, "--context", "other", cwd=workdir, env={"KUBERNETES_SERVICE_HOST": "10.96.0.1"})

    assert result.returncode == usage_exit, result.stderr
    assert "Error: --context needs a kubeconfig (--kubeconfig or KUBECONFIG)" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(("args", "broken_exit", "usage_exit"), COMMANDS)
def test_no_cluster_configured_exits_3_for_every_command(
    workdir: Path, tmp_path: Path, args: list[str], broken_exit: int, usage_exit: int
) -> None:
    home = tmp_path / "home-without-kubeconfig"
    home.mkdir()
    result = run_cli(*args, cwd=workdir, env={"HOME": str(home)})

    assert result.returncode == 3, result.stderr
    assert "no cluster configured: pass --kubeconfig, set KUBECONFIG" in result.stderr, result.stderr
    assert "Usage:" not in result.stderr, "not a usage error: no banner"
