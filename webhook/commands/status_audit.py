"""The standing violations section of ``csinode-guard status``: which node, which entry, why, since when.

Judged here with the audit's own pure judgement (:func:`webhook.admission.standing.judge_standing`) on the
CSINodes and Node labels ``status`` lists anyway, so it answers the same as the audit under the same policy.
"Since" is the ``eventTime`` of the audit's Event about that finding (``events.k8s.io/v1`` in ``default``,
label ``csinode-guard.io/audit``, one deterministic name per finding: :func:`webhook.kube.events.event_name`);
"-" when the audit has not reported it (yet), when Events are not readable, or once the apiserver expired
the Event (``--event-ttl``, 1 h by default). Without ``--state-key-file`` the state is read unverified.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from webhook.admission.csinode import CSINodeError, format_count, parse_csinode
from webhook.admission.policy import Policy
from webhook.admission.standing import StandingFinding, judge_standing
from webhook.admission.state import STATE_ANNOTATION, StateKeys, decode_state, read_state_unverified
from webhook.kube import kubeapi
from webhook.kube.events import EVENT_LABEL, EVENT_NAMESPACE, event_name

EVENTS = kubeapi.ApiResource("events.k8s.io", "v1", "events", "Event", namespaced=True)


def read_audit_events(client: kubeapi.KubeClient) -> dict[str, str]:
    """The audit's Events by name -> ``eventTime``; empty when they cannot be read (no RBAC on events)."""
    try:
        items = client.list_all(EVENTS, namespace=EVENT_NAMESPACE, label_selector=EVENT_LABEL)
    except (kubeapi.KubeApiError, kubeapi.ApiUnreachableError):
        return {}
    return {str((e.get("metadata") or {}).get("name")): str(e.get("eventTime") or "") for e in items}


def standing_findings(
    csinodes: Sequence[Mapping[str, Any]], nodes: Sequence[Mapping[str, Any]], policy: Policy,
    keys: StateKeys | None, now: datetime, *, node_names: set[str] | None = None,
) -> list[StandingFinding]:
    """Every standing finding of ``csinodes`` (JSON objects) under ``policy`` at ``now``, sorted by node."""
    labels = {str((n.get("metadata") or {}).get("name")): dict((n.get("metadata") or {}).get("labels") or {})
              for n in nodes}
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
        found.extend(judge_standing(node, decoded, policy, labels.get(node.name), now).findings)
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
