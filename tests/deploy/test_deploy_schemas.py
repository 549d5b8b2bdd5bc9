"""Every rendered object validates against the Kubernetes OpenAPI schemas of 1.34, 1.35 and 1.36.

kubernetes-validate ships the JSON schemas of the built-in API (strict mode: unknown fields are errors). It has no
schema for custom resources, so ServiceMonitor and PrometheusRule (Prometheus Operator) and Certificate and Issuer
(cert-manager) are skipped here; test_deploy_render.py checks their fields the guard depends on, and
test_deploy_alerts.py runs the PrometheusRule's rules through promtool.
"""

from __future__ import annotations

from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
from deploy_helpers import KUBERNETES_VERSIONS, KUSTOMIZATIONS, Objects

CUSTOM_RESOURCES = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
    ("cert-manager.io/v1", "Certificate"),
    ("cert-manager.io/v1", "Issuer"),
}


def _validate(obj: dict[str, Any], version: str) -> str | None:
    try:
        kubernetes_validate.validate(obj, f"{version}.0", strict=True)
    except kubernetes_validate.ValidationError as exc:
        path = "/".join(str(p) for p in exc.absolute_path)
        return f"{obj['kind']} {obj['metadata']['name']}: {path}: {exc.message}"
    return None


def test_the_schemas_of_every_targeted_version_are_shipped() -> None:
    for version in KUBERNETES_VERSIONS:
        assert kubernetes_validate.validate({"apiVersion": "v1", "kind": "Namespace"}, f"{version}.0", strict=True)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_rendered_objects_validate_strictly(rendered: dict[str, Objects], kustomization: str, version: str) -> None:
    errors = []
    for obj in rendered[kustomization]:
        if (obj["apiVersion"], obj["kind"]) in CUSTOM_RESOURCES:
            continue
        error = _validate(obj, version)
        if error:
            errors.append(error)
    assert not errors, "\n".join(errors)


def test_only_the_known_custom_resources_go_unvalidated(rendered: dict[str, Objects]) -> None:
    unknown = set()
    for objects in rendered.values():
        for obj in objects:
            try:
                kubernetes_validate.validate(obj, f"{KUBERNETES_VERSIONS[-1]}.0", strict=True)
            except kubernetes_validate.SchemaNotFoundError:
                unknown.add((obj["apiVersion"], obj["kind"]))
            except kubernetes_validate.ValidationError:
                pass
    assert unknown == CUSTOM_RESOURCES


def test_the_validator_catches_an_unknown_field() -> None:
    broken = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": "x"},
        "webhooks": [
            {
                "name": "x.example.com",
                "clientConfig": {"url": "https://x.example.com"},
                "sideEffects": "None",
                "admissionReviewVersions": ["v1"],
                "matchCondition": [],
            }
        ],
    }
    assert _validate(broken, KUBERNETES_VERSIONS[0]) is not None
