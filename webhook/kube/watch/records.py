"""Slim cache records: only the fields the rules read, parsed from the API's JSON.

The kubernetes client's models validate every field of every object (pydantic) and keep them all; a watch cache of
thousands of Nodes and VolumeAttachments built from them is slow to fill and large. The providers parse the JSON
themselves and keep one small frozen record per object. Strings that repeat across objects (label keys and values,
image names, driver and node names) are interned so that 5,000 records share one copy of each.

The parse functions are pure: a decoded object (``dict``) in, a record or None out.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import semver

from webhook.admission import versions
from webhook.admission.capacity import is_pending_on_volume_limits
from webhook.admission.cluster import AttachError, PodVersionSource
from webhook.admission.label_provenance import PROVENANCE_ANNOTATION, ceiling_labels
from webhook.admission.state import StateKeys

_intern = sys.intern


@dataclass(frozen=True, slots=True)
class NodeRecord:
    """A Node: ``metadata.labels`` and ``status.nodeInfo.kubeletVersion`` (e.g. ``v1.35.1``, "" when unset);
    ``vouched`` the labels a ceiling may be selected by (:func:`webhook.admission.label_provenance.vouched_labels`
    with the verified record; None when parsed without the state keys: then only labels the node cannot set)."""

    labels: Mapping[str, str]
    kubelet_version: str
    vouched: Mapping[str, str] | None = None


@dataclass(frozen=True, slots=True)
class CSIDriverRecord:
    """A CSIDriver: ``spec.nodeAllocatableUpdatePeriodSeconds`` in seconds (None when unset, KEP-4876)."""

    update_period: float | None


@dataclass(frozen=True, slots=True)
class VolumeAttachmentRecord:
    """A VolumeAttachment (storage.k8s.io/v1).

    ``driver`` is ``spec.attacher``, ``node`` is ``spec.nodeName``, ``attached`` is ``status.attached``, ``error``
    is ``status.attachError`` (None when absent or when it carries no ``time``).
    """

    node: str
    driver: str
    attached: bool
    error: AttachError | None


@dataclass(frozen=True, slots=True)
class PodRecord:
    """A DaemonSet-controlled driver pod: ``spec.nodeName``, ``metadata.labels`` and ``spec.containers[].{name,image}``
    (never ``status``, which the node writes)."""

    node: str
    labels: Mapping[str, str]
    images: tuple[tuple[str, str], ...]

    def version(self, source: PodVersionSource) -> str | None:
        """The driver version this pod reports under ``source``, unparsed (e.g. ``v1.37.0``), or None.

        With ``source.label`` set, that pod label's value; otherwise the image tag of the container named
        ``source.container`` (the first container when no name is given).
        """
        if source.label:
            return self.labels.get(source.label) or None
        for name, image in self.images:
            if source.container is None or name == source.container:
                return image_tag(image)
        return None


def object_key(obj: Mapping[str, Any]) -> str | None:
    """The cache key of an object: ``namespace/name`` for namespaced objects, ``name`` otherwise."""
    meta = obj.get("metadata")
    if not isinstance(meta, Mapping):
        return None
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        return None
    namespace = meta.get("namespace")
    return f"{namespace}/{name}" if isinstance(namespace, str) and namespace else name


def resource_version(obj: Mapping[str, Any]) -> str | None:
    """``metadata.resourceVersion`` of an object, a list or a BOOKMARK, or None."""
    meta = obj.get("metadata")
    if isinstance(meta, Mapping):
        rv = meta.get("resourceVersion")
        if isinstance(rv, str) and rv:
            return rv
    return None


def _labels(meta: Mapping[str, Any]) -> Mapping[str, str]:
    raw = meta.get("labels")
    if not isinstance(raw, Mapping):
        return {}
    return {_intern(str(k)): _intern(str(v)) for k, v in raw.items()}


def _get(obj: Mapping[str, Any], *path: str) -> Any:
    value: Any = obj
    for part in path:
        if not isinstance(value, Mapping):
            return None
        value = value.get(part)
    return value


def parse_node(obj: Mapping[str, Any]) -> NodeRecord:
    """A :class:`NodeRecord` from a core/v1 Node."""
    version = _get(obj, "status", "nodeInfo", "kubeletVersion")
    return NodeRecord(
        labels=_labels(_get(obj, "metadata") or {}),
        kubelet_version=_intern(version) if isinstance(version, str) else "",
    )


def make_node_parser(keys: StateKeys) -> Callable[[Mapping[str, Any]], NodeRecord]:
    """A parser like :func:`parse_node` that also verifies the guard's label provenance record on the Node
    (``csinode-guard.io/label-provenance``, bound to the Node's name and UID, signed with ``keys``) and keeps the
    labels it vouches for in ``vouched``."""

    def parse(obj: Mapping[str, Any]) -> NodeRecord:
        record = parse_node(obj)
        meta = _get(obj, "metadata") or {}
        annotations = meta.get("annotations") if isinstance(meta, Mapping) else None
        value = annotations.get(PROVENANCE_ANNOTATION) if isinstance(annotations, Mapping) else None
        name, uid = _get(obj, "metadata", "name"), _get(obj, "metadata", "uid")
        vouched = ceiling_labels(record.labels, value if isinstance(value, str) else None, str(name or ""),
                                 str(uid or ""), keys)
        return NodeRecord(record.labels, record.kubelet_version, vouched)

    return parse


def parse_csidriver(obj: Mapping[str, Any]) -> CSIDriverRecord:
    """A :class:`CSIDriverRecord` from a storage.k8s.io/v1 CSIDriver."""
    period = _get(obj, "spec", "nodeAllocatableUpdatePeriodSeconds")
    if isinstance(period, bool) or not isinstance(period, int | float):
        return CSIDriverRecord(update_period=None)
    return CSIDriverRecord(update_period=float(period))


def parse_time(value: object) -> datetime | None:
    """An RFC 3339 ``metav1.Time`` / ``MicroTime`` (``2025-03-01T12:00:00Z``) as an aware UTC datetime, or None."""
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return parsed.astimezone(UTC)


@dataclass(frozen=True, slots=True)
class PendingPodRecord:
    """An unscheduled Pod Pending because of volume limits (``PodScheduled`` False, Unschedulable, the scheduler's
    NodeVolumeLimits message ``node(s) exceed max volume count``): only how many there are counts."""

    namespace: str


def parse_volume_limit_pending(obj: Mapping[str, Any]) -> PendingPodRecord | None:
    """A :class:`PendingPodRecord` for a Pod Pending on volume limits; None for any other pod (not kept).

    The scheduler writes that condition of a pod no node is bound to: no node can write it (NodeRestriction lets a
    node write the status of pods bound to it only)."""
    if not is_pending_on_volume_limits(obj):
        return None
    namespace = _get(obj, "metadata", "namespace")
    return PendingPodRecord(_intern(namespace) if isinstance(namespace, str) else "")


def parse_volume_attachment(obj: Mapping[str, Any]) -> VolumeAttachmentRecord:
    """A :class:`VolumeAttachmentRecord` from a storage.k8s.io/v1 VolumeAttachment.

    ``status.attachError.errorCode`` is the gRPC code the external-attacher copied from ControllerPublishVolume
    (KEP-4876, Kubernetes >= 1.33); it may be absent on older clusters (``code`` None).
    """
    node = _get(obj, "spec", "nodeName")
    driver = _get(obj, "spec", "attacher")
    error: AttachError | None = None
    raw_error = _get(obj, "status", "attachError")
    if isinstance(raw_error, Mapping):
        when = parse_time(raw_error.get("time"))
        if when is not None:
            code = raw_error.get("errorCode")
            message = raw_error.get("message")
            error = AttachError(
                code=code if isinstance(code, int) and not isinstance(code, bool) else None,
                time=when,
                volume_attachment=str(_get(obj, "metadata", "name") or ""),
                message=message if isinstance(message, str) else "",
            )
    return VolumeAttachmentRecord(
        node=_intern(node) if isinstance(node, str) else "",
        driver=_intern(driver) if isinstance(driver, str) else "",
        attached=_get(obj, "status", "attached") is True,
        error=error,
    )


MIRROR_POD_ANNOTATION = "kubernetes.io/config.mirror"
"""Annotation of a mirror pod: the API copy of a static pod, which a node creates itself (NodeRestriction
``admitPodCreate`` lets a node create only these, bound to itself, with a single owner reference to its Node)."""


def daemonset_controlled(meta: Mapping[str, Any]) -> bool:
    """True when ``metadata.ownerReferences`` holds a controller reference to an ``apps/v1`` DaemonSet.

    The apiserver allows at most one controller reference per object (``ValidateOwnerReferences``); NodeRestriction
    refuses a node's pod whose single owner reference is not its own Node, so no pod a node created passes.
    """
    owners = meta.get("ownerReferences")
    if not isinstance(owners, list):
        return False
    return any(
        isinstance(owner, Mapping)
        and owner.get("controller") is True
        and owner.get("kind") == "DaemonSet"
        and owner.get("apiVersion") == "apps/v1"
        for owner in owners
    )


def parse_pod(obj: Mapping[str, Any]) -> PodRecord | None:
    """A :class:`PodRecord` for a driver pod a DaemonSet controls, bound to a node; None for any other pod.

    Only what the node cannot write counts. A node may update the status of pods bound to it (phase,
    ``containerStatuses[].image``), delete them, and create mirror pods (NodeRestriction ``admitPodStatus``,
    ``admitPod``, ``admitPodCreate``); it may not change a pod's metadata or spec (the Node authorizer gives nodes
    ``pods/status``, never ``update pods``). So: never a mirror pod (annotation ``kubernetes.io/config.mirror``, i.e.
    a static pod), only a pod with a DaemonSet controller reference, and the images and labels from
    ``metadata``/``spec`` as the DaemonSet controller set them -- whatever ``status`` says. The phase is ignored: a
    node marking its driver pod Failed does not hide its version (the DaemonSet controller deletes a failed pod
    and creates its replacement from the same template).
    """
    meta = _get(obj, "metadata")
    if not isinstance(meta, Mapping):
        return None
    annotations = meta.get("annotations")
    if isinstance(annotations, Mapping) and MIRROR_POD_ANNOTATION in annotations:
        return None
    if not daemonset_controlled(meta):
        return None
    node = _get(obj, "spec", "nodeName")
    if not isinstance(node, str) or not node:
        return None
    containers = _get(obj, "spec", "containers")
    images: list[tuple[str, str]] = []
    if isinstance(containers, list):
        for container in containers:
            if isinstance(container, Mapping):
                name, image = container.get("name"), container.get("image")
                if isinstance(name, str) and isinstance(image, str):
                    images.append((_intern(name), _intern(image)))
    return PodRecord(node=_intern(node), labels=_labels(meta), images=tuple(images))


def image_tag(image: str) -> str | None:
    """The tag of a container image reference, or None when it has none.

    ``public.ecr.aws/ebs-csi-driver/aws-ebs-csi-driver:v1.37.0`` -> ``v1.37.0``; a digest is ignored
    (``repo:v1.2@sha256:...`` -> ``v1.2``; ``repo@sha256:...`` -> None); a registry port is not a tag
    (``registry:5000/repo`` -> None). Reference grammar: distribution/reference ``reference.go``.
    """
    name = image.split("@", 1)[0]
    colon = name.rfind(":")
    if colon > name.rfind("/"):
        return name[colon + 1 :] or None
    return None


def parse_version(text: str) -> semver.Version | None:
    """A version string as :class:`semver.Version` (``webhook.admission.versions`` rules), or None when it is not one.

    Vendor build suffixes (``-eksbuild.1``) are builds of their release; real pre-releases (``-rc.1``) order
    below it. Cached in ``webhook.admission.versions``: the admission path calls it on every lookup.
    """
    try:
        return versions.parse_version(text)
    except versions.VersionError:
        return None


def lowest_version(versions: list[str]) -> str | None:
    """The lowest of ``versions`` by SemVer precedence; unparsable ones are ignored; None when none parses.

    Two strings of equal precedence (``v1.37`` and ``1.37.0``) resolve to the lexically smaller one, so the answer
    does not depend on the order of the input.
    """
    best: tuple[semver.Version, str] | None = None
    for text in versions:
        parsed = parse_version(text)
        if parsed is None:
            continue
        if best is None or parsed < best[0] or (parsed == best[0] and text < best[1]):
            best = (parsed, text)
    return best[1] if best else None
