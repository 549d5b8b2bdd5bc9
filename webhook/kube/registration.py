"""The guard's two webhook configurations, built as plain dicts: two webhook entries in each.

``csinode-guard register`` applies what :func:`build_webhook_configurations` returns, and
``deploy/base/webhooks.yaml`` declares the same objects for ``kubectl apply -k``; the tests in ``tests/deploy``
keep both equal (rules, matchConditions, failurePolicy, timeouts, everything but the CA bundle wiring).

What reaches the guard, and why (Kubernetes facts this module relies on):

- ``CREATE``, ``UPDATE`` and ``DELETE`` of ``storage.k8s.io/v1`` ``csinodes``. A DELETE removes every driver's
  limit at once (the scheduler has no limit for a node without a CSINode), so a stranger's DELETE is judged like a
  stranger's removal (the ``Fail`` entries; writer-identity refuses it); the node's own kubelet deletes its CSINode
  when its Node's UID changed (kubernetes#137199), and that DELETE is on the never-refused entries. On DELETE the
  apiserver calls the mutating webhooks too, with ``oldObject`` and no ``object`` (the guard returns no patch).
  kubelet creates its CSINode, registers each driver into it (``InstallCSIDriver``: a driver entry
  appears, or an entry is rewritten when its ``nodeID`` or ``topologyKeys`` changed), removes a driver whose
  node plugin goes away, and updates counts (KEP-4876). If it cannot create its CSINode or register a driver it
  marks the node NotReady and finally exits (~140 s of failed registration), so those writes must never fail.
- Two entries per configuration carry DESIGN.md's asymmetry, split by complementary ``matchConditions`` on the
  write and on ``request.userInfo``:

  * ``increases-and-other-writers.mutate.csinode-guard.io`` / ``increases-and-other-writers.validate.csinode-guard.io``,
    ``failurePolicy: Fail``: an UPDATE that raises the count of an entry that stays (same name, ``nodeID`` and
    ``topologyKeys``; bounded -> unbounded included), or that changes a trust-raising annotation (justification,
    driver versions) without any registration or removal, or -- in the mutating configuration -- that changes or
    removes the guard's state (in the validating one: the state alone, as /validate sees the state /mutate wrote);
    and every write that matters by anyone but the node's own kubelet (``system:node:<name>`` in ``system:nodes``):
    its CREATE, registration, removal, decrease or DELETE. A guard that is down admits none of these.
  * ``node-registrations.mutate.csinode-guard.io`` / ``node-registrations.validate.csinode-guard.io``,
    ``failurePolicy: Ignore``: the node's own kubelet's other writes that matter: its CREATE, its DELETE, a
    registration, a removal, a count decrease (and any guard annotation change riding on those, the state
    excepted). The guard judges them when it can (clamps a registration's count, never refuses it; lets the
    node's DELETE through); a guard that is down, hanging or misconfigured blocks none.

  With ``validation="cel"`` (``register --validation cel``) both validating entries get one more condition,
  :data:`webhook.kube.one_call.NOT_DECIDED_CONDITION`: the apiserver skips /validate where the final counts are
  the ones the state /mutate wrote records (see :mod:`webhook.kube.one_call`).

  Exactly one entry of a configuration matches a write, or none (label edits, kubelet's
  ``storage.alpha.kubernetes.io/migrated-plugins`` annotation, a PUT that changes nothing the guard reads).
  What went through unjudged under ``Ignore`` is reconciled at the next judged write of the object (see
  :mod:`webhook.admission.evaluation`).
- The documented matching logic: if any match condition is ``false`` the webhook is skipped; if all are
  ``true`` it is called; if one *errors* (and none is ``false``) the ``failurePolicy`` decides, and with
  ``Fail`` the request is rejected. A CEL error is therefore as dangerous as a denial, so the expressions are
  written never to fail on any object the apiserver can produce: ``spec.drivers`` is ``null`` (not ``[]``) on a
  CSINode without drivers (the Go field has no ``omitempty``), and so is ``topologyKeys`` of a driver without
  any; ``metadata.annotations``, ``allocatable`` and ``allocatable.count`` are simply absent when unset;
  ``oldObject`` is ``null`` on CREATE and ``object`` on DELETE, so every expression that reads either is behind
  ``request.operation == 'UPDATE' &&`` (CEL's ``&&`` and ``||`` are short-circuiting, also past errors); the DELETE
  terms read ``request`` only. Every access is guarded by
  ``has()`` or a type test.
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

from webhook.admission.justification import JUSTIFICATION_ANNOTATION
from webhook.admission.label_provenance import NODE_LABELS_PATH, PROVENANCE_ANNOTATION
from webhook.admission.policy import DRIVER_VERSIONS_ANNOTATION
from webhook.admission.state import STATE_ANNOTATION
from webhook.kube.one_call import NOT_DECIDED_CONDITION, VALIDATION_CEL, VALIDATION_MODES, VALIDATION_WEBHOOK

CONFIGURATION_NAME: Final = "csinode-guard"
"""``metadata.name`` of both the MutatingWebhookConfiguration and the ValidatingWebhookConfiguration."""

MUTATING_WEBHOOK_NAME: Final = "increases-and-other-writers.mutate.csinode-guard.io"
VALIDATING_WEBHOOK_NAME: Final = "increases-and-other-writers.validate.csinode-guard.io"
"""The entries with ``failurePolicy: Fail``: writes that raise a count or trust, change the guard's state, or come
from anyone but the node's own kubelet."""
MUTATING_NEVER_REFUSED_NAME: Final = "node-registrations.mutate.csinode-guard.io"
VALIDATING_NEVER_REFUSED_NAME: Final = "node-registrations.validate.csinode-guard.io"
"""The entries with ``failurePolicy: Ignore``: the node's own kubelet's CREATE, registrations, removals, decreases."""
NODE_LABELS_WEBHOOK_NAME: Final = "node-label-provenance.mutate.csinode-guard.io"
"""The Node entry (mutating configuration only): observes who sets a Node's labels and records it in the signed
``csinode-guard.io/label-provenance`` annotation (:mod:`webhook.admission.label_provenance`); never refuses,
``failurePolicy: Ignore``."""
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

