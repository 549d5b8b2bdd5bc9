"""A stored CSINode judged as a write: the count admission allows for each of its entries now.

One judgement (DESIGN.md, audit and reconcile; as Gatekeeper's audit calls the review its admission calls): the
background audit, ``csinode-guard status`` and admission's reconciliation judge a stored entry with the same
function and the same inputs. :func:`judge_stored` judges the stored object as the write "last trusted state ->
stored object": the node's own kubelet writing the object back as it is (an UPDATE whose ``oldObject`` and
``object`` are the stored CSINode), through the stages of :func:`webhook.admission.evaluation.evaluate`:

- :mod:`.classify` judges each entry from the last count the signed state trusts (reconciliation): a stored count
  above it as a change from it, an entry without state by the ceilings, an accepted count above a ceiling the
  policy tightened since by the ceilings; all clamped, never refused; the enforcement scope as admission pins it;
  a replayed or removed state is not used (``ClusterView.newest_state_sequence``: state freshness).
- :mod:`.judge` builds each entry's rule context the one way admission does: the ceiling pinned for the entry
  (not today's label), the driver version from the policy's ``versionSource``, recent attach errors, the
  CSIDriver's update period, the recorded approvals.
- :mod:`.settle` gives each finding its effective action and each entry its final count: the count admission
  would store for that entry at the node's next write, which is the count the audit lowers it to.

No cluster budget is asked (lowering takes nothing from it) and nothing is persisted. Pure: the cluster view
answers from memory, the clock is an argument.
"""

from __future__ import annotations

from datetime import datetime
from typing import NamedTuple

from webhook.admission.cluster import ClusterView
from webhook.admission.csinode import CSINode
from webhook.admission.decision import Mode
from webhook.admission.evaluation.classify import Write, classify
from webhook.admission.evaluation.judge import Judgement, judge
from webhook.admission.evaluation.settle import Settlement, settle
from webhook.admission.policy import Policy
from webhook.admission.review import AdmissionRequest
from webhook.admission.state import DecodedState, StateKeys

NODES_GROUP = "system:nodes"
"""The group of every kubelet's credentials (the Node authorizer's)."""


class StoredJudgement(NamedTuple):
    """The evaluation stages' values for a stored CSINode judged as its kubelet's no-op write: ``write`` (what
    was classified: the changes judged, each from its last trusted count), ``judgement`` (what each rule found,
    with each entry's :class:`~webhook.admission.rules.base.RuleContext`) and ``settlement`` (effective actions,
    ``finals``: each judged entry's allowed count, None = unbounded)."""

    write: Write
    judgement: Judgement
    settlement: Settlement

    def allowed(self, driver: str) -> int | None:
        """The count admission allows for ``driver``'s entry (the stored one when it judged nothing there; None =
        unbounded). Raises KeyError for a driver the object does not have."""
        if driver in self.settlement.finals:
            return self.settlement.finals[driver]
        return self.write.new.drivers[driver].allocatable_count


def kubelet_noop_request(node: str) -> AdmissionRequest:
    """The AdmissionRequest of the node's kubelet (``system:node:<node>`` in ``system:nodes``) writing CSINode
    ``node`` back unchanged, as a dry run (its objects are given to :func:`classify` parsed)."""
    return AdmissionRequest(
        uid="", operation="UPDATE", group="storage.k8s.io", version="v1", resource="csinodes", sub_resource="",
        name=node, username=f"system:node:{node}", groups=(NODES_GROUP, "system:authenticated"), dry_run=True,
        object=None, old_object=None,
    )


def judge_stored(
    node: CSINode,
    policy: Policy,
    cluster: ClusterView,
    now: datetime,
    keys: StateKeys,
    *,
    decoded: DecodedState | None = None,
) -> StoredJudgement:
    """Judge the stored CSINode ``node`` under ``policy`` at ``now`` (timezone-aware UTC) as its kubelet's
    no-op write (see the module docstring). ``cluster`` answers labels, versions, attach errors, periods and the
    newest state sequence seen; ``keys`` verify the state unless ``decoded`` gives it already (verified by the
    watch cache, or read unverified by ``status`` without the key).

    Never raises for any CSINode :func:`webhook.admission.csinode.parse_csinode` accepts.
    """
    write = classify(kubelet_noop_request(node.name), policy, cluster, now, keys, Mode.MUTATE, node, node,
                     decoded=decoded)
    judgement = judge(write, cluster, keys)
    return StoredJudgement(write, judgement, settle(write, judgement))
