"""Who set a Node label: the guard's signed record on the Node, ``csinode-guard.io/label-provenance``.

A ceiling selected by a Node label (``ceiling.nodeLabel``, a driver profile) is only as good as whoever set the
label. Under NodeRestriction the node's own kubelet may set ``node.kubernetes.io/instance-type`` and many more
labels on its own Node (:mod:`webhook.admission.node_labels`), at creation too (``--node-labels``, or a Node it
POSTs itself), and the field manager in ``managedFields`` is whatever the writer sent. What the writer cannot
choose is its authenticated identity, ``request.userInfo``. So the guard has an observe-only entry on Node
CREATE and UPDATE (``failurePolicy: Ignore``, never refuses, called only when the labels or this annotation
change: webhook/kube/registration.py) that records, for every label the node could set itself, whether the value
now on the Node was set by an identity other than the node (``system:node:<name>`` in ``system:nodes``). The record
is this annotation, HMAC-signed with the state key and bound to the Node's name and UID::

    {"v": 1, "node": "node-a", "uid": "<metadata.uid, '' when recorded at CREATE>",
     "labels": {"node.kubernetes.io/instance-type": "m6i.large"},
     "sig": "<base64url HMAC-SHA256 of the document without sig>"}

``labels`` holds only values an identity other than the node set (vouched values); a value the node set, or one
set while the guard was not called, is not in it. A ceiling is then selected only by a *vouched* label
(:func:`vouched_labels`): a label the kubelet cannot set at all, or one whose current value equals the recorded
one. Anything else resolves as an unknown label (the ``unknown`` ceiling), or the entry's pin.

What the record is built from: the *old* object's verified record (never the one the writer sends), the old and
new labels, and the requester. The node may strip or replace the annotation: while the guard is up its entry is
called and puts the old record back; while the guard is down a stripped record vouches for nothing (the safe
direction) and a replayed record of its own Node vouches only for values an identity other than the node once set
on that Node. Bounded: at most :data:`MAX_VOUCHED` labels are kept (the rest are not vouched). Pure: no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from webhook.admission.node_labels import kubelet_can_set
from webhook.admission.review import AdmissionRequest, AdmissionResponse
from webhook.admission.state import StateKeys, _canonical

PROVENANCE_ANNOTATION = "csinode-guard.io/label-provenance"
NODE_LABELS_PATH = "/node-labels"
"""The path the guard serves the Node entry on (webhook/kube/registration.py registers it)."""
FORMAT_VERSION = 1
MAX_VOUCHED = 64
"""At most this many vouched labels per Node are recorded (sorted by key; the rest count as set by the node)."""

MAX_ANNOTATION_BYTES = 16 * 1024
"""A record longer than this is not read (the guard never writes one: :data:`MAX_VOUCHED` short labels)."""


def is_node_itself(username: str, groups: Sequence[str], node: str) -> bool:
    """True when the requester is the node's own kubelet: ``system:node:<node>`` in group ``system:nodes`` (the
    identity NodeRestriction and the Node authorizer recognise)."""
    return username == f"system:node:{node}" and "system:nodes" in groups


def encode_provenance(node: str, uid: str, vouched: Mapping[str, str], keys: StateKeys) -> str:
    """The signed annotation value binding ``vouched`` (label -> value set by an identity other than the node) to
    Node ``node`` with ``metadata.uid`` ``uid`` ("" at CREATE, before the apiserver assigns one). Deterministic."""
    doc: dict[str, Any] = {"v": FORMAT_VERSION, "node": node, "uid": uid, "labels": dict(vouched)}
    payload = _canonical(doc)
    doc["sig"] = keys.sign(payload)
    return _canonical(doc).decode("ascii")


def decode_provenance(value: str | None, node: str, uid: str, keys: StateKeys) -> dict[str, str]:
    """The vouched labels of a verified record for Node ``node`` (``uid``), or {} when the annotation is absent,
    malformed, too long, not signed by a state key, or recorded for another Node (another name, or another UID; a
    record made at CREATE carries "" and is accepted for the Node of that name). Never raises."""
    if not value or len(value) > MAX_ANNOTATION_BYTES:
        return {}
    try:
        doc = json.loads(value)
    except (ValueError, RecursionError):
        return {}
    if not isinstance(doc, dict) or doc.get("v") != FORMAT_VERSION:
        return {}
    signature = doc.pop("sig", None)
    labels = doc.get("labels")
    if not isinstance(signature, str) or not isinstance(labels, dict):
        return {}
    if doc.get("node") != node or doc.get("uid") not in ("", uid):
        return {}
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
        return {}
    if set(doc) != {"v", "node", "uid", "labels"} or not keys.verify(_canonical(doc), signature):
        return {}
    return dict(labels)


def ceiling_labels(labels: Mapping[str, str], record: str | None, node: str, uid: str,
                   keys: StateKeys) -> dict[str, str]:
    """The labels of Node ``node`` (``uid``) a ceiling may be selected by, given its provenance annotation
    ``record`` (None when absent). A Node with a record, valid or not: :func:`vouched_labels` of what it verifies
    to. A Node with none: every label. Such a Node was created and labelled before the guard's Node entry was
    registered (installing the guard must not lower every existing node's ceiling to the unknown-type one), or
    the record was stripped while the guard was down; either way the ceiling pin in its CSINode's signed state
    (kept by node across re-creation) still bounds what a later label can lift. A node that creates its own Node
    while the Node entry is registered gets a record at CREATE, so its own labels are never vouched for."""
    if record is None:
        return dict(labels)
    return vouched_labels(labels, decode_provenance(record, node, uid, keys))


def vouched_labels(labels: Mapping[str, str], vouched: Mapping[str, str]) -> dict[str, str]:
    """The labels a ceiling may be selected by: every label the node's kubelet cannot set
    (``node-restriction.kubernetes.io/``, most of ``kubernetes.io``) and every other label whose value equals the
    one an identity other than the node set (``vouched``, from :func:`decode_provenance`)."""
    return {k: v for k, v in labels.items() if not kubelet_can_set(k) or vouched.get(k) == v}


class LabelWrite(NamedTuple):
    """One Node write as the provenance entry sees it: ``node`` the Node's name, ``uid`` its ``metadata.uid`` (""
    at CREATE), ``create`` a CREATE, ``by_node`` the requester is the node itself (:func:`is_node_itself`),
    ``old_labels``/``new_labels`` the labels before and after ({} at CREATE for the old), ``old_record`` the old
    object's annotation value (None at CREATE or when absent)."""

    node: str
    uid: str
    create: bool
    by_node: bool
    old_labels: Mapping[str, str]
    new_labels: Mapping[str, str]
    old_record: str | None


