"""The documented installs work on a real apiserver (../shared/k8s): the one-step ``kubectl apply -k deploy/``
of a fresh checkout, and the two-step order that refuses no write on the way in.

Webhook configurations with ``failurePolicy: Fail`` that exist before a replica is ready make the apiserver
refuse every count increase (no endpoint answers). No kubelet runs pods here, so ``rollout status`` is the one
command not run; the check is that the configurations come only after it. (What a replica does at start, the
Secrets and the caBundle, is tests/k8s/test_install.py.)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from deploy_helpers import DEPLOY, REPO, kustomize

from tests.k8s.controlplane import REQUIRE_ENV, ControlPlane, ControlPlaneUnavailable, discover

RUNBOOK = REPO / "docs" / "operations.md"
WEBHOOK_LABEL = "app.kubernetes.io/component=admission-webhooks"


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[dict[str, str]]:
    """A cluster of its own (the install creates webhook configurations that nothing answers): kube-apiserver
    without kubelet or controller manager, found as tests/k8s finds it; its DIR/env as a dict."""
    try:
        cluster_sh, start_env = discover()
    except ControlPlaneUnavailable as exc:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"no control plane: {exc} ({REQUIRE_ENV}=1)")
        pytest.skip(f"no control plane: {exc}")
    plane = ControlPlane(tmp_path / "k8s", cluster_sh, {**start_env, "K8S_SCHEDULER": "0"})
    plane.start()
    try:
        yield plane.env
    finally:
        plane.stop()


def _install_commands(heading: str) -> list[str]:
    """The shell commands of the first ``sh`` block under ``heading``, continuation lines joined."""
    text = RUNBOOK.read_text("utf-8")
    section = text[text.index(heading):]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block is not None, f"no sh block under {heading}"
    joined = block.group(1).replace("\\\n", " ")
    return [" ".join(line.split()) for line in joined.splitlines() if line.strip()]


def _kubectl_json(kubectl: str, env: dict[str, str], *args: str) -> dict[str, object]:
    out = subprocess.run([kubectl, *args, "-o", "json"], capture_output=True, text=True, env=env, timeout=60,
                         check=True)
    document: dict[str, object] = json.loads(out.stdout)
    return document


def test_only_the_webhook_configurations_carry_the_label_the_install_selects_on(
    kubectl: str, deploy_copy: Path
) -> None:
    for overlay in ("overlays/default", "overlays/cert-manager", "."):
        objects = kustomize(kubectl, deploy_copy / overlay)
        labelled = sorted(
            o["kind"] for o in objects
            if (o["metadata"].get("labels") or {}).get("app.kubernetes.io/component") == "admission-webhooks"
        )
        # the two CSINode configurations and the Node entry's (csinode-guard-nodes)
        assert labelled == ["MutatingWebhookConfiguration", "MutatingWebhookConfiguration",
                            "ValidatingWebhookConfiguration"], overlay


def test_deploy_is_the_default_overlay(kubectl: str, deploy_copy: Path) -> None:
    assert kustomize(kubectl, deploy_copy) == kustomize(kubectl, deploy_copy / "overlays" / "default")


def test_the_two_step_install_creates_the_webhooks_only_after_the_rollout(
    kubectl: str, cluster: dict[str, str], tmp_path: Path
) -> None:
    work = tmp_path / "checkout"
    work.mkdir()
    shutil.copytree(DEPLOY, work / "deploy", ignore=shutil.ignore_patterns("*.crt", "*.key"))
    env = {**os.environ, "KUBECONFIG": cluster["KUBECONFIG"]}
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "csinode-guard").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m webhook "$@"\n')
    (bindir / "csinode-guard").chmod(0o755)
    (bindir / "kubectl").symlink_to(kubectl)
    env["PATH"] = f"{bindir}{os.pathsep}{env['PATH']}"
    env["PYTHONPATH"] = str(REPO)

    commands = _install_commands("To have nothing refused on the way in")
    assert any("rollout status" in c for c in commands)
    rolled_out = False
    for command in commands:
        if "rollout status" in command:
            rolled_out = True  # no kubelet runs the pods here: the step's place in the order is what is checked
            continue
        result = subprocess.run(["bash", "-c", command], cwd=work, env=env, capture_output=True, text=True,
                                timeout=180, check=False)
        assert result.returncode == 0, f"{command}\n{result.stderr[-2000:]}"
        webhooks = [
            kind for kind in ("mutatingwebhookconfigurations", "validatingwebhookconfigurations")
            if _kubectl_json(kubectl, env, "get", kind, "-l", WEBHOOK_LABEL)["items"]
        ]
        if webhooks:
            assert rolled_out, f"{webhooks} exist before the rollout finished, after: {command}"
    deployment = _kubectl_json(kubectl, env, "-n", "csinode-guard", "get", "deployment", "csinode-guard")
    assert deployment["kind"] == "Deployment"
    for kind in ("mutatingwebhookconfiguration", "validatingwebhookconfiguration"):
        assert _kubectl_json(kubectl, env, "get", kind, "csinode-guard")["kind"]


def test_the_one_step_install_of_a_fresh_checkout_is_accepted(kubectl: str, cluster: dict[str, str],
                                                               tmp_path: Path) -> None:
    """The runbook's first command on a checkout with nothing generated: every object is created."""
    work = tmp_path / "checkout"
    work.mkdir()
    shutil.copytree(DEPLOY, work / "deploy", ignore=shutil.ignore_patterns("*.crt", "*.key", "certs"))
    env = {**os.environ, "KUBECONFIG": cluster["KUBECONFIG"]}
    commands = _install_commands("### With the guard's own certificates")
    assert commands[0] == "kubectl apply -k deploy/"
    result = subprocess.run([kubectl, "apply", "-k", "deploy/"], cwd=work, env=env, capture_output=True,
                            text=True, timeout=180, check=False)
    assert result.returncode == 0, result.stderr
    for kind, name in (("deployment", "csinode-guard"), ("role", "csinode-guard-secrets"),
                       ("mutatingwebhookconfiguration", "csinode-guard"),
                       ("validatingwebhookconfiguration", "csinode-guard")):
        assert _kubectl_json(kubectl, env, "-n", "csinode-guard", "get", kind, name)["kind"]


def test_a_replica_serves_only_with_the_state_key_from_its_secret(kubectl: str, deploy_copy: Path) -> None:
    """The server is given the state key file it copies from the Secret it names (without that file ``serve``
    exits 2: tests/test_state_key_operations.py)."""
    objects = kustomize(kubectl, deploy_copy)
    [deployment] = [o for o in objects if o["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    [container] = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["CSINODE_GUARD_STATE_KEY_SECRET"] == "csinode-guard-state-key"
    [mount] = [m for m in container["volumeMounts"] if m["name"] == "state-key"]
    args = container["args"]
    assert args[args.index("--state-key-file") + 1] == f"{mount['mountPath']}/key"