TRUST_ANNOTATIONS: Final = (JUSTIFICATION_ANNOTATION, DRIVER_VERSIONS_ANNOTATION)
"""Annotations that raise what the guard trusts: an approver's justification, a reporter's driver versions.
(A policy may name another driver-versions annotation; only this default one is in the conditions.)"""
GUARD_ANNOTATIONS: Final = (STATE_ANNOTATION, *TRUST_ANNOTATIONS)
"""The CSINode annotations whose change always reaches the guard: its signed state, operator approvals and
declared driver versions."""

TIMEOUT_SECONDS: Final = 5
"""``timeoutSeconds`` of both webhooks (the API default is 10, the maximum 30).

The kubelet's CSINode PUT waits for the mutating call, then the validating call (and a reinvocation), and holds
an apiserver request seat in the API Priority and Fairness level that serves the node's other requests all that
time; a hung guard at the default 10 s would stretch every kubelet attempt (4 quick retries per period) to 20 s
or more. The guard answers inside its own internal budget, well under a second; 5 s leaves room for a TLS
handshake and a scheduling hiccup and still fails fast. When it fails, ``FAILURE_POLICY`` applies.
"""

FAILURE_POLICY: Final = "Fail"
"""``failurePolicy`` of the entries for increases (:data:`MUTATING_WEBHOOK_NAME`, :data:`VALIDATING_WEBHOOK_NAME`).

A rejected increase leaves the last accepted count in place: the scheduler keeps using a value that was already
trusted, attach stays the final check, and kubelet retries at its next period -- the outcome of a denial.
``Ignore`` here would turn "the guard is down" (or made unreachable) into "every increase is accepted unchecked".
The emergency switch is ``csinode-guard unregister`` (see docs/operations.md).
"""

