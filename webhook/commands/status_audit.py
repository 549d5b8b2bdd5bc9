"""The standing violations section of ``csinode-guard status``: which node, which entry, why, since when.

Judged here with the audit's own pure judgement (:func:`webhook.admission.standing.judge_standing`, which is
admission's) on the CSINodes, Nodes and VolumeAttachments ``status`` lists anyway and the CSIDrivers, so it
answers the same as the audit under the same policy.
"Since" is the ``eventTime`` of the audit's Event about that finding (``events.k8s.io/v1`` in ``default``,
label ``csinode-guard.io/audit``, one deterministic name per finding: :func:`webhook.kube.events.event_name`);
"-" when the audit has not reported it (yet), when Events are not readable, or once the apiserver expired
the Event (``--event-ttl``, 1 h by default). Without ``--state-key-file`` the state is read unverified.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from webhook.admission.cluster import ClusterView, StaticClusterView
from webhook.admission.csinode import CSINodeError, format_count, parse_csinode
from webhook.admission.label_provenance import PROVENANCE_ANNOTATION, ceiling_labels
from webhook.admission.policy import Policy
from webhook.admission.standing import StandingFinding, judge_standing
from webhook.admission.state import STATE_ANNOTATION, StateKeys, decode_state, read_state_unverified
from webhook.kube import kubeapi
from webhook.kube.events import EVENT_LABEL, EVENT_NAMESPACE, event_name
from webhook.kube.watch.records import parse_csidriver, parse_node, parse_volume_attachment

EVENTS = kubeapi.ApiResource("events.k8s.io", "v1", "events", "Event", namespaced=True)


def read_audit_events(client: kubeapi.KubeClient) -> dict[str, str]:
    """The audit's Events by name -> ``eventTime``; empty when they cannot be read (no RBAC on events)."""
    try:
        items = client.list_all(EVENTS, namespace=EVENT_NAMESPACE, label_selector=EVENT_LABEL)
    except (kubeapi.KubeApiError, kubeapi.ApiUnreachableError):
        return {}
    return {str((e.get("metadata") or {}).get("name")): str(e.get("eventTime") or "") for e in items}


def read_csidrivers(client: kubeapi.KubeClient) -> list[kubeapi.JSON]:
    """Every CSIDriver (their update periods are an input of change-rate); empty when they cannot be read."""
    try:
        return client.list_all(kubeapi.CSIDRIVERS)
    except (kubeapi.KubeApiError, kubeapi.ApiUnreachableError):
        return []


def status_cluster_view(
    nodes: Sequence[Mapping[str, Any]], volume_attachments: Sequence[Mapping[str, Any]],
    csidrivers: Sequence[Mapping[str, Any]], keys: StateKeys | None = None,
) -> StaticClusterView:
    """The cluster as ``status`` read it, as the :class:`~webhook.admission.cluster.ClusterView` admission asks:
    Node labels (and kubelet versions where the Nodes carry a status), the attach errors of the
    VolumeAttachments, the CSIDrivers' update periods; a ceiling label counts only where the guard's record on the
    Node (verified with ``keys``) says an identity other than the node set it, as admission reads it
    (:mod:`webhook.admission.label_provenance`); without ``keys``, where the state is read unverified too, every
    label counts. Driver versions from the ``pod`` source and the newest
    state sequence are unknown to ``status`` (None): it judges those entries as admission does when they are."""
    view = StaticClusterView()
    for n in nodes:
        name = str((n.get("metadata") or {}).get("name") or "")
        record = parse_node(n)
        view.nodes[name] = {"labels": dict(record.labels), "kubeletVersion": record.kubelet_version}
        if keys is not None:
            metadata = n.get("metadata") or {}
            view.nodes[name]["vouchedLabels"] = ceiling_labels(
                record.labels, (metadata.get("annotations") or {}).get(PROVENANCE_ANNOTATION), name,
                str(metadata.get("uid") or ""), keys)
    for va in volume_attachments:
        attachment = parse_volume_attachment(va)
        if attachment.error is not None:
            view.attach_error_list.setdefault((attachment.node, attachment.driver), []).append(attachment.error)
    for d in csidrivers:
        period = parse_csidriver(d).update_period
        if period is not None:
            view.driver_periods[str((d.get("metadata") or {}).get("name") or "")] = period
    return view


def standing_findings(
    csinodes: Sequence[Mapping[str, Any]], cluster: ClusterView, policy: Policy,
    keys: StateKeys | None, now: datetime, *, node_names: set[str] | None = None,
) -> list[StandingFinding]:
    """Every standing finding of ``csinodes`` (JSON objects) under ``policy`` at ``now``, sorted by node: the
    audit's judgement (admission's) with ``cluster`` (:func:`status_cluster_view`). Without ``keys`` the state is
    read unverified."""
    judging_keys = keys if keys is not None else StateKeys([secrets.token_bytes(32)])  # verifies nothing here
    found: list[StandingFinding] = []
    for obj in csinodes:
        try:
            node = parse_csinode(obj)
        except CSINodeError:
            continue
        if node_names is not None and node.name not in node_names:
            continue
        raw = node.annotations.get(STATE_ANNOTATION)
        decoded = decode_state(raw, node.uid, keys) if keys is not None else read_state_unverified(raw, node.uid)
        found.extend(judge_standing(node, decoded, policy, cluster, now, judging_keys).findings)
    return sorted(found, key=lambda f: (f.node, f.driver or "", f.rule))


def findings_json(findings: Sequence[StandingFinding], since: Mapping[str, str]) -> list[dict[str, Any]]:
    """The findings as JSON-ready dicts (``since`` None when unknown)."""
    return [{"node": f.node, "driver": f.driver, "rule": f.rule, "stored": f.stored, "allowed": f.allowed,
             "repairable": f.repairable, "why": f.why, "since": since.get(event_name(f.node, f.key)) or None}
            for f in findings]


def format_findings(findings: Sequence[StandingFinding], since: Mapping[str, str]) -> str:
    """The section's text (empty when nothing stands)."""
    if not findings:
        return ""
    rows = [("NODE", "DRIVER", "RULE", "STORED", "ALLOWED", "SINCE", "WHY")]
    for f in findings:
        rows.append((f.node, f.driver or "-", f.rule, format_count(f.stored) if f.driver else "-",
                     format_count(f.allowed) if f.allowed is not None else "-",
                     since.get(event_name(f.node, f.key)) or "-", f.why))
    widths = [max(len(r[i]) for r in rows) for i in range(6)]
    lines = ["", f"standing violations ({len(findings)}; the audit reports and, with spec.reconcile: clamp, lowers "
                 "them):"]
    for r in rows:
        lines.append("   ".join(r[i].ljust(widths[i]) for i in range(6)) + "   " + r[6])
    return "\n".join(lines) + "\n"