def record_label_write(write: LabelWrite, keys: StateKeys) -> dict[str, str]:
    """The vouched labels after ``write``: the old verified record's values that are still on the Node, plus every
    label the node could set that this write set or changed by an identity other than the node; a label the node
    sets or changes is dropped. At CREATE the record starts empty (an annotation the creator sends is never read).
    A Node the guard has never observed (an UPDATE whose old object carries no record: labelled before the Node
    entry was registered) starts from its old labels, as :func:`ceiling_labels` reads such a Node. At most
    :data:`MAX_VOUCHED` labels, by key."""
    if write.create:
        before: dict[str, str] = {}
    elif write.old_record is None:
        before = dict(write.old_labels)
    else:
        before = decode_provenance(write.old_record, write.node, write.uid, keys)
    after: dict[str, str] = {}
    for key in sorted(write.new_labels):
        value = write.new_labels[key]
        if not kubelet_can_set(key):
            continue  # the node cannot set it: trusted without a record
        changed = write.create or write.old_labels.get(key) != value
        if changed:
            if not write.by_node:
                after[key] = value
        elif before.get(key) == value:
            after[key] = value
    return dict(list(after.items())[:MAX_VOUCHED])


def provenance_patch(
    write: LabelWrite, annotations: Mapping[str, str] | None, keys: StateKeys
) -> list[dict[str, Any]]:
    """The JSONPatch (RFC 6902) that leaves the new Node object carrying the record of ``write``; ``annotations``
    are the new object's ``metadata.annotations`` (None when absent). Empty when it already carries exactly that
    value (a reinvocation, or a write that changed no label the node could set)."""
    value = encode_provenance(write.node, write.uid, record_label_write(write, keys), keys)
    if annotations is None:
        return [{"op": "add", "path": "/metadata/annotations", "value": {PROVENANCE_ANNOTATION: value}}]
    if annotations.get(PROVENANCE_ANNOTATION) == value:
        return []
    path = "/metadata/annotations/" + PROVENANCE_ANNOTATION.replace("~", "~0").replace("/", "~1")
    return [{"op": "add", "path": path, "value": value}]


def _labels_of(obj: Mapping[str, Any] | None) -> dict[str, str]:
    meta = obj.get("metadata") if obj is not None else None
    labels = meta.get("labels") if isinstance(meta, Mapping) else None
    if not isinstance(labels, Mapping):
        return {}
    return {str(k): str(v) for k, v in labels.items()}


def _annotations_of(obj: Mapping[str, Any] | None) -> Mapping[str, str] | None:
    meta = obj.get("metadata") if obj is not None else None
    annotations = meta.get("annotations") if isinstance(meta, Mapping) else None
    return {str(k): str(v) for k, v in annotations.items()} if isinstance(annotations, Mapping) else None


def is_node_request(request: AdmissionRequest) -> bool:
    """True for a CREATE or UPDATE of core/v1 ``nodes`` or its ``status`` subresource (kubelet changes its own
    labels through ``nodes/status`` too: ``PatchNodeStatus`` after ``updateDefaultLabels``)."""
    return (request.group == "" and request.version == "v1" and request.resource == "nodes"
            and request.sub_resource in ("", "status") and request.operation in ("CREATE", "UPDATE")
            and request.object is not None)


def review_label_write(request: AdmissionRequest, keys: StateKeys) -> AdmissionResponse:
    """The answer of the Node entry: always allowed (it observes, never refuses); with a JSONPatch that leaves the
    Node carrying the record of this write (:func:`provenance_patch`) when it does not already. A request for
    another resource is allowed unchanged."""
    if not is_node_request(request):
        return AdmissionResponse(allowed=True)
    obj = request.object
    old = request.old_object
    meta = obj.get("metadata") if obj is not None else None
    old_meta = old.get("metadata") if old is not None else None
    name = request.name or (str(meta.get("name", "")) if isinstance(meta, Mapping) else "")
    create = request.operation == "CREATE"
    uid = "" if create or not isinstance(old_meta, Mapping) else str(old_meta.get("uid") or "")
    old_annotations = _annotations_of(old)
    write = LabelWrite(
        node=name,
        uid=uid,
        create=create,
        by_node=is_node_itself(request.username, request.groups, name),
        old_labels=_labels_of(old),
        new_labels=_labels_of(obj),
        old_record=old_annotations.get(PROVENANCE_ANNOTATION) if old_annotations else None,
    )
    return AdmissionResponse(allowed=True, patch=provenance_patch(write, _annotations_of(obj), keys))
