"""What the guard knows about the cluster beyond the AdmissionReview: the ClusterView protocol.

The rules need facts that an AdmissionRequest does not carry: the Node's labels and kubelet version, the
CSIDriver's ``spec.nodeAllocatableUpdatePeriodSeconds``, recent VolumeAttachment attach errors and the driver's
version on the node. The evaluation reads them through :class:`ClusterView`, a read-only protocol whose methods
return ``None`` for *unknown* (cache not synced, watch lost for too long, no cluster at all). Unknown is never the
same as empty: the rules then follow the design's asymmetry (decreases and no-ops pass; increases are judged on
what is known).

Two implementations exist: :class:`StaticClusterView` here (tests, ``policy test``, ``evaluate --cluster-facts``,
and the offline default) and ``webhook.kube.watch`` (watch caches filled by the official kubernetes client). This
module is part of the pure core and performs no I/O.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NamedTuple, Protocol


class AttachErrorClass(enum.StrEnum):
    """Class of a VolumeAttachment ``status.attachError.errorCode`` (a gRPC status code).

    Only ``capacity`` (gRPC ResourceExhausted, code 8, KEP-4876) is evidence that the node ran out of attach
    slots; the other classes never justify a lower allocatable count.
    """

    CAPACITY = "capacity"  # 8 ResourceExhausted
    PERMISSION = "permission"  # 7 PermissionDenied
    PRECONDITION = "precondition"  # 9 FailedPrecondition (topology, wrong zone, ...)
    TRANSIENT = "transient"  # 4 DeadlineExceeded, 14 Unavailable
    OTHER = "other"


def classify_attach_error(code: int | None) -> AttachErrorClass:
    """Map a VolumeAttachment ``status.attachError.errorCode`` (gRPC code) to its :class:`AttachErrorClass`."""
    if code == 8:
        return AttachErrorClass.CAPACITY
    if code == 7:
        return AttachErrorClass.PERMISSION
    if code == 9:
        return AttachErrorClass.PRECONDITION
    if code in (4, 14):
        return AttachErrorClass.TRANSIENT
    return AttachErrorClass.OTHER


@dataclass(frozen=True)
class AttachError:
    """One attach error seen on a VolumeAttachment for (node, attacher = driver).

    ``code`` is ``status.attachError.errorCode`` (gRPC code, may be None on older clusters), ``time`` is
    ``status.attachError.time`` (UTC, timezone-aware), ``volume_attachment`` the object's name.
    """

    code: int | None
    time: datetime
    volume_attachment: str = ""
    message: str = ""

    @property
    def error_class(self) -> AttachErrorClass:
        """The error's :class:`AttachErrorClass`."""
        return classify_attach_error(self.code)


class RetainedState(NamedTuple):
    """A node's history record as read (:mod:`webhook.admission.node_history` verifies and decodes it): ``node``
    its name, ``uid`` the CSINode the state was written for, ``node_uid`` the Node's UID when known (""),
    ``state`` the state annotation value, ``saved_at`` when the audit leader saved it."""

    node: str
    uid: str
    node_uid: str
    state: str
    saved_at: datetime


class BrakeEvidence(NamedTuple):
    """One node's evidence for a brake: the guard admitted the increase ``before`` -> ``after`` (None: unbounded)
    of the driver on ``node`` at ``raised_at`` (its signed state's ``raised``), and VolumeAttachment
    ``volume_attachment`` reported the attach error ``code`` at ``failed_at``, after it (both UTC)."""

    node: str
    before: int
    after: int | None
    raised_at: datetime
    failed_at: datetime
    volume_attachment: str
    code: int | None


@dataclass(frozen=True)
class Brake:
    """One driver's brake as the audit leader recorded it (:mod:`webhook.admission.brake`).

    ``engaged_at`` when it engaged (UTC); ``window_start`` the increases admitted at or after it are restored
    (``engaged_at`` minus the policy's ``lookback``); ``last_failure_at`` the newest capacity-class attach failure
    of the driver seen anywhere (the quiet period counts from it); ``evidence`` the failed nodes' increases and
    failures, ``raised_nodes`` how many nodes had an admitted increase inside the lookback; ``released_at`` None
    while engaged, else when it released, ``released_by`` who (``quiet-period``, ``policy`` or the approver's
    username) and ``release_reason`` why."""

    driver: str
    engaged_at: datetime
    window_start: datetime
    last_failure_at: datetime
    evidence: tuple[BrakeEvidence, ...]
    raised_nodes: int
    released_at: datetime | None = None
    released_by: str = ""
    release_reason: str = ""

    @property
    def engaged(self) -> bool:
        """True until it is released."""
        return self.released_at is None


