"""The guard's two webhook configurations, built as plain dicts.

``csinode-guard register`` applies what :func:`build_webhook_configurations` returns, and
``deploy/base/webhooks.yaml`` declares the same objects for ``kubectl apply -k``; the tests in ``tests/deploy``
keep both equal (rules, matchConditions, failurePolicy, timeouts, everything but the CA bundle wiring).

What reaches the guard, and why (Kubernetes facts this module relies on):

- Only ``UPDATE`` of ``storage.k8s.io/v1`` ``csinodes``. CREATE and DELETE never reach it: kubelet creates its
  CSINode before any driver registers, and a kubelet that cannot write its CSINode marks the node NotReady and
  finally exits.
- ``matchConditions`` (CEL, GA since Kubernetes 1.30) filter inside the apiserver, before any call: the webhook
  is called only when some driver present in *both* objects changes ``allocatable.count`` (to or from absent
  ``allocatable`` or ``count`` included), or when one of the guard's annotations changes. A driver registration
  (a name only in ``object``), a removal (a name only in ``oldObject``), label edits, kubelet's
  ``storage.alpha.kubernetes.io/migrated-plugins`` annotation and every other field never call the guard.
- The documented matching logic: if any match condition is ``false`` the webhook is skipped; if all are
  ``true`` it is called; if one *errors* (and none is ``false``) the ``failurePolicy`` decides, and with
  ``Fail`` the request is rejected. A CEL error is therefore as dangerous as a denial, so the expressions are
  written never to fail on any object the apiserver can produce: ``spec.drivers`` is ``null`` (not ``[]``) on a
  CSINode without drivers (the Go field has no ``omitempty``), ``metadata.annotations``, ``allocatable`` and
  ``allocatable.count`` are simply absent when unset, and every access is guarded by ``has()`` or a type test.
  The first condition, ``update-only``, keeps CREATE/DELETE out even if someone widens ``rules``: a ``false``
  condition skips the webhook whatever the others evaluate to.
- ``object`` and ``oldObject`` are untyped (``dyn``) maps for webhooks: the apiserver converts the versioned
  object to unstructured JSON before evaluation, so field names are the JSON ones (``allocatable.count``).

This module is pure: it performs no I/O and imports neither kubernetes nor Flask; ``register`` and
``unregister`` send what it builds.
"""

from __future__ import annotations

import base64
import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import yaml

from webhook.justification import JUSTIFICATION_ANNOTATION
from webhook.state import STATE_ANNOTATION

CONFIGURATION_NAME: Final = "csinode-guard"
"""``metadata.name`` of both the MutatingWebhookConfiguration and the ValidatingWebhookConfiguration."""

MUTATING_WEBHOOK_NAME: Final = "mutate.csinode-guard.io"
VALIDATING_WEBHOOK_NAME: Final = "validate.csinode-guard.io"
MUTATE_PATH: Final = "/mutate"
VALIDATE_PATH: Final = "/validate"

SERVICE_NAME: Final = "csinode-guard"
SERVICE_NAMESPACE: Final = "csinode-guard"
SERVICE_PORT: Final = 443

WEBHOOK_COMPONENT: Final = "admission-webhooks"
"""``app.kubernetes.io/component`` of both configurations, and of no other object in ``deploy/``: the documented
install applies everything else first (``kubectl apply -k deploy/ -l app.kubernetes.io/component!=admission-webhooks``)
and the configurations last, once the guard is ready, so that no write is refused on the way in."""

LABELS: Final[Mapping[str, str]] = {
    "app.kubernetes.io/name": "csinode-guard",
    "app.kubernetes.io/component": WEBHOOK_COMPONENT,
}
"""Labels on both configurations (``unregister`` finds them by name, not by label)."""

GUARD_ANNOTATIONS: Final = (STATE_ANNOTATION, JUSTIFICATION_ANNOTATION)
"""The CSINode annotations whose change always reaches the guard: its signed state and operator approvals."""

TIMEOUT_SECONDS: Final = 5
"""``timeoutSeconds`` of both webhooks (the API default is 10, the maximum 30).

The kubelet's CSINode PUT waits for the mutating call, then the validating call (and a reinvocation), and holds
an apiserver request seat in the API Priority and Fairness level that serves the node's other requests all that
time; a hung guard at the default 10 s would stretch every kubelet attempt (4 quick retries per period) to 20 s
or more. The guard answers inside its own internal budget, well under a second; 5 s leaves room for a TLS
handshake and a scheduling hiccup and still fails fast. When it fails, ``FAILURE_POLICY`` applies.
"""

