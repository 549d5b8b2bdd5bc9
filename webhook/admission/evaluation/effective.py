"""Where a finding's effective action is decided: a rule's configured ``enforcementAction`` -> what it does here.

- Out of the enforcement scope, or an exempt requester: ``dryrun`` (evaluated and audited as if enforced, never
  blocked).
- A write that is never refused, and a count rule on an entry judged from its last trusted count
  (:attr:`.classify.Write.soft_drivers`; a registration by the node's kubelet too): ``deny`` and ``clamp`` act
  as a ``clamp`` to the count the rule would keep, or a ``warn`` with nothing lower to clamp to or in
  /validate, which cannot patch.
- A ``clamp`` with nothing to clamp to on a decrease: ``warn`` (a lower count is the safe direction); a
  ``clamp`` in /validate (it cannot patch) or without a count: ``deny``.
- The node's own kubelet raising the count of an entry that stays (/mutate): a count rule's ``deny`` acts as a
  ``clamp`` to the stored count (:func:`keeps_stored_count`).

Later adjustments, once every change is judged, are :mod:`.settle`'s (a moot denial becomes a clamp).
"""

from __future__ import annotations

from typing import NamedTuple

from webhook.admission.csinode import CountChange
from webhook.admission.decision import Mode
from webhook.admission.evaluation.classify import Write
from webhook.admission.policy import STATE_INTEGRITY, EnforcementAction
from webhook.admission.rules.base import Violation
from webhook.admission.rules.writer_identity import RULE_ID as WRITER_IDENTITY


class Finding(NamedTuple):
    """A violation with the action it takes: ``change`` what it is about (None: the request) and ``change_index`` that
    change's index in :attr:`.classify.Write.changes`; ``outcome`` the index of its
    :class:`~webhook.admission.decision.RuleOutcome` among the decision's outcomes."""

    change: CountChange | None
    change_index: int | None
    violation: Violation
    effective: EnforcementAction
    outcome: int


def soft(write: Write, change: CountChange | None, rule: str) -> bool:
    """True when ``rule``'s findings on ``change`` (None: request-level) may clamp or warn but never deny: on
    a write that is never refused, and for a count rule on an entry judged from its last trusted count (a
    refusal would keep the untrusted stored count; who writes is judged as usual)."""
    if write.never_refused:
        return True
    if change is None or rule == WRITER_IDENTITY:
        return False
    # A registration is never refused by a count rule, also when it shares its write with an increase.
    return change.driver in write.soft_drivers or (change.registration and write.writer.is_node_kubelet)


def keeps_stored_count(write: Write, v: Violation, change: CountChange | None) -> bool:
    """True when a ``deny`` of ``v`` would only keep the stored count of a rise the node's own kubelet writes.

    The node's kubelet (``system:node:<node>`` in ``system:nodes``) raising the count of an entry that stays
    (not a registration; /mutate only): a count rule's denial (change-rate, the cluster budget, a freeze, a
    recovery or version-rollback check, minVersion, a ceiling set to deny) keeps the stored count, and
    costs kubelet four requests per period — or, when kubelet restarted while its node plugin kept running,
    fails the plugin's registration: kubelet's InstallCSIDriver (pkg/volume/csi/nodeinfomanager) rewrites an
    entry with the same nodeID and topologyKeys but another count with the very PUT of a periodic update.
    Such a denial acts as a clamp to the stored count. Request-level findings (annotations), writer-identity,
    state-integrity and decreases (the drop to 0) are judged as configured.
    """
    return (
        write.writer.is_node_kubelet
        and write.mode is Mode.MUTATE
        and change is not None
        and not change.registration
        and change.is_increase
        and change.old is not None
        and v.rule not in (WRITER_IDENTITY, STATE_INTEGRITY)
    )


def effective_action(write: Write, v: Violation, change: CountChange | None) -> EnforcementAction:
    """What ``v`` (about ``change``; None: the request) does on ``write``, before :func:`keeps_stored_count`."""
    action = v.action
    if not write.in_scope or write.exempt:
        return EnforcementAction.DRYRUN
    if soft(write, change, v.rule) and action in (EnforcementAction.DENY, EnforcementAction.CLAMP):
        # Never refused: a deny acts as a clamp; with nothing lower to clamp to (or in /validate, which
        # cannot patch) the finding is a warning.
        lowers = change is not None and v.clamp_to is not None and (change.new is None or v.clamp_to < change.new)
        return EnforcementAction.CLAMP if lowers and write.mode is Mode.MUTATE else EnforcementAction.WARN
    if action is EnforcementAction.CLAMP and v.clamp_to is None and change is not None and not change.is_increase:
        # Nothing to clamp to, and a lower count is the safe direction: say so, do not block.
        return EnforcementAction.WARN
    if action is EnforcementAction.CLAMP and (write.mode is Mode.VALIDATE or v.clamp_to is None):
        return EnforcementAction.DENY
    return action


def freezes(write: Write, v: Violation, change: CountChange | None, effective: EnforcementAction) -> bool:
    """A version rollback freezes increases unless its finding only ran as a dry run."""
    if not v.freeze or not write.in_scope or write.exempt:
        return False
    if v.action is EnforcementAction.DRYRUN:  # a justified rollback still freezes
        return change is not None and (
            write.policy.for_driver(change.driver).rules.version_action is not EnforcementAction.DRYRUN
        )
    return effective is not EnforcementAction.DRYRUN