NEVER_REFUSED_FAILURE_POLICY: Final = "Ignore"
"""``failurePolicy`` of the entries for the node's own writes that must never fail: CREATE, registration,
removal, decrease.

A kubelet that cannot register a driver exits; a decrease is the safe direction. The guard clamps what these
carry when it answers, and a write that went through without it is reconciled at the object's next judged write
(the lower count counts as accepted, a higher one is judged from the last count the guard accepted).
"""

MATCH_POLICY: Final = "Equivalent"
SIDE_EFFECTS: Final = "None"
ADMISSION_REVIEW_VERSIONS: Final = ("v1",)
REINVOCATION_POLICY: Final = "IfNeeded"
"""The mutating webhook runs again when a later mutating webhook changed the object, so its state annotation
and clamped count are computed on the final object (the validating webhook then checks that final object). The
apiserver reinvokes only an entry called in the first round whose conditions still match: the ``Fail`` entry's
do (an increase stays one); the node's own never-refused write is not reinvoked, as the guard's patch changed its
state, which routes to the ``Fail`` entry -- there the validating webhook alone checks the final object."""

UPDATE_ONLY_CONDITION_NAME: Final = "update-only"
UPDATE_ONLY_EXPRESSION: Final = "request.operation == 'UPDATE'"
CREATE_OR_UPDATE_CONDITION_NAME: Final = "create-or-update-only"
CREATE_OR_UPDATE_EXPRESSION: Final = "request.operation == 'CREATE' || request.operation == 'UPDATE'"
OPERATIONS_CONDITION_NAME: Final = "create-update-or-delete-only"
OPERATIONS_EXPRESSION: Final = (
    "request.operation == 'CREATE' || request.operation == 'UPDATE' || request.operation == 'DELETE'"
)
"""The first condition of every csinodes entry: the operations the guard judges (CONNECT never)."""


def _quoted(values: Sequence[str]) -> str:
    return ", ".join(f"'{value}'" for value in values)


def _drivers(obj: str) -> str:
    return f"(has({obj}.spec.drivers) && type({obj}.spec.drivers) == list ? {obj}.spec.drivers : [])"


def _count(d: str) -> str:
    return f"(has({d}.allocatable) && has({d}.allocatable.count) ? [{d}.allocatable.count] : [])"


def _topology(d: str) -> str:
    return f"(has({d}.topologyKeys) && type({d}.topologyKeys) == list ? {d}.topologyKeys : [])"


def _node_id(d: str) -> str:
    return f"(has({d}.nodeID) ? {d}.nodeID : '')"


def _annotations_changed(keys: Sequence[str]) -> str:
    return f"""[{_quoted(keys)}].exists(k,
    (has(object.metadata.annotations) && k in object.metadata.annotations
      ? [object.metadata.annotations[k]] : [])
    != (has(oldObject.metadata.annotations) && k in oldObject.metadata.annotations
      ? [oldObject.metadata.annotations[k]] : []))"""


def same_entry(o: str, d: str) -> str:
    """CEL: the driver entries ``o`` (old) and ``d`` (new) are the same registration -- same ``name``,
    ``nodeID`` and ``topologyKeys``. An entry rewritten with another ``nodeID`` or ``topologyKeys`` is a
    registration (kubelet's ``InstallCSIDriver``), never a count change; the VAP floor pairs entries the same way."""
    return f"{o}.name == {d}.name && {_node_id(o)} == {_node_id(d)} && {_topology(o)} == {_topology(d)}"


_SAME_ENTRY = same_entry("o", "d")
_NEW, _OLD = _drivers("object"), _drivers("oldObject")

INCREASE: Final = f"""{_NEW}.exists(d, {_OLD}.exists(o,
    {_SAME_ENTRY}
    && {_count('o')}.exists(oc, {_count('d')}.size() == 0 || {_count('d')}.exists(dc, dc > oc))))"""
"""Some entry that stays (same name, nodeID and topologyKeys) gets a higher count or loses it (unbounded)."""