class ClusterView(Protocol):
    """Read-only cluster facts for one admission decision. Every method returns None for *unknown*.

    Implementations must answer from memory (watch caches), never with an API call, and must return within a
    few milliseconds even when a cache is being rebuilt.
    """

    def node_labels(self, node: str) -> Mapping[str, str] | None:
        """Labels of the Node named ``node`` (the CSINode's name), or None when unknown."""
        ...

    def vouched_node_labels(self, node: str) -> Mapping[str, str] | None:
        """The Node's labels a ceiling may be selected by, or None when unknown: those the node's kubelet cannot set
        and those whose value an identity other than the node set, as the guard's signed record on the Node says
        (:mod:`webhook.admission.label_provenance`). A label the node set itself is left out."""
        ...

    def node_exists(self, node: str) -> bool | None:
        """True when the Node named ``node`` exists, False when the Node cache is synced and has no such Node, None
        when unknown. A CSINode whose Node is gone is the garbage collector's to delete (its ownerReference names
        the Node), so such a DELETE is not a stranger's removal of a live node's limits."""
        ...

    def kubelet_version(self, node: str) -> str | None:
        """``status.nodeInfo.kubeletVersion`` of the Node, e.g. ``v1.35.1``, or None when unknown."""
        ...

    def driver_update_period(self, driver: str) -> float | None:
        """CSIDriver ``spec.nodeAllocatableUpdatePeriodSeconds`` in seconds; None when unset or unknown."""
        ...

    def csidriver_exists(self, driver: str) -> bool | None:
        """True when the cluster has a CSIDriver object named ``driver``, False when it has none, None unknown.

        A driver without one draws nothing from change-rate's cluster budget (it is judged by the ceilings and
        its own entry's rules): the node can invent driver names at will, and fifty invented drivers raised at
        once must not spend the increases every other node needs (issue 32, attack 8)."""
        ...

    def driver_version(self, node: str, driver: str) -> str | None:
        """Version of ``driver`` running on ``node`` from the policy's ``pod`` version source, or None.

        Only pods a DaemonSet controls, bound to the node, count (never mirror pods, never their status); two
        versions on one node resolve to the lower.
        """
        ...

    def attach_errors(self, node: str, driver: str, since: datetime) -> Sequence[AttachError] | None:
        """Attach errors of VolumeAttachments for (node, attacher = driver) with ``time >= since``; None unknown."""
        ...

    def attached_volumes(self, node: str, driver: str) -> int | None:
        """Number of attached VolumeAttachments (``status.attached``) for (node, driver), or None when unknown."""
        ...

    def newest_state_sequence(self, uid: str) -> int | None:
        """The highest ``seq`` of a verified ``csinode-guard.io/state`` seen on the CSINode with ``metadata.uid``
        ``uid`` (a CSINode watch), or None when none was seen or it is unknown. A state older than it is a replay."""
        ...

    def retained_state(self, node: str) -> RetainedState | None:
        """The node's history record (:mod:`webhook.admission.node_history`): the newest state the guard saw on any
        CSINode of that name, kept where only the guard writes; None when there is none or it is unknown. Its
        signature is checked by the reader (``RetainedState.decoded``)."""
        ...

    def brake(self, driver: str) -> Brake | None:
        """The driver's engaged :class:`Brake` (the audit leader's signed record), or None when none is engaged or
        it is unknown (the rules then judge increases on their own merits)."""
        ...


