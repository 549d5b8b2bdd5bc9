"""The webhook configurations in deploy/ and the ones webhook.kube.registration builds are the same objects."""

from __future__ import annotations

import base64
import copy
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_helpers import DEPLOY, Objects, find, kustomize, load_yaml_documents

from webhook.kube import registration
from webhook.kube.registration import WebhookTarget

KINDS = ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration")
WEBHOOKS_YAML = DEPLOY / "base" / "webhooks.yaml"


def _configurations(objects: Objects) -> list[dict[str, Any]]:
    return [find(objects, kind, registration.CONFIGURATION_NAME) for kind in KINDS]


def _decoded_ca(configurations: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A copy with every caBundle decoded to bytes (kustomize wraps base64 lines; the apiserver ignores that)."""
    result = copy.deepcopy(configurations)
    for configuration in result:
        for webhook in configuration["webhooks"]:
            config = webhook["clientConfig"]
            if "caBundle" in config:
                config["caBundle"] = base64.b64decode(config["caBundle"])
    return result


def test_the_base_yaml_is_exactly_what_python_builds() -> None:
    assert _configurations(load_yaml_documents(WEBHOOKS_YAML)) == registration.build_webhook_configurations()


def test_the_default_overlay_is_what_python_builds_without_a_ca_bundle(rendered: dict[str, Objects]) -> None:
    """The guard fills in caBundle at start (serve --inject-ca-bundle; tests/k8s/test_install.py)."""
    built = registration.build_webhook_configurations(WebhookTarget(ca_bundle=None))
    assert _configurations(rendered["overlays/default"]) == built


def test_the_cert_manager_overlay_is_what_python_builds_with_the_injector_annotation(
    rendered: dict[str, Objects],
) -> None:
    built = registration.build_webhook_configurations(
        annotations={"cert-manager.io/inject-ca-from": "csinode-guard/csinode-guard-serving"}
    )
    assert _configurations(rendered["overlays/cert-manager"]) == built


@pytest.mark.parametrize("kind", KINDS)
def test_create_update_and_delete_of_csinodes_reach_two_entries_with_complementary_failure_policies(kind: str) -> None:
    webhooks = find(registration.build_webhook_configurations(), kind)["webhooks"]
    assert [w["failurePolicy"] for w in webhooks] == ["Fail", "Ignore"]
    for webhook in webhooks:
        assert webhook["rules"] == [
            {
                "operations": ["CREATE", "UPDATE", "DELETE"],
                "apiGroups": ["storage.k8s.io"],
                "apiVersions": ["v1"],
                "resources": ["csinodes"],
                "scope": "Cluster",
            }
        ]
        assert webhook["sideEffects"] == "None"
        assert webhook["admissionReviewVersions"] == ["v1"]
        assert 1 <= webhook["timeoutSeconds"] <= 5
    fail, ignore = webhooks
    assert [c["name"] for c in fail["matchConditions"]] == [
        "create-update-or-delete-only",
        "raises-a-count-or-trust-or-not-the-nodes-kubelet",
    ]
    assert [c["name"] for c in ignore["matchConditions"]] == [
        "create-update-or-delete-only",
        "the-nodes-own-registration-removal-create-or-decrease",
    ]


def test_the_endpoints_and_reinvocation() -> None:
    mutating, validating = registration.build_webhook_configurations()
    assert [w["name"] for w in mutating["webhooks"]] == [
        "increases-and-other-writers.mutate.csinode-guard.io", "node-registrations.mutate.csinode-guard.io",
    ]
    assert [w["name"] for w in validating["webhooks"]] == [
        "increases-and-other-writers.validate.csinode-guard.io", "node-registrations.validate.csinode-guard.io",
    ]
    for mutate in mutating["webhooks"]:
        assert mutate["clientConfig"]["service"] == {
            "name": "csinode-guard",
            "namespace": "csinode-guard",
            "path": "/mutate",
            "port": 443,
        }
        assert mutate["reinvocationPolicy"] == "IfNeeded"
        assert "caBundle" not in mutate["clientConfig"]
    for validate in validating["webhooks"]:
        assert validate["clientConfig"]["service"]["path"] == "/validate"
        assert "reinvocationPolicy" not in validate, "validating webhooks have no reinvocationPolicy"


def test_a_url_target_replaces_the_service_and_carries_the_bundle() -> None:
    mutating, validating = registration.build_webhook_configurations(
        WebhookTarget(url="https://192.0.2.10:8443/", ca_bundle=b"-----BEGIN CERTIFICATE-----\n")
    )
    for webhook in mutating["webhooks"]:
        assert webhook["clientConfig"] == {
            "url": "https://192.0.2.10:8443/mutate",
            "caBundle": base64.b64encode(b"-----BEGIN CERTIFICATE-----\n").decode(),
        }
    for webhook in validating["webhooks"]:
        assert webhook["clientConfig"]["url"] == "https://192.0.2.10:8443/validate"


def test_dry_run_yaml_loads_back_to_the_same_objects() -> None:
    built = registration.build_webhook_configurations(WebhookTarget(ca_bundle=b"ca"))
    text = registration.dump_yaml(built)
    assert list(yaml.safe_load_all(text)) == built
    assert "expression: |-" in text, "the CEL expression prints as a readable block"


def test_the_builders_return_fresh_objects() -> None:
    first = registration.build_mutating_webhook_configuration()
    first["webhooks"][0]["rules"][0]["operations"].append("CONNECT")
    first["webhooks"][0]["matchConditions"].clear()
    assert registration.build_mutating_webhook_configuration()["webhooks"][0]["rules"][0]["operations"] == [
        "CREATE", "UPDATE", "DELETE",
    ]
    assert registration.build_mutating_webhook_configuration()["webhooks"][0]["matchConditions"]


@pytest.mark.parametrize("field", ["timeoutSeconds", "failurePolicy"])
def test_the_yaml_explains_its_choice_beside_the_field(field: str) -> None:
    lines = WEBHOOKS_YAML.read_text("utf-8").splitlines()
    positions = [i for i, line in enumerate(lines) if line.strip().startswith(f"{field}:")]
    assert len(positions) == 5  # two entries in each CSINode configuration, one Node entry
    for position in positions:
        assert lines[position - 1].strip().startswith("#"), f"no comment right above {field} at line {position + 1}"


def test_the_one_call_component_is_what_register_validation_cel_builds(kubectl: str, tmp_path: Path) -> None:
    """An installation overlay with ``components: [../../components/one-call]`` registers what ``register
    --validation cel`` builds (the default overlay's caBundle left to the guard)."""
    root = tmp_path / "deploy"
    for part in ("base", "overlays/default", "components/one-call"):
        shutil.copytree(DEPLOY / part, root / part)
    overlay = root / "overlays" / "one-call"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": ["../default"], "components": ["../../components/one-call"],
    }), "utf-8")
    built = registration.build_webhook_configurations(WebhookTarget(ca_bundle=None), validation="cel")
    assert _configurations(kustomize(kubectl, overlay)) == built
