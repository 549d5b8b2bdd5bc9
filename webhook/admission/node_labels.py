"""Which Node labels the node's own kubelet can set, and the policy settings that select by one.

Under the NodeRestriction admission plugin a kubelet (``system:node:<name>``) may add, change and remove labels
on its own Node except (``plugin/pkg/admission/noderestriction/admission.go``, ``getForbiddenLabels``):

- labels under ``node-restriction.kubernetes.io/`` (or a subdomain of it): never;
- other labels under ``kubernetes.io/`` or ``k8s.io/`` (or a subdomain): only the kubelet labels of
  ``k8s.io/kubelet/pkg/apis/well_known_labels.go`` -- ``kubernetes.io/hostname``, ``kubernetes.io/arch``,
  ``kubernetes.io/os``, ``topology.kubernetes.io/zone|region``, ``node.kubernetes.io/instance-type`` and their
  ``beta.kubernetes.io`` / ``failure-domain.beta.kubernetes.io`` forms -- and anything under
  ``kubelet.kubernetes.io/`` or ``node.kubernetes.io/`` (or a subdomain of those);
- every label outside ``kubernetes.io`` and ``k8s.io``, unprefixed ones included.

kubelet's ``--node-labels`` flag accepts the same set. A policy that selects a ceiling or its enforcement scope
by a label the kubelet can set depends on something the node controls: :func:`node_label_warnings` names them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

from webhook.admission.policy import Policy, json_path

NODE_RESTRICTION_NAMESPACE = "node-restriction.kubernetes.io"
"""The label namespace no kubelet may set: the safe prefix for labels the guard's policy selects by."""

KUBELET_LABELS = frozenset({
    "kubernetes.io/hostname",
    "topology.kubernetes.io/zone",
    "topology.kubernetes.io/region",
    "failure-domain.beta.kubernetes.io/zone",
    "failure-domain.beta.kubernetes.io/region",
    "beta.kubernetes.io/instance-type",
    "node.kubernetes.io/instance-type",
    "kubernetes.io/os",
    "kubernetes.io/arch",
    "beta.kubernetes.io/os",
    "beta.kubernetes.io/arch",
})
"""``kubeletapis.KubeletLabels()``: the kubernetes.io labels a kubelet may set on its own Node."""

KUBELET_LABEL_NAMESPACES = ("kubelet.kubernetes.io", "node.kubernetes.io")
"""``kubeletapis.KubeletLabelNamespaces()``: label namespaces (and their subdomains) a kubelet may set."""

INSTANCE_TYPE_LABELS = frozenset({"node.kubernetes.io/instance-type", "beta.kubernetes.io/instance-type"})
"""Labels the cloud provider (cloud-controller-manager) sets on a new Node, which the kubelet may set too."""


def _namespace(key: str) -> str:
    return key.split("/", 1)[0] if "/" in key else ""


def _in(namespace: str, parent: str) -> bool:
    return namespace == parent or namespace.endswith("." + parent)


def kubelet_can_set(key: str) -> bool:
    """True when a kubelet may set (add, change or remove) label ``key`` on its own Node under NodeRestriction."""
    namespace = _namespace(key)
    if _in(namespace, NODE_RESTRICTION_NAMESPACE):
        return False
    if _in(namespace, "kubernetes.io") or _in(namespace, "k8s.io"):
        return key in KUBELET_LABELS or any(_in(namespace, n) for n in KUBELET_LABEL_NAMESPACES)
    return True


class LabelWarning(NamedTuple):
    """A policy setting that depends on what the node writes: ``path`` (a JSON path), ``label`` (the label, or ""),
    ``message``."""

    path: str
    label: str
    message: str


def _ceiling_message(label: str) -> str:
    source = "; the cloud provider sets it on a new Node" if label in INSTANCE_TYPE_LABELS else ""
    return (f"ceiling label {label} can be set by the node's own kubelet on its own Node{source}: pinned, not "
            f"trusted (a value the node set selects nothing; the ceiling a value selects can be lowered, never "
            f"raised: docs/threat-model.md); recommended: a label under {NODE_RESTRICTION_NAMESPACE}/, which the "
            f"kubelet cannot set")


def _scope_message(label: str) -> str:
    return (f"enforcementScope label {label} can be set and removed by the node's own kubelet on its own Node, "
            f"as NodeRestriction allows, so the node decides whether it is in scope; select with a label under "
            f"{NODE_RESTRICTION_NAMESPACE}/, which the kubelet cannot set")


def _ceilings(doc: Mapping[str, Any]) -> Iterator[tuple[tuple[str, ...], Mapping[str, Any], str | None]]:
    """(path to the ceiling, the ceiling mapping, driver name or None for defaults) of every ceiling written."""
    spec = doc.get("spec")
    if not isinstance(spec, Mapping):
        return
    defaults = spec.get("defaults")
    if isinstance(defaults, Mapping) and isinstance(defaults.get("ceiling"), Mapping):
        yield ("spec", "defaults", "ceiling"), defaults["ceiling"], None
    drivers = spec.get("drivers")
    if isinstance(drivers, Mapping):
        for name, settings in drivers.items():
            if isinstance(settings, Mapping) and isinstance(settings.get("ceiling"), Mapping):
                yield ("spec", "drivers", str(name), "ceiling"), settings["ceiling"], str(name)


def node_label_warnings(policy: Policy) -> list[LabelWarning]:
    """Every ceiling ``nodeLabel`` (written, or a referenced profile's) and ``enforcementScope.nodeSelector`` label
    of ``policy`` that the kubelet can set (:func:`kubelet_can_set`), in document order."""
    found: list[LabelWarning] = []
    for path, ceiling, driver in _ceilings(policy.document):
        label = ceiling.get("nodeLabel")
        where = (*path, "nodeLabel")
        if not isinstance(label, str) and ceiling.get("profile") is not None:
            effective = policy.for_driver(driver).ceiling if driver else policy.default_driver.ceiling
            label = effective.profile.node_label if effective.profile is not None else None
            where = (*path, "profile")
        if isinstance(label, str) and kubelet_can_set(label):
            found.append(LabelWarning(json_path(where), label, _ceiling_message(label)))
    spec = policy.document.get("spec")
    scope = spec.get("enforcementScope") if isinstance(spec, Mapping) else None
    selector = scope.get("nodeSelector") if isinstance(scope, Mapping) else None
    labels = selector.get("matchLabels") if isinstance(selector, Mapping) else None
    if isinstance(labels, Mapping):
        for key in labels:
            if kubelet_can_set(str(key)):
                path = ("spec", "enforcementScope", "nodeSelector", "matchLabels", str(key))
                found.append(LabelWarning(json_path(path), str(key), _scope_message(str(key))))
    return found
