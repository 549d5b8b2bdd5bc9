"""Every object of every kustomization in deploy/ (the root one included) is accepted by the real apiserver
(``--dry-run=server``).

This runs the apiserver's own validation and defaulting, and compiles the webhooks' CEL ``matchConditions`` in
its own CEL environment. Kinds from CRDs this control plane does not have (cert-manager's ``Certificate`` and
``Issuer``, the Prometheus operator's ``ServiceMonitor`` and ``PrometheusRule``) cannot be checked here: the test
asserts they are exactly those, and that the apiserver indeed does not serve them (tests/deploy validates them
against their schemas). The namespace ``csinode-guard`` is created for real first, since a dry-run Namespace
does not exist for the dry-run objects inside it.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.k8s.controlplane import REPO, ControlPlane, kubectl_binary

KUSTOMIZATIONS = (".", "base", "overlays/default", "overlays/cert-manager", "overlays/monitoring")
CRD_KINDS = {
    "cert-manager.io/v1": {"Certificate", "Issuer"},
    "monitoring.coreos.com/v1": {"ServiceMonitor", "PrometheusRule"},
}


@pytest.fixture(scope="module")
def deploy_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """deploy/ as a fresh clone has it (no certificate to make first)."""
    root = tmp_path_factory.mktemp("deploy") / "deploy"
    shutil.copytree(REPO / "deploy", root, ignore=shutil.ignore_patterns("*.crt", "*.key", "certs"))
    return root


def render(cp: ControlPlane, directory: Path) -> list[dict[str, Any]]:
    out = cp.kubectl("kustomize", str(directory)).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def needs_crd(obj: dict[str, Any]) -> bool:
    return obj["kind"] in CRD_KINDS.get(obj["apiVersion"], set())


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_every_object_is_accepted_by_the_real_apiserver(
    control_plane: ControlPlane, deploy_copy: Path, kustomization: str
) -> None:
    assert kubectl_binary()
    cp = control_plane
    objects = render(cp, deploy_copy / kustomization)
    cp.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "Namespace",
                                                      "metadata": {"name": "csinode-guard"}}))
    checked = [o for o in objects if not needs_crd(o)]
    skipped = {f"{o['apiVersion']}/{o['kind']}" for o in objects if needs_crd(o)}
    if kustomization == "overlays/monitoring":  # the Prometheus operator's objects and the Grafana dashboard
        assert [(o["kind"], o["metadata"]["labels"].get("grafana_dashboard")) for o in checked] == [("ConfigMap", "1")]
    else:
        assert {o["kind"] for o in checked} >= {"Deployment", "Service", "ServiceAccount", "ClusterRole",
                                                "MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"}
    result = cp.kubectl("apply", "--dry-run=server", "-f", "-",
                        input=json.dumps({"apiVersion": "v1", "kind": "List", "items": checked}))
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert len(lines) == len(checked), result.stdout
    assert all(line.endswith("(server dry run)") for line in lines), result.stdout
    print(f"{kustomization}: {len(checked)} objects accepted by the apiserver's dry run")

    _assert_not_served(cp, skipped)


def _assert_not_served(cp: ControlPlane, kinds: set[str]) -> None:
    """The apiserver really does not serve these CRD kinds: nothing to check them against here."""
    if kinds:
        print(f"not served here (CRDs): {sorted(kinds)}")
        served = cp.kubectl("api-resources", "-o", "name").stdout.split()
        assert not any(name.endswith((".cert-manager.io", ".monitoring.coreos.com")) for name in served)


def test_a_broken_match_condition_is_refused_by_the_apiserver(
    control_plane: ControlPlane, deploy_copy: Path
) -> None:
    """The dry run does compile the CEL: the same configuration with one expression broken is refused."""
    objects = render(control_plane, deploy_copy / "overlays" / "default")
    webhook = copy.deepcopy(next(o for o in objects if o["kind"] == "ValidatingWebhookConfiguration"))
    webhook["webhooks"][0]["matchConditions"][1]["expression"] = "object.spec.drivers.exists(d, d.name ==)"
    result = control_plane.kubectl("apply", "--dry-run=server", "-f", "-", check=False, input=json.dumps(webhook))
    assert result.returncode != 0
    assert "compilation failed" in result.stderr or "matchConditions" in result.stderr, result.stderr