STRUCTURAL: Final = f"""({_NEW}.exists(d, !{_OLD}.exists(o,
    {_SAME_ENTRY}))
  || {_OLD}.exists(o, !{_NEW}.exists(d, d.name == o.name)))"""
"""A registration (an entry that appears, or rewritten with another nodeID/topologyKeys) or a removal."""

COUNT_CHANGED: Final = f"""{_NEW}.exists(d, {_OLD}.exists(o,
    {_SAME_ENTRY}
    && {_count('d')} != {_count('o')}))"""
"""Some entry that stays changes its count (to or from absent ``allocatable``/``count`` included)."""

RAISES: Final = f"""{INCREASE}
|| !{STRUCTURAL}
  && ({_annotations_changed(TRUST_ANNOTATIONS)}
    || {_annotations_changed((STATE_ANNOTATION,))}
    && !{COUNT_CHANGED})"""
"""True for the writes the ``Fail`` entries take (evaluated on UPDATE only): an increase, or a change of a
trust-raising annotation -- or of the guard's state alone -- without a registration or removal.

Counts are compared as ``[count]`` or ``[]`` (absent), so no sentinel value can collide with a real one; drivers
are matched by name, never by index (kubelet re-appends the driver it updates). The state annotation counts
only without a count change, because /validate sees the state /mutate just wrote on every admitted change.
"""

NODE_KUBELET: Final = """request.userInfo.username == 'system:node:' + request.name
  && has(request.userInfo.groups) && 'system:nodes' in request.userInfo.groups"""
"""The writer is the node's own kubelet: ``system:node:<node>`` in group ``system:nodes`` (a CSINode is named
after its Node; NodeRestriction lets a kubelet write only its own). Anyone else's write that matters -- a
stranger's removal, CREATE or decrease, another node's -- goes to the ``Fail`` entry."""

STATE_CHANGED: Final = _annotations_changed((STATE_ANNOTATION,))
"""The guard's state annotation changes or disappears in the object (mutating: before the guard's own patch)."""

MATTERS: Final = f"""({STRUCTURAL}
    || {COUNT_CHANGED}
    || {_annotations_changed(GUARD_ANNOTATIONS)})"""
"""A registration, a removal, a count change or a guard annotation change: a write the guard reads."""


WIDE_DRIVERS: Final = 64
"""Drivers in the object or oldObject above which the conditions do not compare entries (:data:`WIDE`)."""

WIDE: Final = f"({_NEW}.size() > {WIDE_DRIVERS} || {_OLD}.size() > {WIDE_DRIVERS})"
"""A write of a wide CSINode. The conditions pair the entries of object and oldObject (``exists`` in ``exists``):
their cost grows with the square of the drivers, and past kube-apiserver's per-expression cost limit
(``PerCallLimit``, 1,000,000) the expression fails, which the ``Fail`` entry turns into a refusal: measured on
v1.36.2, the kubelet's periodic update of a 2,001-driver CSINode was refused ("actual cost limit exceeded"),
an outage. So a wide write is routed by its writer alone, before any pairing (``||`` and ``&&`` short-circuit): the
node's own kubelet to the ``Ignore`` entry (never refused by an unreachable guard; the guard still judges it in full
when it answers), anyone else to the ``Fail`` entry. What remains: while the guard is down, an increase on a node
with more than 64 drivers is not refused (the audit lowers it afterwards)."""


def _judged(mutating: bool) -> str:
    raises = f"{RAISES}\n|| {STATE_CHANGED}" if mutating else RAISES
    return f"""(request.operation == 'CREATE' || request.operation == 'DELETE') && !({NODE_KUBELET})
|| request.operation == 'UPDATE' && (!({NODE_KUBELET}) && ({WIDE} || {MATTERS})
  || !{WIDE} && ({raises}))"""


def _node_own(mutating: bool) -> str:
    raises = f"{RAISES}\n|| {STATE_CHANGED}" if mutating else RAISES
    return f"""({NODE_KUBELET})
&& (request.operation == 'CREATE' || request.operation == 'DELETE'
  || request.operation == 'UPDATE' && ({WIDE}
    || !({raises})
    && {MATTERS}))"""


