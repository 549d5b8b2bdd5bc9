"""One call or two, chosen on the cluster: list the other mutators of CSINodes and switch the guard's
ValidatingWebhookConfiguration to match (``register --validation auto`` and the in-cluster caBundle keeper).

The one-call registration (:mod:`webhook.kube.one_call`) lets the apiserver skip /validate where the final
object's counts are the ones /mutate recorded. It gives nothing away against the node or a stranger
(docs/threat-model.md, *One call*); what it gives up is a re-judgement after *another* mutator that rewrites
CSINodes. So the guard takes one call only where no such mutator exists: no other MutatingWebhookConfiguration
whose rules can match a CREATE or UPDATE of ``storage.k8s.io`` ``csinodes``, and no MutatingAdmissionPolicy whose
``matchConstraints`` can (:func:`webhook.kube.one_call.csinode_mutators`). Needs ``list`` on
``mutatingwebhookconfigurations`` and ``mutatingadmissionpolicies`` (deploy/base/rbac.yaml); when either list is
refused or fails, the answer is two calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from webhook.kube.kubeapi import (
    MUTATING_WEBHOOK_CONFIGURATIONS,
    VALIDATING_WEBHOOK_CONFIGURATIONS,
    ApiRequest,
    ApiResource,
    ApiUnreachableError,
    KubeApiError,
    KubeClient,
)
from webhook.kube.one_call import choose_validation, csinode_mutators
from webhook.kube.registration import validation_of, with_validation

FIELD_MANAGER: Final = "csinode-guard"
MUTATING_ADMISSION_POLICY_VERSIONS: Final = ("v1", "v1beta1", "v1alpha1")
"""The versions of ``admissionregistration.k8s.io`` MutatingAdmissionPolicy tried in turn (KEP-3962: alpha in
1.32, beta in 1.34); a version the apiserver does not serve answers 404 and the next one is tried."""


def _mutating_admission_policies(client: KubeClient) -> list[dict[str, Any]]:
    for version in MUTATING_ADMISSION_POLICY_VERSIONS:
        resource = ApiResource("admissionregistration.k8s.io", version, "mutatingadmissionpolicies",
                               "MutatingAdmissionPolicy")
        try:
            return client.list_all(resource)
        except KubeApiError as exc:
            if exc.not_found:
                continue
            raise
    return []


def list_csinode_mutators(client: KubeClient, own_configuration: str) -> tuple[str, ...] | None:
    """The other mutators that can rewrite a CSINode (``configuration/webhook`` and
    ``mutatingadmissionpolicy/NAME``), or None when they cannot be listed (refused, unreachable): two LISTs
    (three or four where MutatingAdmissionPolicy is not served at v1)."""
    try:
        configurations = client.list_all(MUTATING_WEBHOOK_CONFIGURATIONS)
        policies = _mutating_admission_policies(client)
    except (KubeApiError, ApiUnreachableError):
        return None
    return csinode_mutators(configurations, own_configuration, policies)


@dataclass(frozen=True)
class ValidationSync:
    """What :func:`sync_validation` found and did: the ``mode`` wanted (``webhook`` or ``cel``), why
    (``reason``), the mode stored before (None: no configuration, or its entries disagree) and whether it wrote."""

    mode: str
    reason: str
    before: str | None
    switched: bool
    exists: bool


def sync_validation(client: KubeClient, name: str, requested: str) -> ValidationSync:
    """Put the guard's ValidatingWebhookConfiguration ``name`` in the mode ``requested`` chooses (``auto``,
    ``webhook`` or ``cel``, :func:`webhook.kube.one_call.choose_validation`), with a resourceVersion
    precondition (a configuration changed between GET and PUT is read again, up to 3 times). A configuration
    that does not exist yet is left alone. Raises :class:`KubeApiError` for a refused GET or PUT,
    :class:`ApiUnreachableError` when the apiserver cannot be reached."""
    mutators = list_csinode_mutators(client, name) if requested == "auto" else ()
    mode, reason = choose_validation(requested, mutators)
    for attempt in range(3):
        try:
            stored = client.get(VALIDATING_WEBHOOK_CONFIGURATIONS, name)
        except KubeApiError as exc:
            if exc.not_found:
                return ValidationSync(mode, reason, None, switched=False, exists=False)
            raise
        before = validation_of(stored)
        updated = with_validation(stored, mode)
        if updated is None:
            return ValidationSync(mode, reason, before, switched=False, exists=True)
        request = ApiRequest("PUT", VALIDATING_WEBHOOK_CONFIGURATIONS.object_path(name),
                             (("fieldManager", FIELD_MANAGER),), updated)
        try:
            client.send(request)
        except KubeApiError as exc:
            if exc.conflict and attempt < 2:
                continue
            raise
        return ValidationSync(mode, reason, before, switched=True, exists=True)
    raise AssertionError("unreachable")  # pragma: no cover
