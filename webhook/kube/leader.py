"""Leader election on a ``coordination.k8s.io/v1`` Lease: one replica audits and repairs, all serve admission.

The algorithm is client-go's ``tools/leaderelection`` (``LeaseLock``), in a small module around the Lease API:

- a candidate that finds no Lease creates it with itself as ``holderIdentity``;
- the holder renews ``spec.renewTime`` every ``retry_period`` seconds with a PUT carrying the Lease's
  ``resourceVersion`` (a lost race is a 409, never two holders), and steps down when it could not renew for
  ``renew_deadline`` seconds;
- another candidate takes the Lease over only when the Lease record has not changed for its lease duration
  *as observed on its own clock* (client-go's ``observedTime``: clocks of replicas need not agree), with a
  PUT on the resourceVersion it read, incrementing ``spec.leaseTransitions``.

One departure from client-go: the lease duration a candidate waits is the *lower* of the Lease's
``spec.leaseDurationSeconds`` and its own ``lease_duration``, never the holder's word alone. Anyone who may update
Leases in the namespace can write a Lease (``holderIdentity: mallory``, ``leaseDurationSeconds: 999999``) and
never renew it; client-go would wait 999,999 s, and no replica would audit or repair in that time. Here such a
holder is replaced once it has not renewed for the guard's own lease duration, whatever it wrote. (A shorter
duration, such as the 1 s a replica writes when it releases the Lease, is honoured.) Who can still write the Lease,
and what that costs: docs/threat-model.md, "The audit Lease". :meth:`LeaderElector.unrenewed_seconds` says how
long the Lease has gone without a renewal, for the ``csinode_guard_audit_lease_unrenewed_seconds`` gauge.

So a leader that dies is replaced within ``lease_duration`` + ``retry_period`` seconds; a leader that is cut off
from the apiserver stops acting after ``renew_deadline`` < ``lease_duration`` seconds, before anyone else may start.
A holder that stops cleanly releases the Lease (``holderIdentity`` cleared, a 1 s duration), so its successor
starts at once. RBAC: ``create`` on ``leases`` in the guard's namespace, ``get`` and ``update`` on this Lease's name
only (``resourceNames``; deploy/base/rbac.yaml).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from webhook.kube.kubeapi import ApiRequest, KubeApiError, KubeClient

log = logging.getLogger("csinode_guard.leader")


@dataclass(frozen=True)
class LeaseSettings:
    """Where the Lease lives and its timing, in seconds (client-go's defaults are 15 / 10 / 2)."""

    namespace: str = "csinode-guard"
    name: str = "csinode-guard-audit"
    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0


def lease_path(namespace: str, name: str | None = None) -> str:
    """``/apis/coordination.k8s.io/v1/namespaces/<ns>/leases[/<name>]``."""
    base = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
    return f"{base}/{name}" if name else base


def micro_time(when: datetime) -> str:
    """A Kubernetes ``MicroTime``: RFC 3339 UTC with microseconds (``2026-12-02T10:11:12.123456Z``)."""
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def lease_body(settings: LeaseSettings, holder: str, now: datetime, *, transitions: int = 0,
               acquired: str | None = None, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """The Lease object held by ``holder`` at ``now`` (``base``: the Lease read, whose metadata it keeps)."""
    metadata = dict((base or {}).get("metadata") or {"name": settings.name, "namespace": settings.namespace})
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": metadata,
        "spec": {
            "holderIdentity": holder,
            "leaseDurationSeconds": max(1, round(settings.lease_duration)),
            "acquireTime": acquired or micro_time(now),
            "renewTime": micro_time(now),
            "leaseTransitions": transitions,
        },
    }


class LeaderElector:
    """Campaigns for the Lease in a daemon thread; :attr:`is_leader` says whether this process holds it.

    ``on_change(leading)`` is called from the thread whenever leadership is gained or lost. ``client`` sends the
    Lease requests (:class:`webhook.kube.kubeapi.KubeClient`); ``identity`` names this candidate (pod name and
    process id).
    """

    def __init__(self, client: KubeClient, identity: str, settings: LeaseSettings,
                 on_change: Callable[[bool], None] | None = None, *,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], datetime] = lambda: datetime.now(UTC)) -> None:
        """``clock`` (seconds, monotonic) times renewals and expiry; ``wall_clock`` (aware UTC) gives the
        ``renewTime``/``acquireTime`` written. Both are arguments so that tests can drive them."""
        self.client = client
        self._clock = clock
        self._wall_clock = wall_clock
        self.identity = identity
        self.settings = settings
        self._on_change = on_change
        self._leading = False
        self._observed: tuple[str, float] | None = None  # (record fingerprint, monotonic time it was first seen)
        self._last_renew = 0.0
        self._last_error = ""  # logged once until it changes (a missing namespace would repeat every period)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def is_leader(self) -> bool:
        """True while this candidate holds the Lease (renewed within ``renew_deadline``)."""
        return self._leading and self._clock() - self._last_renew < self.settings.renew_deadline

    def unrenewed_seconds(self) -> float:
        """Seconds the Lease record has gone unchanged as this candidate observed it (0 while it leads, and before
        its first look). A holder that renews keeps it under ``retry_period``; a stale or foreign holder makes it
        grow until the candidate takes the Lease over (at the lease duration) -- or for good, when it cannot
        (the Lease unwritable for its ServiceAccount)."""
        if self.is_leader or self._observed is None:
            return 0.0
        return max(0.0, self._clock() - self._observed[1])

    def effective_duration(self, written: object) -> float:
        """The seconds a holder that stopped renewing keeps the Lease: ``written`` (its
        ``spec.leaseDurationSeconds``) capped at this candidate's own ``lease_duration``; the own duration when
        ``written`` is absent or not a positive number."""
        own = self.settings.lease_duration
        if isinstance(written, bool) or not isinstance(written, (int, float)) or written <= 0:
            return own
        return min(float(written), own)

    def start(self) -> None:
        """Start campaigning (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="csinode-guard-leader", daemon=True)
            self._thread.start()

    def stop(self, release: bool = True) -> None:
        """Stop campaigning; with ``release``, give the Lease up so that another replica takes it at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.settings.retry_period + 5)
        if release and self._leading:
            self._release()
        self._set(False)

    def _set(self, leading: bool) -> None:
        if leading != self._leading:
            self._leading = leading
            log.info("%s the audit Lease %s/%s as %s", "holding" if leading else "no longer holding",
                     self.settings.namespace, self.settings.name, self.identity)
            if self._on_change is not None:
                self._on_change(leading)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self.try_acquire_or_renew():
                    self._last_error = ""
                    self._last_renew = self._clock()
                    self._set(True)
                elif self._leading and self._clock() - self._last_renew >= self.settings.renew_deadline:
                    self._set(False)
            except Exception as exc:  # the apiserver unreachable, a refused request: try again next period
                text = str(exc)
                log.log(logging.WARNING if text != self._last_error else logging.DEBUG, "audit Lease: %s", text)
                self._last_error = text
                if self._leading and self._clock() - self._last_renew >= self.settings.renew_deadline:
                    self._set(False)
            self._stop.wait(self.settings.retry_period)

    def try_acquire_or_renew(self) -> bool:
        """One round: True when this candidate holds the Lease afterwards. Raises on API errors other than a
        lost race (409) or a Lease another holder keeps. A holder other than this candidate keeps the Lease while
        its record changes within :meth:`effective_duration` (at most this candidate's own lease duration)."""
        now = self._wall_clock()
        path = lease_path(self.settings.namespace, self.settings.name)
        try:
            lease = self.client.send(ApiRequest("GET", path))
        except KubeApiError as exc:
            if not exc.not_found:
                raise
            body = lease_body(self.settings, self.identity, now)
            try:
                self.client.send(ApiRequest("POST", lease_path(self.settings.namespace), body=body))
            except KubeApiError as create_error:
                if create_error.code == 409:
                    return False
                raise
            return True
        spec = lease.get("spec") or {}
        holder = str(spec.get("holderIdentity") or "")
        fingerprint = f"{holder}|{spec.get('renewTime')}|{(lease.get('metadata') or {}).get('resourceVersion')}"
        if self._observed is None or self._observed[0] != fingerprint:
            self._observed = (fingerprint, self._clock())
        expired = self._clock() - self._observed[1] >= self.effective_duration(spec.get("leaseDurationSeconds"))
        transitions = int(spec.get("leaseTransitions") or 0)
        if holder == self.identity:
            acquired = spec.get("acquireTime")
        elif holder and not expired:
            return False
        else:
            transitions += 1
            acquired = None
        body = lease_body(self.settings, self.identity, now, transitions=transitions,
                          acquired=str(acquired) if acquired else None, base=lease)
        try:
            self.client.send(ApiRequest("PUT", path, body=body))
        except KubeApiError as exc:
            if exc.code == 409:
                return False
            raise
        return True

    def _release(self) -> None:
        path = lease_path(self.settings.namespace, self.settings.name)
        try:
            lease = self.client.send(ApiRequest("GET", path))
            spec = dict(lease.get("spec") or {})
            if spec.get("holderIdentity") != self.identity:
                return
            spec.update({"holderIdentity": "", "leaseDurationSeconds": 1,
                         "renewTime": micro_time(self._wall_clock())})
            self.client.send(ApiRequest("PUT", path, body={**lease, "spec": spec}))
        except Exception as exc:  # best effort: the Lease then expires
            log.info("audit Lease not released (%s); it expires in %.0f s", exc, self.settings.lease_duration)
