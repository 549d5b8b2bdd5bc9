"""The Node entry's configuration (``csinode-guard-nodes``): deploy/ declares what ``register`` builds, and its
matchCondition calls the guard for a CREATE and for a change of the labels or of their record, never for the
kubelet's status heartbeats. The expression is evaluated by both CEL engines the CSINode conditions' tests use; the
real apiserver evaluates it in tests/k8s/test_label_provenance.py."""

from __future__ import annotations

from typing import Any

import pytest
from deploy_helpers import DEPLOY, find, load_yaml_documents
from test_deploy_match_conditions import ENGINES, Evaluate

from webhook.admission.label_provenance import PROVENANCE_ANNOTATION
from webhook.kube import registration
from webhook.kube.registration import WebhookTarget

KIND = "MutatingWebhookConfiguration"
NAME = registration.node_configuration_name()


def test_the_base_yaml_holds_the_node_configuration_python_builds() -> None:
    declared = find(load_yaml_documents(DEPLOY / "base" / "webhooks.yaml"), KIND, NAME)
    assert declared == registration.build_node_webhook_configuration()


def test_the_node_entry_observes_and_never_refuses() -> None:
    (entry,) = registration.build_node_webhook_configuration(WebhookTarget(url="https://192.0.2.1:8443"))["webhooks"]
    assert entry["failurePolicy"] == "Ignore"
    assert entry["clientConfig"] == {"url": "https://192.0.2.1:8443/node-labels"}
    assert entry["rules"] == [{"operations": ["CREATE", "UPDATE"], "apiGroups": [""], "apiVersions": ["v1"],
                               "resources": ["nodes", "nodes/status"], "scope": "Cluster"}]
    assert entry["sideEffects"] == "None"


def _node(labels: dict[str, str] | None, record: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "node-a"}
    if labels is not None:
        meta["labels"] = labels
    if record is not None:
        meta["annotations"] = {PROVENANCE_ANNOTATION: record, "other": "x"}
    return {"apiVersion": "v1", "kind": "Node", "metadata": meta, "status": {"conditions": []}}


TYPE = "node.kubernetes.io/instance-type"
CASES = [
    pytest.param("CREATE", _node({TYPE: "c7i.48xlarge"}), None, True, id="a Node created with labels is observed"),
    pytest.param("CREATE", _node(None), None, True, id="a Node created without labels is observed"),
    pytest.param("UPDATE", _node({TYPE: "c7i.48xlarge"}), _node({TYPE: "m6i.large"}), True,
                 id="a changed label is observed"),
    pytest.param("UPDATE", _node({TYPE: "m6i.large"}), _node(None), True, id="a first label is observed"),
    pytest.param("UPDATE", _node({}), _node({TYPE: "m6i.large"}), True, id="a removed label is observed"),
    pytest.param("UPDATE", _node({TYPE: "m6i.large"}, "forged"), _node({TYPE: "m6i.large"}, "signed"), True,
                 id="a replaced record is observed"),
    pytest.param("UPDATE", _node({TYPE: "m6i.large"}), _node({TYPE: "m6i.large"}, "signed"), True,
                 id="a removed record is observed"),
    pytest.param("UPDATE", _node({TYPE: "m6i.large"}, "signed"), _node({TYPE: "m6i.large"}, "signed"), False,
                 id="a status heartbeat with the same labels and record is not"),
    pytest.param("UPDATE", _node(None), _node(None), False, id="a write of a Node without labels is not"),
]


@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize(("operation", "obj", "old", "called"), CASES)
def test_the_condition_calls_the_guard_only_when_labels_or_their_record_change(
    engine: str, operation: str, obj: dict[str, Any], old: dict[str, Any] | None, called: bool
) -> None:
    evaluate: Evaluate = ENGINES[engine]
    (entry,) = registration.build_node_webhook_configuration()["webhooks"]
    request = {"operation": operation, "name": "node-a", "userInfo": {"username": "system:node:node-a"}}
    results = [evaluate(c["expression"], {"object": obj, "oldObject": old, "request": request})
               for c in entry["matchConditions"]]
    assert None not in results, "a condition errored (failurePolicy would decide)"
    assert all(results) is called
