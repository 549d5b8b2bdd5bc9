"""What ``csinode-guard preflight`` judges and what it answers, as plain values: :class:`ClusterFacts` (read by
:mod:`webhook.kube.preflight_gather`, judged by :mod:`webhook.kube.preflight` and :mod:`webhook.kube.preflight_guard`)
and the
:class:`Check` rows the checks return. Pure.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from webhook.kube.registration import CONFIGURATION_NAME


class Status(enum.StrEnum):
    """Outcome of one check; the order is the severity."""

    OK = "OK"
    WARN = "WARN"
    FAIL = "FAIL"


SEVERITY = {Status.OK: 0, Status.WARN: 1, Status.FAIL: 2}


@dataclass(frozen=True)
class Check:
    """One row: ``component`` (kube-apiserver, kubelet, ...), what was ``checked`` and found, the ``status``
    and ``action`` (what to do; empty when nothing)."""

    component: str
    checked: str
    status: Status
    action: str = ""

    def to_json(self) -> dict[str, str]:
        """The row as JSON (``-o json``)."""
        return {"component": self.component, "checked": self.checked, "status": str(self.status),
                "action": self.action}


class ProbeOutcome(enum.StrEnum):
    """What the dry-run count update answered."""

    ACCEPTED = "accepted"
    IMMUTABLE = "immutable"
    REFUSED_BY_ADMISSION = "refused-by-admission"
    REFUSED_AFTER_VALIDATION = "refused-after-validation"
    NO_CANDIDATE = "no-candidate"
    ERROR = "error"


@dataclass(frozen=True)
class ProbeResult:
    """The dry-run probe: ``outcome``, the CSINode/driver it wrote (``target``) and the apiserver's message."""

    outcome: ProbeOutcome
    target: str = ""
    detail: str = ""


@dataclass(frozen=True)
class ServingCertificate:
    """The guard's serving certificate for one webhook: the leaf as DER (None when it could not be fetched),
    where it came from (``source``: ``TLS handshake with host:port``, ``Secret ns/name``), the host name the
    apiserver checks it against, and why fetching failed (``error``)."""

    der: bytes | None
    source: str
    host: str
    error: str = ""


@dataclass(frozen=True)
class ClusterFacts:
    """Everything preflight judges, as plain values (JSON objects as the API returns them).

    ``server_version`` is ``/version``'s ``gitVersion`` (None: unreadable, ``server_version_error`` says why);
    ``scheduler_versions`` the versions found and ``scheduler_source`` where (``--scheduler-version``, pods);
    ``driver_versions`` maps driver -> version -> nodes reporting it (from the policy's version source), with
    ``version_sources`` saying which source was read per driver; ``webhook_configurations`` maps kind -> the
    object (None: absent); ``serving_certificates`` maps webhook name -> certificate; ``deployment`` is the
    guard's Deployment (None: absent or not looked for, ``deployment_note`` says which); ``guard_namespace`` the
    guard's namespace (its audit Lease, node history records and brakes live there) and ``guard_namespace_exists``
    whether the apiserver has it (None: not read); ``before_install`` is ``preflight --before-install``: a guard not
    registered yet is what is expected.
    """

    server_version: str | None
    probe: ProbeResult
    nodes: Sequence[Mapping[str, Any]]
    scheduler_versions: Sequence[str]
    scheduler_source: str
    csidrivers: Sequence[Mapping[str, Any]]
    driver_versions: Mapping[str, Mapping[str, int]]
    version_sources: Mapping[str, str]
    webhook_configurations: Mapping[str, Mapping[str, Any] | None]
    serving_certificates: Mapping[str, ServingCertificate]
    deployment: Mapping[str, Any] | None
    now: datetime
    server_version_error: str = ""
    deployment_note: str = ""
    errors: Mapping[str, str] = field(default_factory=dict)
    configuration_name: str = CONFIGURATION_NAME
    guard_namespace: str = ""
    guard_namespace_exists: bool | None = None
    before_install: bool = False

