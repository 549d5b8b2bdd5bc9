"""Leader election on a ``coordination.k8s.io/v1`` Lease: one replica audits and repairs, all serve admission.

The algorithm is client-go's ``tools/leaderelection`` (``LeaseLock``), in a small module around the Lease API:

- a candidate that finds no Lease creates it with itself as ``holderIdentity``;
- the holder renews ``spec.renewTime`` every ``retry_period`` seconds with a PUT carrying the Lease's
  ``resourceVersion`` (a lost race is a 409, never two holders), and steps down when it could not renew for
  ``renew_deadline`` seconds;
- another candidate takes the Lease over only when the Lease record has not changed for ``lease_duration``
  seconds *as observed on its own clock* (client-go's ``observedTime``: clocks of replicas need not agree), with a
  PUT on the resourceVersion it read, incrementing ``spec.leaseTransitions``.

So a leader that dies is replaced within ``lease_duration`` + ``retry_period`` seconds; a leader that is cut off
from the apiserver stops acting after ``renew_deadline`` < ``lease_duration`` seconds, before anyone else may start.
A holder that stops cleanly releases the Lease (``holderIdentity`` cleared, a 1 s duration), so its successor
starts at once. RBAC: ``get``, ``create`` and ``update`` on ``leases`` in the guard's namespace.
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
                 on_change: Callable[[bool], None] | None = None) -> None:
        self.client = client
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
        return self._leading and time.monotonic() - self._last_renew < self.settings.renew_deadline

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
                    self._last_renew = time.monotonic()
                    self._set(True)
                elif self._leading and time.monotonic() - self._last_renew >= self.settings.renew_deadline:
                    self._set(False)
            except Exception as exc:  # the apiserver unreachable, a refused request: try again next period
                text = str(exc)
                log.log(logging.WARNING if text != self._last_error else logging.DEBUG, "audit Lease: %s", text)
                self._last_error = text
                if self._leading and time.monotonic() - self._last_renew >= self.settings.renew_deadline:
                    self._set(False)
            self._stop.wait(self.settings.retry_period)

    def try_acquire_or_renew(self) -> bool:
        """One round: True when this candidate holds the Lease afterwards. Raises on API errors other than a
        lost race (409) or a Lease another holder keeps."""
        now = datetime.now(UTC)
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
            self._observed = (fingerprint, time.monotonic())
        duration = float(spec.get("leaseDurationSeconds") or self.settings.lease_duration)
        expired = time.monotonic() - self._observed[1] >= duration
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
                         "renewTime": micro_time(datetime.now(UTC))})
            self.client.send(ApiRequest("PUT", path, body={**lease, "spec": spec}))
        except Exception as exc:  # best effort: the Lease then expires
            log.info("audit Lease not released (%s); it expires in %.0f s", exc, self.settings.lease_duration)
