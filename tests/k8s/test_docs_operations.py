"""docs/operations.md, *Running the guard outside the cluster*, runs as written: its commands are read from the
page's first ``sh`` block of that section and run one by one against a real control plane, with only the
addresses a reader would change replaced (the guard's IP 10.0.0.5 by 127.0.0.1, port 8443 by a free one, the
kubeconfig path by the cluster's). The apiserver then calls the guard; the section's second block (unregister,
then the in-cluster installation) leaves configurations ``kubectl apply`` of deploy/ accepts, where applying
over the ``register --url`` ones is refused ("exactly one of url or service")."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import ssl
import subprocess
import sys
import urllib.request
from pathlib import Path

import yaml

from tests.k8s.controlplane import REPO, ControlPlane, kubectl_binary, wait_until
from tests.ports import free_port

DOC = REPO / "docs" / "operations.md"
SECTION = "## Running the guard outside the cluster"


def section_blocks() -> list[list[str]]:
    """The commands of each ``sh`` block of the section: comments dropped, continuation lines joined."""
    text = DOC.read_text("utf-8")
    start = text.index(SECTION)
    end = text.index("\n## ", start + len(SECTION))
    blocks = re.findall(r"```sh\n(.*?)```", text[start:end], flags=re.DOTALL)
    out = []
    for block in blocks:
        joined = block.replace("\\\n", " ")
        commands = []
        for line in joined.splitlines():
            command = line.split(" #", 1)[0].strip()
            if command and not command.startswith("#"):
                commands.append(command)
        out.append(commands)
    return out


def _readyz(port: int, ca: Path) -> bool:
    context = ssl.create_default_context(cafile=str(ca))
    with contextlib.suppress(OSError), urllib.request.urlopen(f"https://127.0.0.1:{port}/readyz", context=context,
                                                              timeout=2) as answer:
        return bool(answer.status == 200)
    return False


def test_the_out_of_cluster_recipe_runs_as_written(control_plane: ControlPlane, tmp_path: Path) -> None:
    first, upgrade = section_blocks()
    assert [c.split()[:3] for c in first] == [["csinode-guard", "certs", "generate"], ["csinode-guard", "serve",
                                              "--cert-dir"], ["csinode-guard", "register", "--url"]]
    assert upgrade == ["csinode-guard unregister", "kubectl apply -k deploy/"]
    port = free_port()
    bin_dir = Path(sys.executable).parent  # csinode-guard, the console script of this checkout
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("CSINODE_GUARD_") and k != "PROMETHEUS_MULTIPROC_DIR"}
    env.update(PATH=f"{bin_dir}:{Path(kubectl_binary()).parent}:{env.get('PATH', '')}",
               KUBECONFIG=str(control_plane.kubeconfig), CSINODE_GUARD_METRICS_PORT=str(free_port()))

    def adapt(command: str) -> list[str]:
        command = command.replace("10.0.0.5", "127.0.0.1").replace("8443", str(port))
        command = command.replace("~/.kube/guard.kubeconfig", str(control_plane.kubeconfig))
        return shlex.split(command.rstrip("&").strip())

    serve: subprocess.Popen[bytes] | None = None
    log = tmp_path / "serve.log"
    try:
        for command in first:
            args = adapt(command)
            if command.endswith("&"):
                assert args[:2] == ["csinode-guard", "serve"]
                with log.open("wb") as out:
                    serve = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=out, stderr=out,
                                             start_new_session=True)
                wait_until(lambda process=serve: process.poll() is None
                           and _readyz(port, tmp_path / "certs" / "ca.crt"),
                           timeout=90, what=f"the documented serve ready ({log})")
                continue
            done = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
                                  check=False)
            assert done.returncode == 0, (command, done.stdout, done.stderr)
        assert (tmp_path / "certs" / "state.key").exists(), "certs generate made the state key serve reads"
        assert f"cluster: {control_plane.kas_url}" in log.read_text(), "serve says which cluster it joined"
        # The apiserver calls the documented guard: a write of the probe CSINode reaches /mutate (stdout log).
        wait_until(lambda: control_plane.probe_write().returncode == 0 and '"endpoint":"mutate"' in
                   log.read_text().replace(" ", ""), timeout=30, what="the apiserver calls the guard")

        webhooks = [d for d in yaml.safe_load_all(control_plane.kubectl("kustomize", str(REPO / "deploy")).stdout)
                    if d and d["kind"].endswith("WebhookConfiguration")]
        manifest = json.dumps({"apiVersion": "v1", "kind": "List", "items": webhooks})
        refused = control_plane.kubectl("apply", "--dry-run=server", "-f", "-", input=manifest, check=False)
        assert refused.returncode != 0 and "exactly one of url or service" in refused.stderr, refused.stderr
        unregister = subprocess.run(adapt(upgrade[0]), cwd=tmp_path, env=env, capture_output=True, text=True,
                                    timeout=120, check=False)
        assert unregister.returncode == 0, unregister.stderr
        applied = control_plane.kubectl("apply", "--dry-run=server", "-f", "-", input=manifest, check=False)
        assert applied.returncode == 0, applied.stderr  # the documented kubectl apply -k deploy/ then succeeds
    finally:
        if serve is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(serve.pid, signal.SIGTERM)
            serve.wait(30)
        subprocess.run([sys.executable, "-m", "webhook", "unregister"], env=env, capture_output=True, timeout=60,
                       check=False)