FAILURE_POLICY: Final = "Fail"
"""``failurePolicy`` of both webhooks.

``Fail`` is safe here, and ``Ignore`` is not:

- Registrations, removals, CREATE and DELETE never reach the webhook (``rules`` and ``matchConditions``), so an
  unavailable guard can never stop a kubelet from registering a driver or a node from becoming Ready.
- What it can stop is a count change (or a guard annotation change). A rejected count change leaves the last
  accepted count in place: the scheduler keeps using a value that was already trusted, attach stays the final
  check, and kubelet retries at its next period. That is the same outcome as a denial.
- ``Ignore`` would turn "the guard is down" (or made unreachable) into "every write is accepted unchecked and
  without state", which is the failure the guard exists to prevent.

The emergency switch is ``csinode-guard unregister`` (see docs/operations.md).
"""

MATCH_POLICY: Final = "Equivalent"
SIDE_EFFECTS: Final = "None"
ADMISSION_REVIEW_VERSIONS: Final = ("v1",)
REINVOCATION_POLICY: Final = "IfNeeded"
"""The mutating webhook runs again when a later mutating webhook changed the object, so its state annotation
and clamped count are computed on the final object (the validating webhook then checks that final object)."""

UPDATE_ONLY_CONDITION_NAME: Final = "update-only"
UPDATE_ONLY_EXPRESSION: Final = "request.operation == 'UPDATE'"

CHANGE_CONDITION_NAME: Final = "allocatable-count-or-guard-annotation-changed"


def _quoted(values: Sequence[str]) -> str:
    return ", ".join(f"'{value}'" for value in values)


CHANGE_EXPRESSION: Final = f"""\
[{_quoted(GUARD_ANNOTATIONS)}].exists(k,
  (has(object.metadata.annotations) && k in object.metadata.annotations
    ? [object.metadata.annotations[k]] : [])
  != (has(oldObject.metadata.annotations) && k in oldObject.metadata.annotations
    ? [oldObject.metadata.annotations[k]] : []))
|| (has(object.spec.drivers) && type(object.spec.drivers) == list
    ? object.spec.drivers : []).exists(d,
  (has(oldObject.spec.drivers) && type(oldObject.spec.drivers) == list
    ? oldObject.spec.drivers : []).exists(o,
    o.name == d.name
    && (has(d.allocatable) && has(d.allocatable.count) ? [d.allocatable.count] : [])
      != (has(o.allocatable) && has(o.allocatable.count) ? [o.allocatable.count] : [])))"""
"""True when a guard annotation or a count of a driver present in both objects changes.

Read it as two parts joined by ``||``:

1. For each guard annotation, ``[value]`` when present and ``[]`` when absent, compared between the objects:
   added, removed and changed values all differ, with no sentinel value that a real annotation could collide
   with.
2. For each driver ``d`` of the new object and ``o`` of the old one with the same name (drivers are matched by
   name, never by index: kubelet re-appends the driver it updates), ``[count]`` or ``[]`` compared the same
   way. A driver only in one object has no partner, so registration and removal yield ``false``.

``spec.drivers`` is ``null`` on a CSINode without drivers, hence the ``type(...) == list`` guards that fall back
to ``[]``: evaluating ``exists`` on ``null`` would be an error, and an error under ``failurePolicy: Fail`` rejects
the request (a registration into an empty CSINode among them).
"""

MATCH_CONDITIONS: Final[tuple[Mapping[str, str], ...]] = (
    {"name": UPDATE_ONLY_CONDITION_NAME, "expression": UPDATE_ONLY_EXPRESSION},
    {"name": CHANGE_CONDITION_NAME, "expression": CHANGE_EXPRESSION},
)

RULES: Final[tuple[Mapping[str, Any], ...]] = (
    {
        "operations": ["UPDATE"],
        "apiGroups": ["storage.k8s.io"],
        "apiVersions": ["v1"],
        "resources": ["csinodes"],
        "scope": "Cluster",
    },
)


