"""The background audit and reconciler: judge every stored CSINode, report, and (``spec.reconcile: clamp``) repair.

Which process runs it: one per cluster. Inside a replica, the gunicorn workers compete for an exclusive ``flock``
on a file in the replica's shared directory (the kernel releases it when its holder dies, so a replaced worker
takes over); the worker holding it campaigns for the ``coordination.k8s.io/v1`` Lease
(:mod:`webhook.kube.leader`) against the other replicas. Only the Lease holder audits, sends Events and repairs;
every worker of every replica keeps serving admission. The audit reuses the worker's watch caches (the CSINode
watch, Node labels for the ceilings) and its policy store, so it costs no second copy of the cluster in memory.

Passes: at ``start`` (once the CSINode cache synced after this process became the leader), after every ``relist`` of
the CSINode watch, after a ``policy-reload`` (a new policy generation), every ``interval`` seconds, and at the first
poll after a brake this leader engaged reached its own watch (``brake``: the pass that restores the counts it
covers, :class:`AuditClusterView`). A pass first decides the brakes (:mod:`webhook.serving.brake_keeper`; an
approver's release request is honoured at every poll), then judges every record with
:func:`webhook.admission.standing.judge_standing` (admission's own judgement, with the same cluster view admission
asks), publishes the ``csinode_guard_standing_violations`` gauge, sends an Event per new finding (deduplicated,
rate-limited), writes an audit record per new or changed finding (``source: audit``), and with ``clamp`` lowers the
counts through the apiserver (:func:`webhook.kube.repair.repair_csinode`, at the client-side write rate limit). A
repair's audit records and Event give the count etcd holds after it (the update's answer: the guard's own admission
judges the repair and may store less than the target), not the target."""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from webhook.admission.cluster import AttachError, Brake, ClusterView, RetainedState
from webhook.admission.csinode import CSINodeError, format_count, parse_csinode
from webhook.admission.policy import Policy
from webhook.admission.standing import (
    ReconcileMode,
    StandingFinding,
    StandingJudgement,
    audit_record,
    judge_standing,
    reconcile_mode,
)
from webhook.admission.state import STATE_ANNOTATION, StateKeys, decode_state, format_time
from webhook.kube.brakes import BrakeWriter
from webhook.kube.events import EventRecorder, event_name
from webhook.kube.kubeapi import KubeClient
from webhook.kube.leader import LeaderElector, LeaseSettings
from webhook.kube.node_history import HistoryWriter
from webhook.kube.repair import RepairRateLimiter, RepairResult, repair_csinode
from webhook.kube.watch.view import KubernetesClusterView
from webhook.serving import audit_metrics
from webhook.serving.audit_settings import AuditSettings
from webhook.serving.brake_keeper import BrakeKeeper
from webhook.serving.key_check import KeyCheck, check_state_key

log = logging.getLogger("csinode_guard.audit")

NO_DRIVER = "none"
"""The ``driver`` label of a finding about an object's state."""


def candidate_identity() -> str:
    """``<hostname>_<pid>``: the pod name (a pod's hostname) and this worker process."""
    return f"{socket.gethostname()}_{os.getpid()}"


@dataclass
class AuditStatus:
    """What the last pass found: findings by node, and the passes run so far."""

    findings: dict[str, tuple[StandingFinding, ...]] = field(default_factory=dict)
    passes: int = 0


