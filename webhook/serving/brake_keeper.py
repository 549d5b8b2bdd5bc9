"""The audit leader's side of the brake: evaluate the evidence, record the brakes, honour release requests, tell.

The Lease holder's audit loop (:mod:`webhook.serving.audit_loop`) calls :meth:`BrakeKeeper.evaluate` at the start
of every audit pass (before it judges the stored CSINodes; the counts a brake covers are restored once its record
reached the leader's own watch, at a pass of its own: :class:`webhook.serving.audit_loop.AuditClusterView`)
and :meth:`BrakeKeeper.honour_requests` at every poll. The decision is
:func:`webhook.admission.brake.decide_brakes` over the CSINode cache (the admitted increases in the verified states)
and the VolumeAttachment cache (the attach errors); the record is the signed ConfigMap
(:mod:`webhook.kube.brakes`) every replica reads through its watch. A brake that engages or releases gets an
audit-log record, an Event regarding the driver's CSIDriver (``kubectl describe csidriver DRIVER``) and the gauge
``csinode_guard_brake_engaged{driver}``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

from webhook.admission.brake import (
    brake_audit_record,
    decide_brakes,
    describe,
    honour_release,
    release_hint,
)
from webhook.admission.cluster import Brake
from webhook.admission.durations import format_duration
from webhook.admission.policy import Policy
from webhook.admission.state import format_time
from webhook.kube.brakes import BrakeWriter
from webhook.kube.events import EventRecorder
from webhook.kube.kubeapi import ApiUnreachableError, KubeApiError
from webhook.kube.watch.view import KubernetesClusterView
from webhook.serving import audit_metrics

log = logging.getLogger("csinode_guard.brake")


class BrakeKeeper:
    """The leader's brakes (not thread-safe: the audit loop's thread calls it).

    ``view`` the worker's watch caches, ``writer`` the record's writer (None: no namespace, no brakes), ``events``
    and ``audit`` (:class:`webhook.serving.audit_writer.AuditWriter`) where it tells, ``label(driver)`` the metric
    label of a driver (bounded)."""

    def __init__(
        self,
        view: KubernetesClusterView,
        writer: BrakeWriter | None,
        events: EventRecorder,
        audit: Any,
        label: Callable[[str], str],
    ) -> None:
        self.view = view
        self.writer = writer
        self.events = events
        self.audit = audit
        self.label = label
        self._brakes: dict[str, Brake] | None = None  # what this leader wrote last (the watch may lag it)
        self._published: set[str] = set()

    def reset(self) -> None:
        """Forget what this process wrote (leadership lost: the next leader's record is read again)."""
        self._brakes = None
        for label in self._published:
            audit_metrics.BRAKE_ENGAGED.labels(label).set(0)
        self._published.clear()

    def brakes(self) -> dict[str, Brake]:
        """Every driver's brake record, engaged or released, as this leader knows it."""
        if self._brakes is not None:
            return dict(self._brakes)
        book = self.view.brake_book()
        return dict(book.brakes) if book is not None else {}

    def brake(self, driver: str) -> Brake | None:
        """The driver's engaged brake as this leader knows it (:meth:`ClusterView.brake`), None when none."""
        found = self.brakes().get(driver)
        return found if found is not None and found.engaged else None

    def evaluate(self, policy: Policy, generation: int, now: datetime) -> dict[str, Brake]:
        """Decide every driver's brake at ``now`` and record what changed; returns the brakes. API errors are
        logged and tried again at the next pass."""
        if self.writer is None:
            return {}
        records = self.view.csinode_records()
        current = self.brakes()
        updated = decide_brakes(
            policy.brake, current, [(r.csinode.name, r.decoded.state) for r in records], self.view.attach_errors, now
        )
        changed = [
            after
            for driver, after in sorted(updated.items())
            if (before := current.get(driver)) is None or before.engaged != after.engaged
        ]
        if (updated != current or self._record_differs(updated)) and self._write(updated, False):
            self._tell(changed, policy, generation, now)
        self._publish()
        return self.brakes()

    def _record_differs(self, brakes: Mapping[str, Brake]) -> bool:
        """True when the record every replica reads (the watch) does not carry ``brakes``' engagements: the
        ConfigMap was deleted, or edited or forged (read as no brakes). The leader writes it again, or its
        replicas would admit the increases it holds until some brake changed. A watch that lags this leader's
        own write costs one more write of the same record."""
        book = self.view.brake_book()
        seen = book.brakes if book is not None else {}
        return _engagements(seen) != _engagements(brakes)

    def honour_requests(self, policy: Policy, generation: int, now: datetime) -> None:
        """Release a brake an approver asked to release (the request names the driver and the engagement); a
        request that names no engaged brake is removed (logged)."""
        book = self.view.brake_book()
        if self.writer is None or book is None or book.release is None:
            return
        request = book.release
        current = self.brakes()
        released = honour_release(current.get(request.driver), request, now)
        if released is None:
            log.warning(
                "brake release request of %s by %s names no engaged brake (engaged at %s); removed",
                request.driver,
                request.requester,
                format_time(request.engaged_at),
            )
            self._write(current, True)
            return
        current[request.driver] = released
        if self._write(current, True):
            self._tell([released], policy, generation, now)
        self._publish()

    def _write(self, brakes: Mapping[str, Brake], clear_release: bool) -> bool:
        assert self.writer is not None
        try:
            self.writer.write(brakes, clear_release=clear_release)
        except (KubeApiError, ApiUnreachableError) as exc:
            log.warning("brake record not written (tried again at the next pass): %s", exc)
            return False
        self._brakes = dict(brakes)
        return True

    def _tell(self, changed: list[Brake], policy: Policy, generation: int, now: datetime) -> None:
        records = []
        quiet = policy.brake.quiet_period
        for brake in changed:
            records.append(
                brake_audit_record(
                    brake, now=now, policy_hash=policy.hash, policy_generation=generation, quiet_period=quiet
                )
            )
            if brake.engaged:
                log.warning("%s", describe(brake, quiet))
                note = (
                    f"{describe(brake, quiet)}. Every increase of {brake.driver} is held cluster-wide; the "
                    f"counts raised since {format_time(brake.window_start)} go back to the last trusted ones "
                    f"(spec.reconcile: clamp). To release: {release_hint(brake.driver)}."
                )
                reason, warning = "BrakeEngaged", True
            else:
                log.warning("the brake on %s released by %s: %s", brake.driver, brake.released_by, brake.release_reason)
                note = (
                    f"the brake on {brake.driver} (engaged at {format_time(brake.engaged_at)}, "
                    f"{format_duration((now - brake.engaged_at).total_seconds())} ago) released by "
                    f"{brake.released_by}: {brake.release_reason}"
                )
                reason, warning = "BrakeReleased", False
            key = f"brake/{reason}/{format_time(brake.engaged_at)}"
            self.events.emit(
                f"csidriver/{brake.driver}",
                "",
                key,
                reason=reason,
                action="Brake",
                note=note,
                warning=warning,
                name=f"{brake.driver}.brake-{reason.lower()}-{int(brake.engaged_at.timestamp())}"[:253],
                regarding={"apiVersion": "storage.k8s.io/v1", "kind": "CSIDriver", "name": brake.driver},
            )
        if records:
            self.audit.write(records)

    def _publish(self) -> None:
        engaged = {self.label(d) for d, b in self.brakes().items() if b.engaged}
        for label in self._published - engaged:
            audit_metrics.BRAKE_ENGAGED.labels(label).set(0)
        for label in engaged:
            audit_metrics.BRAKE_ENGAGED.labels(label).set(1)
        self._published |= engaged


def _engagements(brakes: Mapping[str, Brake]) -> dict[str, tuple[bool, str]]:
    """Each driver's brake as the record keeps it (engaged or not, since when, to the millisecond it is stored
    with), to compare what a leader decided with what its replicas read."""
    return {driver: (brake.engaged, format_time(brake.engaged_at)) for driver, brake in brakes.items()}
