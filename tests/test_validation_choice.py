"""Which mode `register --validation auto` and the caBundle keeper choose: one call (cel) unless another mutator
can rewrite a CSINode, and how the stored ValidatingWebhookConfiguration is switched (webhook/kube/one_call.py,
webhook/kube/registration.py)."""

from __future__ import annotations

from typing import Any

import pytest

from webhook.kube.one_call import NOT_DECIDED_CONDITION_NAME, choose_validation, csinode_mutators
from webhook.kube.registration import (
    build_validating_webhook_configuration,
    validation_of,
    with_validation,
)


def mutating(name: str, *rules: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": name},
            "webhooks": [{"name": f"{name}.example.com", "rules": list(rules)}]}


def rule(operations: list[str], groups: list[str], resources: list[str], **extra: Any) -> dict[str, Any]:
    return {"operations": operations, "apiGroups": groups, "apiVersions": ["*"], "resources": resources, **extra}


@pytest.mark.parametrize(
    ("the_rule", "matches"),
    [
        pytest.param(rule(["UPDATE"], ["storage.k8s.io"], ["csinodes"]), True, id="csinodes-updates"),
        pytest.param(rule(["CREATE"], ["storage.k8s.io"], ["*"]), True, id="every-storage-resource"),
        pytest.param(rule(["*"], ["*"], ["*/*"]), True, id="everything-with-subresources"),
        pytest.param(rule(["UPDATE"], ["storage.k8s.io"], ["csinodes"], apiVersions=["v1beta1"]), True,
                     id="another-version-still-matches-under-matchPolicy-Equivalent"),
        pytest.param(rule(["DELETE"], ["storage.k8s.io"], ["csinodes"]), False, id="delete-only-mutates-nothing"),
        pytest.param(rule(["UPDATE"], [""], ["pods"]), False, id="pods-only"),
        pytest.param(rule(["UPDATE"], ["storage.k8s.io"], ["csidrivers"]), False, id="another-storage-resource"),
        pytest.param(rule(["UPDATE"], ["*"], ["*"], scope="Namespaced"), False,
                     id="namespaced-scope-excludes-a-cluster-scoped-csinode"),
        pytest.param({"operations": "UPDATE"}, True, id="an-unreadable-rule-counts-as-a-match"),
    ],
)
def test_a_mutating_webhook_counts_when_its_rules_can_match_a_csinode_write(
    the_rule: dict[str, Any], matches: bool
) -> None:
    found = csinode_mutators([mutating("other", the_rule)], "csinode-guard")
    assert found == (("other/other.example.com",) if matches else ())


def test_the_guards_own_configuration_is_not_another_mutator() -> None:
    own = mutating("csinode-guard", rule(["UPDATE"], ["storage.k8s.io"], ["csinodes"]))
    assert csinode_mutators([own], "csinode-guard") == ()


def test_a_mutating_admission_policy_counts_through_its_match_constraints() -> None:
    policy = {"metadata": {"name": "set-count"},
              "spec": {"matchConstraints": {"resourceRules": [rule(["UPDATE"], ["storage.k8s.io"], ["csinodes"])]}}}
    unrelated = {"metadata": {"name": "pods"}, "spec": {"matchConstraints": {"resourceRules": [
        rule(["CREATE"], [""], ["pods"])]}}}
    assert csinode_mutators([], "csinode-guard", [policy, unrelated]) == ("mutatingadmissionpolicy/set-count",)


@pytest.mark.parametrize(
    ("requested", "mutators", "mode"),
    [
        pytest.param("auto", (), "cel", id="auto-alone-is-one-call"),
        pytest.param("auto", ("x/y",), "webhook", id="auto-with-another-mutator-is-two-calls"),
        pytest.param("auto", None, "webhook", id="auto-without-a-list-is-two-calls"),
        pytest.param("cel", ("x/y",), "cel", id="cel-override"),
        pytest.param("webhook", (), "webhook", id="webhook-override"),
    ],
)
def test_auto_chooses_one_call_only_where_nothing_else_mutates_csinodes(
    requested: str, mutators: tuple[str, ...] | None, mode: str
) -> None:
    assert choose_validation(requested, mutators)[0] == mode


def test_choose_validation_refuses_an_unknown_mode() -> None:
    with pytest.raises(ValueError, match="auto, webhook, cel"):
        choose_validation("vap", ())


def test_switching_moves_only_the_one_call_condition_and_keeps_everything_else() -> None:
    two = build_validating_webhook_configuration(validation="webhook")
    two["webhooks"][0]["clientConfig"]["caBundle"] = "Q0E="
    two["metadata"]["resourceVersion"] = "42"
    assert validation_of(two) == "webhook"
    assert with_validation(two, "webhook") is None

    one = with_validation(two, "cel")
    assert one is not None and validation_of(one) == "cel"
    built = build_validating_webhook_configuration(validation="cel")["webhooks"]
    assert [w["matchConditions"] for w in one["webhooks"]] == [w["matchConditions"] for w in built]
    assert one["webhooks"][0]["clientConfig"]["caBundle"] == "Q0E=" and one["metadata"]["resourceVersion"] == "42"
    assert with_validation(one, "cel") is None
    back = with_validation(one, "webhook")
    assert back == two


def test_a_stale_one_call_expression_is_replaced_and_mixed_entries_read_as_no_mode() -> None:
    one = build_validating_webhook_configuration(validation="cel")
    one["webhooks"][0]["matchConditions"][-1]["expression"] = "false"
    assert validation_of(one) == "cel"
    fixed = with_validation(one, "cel")
    assert fixed == build_validating_webhook_configuration(validation="cel")
    mixed = build_validating_webhook_configuration(validation="cel")
    mixed["webhooks"][1]["matchConditions"] = [
        c for c in mixed["webhooks"][1]["matchConditions"] if c["name"] != NOT_DECIDED_CONDITION_NAME]
    assert validation_of(mixed) is None