class AuditLoop:
    """The loop of one process; :meth:`start` returns at once (see the module docstring)."""

    def __init__(
        self,
        view: KubernetesClusterView,
        policies: Any,
        keys: StateKeys,
        audit: Any,
        client: KubeClient,
        settings: AuditSettings,
        *,
        lock_dir: Path | None = None,
        known_driver: Any = None,
    ) -> None:
        """``policies`` is the worker's :class:`webhook.serving.live_policy.PolicyStore`, ``audit`` its
        :class:`webhook.serving.audit_writer.AuditWriter`, ``client`` the guard's own API client; ``lock_dir`` the
        replica's shared directory (None: this process is the replica's only candidate)."""
        self.view = view
        self.policies = policies
        self.keys = keys
        self.audit = audit
        self.client = client
        self.settings = settings
        self.lock_dir = lock_dir
        self.known_driver = known_driver
        self.identity = candidate_identity()
        self.elector = LeaderElector(client, self.identity, LeaseSettings(
            namespace=settings.lease_namespace, name=settings.lease_name, lease_duration=settings.lease_duration,
            renew_deadline=settings.renew_deadline, retry_period=settings.retry_period,
        ), on_change=self._on_leadership)
        self.events = EventRecorder(client, self.identity, rate=settings.event_rate, burst=settings.event_burst)
        self.limiter = RepairRateLimiter(settings.repair_rate, settings.repair_burst)
        self.status = AuditStatus()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock_fd: int | None = None
        self._published: set[tuple[str, str]] = set()
        self._recorded: dict[tuple[str, str], str] = {}
        self.history: HistoryWriter | None = None
        if view.history_namespace:
            self.history = HistoryWriter(client, view.history_namespace, keys, view.retained_state)
        self._foreign_said = False
        writer = None
        if view.history_namespace and view.brakes is not None:
            writer = BrakeWriter(client, view.history_namespace, keys)
        self.brakes = BrakeKeeper(view, writer, self.events, audit, self._driver_label)

    # --- lifecycle --------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the loop thread (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="csinode-guard-audit", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """End the loop and give the Lease up."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        self.elector.stop(release=True)

    def _on_leadership(self, leading: bool) -> None:
        audit_metrics.LEADER.set(1 if leading else 0)
        if not leading:
            self._clear_gauges()
            self.brakes.reset()

    def _replica_lock(self) -> bool:
        """Hold the replica's audit lock (non-blocking); True once held."""
        if self.lock_dir is None or self._lock_fd is not None:
            return True
        fd = os.open(self.lock_dir / "audit.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        self._lock_fd = fd
        log.info("this worker (pid %d) runs the replica's audit candidate", os.getpid())
        return True

    # --- the loop ---------------------------------------------------------------------------------------------

    def _run(self) -> None:
        audit_metrics.LEADER.set(0)
        while not self._stop.is_set():
            try:
                if self._replica_lock():
                    break
            except OSError as exc:
                log.warning("audit lock unusable (%s); this worker campaigns anyway", exc)
                break
            self._stop.wait(1.0)
        # A key that verifies none of the stored states is not the cluster's: no Lease, no Event, no record.
        while not self._stop.wait(self.settings.poll):
            if self.view.csinodes_fresh() and not self.key_is_foreign():
                break
        if self._stop.is_set():
            return
        self.elector.start()
        last_pass = 0.0
        relists = -1
        generation = -1
        leading = False
        awaiting: set[str] = set()  # engaged brakes whose record the watch did not show at the last pass
        while not self._stop.wait(self.settings.poll):
            try:
                audit_metrics.LEASE_UNRENEWED.set(self.elector.unrenewed_seconds())
                if not self.elector.is_leader or not self.view.csinodes_fresh():
                    leading = leading and self.elector.is_leader
                    continue
                self._sync_history()
                store = self.view.csinode_store
                snapshot = self.policies.current()
                if leading:
                    self.brakes.honour_requests(snapshot.policy, snapshot.generation, datetime.now(UTC))
                trigger = pass_trigger(
                    leading=leading,
                    relisted=store.relists != relists,
                    reloaded=snapshot.generation != generation,
                    interval_due=self.settings.interval > 0
                    and time.monotonic() - last_pass >= self.settings.interval,
                    record_arrived=bool(awaiting) and not awaiting <= self.brakes_awaiting_record(),
                )
                leading = True
                relists, generation = store.relists, snapshot.generation
                if trigger is None or self.key_is_foreign():
                    continue
                self.run_pass(trigger, snapshot.policy, snapshot.generation)
                last_pass = time.monotonic()
                awaiting = self.brakes_awaiting_record()
            except Exception:
                log.exception("audit pass failed; retrying at the next trigger")

    def brakes_awaiting_record(self) -> set[str]:
        """:func:`awaiting_record` of this leader's brakes."""
        return awaiting_record(self.brakes.brakes(), AuditClusterView(self.view, self.brakes))

    def _sync_history(self) -> None:
        """Copy the CSINodes' newest verified states into the nodes' history records (the leader's job, at every
        poll of the loop: a record lags its CSINode by at most ``poll`` seconds; :mod:`webhook.kube.node_history`)."""
        if self.history is None or self.view.histories is None or not self.view.histories.fresh(
                time.monotonic(), self.settings.lease_duration):
            return
        written = self.history.sync(self.view.csinode_records(), datetime.now(UTC), self.view.retained_records())
        if written:
            log.info("node history: %d record(s) written", written)

    def key_is_foreign(self) -> bool:
        """Whether the state key verifies none of the stored states (:mod:`webhook.serving.key_check`); said once
        as an ERROR when it turns so (and once as a WARNING when it no longer is), and in
        ``csinode_guard_state_key_foreign``."""
        check: KeyCheck = check_state_key(r.decoded for r in self.view.csinode_records())
        audit_metrics.STATE_KEY_FOREIGN.set(1 if check.foreign else 0)
        if check.foreign and not self._foreign_said:
            log.error("%s", check.describe())
        elif not check.foreign and self._foreign_said:
            log.warning("%s: auditing", check.describe())
        self._foreign_said = check.foreign
        return check.foreign

    # --- one pass ---------------------------------------------------------------------------------------------

    def judge_all(self, policy: Policy, now: datetime) -> list[StandingJudgement]:
        """Judge every CSINode in the cache (no I/O but the cache's locks), with admission's judgement and the
        same cluster view admission asks (:class:`AuditClusterView`)."""
        cluster = AuditClusterView(self.view, self.brakes)
        return [judge_standing(record.csinode, record.decoded, policy, cluster, now, self.keys)
                for record in self.view.csinode_records()]

    def run_pass(self, trigger: str, policy: Policy, generation: int) -> list[StandingJudgement]:
        """One audit pass (see the module docstring); returns its judgements."""
        started = time.perf_counter()
        now = datetime.now(UTC)
        # The brakes first; the counts a brake covers are restored once its record reached the watch
        # (AuditClusterView): later in this pass, or in the pass its arrival starts (trigger "brake").
        self.brakes.evaluate(policy, generation, now)
        judgements = self.judge_all(policy, now)
        duration = time.perf_counter() - started
        audit_metrics.AUDIT_PASS_DURATION.observe(duration)
        audit_metrics.AUDIT_PASSES.labels(trigger).inc()
        self._publish(judgements)
        found = [j for j in judgements if j.findings]
        log.info("audit pass (%s): %d CSINodes, %d with findings, %.3f s", trigger, len(judgements), len(found),
                 duration)
        self._report(found, trigger, policy, generation, now)
        if reconcile_mode(policy) is ReconcileMode.CLAMP:
            for judgement in found:
                if judgement.targets and not self._stop.is_set() and self.elector.is_leader:
                    self._repair(judgement, trigger, policy, generation)
        audit_metrics.AUDIT_LAST_PASS.set(time.time())
        self.status.passes += 1
        return judgements

    def _driver_label(self, driver: str | None) -> str:
        if driver is None:
            return NO_DRIVER
        from webhook.serving.metrics import driver_label  # noqa: PLC0415 - the serving worker's labels

        return driver_label(driver, self.known_driver)

    def _publish(self, judgements: list[StandingJudgement]) -> None:
        counts: dict[tuple[str, str], int] = {}
        for j in judgements:
            for f in j.findings:
                key = (f.rule, self._driver_label(f.driver))
                counts[key] = counts.get(key, 0) + 1
        for key in self._published - counts.keys():
            audit_metrics.STANDING_VIOLATIONS.labels(*key).set(0)
        for key, value in counts.items():
            audit_metrics.STANDING_VIOLATIONS.labels(*key).set(value)
        self._published |= counts.keys()

    def _clear_gauges(self) -> None:
        for key in self._published:
            audit_metrics.STANDING_VIOLATIONS.labels(*key).set(0)

    def _report(self, found: list[StandingJudgement], trigger: str, policy: Policy, generation: int,
                now: datetime) -> None:
        current: dict[str, tuple[StandingFinding, ...]] = {j.node: j.findings for j in found}
        for gone in set(self.status.findings) - current.keys():
            self.events.forget(gone)
            for slot in [k for k in self._recorded if k[0] == gone]:
                del self._recorded[slot]
        records = []
        for j in found:
            for f in j.findings:
                key = f.key
                where = (j.node, f"{f.rule}/{f.driver}")
                if self._recorded.get(where) != key:
                    self._recorded[where] = key
                    records.append(audit_record(f, now=now, trigger=trigger, policy_hash=policy.hash,
                                                policy_generation=generation, decision="standing-violation",
                                                final=f.stored))
                self.events.emit(j.node, j.uid, key, reason="StandingViolation", action="Audit", note=f.line(),
                                 name=event_name(j.node, key))
        self.status.findings = current
        if records:
            self.audit.write(records)

    def _judge_fresh(self, policy: Policy) -> Any:
        """``judge(obj) -> targets`` for a repair: the object read from the apiserver, judged again."""

        def judge(obj: Mapping[str, Any]) -> Mapping[str, int]:
            try:
                node = parse_csinode(obj)
            except CSINodeError:
                return {}
            decoded = decode_state(node.annotations.get(STATE_ANNOTATION), node.uid, self.keys)
            return judge_standing(node, decoded, policy, AuditClusterView(self.view, self.brakes), datetime.now(UTC),
                                  self.keys).targets

        return judge

    def _repair(self, judgement: StandingJudgement, trigger: str, policy: Policy, generation: int) -> None:
        outcome = repair_csinode(self.client, judgement.node, self._judge_fresh(policy),
                                 dry_run=self.settings.dry_run, limiter=self.limiter, stop=self._stop.is_set)
        if outcome.result is None:
            return
        lowered = outcome.lowered or dict(judgement.targets)
        # What etcd holds after the repair (the update's answer), which admission may have lowered further than
        # the target; the targets where the write was not stored.
        held: Mapping[str, int | None] = (
            {d: outcome.stored.get(d, c) for d, c in lowered.items()}
            if outcome.result is RepairResult.REPAIRED else lowered
        )
        for driver in lowered:
            audit_metrics.REPAIRS.labels(self._driver_label(driver), outcome.result.value).inc()
        log.log(logging.INFO if outcome.result in (RepairResult.REPAIRED, RepairResult.DRY_RUN) else logging.WARNING,
                "repair of CSINode %s: %s %s%s", judgement.node, outcome.result.value,
                ", ".join(f"{d} -> {format_count(held.get(d, c))}" for d, c in sorted(lowered.items())),
                f" ({outcome.message})" if outcome.message else "")
        now = datetime.now(UTC)
        records = []
        for f in judgement.findings:
            if f.driver is None or f.driver not in lowered:
                continue
            repaired = outcome.result is RepairResult.REPAIRED
            records.append(audit_record(f, now=now, trigger=trigger, policy_hash=policy.hash,
                                        policy_generation=generation, decision=outcome.result.value,
                                        final=held.get(f.driver) if repaired else f.stored,
                                        message=outcome.message))
        if records:
            self.audit.write(records)
        if outcome.result is RepairResult.REPAIRED:
            final = {d: held.get(d) for d in lowered}
            note = "lowered " + ", ".join(f"{d} to {format_count(c)}" for d, c in sorted(final.items())) + \
                   " (spec.reconcile: clamp; the count stored now)"
            key = "repaired/" + ",".join(f"{d}={format_count(c)}" for d, c in sorted(final.items()))
            self.events.emit(judgement.node, judgement.uid, key, reason="Reconciled", action="Reconcile", note=note,
                             warning=False, name=event_name(judgement.node, key))


def pass_trigger(*, leading: bool, relisted: bool, reloaded: bool, interval_due: bool,
                 record_arrived: bool) -> str | None:
    """The trigger of the pass to run at this poll, None for none (the module docstring lists them): ``leading``
    False at the first poll as the leader (``start``), ``relisted`` the CSINode watch re-listed, ``reloaded`` a new
    policy generation, ``interval_due`` ``--audit-interval`` seconds passed since the last pass, ``record_arrived``
    the record of a brake this leader engaged, which its watch did not show at the last pass, now shows
    (``brake``). The first that holds, in that order, names the pass."""
    for trigger, holds in (("start", not leading), ("relist", relisted), ("policy-reload", reloaded),
                           ("interval", interval_due), ("brake", record_arrived)):
        if holds:
            return trigger
    return None


def awaiting_record(decided: Mapping[str, Brake], cluster: ClusterView) -> set[str]:
    """The drivers whose brake the leader engaged (``decided``, by driver) while ``cluster`` (the audit's view,
    :class:`AuditClusterView`) does not show it yet: their counts are restored once it does, at a pass with
    trigger ``brake`` (:func:`pass_trigger`)."""
    return {driver for driver, brake in decided.items() if brake.engaged and cluster.brake(driver) is None}


class AuditClusterView:
    """The worker's :class:`~webhook.kube.watch.view.KubernetesClusterView` as the audit asks it: every answer
    admission gets (driver versions, attach errors, update periods, the newest state sequence seen), the Node
    labels read waiting for the cache's lock (the audit is off the admission path and has no time budget), and the
    brakes as the leader decided them (``keeper``) once its record has reached this worker's own watch.

    That last condition makes the restore under a brake wait for the record admission reads: the pass that
    engages a brake writes the record, and the raised counts are lowered at the pass its arrival in this worker's
    watch starts (trigger ``brake``). Admission judges the guard's own repair write, and a worker that had not
    seen the record yet would judge it as a plain decrease rather than as the restore it is; and a count restored
    while the replicas do not hold increases yet could be raised again at once. Other workers and replicas watch
    the record on their own; waiting for this worker's watch narrows that gap to their lag behind it."""

    def __init__(self, view: KubernetesClusterView, keeper: BrakeKeeper | None = None) -> None:
        self._view = view
        self._keeper = keeper

    def brake(self, driver: str) -> Brake | None:
        """See :meth:`webhook.admission.cluster.ClusterView.brake`: the leader's engaged brake of ``driver`` while
        this worker's watch shows the same engagement (the class docstring says why), else None."""
        seen = self._view.brake(driver)
        if self._keeper is None:
            return seen
        decided = self._keeper.brake(driver)
        if decided is None or seen is None or format_time(seen.engaged_at) != format_time(decided.engaged_at):
            return None
        return decided

    def node_labels(self, node: str) -> Mapping[str, str] | None:
        """See :meth:`webhook.admission.cluster.ClusterView.node_labels`."""
        return self._view.node_labels_for_audit(node)

    def vouched_node_labels(self, node: str) -> Mapping[str, str] | None:
        """See :meth:`webhook.admission.cluster.ClusterView.vouched_node_labels` (waiting for the cache's lock)."""
        return self._view.vouched_node_labels_for_audit(node)

    def kubelet_version(self, node: str) -> str | None:
        """See :meth:`webhook.admission.cluster.ClusterView.kubelet_version`."""
        return self._view.kubelet_version(node)

    def driver_update_period(self, driver: str) -> float | None:
        """See :meth:`webhook.admission.cluster.ClusterView.driver_update_period`."""
        return self._view.driver_update_period(driver)

    def driver_version(self, node: str, driver: str) -> str | None:
        """See :meth:`webhook.admission.cluster.ClusterView.driver_version`."""
        return self._view.driver_version(node, driver)

    def attach_errors(self, node: str, driver: str, since: datetime) -> Sequence[AttachError] | None:
        """See :meth:`webhook.admission.cluster.ClusterView.attach_errors`."""
        return self._view.attach_errors(node, driver, since)

    def attached_volumes(self, node: str, driver: str) -> int | None:
        """See :meth:`webhook.admission.cluster.ClusterView.attached_volumes`."""
        return self._view.attached_volumes(node, driver)

    def newest_state_sequence(self, uid: str) -> int | None:
        """See :meth:`webhook.admission.cluster.ClusterView.newest_state_sequence`."""
        return self._view.newest_state_sequence(uid)

    def retained_state(self, node: str) -> RetainedState | None:
        """See :meth:`webhook.admission.cluster.ClusterView.retained_state`."""
        return self._view.retained_state(node)

    def csidriver_exists(self, driver: str) -> bool | None:
        """See :meth:`webhook.admission.cluster.ClusterView.csidriver_exists`."""
        return self._view.csidriver_exists(driver)

    def node_exists(self, node: str) -> bool | None:
        """See :meth:`webhook.admission.cluster.ClusterView.node_exists`."""
        return self._view.node_exists(node)


def build_audit_loop(settings: AuditSettings, view: Any, policies: Any, keys: StateKeys, audit: Any,
                     lock_dir: Path | None, known_driver: Any = None) -> AuditLoop | None:
    """The worker's audit loop, or None when the audit is off (``--audit-interval 0`` and no other trigger wanted)
    or the view does not watch CSINodes (offline)."""
    if not settings.enabled or not isinstance(view, KubernetesClusterView) or view.csinodes is None:
        return None
    return AuditLoop(view, policies, keys, audit, KubeClient(view.api_client), settings, lock_dir=lock_dir,
                     known_driver=known_driver)
