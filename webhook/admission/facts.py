"""Cluster facts from a YAML/JSON document, as a :class:`webhook.admission.cluster.StaticClusterView`.

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

import json
from collections.abc import Mapping
from functools import cache
from importlib import resources
from typing import Any

import jsonschema

from webhook.admission.cluster import AttachError, StaticClusterView
from webhook.admission.policy import describe_schema_error, json_path
from webhook.admission.state import parse_time


class FactsError(ValueError):
    """The facts document has a field of the wrong shape (message names it)."""


@cache
def _schema() -> dict[str, Any]:
    text = resources.files("webhook").joinpath("schema/clusterfacts.schema.json").read_text("utf-8")
    loaded: dict[str, Any] = json.loads(text)
    return loaded


def check_facts(doc: Any) -> None:
    """Check a facts document against ``webhook/schema/clusterfacts.schema.json``; raises FactsError naming the
    JSON path of the first (deepest) violation and the constraint (``$.nodes['n1'].labels: 7 is not of type
    'object', 'null'``)."""
    validator = jsonschema.Draft202012Validator(_schema())
    errors = sorted(validator.iter_errors(doc), key=lambda e: (-len(e.absolute_path), str(e.absolute_path)))
    if errors:
        best = jsonschema.exceptions.best_match(errors) or errors[0]
        raise FactsError(f"{json_path(best.absolute_path)}: {describe_schema_error(best)}")


def view_from_facts(doc: Mapping[str, Any] | None) -> StaticClusterView:
    """Build a StaticClusterView from a facts document (see the module docstring); raises FactsError when the
    document breaks the schema (:func:`check_facts`) or a time is not RFC 3339."""
    doc = {} if doc is None else doc
    if not isinstance(doc, Mapping):
        raise FactsError("cluster facts must be a mapping (nodes, driverPeriods, driverVersions, attachErrors, "
                         "attached)")
    check_facts(doc)
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
