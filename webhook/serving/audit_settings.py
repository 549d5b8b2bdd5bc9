"""Settings of the background audit and reconciler (``serve --audit-*``, ``--reconcile-*``, ``--lease-*``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AuditSettings:
    """How the audit runs. Times are seconds.

    ``interval`` 60 s by default: a count that entered during an outage (or that a reload no longer allows) is
    found within a minute -- about one kubelet update period (``nodeAllocatableUpdatePeriodSeconds`` is often
    60 s) -- while a pass over 5,000 CSINodes takes well under a second of one core (README, benchmark). Passes
    also run at start, after a re-list of the CSINode watch and after a policy reload.
    """

    enabled: bool = True
    """``--audit/--no-audit``: run the audit loop at all (with a cluster)."""
    interval: float = 60.0
    """``--audit-interval``: seconds between periodic passes (0: only at start, relists and policy reloads)."""
    dry_run: bool = False
    """``--reconcile-dry-run``: send every repair with ``dryRun=All`` (judged by the apiserver and the webhooks,
    nothing stored); reported with result ``dry-run``."""
    repair_rate: float = 10.0
    """``--reconcile-rate``: repair writes per second at most (client-side token bucket)."""
    repair_burst: int = 20
    """``--reconcile-burst``: repair writes at once at most."""
    event_rate: float = 2.0
    """Events per second at most (their burst is 25); each finding gets one Event."""
    event_burst: int = 25
    """Events at once at most."""
    lease_namespace: str = "csinode-guard"
    """``--lease-namespace``: namespace of the audit Lease (the guard's own; ``POD_NAMESPACE`` in deploy/)."""
    lease_name: str = "csinode-guard-audit"
    """``--lease-name``: name of the audit Lease."""
    lease_duration: float = 15.0
    """``--lease-duration``: a dead leader is replaced within this (plus ``retry_period``)."""
    renew_deadline: float = 10.0
    """The leader stops acting when it could not renew for this long (< ``lease_duration``)."""
    retry_period: float = 2.0
    """Seconds between Lease attempts (and renewals)."""
    poll: float = 0.5
    """Seconds between checks of the loop's triggers (leadership, relist, policy generation, interval)."""
