"""Policy settings whose driver version the node reports itself: ``versionSource: kubelet`` with ``minVersion``.

``kubelet`` reads ``Node.status.nodeInfo.kubeletVersion``, which the node's kubelet writes in its own Node status
(NodeRestriction checks a node's labels, taints and configSource, never ``status.nodeInfo``). A ``minVersion``
judged on it holds against an outdated kubelet that reports truthfully, not against a node that lies:
:func:`version_source_warnings` names each such setting for ``policy validate``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from webhook.admission.node_labels import LabelWarning
from webhook.admission.policy import DriverPolicy, Policy, json_path


def _message(driver: str) -> str:
    who = "drivers the policy does not name" if driver == "*" else driver
    return (f"minVersion for {who} is judged on versionSource kubelet, the kubeletVersion the node reports in its "
            f"own Node status: it holds against an outdated kubelet, not a node that lies; versionSource pod reads "
            f"the DaemonSet pod's spec, which the node cannot change")


def version_source_warnings(policy: Policy) -> list[LabelWarning]:
    """One warning per driver (and the defaults) whose effective ``versionSource`` is ``kubelet`` and which has a
    ``minVersion``; the path points at the setting written in the document (``versionSource``, else
    ``minVersion``), ``label`` is empty."""
    spec = policy.document.get("spec")
    spec = spec if isinstance(spec, Mapping) else {}
    found: list[LabelWarning] = []
    entries: list[tuple[tuple[str, ...], DriverPolicy]] = [(("spec", "defaults"), policy.default_driver)]
    entries += [(("spec", "drivers", name), policy.drivers[name]) for name in policy.drivers]
    for path, driver_policy in entries:
        if driver_policy.version_source.type != "kubelet" or not driver_policy.min_version:
            continue
        written: Any = spec
        for part in path[1:]:
            written = written.get(part) if isinstance(written, Mapping) else None
        written = written if isinstance(written, Mapping) else {}
        if "versionSource" not in written and "minVersion" not in written:
            continue  # inherited from the defaults: named there once
        key = "versionSource" if "versionSource" in written else "minVersion"
        found.append(LabelWarning(json_path((*path, key)), "", _message(driver_policy.driver)))
    return found
