"""What an apiserver audit log lacks for replay's decisions to be the guard's, by kind of fact.

The guard judges a count with facts from its watch caches: Node labels (ceilings per instance type, the canary's
``enforcementScope``) and kubelet versions (``writer-version`` with the ``kubelet`` source), CSIDriver update periods
(``change-rate``), VolumeAttachment attach errors (ResourceExhausted evidence: a correction that ``count-rollback``
then holds, a backed decrease, the evidence of the automatic brake). Replay rebuilds them from the log's Node,
CSIDriver and VolumeAttachment events, which carry objects only at the ``Request`` or ``RequestResponse`` level. A
log that has them at ``Metadata`` level (many control planes' default audit policy) or not at all gives replay no
such facts, and a decision that needs one can differ from the guard's: replay must say so.
docs/apiserver-audit-policy.yaml is an audit policy that logs them.
"""

from __future__ import annotations

from webhook.simulation.replay_results import Summary

AUDIT_POLICY_DOC = "docs/apiserver-audit-policy.yaml"

_FACTS = {
    "nodes": ("Node labels and kubelet versions", "ceilings by node label, enforcementScope, writer-version (kubelet)"),
    "volumeattachments": ("VolumeAttachment attach errors", "ResourceExhausted evidence: corrections count-rollback "
                          "holds, backed decreases, the brake"),
    "csidrivers": ("CSIDriver update periods", "change-rate's minInterval"),
}


def missing_facts(summary: Summary) -> list[str]:
    """One warning per kind of fact the log lacks: logged at ``Metadata`` level only, or (Nodes) not at all.
    Empty when every kind present carries objects."""
    warnings = []
    for resource, (facts, needed_by) in _FACTS.items():
        seen, with_objects = summary.cluster_facts[resource], summary.fact_objects[resource]
        if seen and not with_objects:
            warnings.append(
                f"{resource} are logged at Metadata level only ({seen} events, no objects): no {facts}, so "
                f"decisions that need them ({needed_by}) may differ from the guard's; log them at Request level "
                f"({AUDIT_POLICY_DOC}) or pass --cluster-facts"
            )
        elif not seen and resource == "nodes":
            warnings.append(
                f"the log has no {resource} events: no {facts}, so decisions that need them ({needed_by}) may "
                f"differ from the guard's; log them at Request level ({AUDIT_POLICY_DOC}) or pass --cluster-facts"
            )
    return warnings


def not_an_apiserver_audit_log(summary: Summary) -> str | None:
    """Why the input is no kube-apiserver audit log (no line has an ``auditID``), or None when it is one."""
    if summary.audit_ids or not summary.lines:
        return None
    return (
        f"none of the {summary.lines} line(s) is a kube-apiserver audit event (JSON lines of audit.k8s.io/v1 Event "
        "with an auditID): this is not an apiserver audit log (the guard's own audit log is read by "
        "`csinode-guard audit`)"
    )
