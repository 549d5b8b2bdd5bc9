"""Cluster facts from a YAML/JSON document, as a :class:`webhook.cluster.StaticClusterView`.

For ``csinode-guard evaluate --cluster-facts FILE`` and offline experiments::

    nodes:
      ip-10-0-1-23.ec2.internal:
        labels: {node.kubernetes.io/instance-type: m6i.large}
        kubeletVersion: v1.35.0
    driverPeriods: {ebs.csi.aws.com: 60}            # CSIDriver nodeAllocatableUpdatePeriodSeconds
    driverVersions: {ip-10-0-1-23.ec2.internal: {ebs.csi.aws.com: v1.37.0}}
    attachErrors:                                   # VolumeAttachment status.attachError
      - {node: ip-10-0-1-23.ec2.internal, driver: ebs.csi.aws.com, code: 8, time: "2026-11-30T01:00:00Z"}
    attached:
      - {node: ip-10-0-1-23.ec2.internal, driver: ebs.csi.aws.com, count: 12}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from webhook.cluster import AttachError, StaticClusterView
from webhook.state import parse_time


class FactsError(ValueError):
    """The facts document has a field of the wrong shape (message names it)."""


def view_from_facts(doc: Mapping[str, Any] | None) -> StaticClusterView:
    """Build a StaticClusterView from a facts document (see the module docstring); raises FactsError."""
    doc = doc or {}
    if not isinstance(doc, Mapping):
        raise FactsError("cluster facts must be a mapping")
    try:
        errors: dict[tuple[str, str], list[AttachError]] = {}
        for i, e in enumerate(doc.get("attachErrors") or []):
            key = (str(e["node"]), str(e["driver"]))
            code = e.get("code")
            errors.setdefault(key, []).append(
                AttachError(
                    code=int(code) if code is not None else None,
                    time=parse_time(str(e["time"])),
                    volume_attachment=str(e.get("volumeAttachment", f"va-{i}")),
                    message=str(e.get("message", "")),
                )
            )
        return StaticClusterView(
            nodes={str(k): dict(v or {}) for k, v in (doc.get("nodes") or {}).items()},
            driver_periods={str(k): float(v) for k, v in (doc.get("driverPeriods") or {}).items()},
            driver_versions={
                str(n): {str(d): str(v) for d, v in (m or {}).items()}
                for n, m in (doc.get("driverVersions") or {}).items()
            },
            attach_error_list=errors,
            attached={(str(a["node"]), str(a["driver"])): int(a["count"]) for a in doc.get("attached") or []},
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise FactsError(f"bad cluster facts: {exc!r}") from None