RAISES_CONDITION_NAME: Final = "raises-a-count-or-trust-or-not-the-nodes-kubelet"
RAISES_EXPRESSION: Final = _judged(mutating=True)
"""Mutating ``Fail`` entry: a count or trust raised, the state changed, or anyone but the node's kubelet (its
CREATE, DELETE or a write that matters)."""
VALIDATING_RAISES_EXPRESSION: Final = _judged(mutating=False)
"""Validating ``Fail`` entry: as :data:`RAISES_EXPRESSION`, but the state only alone (/validate sees the state
/mutate just wrote on every admitted change)."""

NEVER_REFUSED_CONDITION_NAME: Final = "the-nodes-own-registration-removal-create-or-decrease"
NEVER_REFUSED_EXPRESSION: Final = _node_own(mutating=True)
VALIDATING_NEVER_REFUSED_EXPRESSION: Final = _node_own(mutating=False)
"""The complement of the ``Fail`` condition among the writes that matter: the node's own kubelet's CREATE or DELETE,
or an UPDATE of it with a registration, a removal, a count decrease or a guard annotation change that raises nothing."""


def match_conditions(*, mutating: bool, never_refused: bool) -> tuple[Mapping[str, str], ...]:
    """The ``matchConditions`` of one entry. The first (``create-update-or-delete-only``) keeps every other
    operation out even if someone widens ``rules``: a ``false`` condition skips the webhook whatever the others
    evaluate to."""
    if never_refused:
        expression = NEVER_REFUSED_EXPRESSION if mutating else VALIDATING_NEVER_REFUSED_EXPRESSION
        name = NEVER_REFUSED_CONDITION_NAME
    else:
        expression = RAISES_EXPRESSION if mutating else VALIDATING_RAISES_EXPRESSION
        name = RAISES_CONDITION_NAME
    return (
        {"name": OPERATIONS_CONDITION_NAME, "expression": OPERATIONS_EXPRESSION},
        {"name": name, "expression": expression},
    )


MATCH_CONDITIONS: Final[tuple[Mapping[str, str], ...]] = match_conditions(mutating=True, never_refused=False)
"""The mutating ``Fail`` entry's conditions."""

NEVER_REFUSED_MATCH_CONDITIONS: Final[tuple[Mapping[str, str], ...]] = match_conditions(
    mutating=True, never_refused=True
)
"""The mutating ``Ignore`` entry's conditions."""

RULES: Final[tuple[Mapping[str, Any], ...]] = (
    {
        "operations": ["CREATE", "UPDATE", "DELETE"],
        "apiGroups": ["storage.k8s.io"],
        "apiVersions": ["v1"],
        "resources": ["csinodes"],
        "scope": "Cluster",
    },
)


def _py_drivers(obj: Mapping[str, Any] | None) -> list[Mapping[str, Any]]:
    raw = ((obj or {}).get("spec") or {}).get("drivers")
    return [d for d in raw if isinstance(d, Mapping)] if isinstance(raw, list) else []


def _py_count(entry: Mapping[str, Any]) -> list[Any]:
    allocatable = entry.get("allocatable")
    if isinstance(allocatable, Mapping) and allocatable.get("count") is not None:
        return [allocatable["count"]]
    return []


def _py_same_entry(o: Mapping[str, Any], d: Mapping[str, Any]) -> bool:
    def topology(e: Mapping[str, Any]) -> list[Any]:
        keys = e.get("topologyKeys")
        return keys if isinstance(keys, list) else []

    return bool(o.get("name") == d.get("name") and o.get("nodeID", "") == d.get("nodeID", "")
                and topology(o) == topology(d))


def _py_annotation(obj: Mapping[str, Any] | None, key: str) -> list[str]:
    annotations = ((obj or {}).get("metadata") or {}).get("annotations")
    if isinstance(annotations, Mapping) and key in annotations:
        return [annotations[key]]
    return []


