"""Kubernetes Events about CSINodes (``events.k8s.io/v1``), deduplicated and rate-limited.

An Event about a cluster-scoped object with ``eventTime`` set must live in ``default`` or ``kube-system``
(kube-apiserver ``pkg/apis/core/validation/events.go``, ``legacyValidateEvent``): the audit writes to
``default``, so ``kubectl describe csinode NODE`` and ``kubectl get events --field-selector
regarding.name=NODE`` show them. RBAC: ``create`` on ``events.k8s.io`` ``events`` in ``default``.

Deduplication: one Event per (node, key) -- the key names the finding, e.g. rule, driver and stored count -- per
``repeat_after`` seconds; rate limit: a token bucket (``rate`` per second, ``burst``); an Event over the limit is
dropped (counted in :attr:`EventRecorder.dropped`, and the audit log keeps the finding anyway).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from webhook.admission.budget import IncreaseBudget
from webhook.kube.kubeapi import ApiRequest, ApiUnreachableError, KubeApiError, KubeClient
from webhook.kube.leader import micro_time

log = logging.getLogger("csinode_guard.events")

EVENT_NAMESPACE = "default"
REPORTING_CONTROLLER = "csinode-guard.io/audit"
NOTE_LIMIT = 1024
MAX_REMEMBERED = 50_000
"""Nodes whose Events are remembered for deduplication at most (the least recent forgotten first)."""


EVENT_LABEL = "csinode-guard.io/audit"
"""Label on every audit Event (value ``standing`` or ``reconciled``): ``csinode-guard status`` lists them by it."""


def event_name(node: str, key: str) -> str:
    """A deterministic Event name per (node, finding ``key``): replicas and restarts send each finding once, and
    ``csinode-guard status`` finds the Event (its ``eventTime``: since when) by it."""
    return f"{node}.{hashlib.sha256(key.encode()).hexdigest()[:16]}"[:253]


def event_body(node: str, uid: str, *, reason: str, action: str, note: str, warning: bool, instance: str,
               now: datetime, name: str | None = None, regarding: Mapping[str, str] | None = None) -> dict[str, Any]:
    """An ``events.k8s.io/v1`` Event regarding CSINode ``node`` (``uid``), or the cluster-scoped object
    ``regarding`` names (``apiVersion``, ``kind``, ``name``; a brake's Event is about the CSIDriver); ``note`` is
    cut to 1 KiB; ``name`` None: a generated name."""
    metadata: dict[str, Any] = {"namespace": EVENT_NAMESPACE,
                                "labels": {EVENT_LABEL: "standing" if warning else "reconciled"}}
    if name:
        metadata["name"] = name
    else:
        metadata["generateName"] = f"{node}."
    return {
        "apiVersion": "events.k8s.io/v1",
        "kind": "Event",
        "metadata": metadata,
        "eventTime": micro_time(now),
        "reportingController": REPORTING_CONTROLLER,
        "reportingInstance": instance[:128],
        "action": action,
        "reason": reason,
        "type": "Warning" if warning else "Normal",
        "note": note if len(note) <= NOTE_LIMIT else note[: NOTE_LIMIT - 3] + "...",
        "regarding": dict(regarding) if regarding is not None else
        {"apiVersion": "storage.k8s.io/v1", "kind": "CSINode", "name": node, "uid": uid},
    }


class EventRecorder:
    """Sends Events through ``client`` (thread-safe); see the module docstring for deduplication and limits."""

    def __init__(self, client: KubeClient, instance: str, *, rate: float = 2.0, burst: int = 25,
                 repeat_after: float = 3600.0) -> None:
        self.client = client
        self.instance = instance
        self.repeat_after = repeat_after
        self._bucket = IncreaseBudget(rate, burst)
        self._seen: OrderedDict[str, dict[str, float]] = OrderedDict()
        self._lock = threading.Lock()
        self.sent = 0
        self.dropped = 0

    def emit(self, node: str, uid: str, key: str, *, reason: str, action: str, note: str,
             warning: bool = True, name: str | None = None, regarding: Mapping[str, str] | None = None) -> bool:
        """Send one Event unless (node, key) had one within ``repeat_after`` s or the rate limit is reached;
        True when it was sent. With ``name`` (deterministic per finding) an Event that exists already (another
        replica, an earlier leader) is not sent again. API errors are logged, never raised."""
        now = time.monotonic()
        with self._lock:
            known = self._seen.get(node) or {}
            last = known.get(key)
            if last is not None and now - last < self.repeat_after:
                return False
            if not self._bucket.take(1, now):
                self.dropped += 1
                return False
            self._seen[node] = {**known, key: now}
            self._seen.move_to_end(node)
            while len(self._seen) > MAX_REMEMBERED:
                self._seen.popitem(last=False)
        body = event_body(node, uid, reason=reason, action=action, note=note, warning=warning,
                          instance=self.instance, now=datetime.now(UTC), name=name, regarding=regarding)
        path = f"/apis/events.k8s.io/v1/namespaces/{EVENT_NAMESPACE}/events"
        try:
            self.client.send(ApiRequest("POST", path, body=body))
        except KubeApiError as exc:
            if not exc.already_exists:
                log.warning("Event about CSINode %s not sent: %s", node, exc)
            return False
        except ApiUnreachableError as exc:
            log.warning("Event about CSINode %s not sent: %s", node, exc)
            return False
        self.sent += 1
        return True

    def forget(self, node: str) -> None:
        """Forget the Events sent about ``node`` (its findings are gone: a new one is news again)."""
        with self._lock:
            self._seen.pop(node, None)
