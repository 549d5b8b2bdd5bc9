"""``writer-identity``: only the node's own kubelet, or principals the policy names, change counts.

kubelet writes its CSINode as ``system:node:<node>`` in group ``system:nodes`` (NodeRestriction only checks that
a kubelet writes its own CSINode, not what it writes). A cross-node or unknown writer needs a justification.
"""

from __future__ import annotations

from webhook.admission.rules.base import RuleContext, Violation

RULE_ID = "writer-identity"


def check(ctx: RuleContext) -> list[Violation]:
    """Violation when the writer is neither the node's kubelet nor a listed writer and nothing justifies it."""
    if ctx.writer.is_node_kubelet or ctx.writer.is_listed_writer or ctx.justified:
        return []
    who = ctx.writer.username or "(anonymous)"
    if who == f"system:node:{ctx.change.node}":
        why = f"written as {who} but without the group system:nodes, so not as the node's kubelet"
    elif who.startswith("system:node:"):
        why = f"written by another node's kubelet ({who})"
    else:
        why = f"written by {who}, which is not the node's kubelet nor a writer the policy lists"
    return [
        Violation(
            rule=RULE_ID,
            action=ctx.driver_policy.rules.identity_action,
            why=why,
            proceed="let the node's kubelet report the count, add the principal to spec.writers, "
            "or have an approver set a csinode-guard.io/justification",
            clamp_to=ctx.change.old if ctx.change.is_increase else None,
        )
    ]