def webhook_entry(
    operation: str,
    old: Mapping[str, Any] | None,
    new: Mapping[str, Any] | None,
    *,
    username: str = "",
    groups: Sequence[str] = (),
    name: str = "",
    mutating: bool = True,
) -> str | None:
    """Which entry of a configuration the apiserver calls for a write by ``username``/``groups`` on the CSINode
    ``name``: ``"fail"`` (``failurePolicy: Fail``), ``"ignore"`` (the node's own never-refused writes) or None.

    The Python reading of :func:`match_conditions` (``mutating``: which configuration), for the offline admission
    chain (``policy test``, ``replay``); tests/deploy checks both agree on many objects.
    """
    own = username == f"system:node:{name}" and "system:nodes" in groups
    if operation in ("CREATE", "DELETE"):
        return "ignore" if own else "fail"
    if operation != "UPDATE":
        return None
    new_drivers, old_drivers = _py_drivers(new), _py_drivers(old)
    if len(new_drivers) > WIDE_DRIVERS or len(old_drivers) > WIDE_DRIVERS:
        return "ignore" if own else "fail"  # routed by the writer alone (WIDE)
    pairs = [(o, d) for d in new_drivers for o in old_drivers if _py_same_entry(o, d)]
    increase = any(
        _py_count(o) and (not _py_count(d) or any(dc > oc for dc in _py_count(d) for oc in _py_count(o)))
        for o, d in pairs
    )
    paired_new = {id(d) for _, d in pairs}
    new_names = {d.get("name") for d in new_drivers}
    structural = any(id(d) not in paired_new for d in new_drivers) or any(
        o.get("name") not in new_names for o in old_drivers
    )
    count_changed = any(_py_count(d) != _py_count(o) for o, d in pairs)

    def changed(keys: Sequence[str]) -> bool:
        return any(_py_annotation(new, k) != _py_annotation(old, k) for k in keys)

    raises = increase or (
        not structural and (changed(TRUST_ANNOTATIONS) or (changed((STATE_ANNOTATION,)) and not count_changed))
    )
    if mutating and changed((STATE_ANNOTATION,)):
        raises = True
    matters = structural or count_changed or changed(GUARD_ANNOTATIONS)
    if raises or (matters and not own):
        return "fail"
    return "ignore" if matters else None


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


def _webhook(name: str, target: WebhookTarget, path: str, *, never_refused: bool = False) -> dict[str, Any]:
    conditions = match_conditions(mutating=path == MUTATE_PATH, never_refused=never_refused)
    return {
        "name": name,
        "clientConfig": build_client_config(target, path),
        "rules": copy.deepcopy([dict(rule) for rule in RULES]),
        "matchPolicy": MATCH_POLICY,
        "matchConditions": [dict(condition) for condition in conditions],
        "failurePolicy": NEVER_REFUSED_FAILURE_POLICY if never_refused else FAILURE_POLICY,
        "sideEffects": SIDE_EFFECTS,
        "timeoutSeconds": TIMEOUT_SECONDS,
        "admissionReviewVersions": list(ADMISSION_REVIEW_VERSIONS),
    }


NODE_RULES: Final = (
    {
        "operations": ["CREATE", "UPDATE"],
        "apiGroups": [""],
        "apiVersions": ["v1"],
        # kubelet changes its own labels through nodes/status too (PatchNodeStatus after updateDefaultLabels).
        "resources": ["nodes", "nodes/status"],
        "scope": "Cluster",
    },
)
"""What the Node entry matches: CREATE and UPDATE of Nodes and their status."""


def _map_of(obj: str, field: str) -> str:
    return f"(has({obj}.metadata.{field}) ? {obj}.metadata.{field} : {{}})"