@dataclass(frozen=True)
class WebhookTarget:
    """Where the apiserver sends the guard's AdmissionReviews, and which CA it trusts for that.

    ``ca_bundle`` is PEM (one or more CA certificates: during a CA rotation both the old and the new CA); None
    leaves ``caBundle`` out, for a CA injector (cert-manager's cainjector) to fill in. ``url`` replaces the
    in-cluster Service reference (``https://host:port``, paths are appended), for a guard running outside the
    cluster during development.
    """

    service_name: str = SERVICE_NAME
    service_namespace: str = SERVICE_NAMESPACE
    service_port: int = SERVICE_PORT
    ca_bundle: bytes | None = None
    url: str | None = None


def encode_ca_bundle(pem: bytes) -> str:
    """The ``clientConfig.caBundle`` value for PEM bytes: standard base64 (the API field is ``[]byte``)."""
    return base64.b64encode(pem).decode("ascii")


def build_client_config(target: WebhookTarget, path: str) -> dict[str, Any]:
    """``clientConfig`` for one webhook of ``target`` serving ``path`` (``/mutate`` or ``/validate``)."""
    config: dict[str, Any]
    if target.url is not None:
        config = {"url": target.url.rstrip("/") + path}
    else:
        config = {
            "service": {
                "name": target.service_name,
                "namespace": target.service_namespace,
                "path": path,
                "port": target.service_port,
            }
        }
    if target.ca_bundle is not None:
        config["caBundle"] = encode_ca_bundle(target.ca_bundle)
    return config


def _webhook(name: str, target: WebhookTarget, path: str) -> dict[str, Any]:
    return {
        "name": name,
        "clientConfig": build_client_config(target, path),
        "rules": copy.deepcopy([dict(rule) for rule in RULES]),
        "matchPolicy": MATCH_POLICY,
        "matchConditions": [dict(condition) for condition in MATCH_CONDITIONS],
        "failurePolicy": FAILURE_POLICY,
        "sideEffects": SIDE_EFFECTS,
        "timeoutSeconds": TIMEOUT_SECONDS,
        "admissionReviewVersions": list(ADMISSION_REVIEW_VERSIONS),
    }


def _metadata(name: str, annotations: Mapping[str, str] | None) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "labels": dict(LABELS)}
    if annotations:
        metadata["annotations"] = dict(annotations)
    return metadata


def build_mutating_webhook_configuration(
    target: WebhookTarget | None = None,
    *,
    name: str = CONFIGURATION_NAME,
    annotations: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The ``admissionregistration.k8s.io/v1`` MutatingWebhookConfiguration for ``target``.

    ``target`` defaults to the in-cluster Service without a CA bundle; ``annotations`` go onto the object's
    metadata (e.g. ``cert-manager.io/inject-ca-from``).
    """
    webhook = _webhook(MUTATING_WEBHOOK_NAME, target or WebhookTarget(), MUTATE_PATH)
    webhook["reinvocationPolicy"] = REINVOCATION_POLICY
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": _metadata(name, annotations),
        "webhooks": [webhook],
    }


def build_validating_webhook_configuration(
    target: WebhookTarget | None = None,
    *,
    name: str = CONFIGURATION_NAME,
    annotations: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The ``admissionregistration.k8s.io/v1`` ValidatingWebhookConfiguration for ``target``."""
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": _metadata(name, annotations),
        "webhooks": [_webhook(VALIDATING_WEBHOOK_NAME, target or WebhookTarget(), VALIDATE_PATH)],
    }


def build_webhook_configurations(
    target: WebhookTarget | None = None,
    *,
    name: str = CONFIGURATION_NAME,
    annotations: Mapping[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Both configurations, mutating first (the order ``register`` applies them in)."""
    return [
        build_mutating_webhook_configuration(target, name=name, annotations=annotations),
        build_validating_webhook_configuration(target, name=name, annotations=annotations),
    ]


class _LiteralDumper(yaml.SafeDumper):
    """A SafeDumper that writes multi-line strings (the CEL expression) as ``|`` blocks."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_LiteralDumper.add_representer(str, _represent_str)


def dump_yaml(objects: Sequence[Mapping[str, Any]]) -> str:
    """A multi-document YAML stream of ``objects`` (what ``register --dry-run`` prints); loads back equal."""
    return yaml.dump_all([dict(obj) for obj in objects], Dumper=_LiteralDumper, sort_keys=False, width=120)