@dataclass
class StaticClusterView:
    """An in-memory :class:`ClusterView` built from plain values; anything not given is unknown (None).

    ``nodes`` maps node name -> {"labels": {...}, "kubeletVersion": "v1.35.0", "vouchedLabels": {...}}
    (``vouchedLabels``, the labels a ceiling may be selected by, defaults to ``labels``: offline facts are the
    operator's own); ``driver_periods`` maps driver
    -> seconds; ``driver_versions`` maps node -> driver -> version; ``attach_error_list`` maps (node, driver)
    -> errors; ``attached`` maps (node, driver) -> count. ``known_attach_errors`` says whether an absent
    (node, driver) means "no errors" (True) or "unknown" (False). ``state_sequences`` maps a CSINode's UID to
    the newest state sequence seen for it; ``retained`` maps a node name to its history record.
    """

    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    driver_periods: dict[str, float] = field(default_factory=dict)
    driver_versions: dict[str, dict[str, str]] = field(default_factory=dict)
    attach_error_list: dict[tuple[str, str], list[AttachError]] = field(default_factory=dict)
    attached: dict[tuple[str, str], int] = field(default_factory=dict)
    known_attach_errors: bool = True
    state_sequences: dict[str, int] = field(default_factory=dict)
    retained: dict[str, RetainedState] = field(default_factory=dict)
    nodes_complete: bool = False
    """True when ``nodes`` lists every Node of the cluster (then a node not in it does not exist)."""
    csidrivers: frozenset[str] | None = None
    """The CSIDriver objects the cluster has, by name; None: unknown."""
    brakes: dict[str, Brake] = field(default_factory=dict)

    def node_exists(self, node: str) -> bool | None:
        """See :meth:`ClusterView.node_exists`: True for a node given in ``nodes``; unknown (None) otherwise, unless
        ``nodes_complete`` says the given nodes are all there are."""
        if node in self.nodes:
            return True
        return False if self.nodes_complete else None

    def node_labels(self, node: str) -> Mapping[str, str] | None:
        """See :meth:`ClusterView.node_labels`."""
        info = self.nodes.get(node)
        if info is None:
            return None
        labels = info.get("labels")
        return dict(labels) if isinstance(labels, Mapping) else {}

    def vouched_node_labels(self, node: str) -> Mapping[str, str] | None:
        """See :meth:`ClusterView.vouched_node_labels`: ``vouchedLabels``, else ``labels``."""
        info = self.nodes.get(node)
        if info is None:
            return None
        labels = info.get("vouchedLabels", info.get("labels"))
        return dict(labels) if isinstance(labels, Mapping) else {}

    def kubelet_version(self, node: str) -> str | None:
        """See :meth:`ClusterView.kubelet_version`."""
        info = self.nodes.get(node)
        value = info.get("kubeletVersion") if info else None
        return str(value) if value else None

    def driver_update_period(self, driver: str) -> float | None:
        """See :meth:`ClusterView.driver_update_period`."""
        return self.driver_periods.get(driver)

    def csidriver_exists(self, driver: str) -> bool | None:
        """See :meth:`ClusterView.csidriver_exists`."""
        return None if self.csidrivers is None else driver in self.csidrivers

    def driver_version(self, node: str, driver: str) -> str | None:
        """See :meth:`ClusterView.driver_version`."""
        return self.driver_versions.get(node, {}).get(driver)

    def attach_errors(self, node: str, driver: str, since: datetime) -> Sequence[AttachError] | None:
        """See :meth:`ClusterView.attach_errors`."""
        errors = self.attach_error_list.get((node, driver))
        if errors is None:
            return [] if self.known_attach_errors else None
        return [e for e in errors if e.time >= since]

    def attached_volumes(self, node: str, driver: str) -> int | None:
        """See :meth:`ClusterView.attached_volumes`."""
        return self.attached.get((node, driver))

    def newest_state_sequence(self, uid: str) -> int | None:
        """See :meth:`ClusterView.newest_state_sequence`."""
        return self.state_sequences.get(uid)

    def retained_state(self, node: str) -> RetainedState | None:
        """See :meth:`ClusterView.retained_state`."""
        return self.retained.get(node)

    def brake(self, driver: str) -> Brake | None:
        """See :meth:`ClusterView.brake`: the record in ``brakes`` while it is engaged."""
        found = self.brakes.get(driver)
        return found if found is not None and found.engaged else None


class UnknownClusterView:
    """A :class:`ClusterView` that knows nothing: the offline default when no cluster is configured."""

    def node_exists(self, node: str) -> bool | None:
        """Always unknown."""
        return None

    def node_labels(self, node: str) -> Mapping[str, str] | None:
        """Always unknown."""
        return None

    def vouched_node_labels(self, node: str) -> Mapping[str, str] | None:
        """Always unknown."""
        return None

    def kubelet_version(self, node: str) -> str | None:
        """Always unknown."""
        return None

    def driver_update_period(self, driver: str) -> float | None:
        """Always unknown."""
        return None

    def csidriver_exists(self, driver: str) -> bool | None:
        """Always unknown."""
        return None

    def driver_version(self, node: str, driver: str) -> str | None:
        """Always unknown."""
        return None

    def attach_errors(self, node: str, driver: str, since: datetime) -> Sequence[AttachError] | None:
        """Always unknown."""
        return None

    def attached_volumes(self, node: str, driver: str) -> int | None:
        """Always unknown."""
        return None

    def newest_state_sequence(self, uid: str) -> int | None:
        """Always unknown."""
        return None

    def retained_state(self, node: str) -> RetainedState | None:
        """Always unknown."""
        return None

    def brake(self, driver: str) -> Brake | None:
        """Always unknown."""
        return None


@dataclass(frozen=True)
class PodVersionSource:
    """Policy ``versionSource`` of type ``pod`` for one driver: where the driver's node pods run.

    ``namespace`` and ``match_labels`` (a label selector's ``matchLabels``) select the driver's node pods;
    the version is read from the image tag of ``container`` (``registry/image:v1.37.0`` -> ``v1.37.0``), or,
    when ``label`` is set, from that pod label. Only pods with a DaemonSet controller reference and ``spec.nodeName``
    equal to the node count, in any phase; mirror pods never (the node can create those and write every pod's status).
    """

    driver: str
    namespace: str
    match_labels: tuple[tuple[str, str], ...]
    container: str | None = None
    label: str | None = None