NODE_LABELS_CONDITIONS: Final = (
    {
        "name": "labels-or-their-record-change",
        "expression": (
            "request.operation == 'CREATE'\n"
            f"|| {_map_of('object', 'labels')} != {_map_of('oldObject', 'labels')}\n"
            f"|| (has(object.metadata.annotations) && '{PROVENANCE_ANNOTATION}' in object.metadata.annotations\n"
            f"    ? [object.metadata.annotations['{PROVENANCE_ANNOTATION}']] : [])\n"
            "  != (has(oldObject.metadata.annotations)"
            f" && '{PROVENANCE_ANNOTATION}' in oldObject.metadata.annotations\n"
            f"    ? [oldObject.metadata.annotations['{PROVENANCE_ANNOTATION}']] : [])"
        ),
    },
)
"""The Node entry is called for a CREATE, and for an UPDATE that changes the labels or the guard's record of them:
never for the kubelet's status heartbeats (same labels, same record)."""


def node_labels_webhook(target: WebhookTarget) -> dict[str, Any]:
    """The Node entry of the mutating configuration: CREATE/UPDATE of ``nodes`` (and ``nodes/status``) when labels
    or their record change, sent to :data:`~webhook.admission.label_provenance.NODE_LABELS_PATH`, ``failurePolicy:
    Ignore`` (it observes and never refuses: a guard that is down leaves a label unvouched, the safe direction)."""
    return {
        "name": NODE_LABELS_WEBHOOK_NAME,
        "clientConfig": build_client_config(target, NODE_LABELS_PATH),
        "rules": copy.deepcopy([dict(rule) for rule in NODE_RULES]),
        "matchPolicy": MATCH_POLICY,
        "matchConditions": [dict(condition) for condition in NODE_LABELS_CONDITIONS],
        "failurePolicy": NEVER_REFUSED_FAILURE_POLICY,
        "sideEffects": SIDE_EFFECTS,
        "timeoutSeconds": TIMEOUT_SECONDS,
        "admissionReviewVersions": list(ADMISSION_REVIEW_VERSIONS),
        "reinvocationPolicy": REINVOCATION_POLICY,
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
    webhooks = [
        _webhook(MUTATING_WEBHOOK_NAME, target or WebhookTarget(), MUTATE_PATH),
        _webhook(MUTATING_NEVER_REFUSED_NAME, target or WebhookTarget(), MUTATE_PATH, never_refused=True),
    ]
    for webhook in webhooks:
        webhook["reinvocationPolicy"] = REINVOCATION_POLICY
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": _metadata(name, annotations),
        "webhooks": webhooks,
    }


def build_validating_webhook_configuration(
    target: WebhookTarget | None = None,
    *,
    name: str = CONFIGURATION_NAME,
    annotations: Mapping[str, str] | None = None,
    validation: str = VALIDATION_WEBHOOK,
) -> dict[str, Any]:
    """The ``admissionregistration.k8s.io/v1`` ValidatingWebhookConfiguration for ``target``.

    ``validation``: ``webhook`` (every write the entries match is sent to /validate) or ``cel`` (both entries get
    :data:`webhook.kube.one_call.NOT_DECIDED_CONDITION`: /validate is called only where the final counts are not
    the ones the state /mutate wrote records). Raises ValueError for another value.
    """
    if validation not in VALIDATION_MODES:
        raise ValueError(f"validation must be one of {', '.join(VALIDATION_MODES)}, not {validation!r}")
    webhooks = [
        _webhook(VALIDATING_WEBHOOK_NAME, target or WebhookTarget(), VALIDATE_PATH),
        _webhook(VALIDATING_NEVER_REFUSED_NAME, target or WebhookTarget(), VALIDATE_PATH, never_refused=True),
    ]
    if validation != VALIDATION_WEBHOOK:
        for webhook in webhooks:
            webhook["matchConditions"].append(dict(NOT_DECIDED_CONDITION))
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": _metadata(name, annotations),
        "webhooks": webhooks,
    }


NODE_CONFIGURATION_SUFFIX: Final = "-nodes"
"""The Node entry has a MutatingWebhookConfiguration of its own, named ``<name>-nodes``: the CSINode
configurations stay as they are, and the guard's Node observation can be removed without touching them."""


def node_configuration_name(name: str = CONFIGURATION_NAME) -> str:
    """``metadata.name`` of the Node entry's MutatingWebhookConfiguration for the CSINode configurations' ``name``."""
    return name + NODE_CONFIGURATION_SUFFIX


def build_node_webhook_configuration(
    target: WebhookTarget | None = None,
    *,
    name: str = CONFIGURATION_NAME,
    annotations: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The MutatingWebhookConfiguration ``<name>-nodes`` holding the Node entry (:func:`node_labels_webhook`);
    ``target`` and ``annotations`` as in :func:`build_mutating_webhook_configuration`."""
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": _metadata(node_configuration_name(name), annotations),
        "webhooks": [node_labels_webhook(target or WebhookTarget())],
    }


def build_webhook_configurations(
    target: WebhookTarget | None = None,
    *,
    name: str = CONFIGURATION_NAME,
    annotations: Mapping[str, str] | None = None,
    validation: str = VALIDATION_WEBHOOK,
) -> list[dict[str, Any]]:
    """Both configurations, mutating first (the order ``register`` applies them in); ``validation`` as in
    :func:`build_validating_webhook_configuration`."""
    return [
        build_mutating_webhook_configuration(target, name=name, annotations=annotations),
        build_validating_webhook_configuration(target, name=name, annotations=annotations, validation=validation),
    ]


_VALIDATING_ENTRIES: Final = (VALIDATING_WEBHOOK_NAME, VALIDATING_NEVER_REFUSED_NAME)


def validation_of(configuration: Mapping[str, Any]) -> str | None:
    """The mode a stored ValidatingWebhookConfiguration of the guard is in: ``cel`` when both of its entries carry
    :data:`webhook.kube.one_call.NOT_DECIDED_CONDITION` (by name), ``webhook`` when neither does, None when the
    entries are missing or disagree."""
    found = {w.get("name"): any(isinstance(c, Mapping) and c.get("name") == NOT_DECIDED_CONDITION["name"]
                                for c in w.get("matchConditions") or [])
             for w in configuration.get("webhooks") or [] if isinstance(w, Mapping)}
    marks = {found.get(name) for name in _VALIDATING_ENTRIES}
    if marks == {True}:
        return VALIDATION_CEL
    if marks == {False}:
        return VALIDATION_WEBHOOK
    return None


def with_validation(configuration: Mapping[str, Any], validation: str) -> dict[str, Any] | None:
    """A copy of the guard's stored ValidatingWebhookConfiguration switched to ``validation`` (``webhook`` or
    ``cel``): the one-call matchCondition added to (with today's expression) or removed from both validating
    entries, every other field as stored (caBundle, labels, other conditions). None when it is already so.
    Raises ValueError for another mode."""
    if validation not in VALIDATION_MODES:
        raise ValueError(f"validation must be one of {', '.join(VALIDATION_MODES)}, not {validation!r}")
    updated = copy.deepcopy(dict(configuration))
    changed = False
    for webhook in updated.get("webhooks") or []:
        if not isinstance(webhook, dict) or webhook.get("name") not in _VALIDATING_ENTRIES:
            continue
        conditions = list(webhook.get("matchConditions") or [])
        ours = NOT_DECIDED_CONDITION["name"]
        kept = [c for c in conditions if not (isinstance(c, Mapping) and c.get("name") == ours)]
        wanted = kept + ([dict(NOT_DECIDED_CONDITION)] if validation == VALIDATION_CEL else [])
        if wanted != conditions:
            webhook["matchConditions"] = wanted
            changed = True
    return updated if changed else None


class _LiteralDumper(yaml.SafeDumper):
    """A SafeDumper that writes multi-line strings (the CEL expression) as ``|`` blocks."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_LiteralDumper.add_representer(str, _represent_str)


def dump_yaml(objects: Sequence[Mapping[str, Any]]) -> str:
    """A multi-document YAML stream of ``objects`` (what ``register --dry-run`` prints); loads back equal."""
    return yaml.dump_all([dict(obj) for obj in objects], Dumper=_LiteralDumper, sort_keys=False, width=120)
