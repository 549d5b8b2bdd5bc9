"""What ``csinode-guard uninstall`` removes, in order, through :class:`webhook.kube.kubeapi.KubeClient`.

1. Both webhook configurations (the apiserver stops calling the guard: nothing is refused from here on).
2. The ValidatingAdmissionPolicy floor and its binding (``policy export``, ``deploy/overlays/vap``), which refuse
   count changes on their own while they exist.
3. Every annotation under ``csinode-guard.io/`` on every CSINode: the signed state, justifications, declared driver
   versions. Each CSINode is written back whole with its ``resourceVersion`` (a 409 reads it again), never its
   counts; a webhook the apiserver still calls for a moment after step 1 may put the state back, so the stored
   object is checked and the write repeated.
4. The audit Lease, the guard's Secrets (serving certificate, state key) and its Events (label
   ``csinode-guard.io/audit``).

Objects already gone count as removed: running it twice is the same as once. ``kubectl delete -k`` of the overlay
removes the rest (Namespace, Deployment, RBAC; docs/operations.md, Uninstall).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from webhook.kube import kubeapi
from webhook.kube.events import EVENT_LABEL, EVENT_NAMESPACE
from webhook.kube.registration import CONFIGURATION_NAME
from webhook.kube.vap import VAP_NAME

ANNOTATION_PREFIX = "csinode-guard.io/"
"""Every CSINode annotation of the guard (and of its justifiers and version reporters) starts with this."""
FIELD_MANAGER = "csinode-guard-uninstall"
ATTEMPTS = 5
"""Writes of one CSINode before giving up (409 Conflict, or the state put back by a webhook still called)."""


class DryRun(StrEnum):
    """kubectl's ``--dry-run``: ``none`` writes; ``client`` reads and prints what it would remove, sends no write;
    ``server`` sends every write with ``dryRun=All`` (checked by the apiserver, nothing stored)."""

    NONE = "none"
    CLIENT = "client"
    SERVER = "server"


@dataclass(frozen=True)
class Targets:
    """Names of what to remove (the defaults are deploy/'s)."""

    configuration: str = CONFIGURATION_NAME
    """metadata.name of both webhook configurations (``register --name``)."""
    vap: str = VAP_NAME
    """metadata.name of the ValidatingAdmissionPolicy and its binding (``policy export --name``)."""
    namespace: str = "csinode-guard"
    """The guard's namespace: its Lease and Secrets."""
    lease: str = "csinode-guard-audit"
    """The audit Lease (``serve --lease-name``)."""
    secrets: tuple[str, ...] = ("csinode-guard-tls", "csinode-guard-state-key")
    """The Secrets ``serve --tls-secret``/``--state-key-secret`` made."""
    events: bool = True
    """Also delete the audit's Events."""


@dataclass
class Outcome:
    """What one step did: ``removed``/``absent``/``failed`` counts, and the failures' messages."""

    removed: int = 0
    absent: int = 0
    failed: int = 0


def guard_annotations(obj: Mapping[str, Any]) -> list[str]:
    """The keys under :data:`ANNOTATION_PREFIX` among ``obj``'s annotations, sorted."""
    annotations = (obj.get("metadata") or {}).get("annotations") or {}
    return sorted(k for k in annotations if str(k).startswith(ANNOTATION_PREFIX))


def without_guard_annotations(obj: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``obj`` (with its ``resourceVersion``) without :func:`guard_annotations`; nothing else changed."""
    body = copy.deepcopy(dict(obj))
    metadata = body.setdefault("metadata", {})
    kept = {k: v for k, v in (metadata.get("annotations") or {}).items() if not str(k).startswith(ANNOTATION_PREFIX)}
    if kept:
        metadata["annotations"] = kept
    else:
        metadata.pop("annotations", None)
    return body


class Uninstaller:
    """Runs the steps of the module docstring; ``say(line)`` gets one line per object as it goes (the command
    prints them), ``progress(line)`` a line before each step that may take seconds."""

    def __init__(self, client: kubeapi.KubeClient, targets: Targets, dry_run: DryRun,
                 say: Callable[[str], None], progress: Callable[[str], None],
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.client = client
        self.targets = targets
        self.dry_run = dry_run
        self.say = say
        self.progress = progress
        self.sleep = sleep
        self.outcome = Outcome()

    @property
    def _server_dry_run(self) -> bool:
        return self.dry_run is DryRun.SERVER

    def _done(self, what: str) -> str:
        return {DryRun.NONE: f"{what} deleted", DryRun.CLIENT: f"{what} would be deleted (client dry run)",
                DryRun.SERVER: f"{what} would be deleted (server dry run)"}[self.dry_run]

    def _fail(self, what: str, exc: Exception) -> None:
        self.outcome.failed += 1
        self.say(f"{what}: FAILED: {exc}")

    def delete(self, resource: kubeapi.ApiResource, name: str, namespace: str | None = None) -> None:
        """Delete one object; absent is fine."""
        what = resource.describe(name) if namespace is None else f"{resource.describe(name)} -n {namespace}"
        try:
            if self.dry_run is DryRun.CLIENT:
                self.client.get(resource, name, namespace)
            else:
                self.client.delete(resource, name, dry_run=self._server_dry_run, namespace=namespace)
        except kubeapi.KubeApiError as exc:
            if exc.not_found:
                self.outcome.absent += 1
                self.say(f"{what} not found (already removed)")
                return
            self._fail(what, exc)
            return
        except kubeapi.ApiUnreachableError as exc:
            self._fail(what, exc)
            return
        self.outcome.removed += 1
        self.say(self._done(what))

    def strip_csinode(self, name: str) -> None:
        """Remove the guard's annotations from CSINode ``name`` (GET, PUT with its resourceVersion; again on 409
        or when the stored object still carries one)."""
        what = kubeapi.CSINODES.describe(name)
        for attempt in range(1, ATTEMPTS + 1):
            try:
                obj = self.client.get(kubeapi.CSINODES, name)
                keys = guard_annotations(obj)
                if not keys:
                    if attempt == 1:
                        self.outcome.absent += 1
                    return
                if self.dry_run is DryRun.CLIENT:
                    self.outcome.removed += 1
                    self.say(f"{what} annotations {', '.join(keys)} would be removed (client dry run)")
                    return
                stored = self.client.replace(kubeapi.CSINODES, without_guard_annotations(obj),
                                             dry_run=self._server_dry_run, field_manager=FIELD_MANAGER)
            except kubeapi.KubeApiError as exc:
                if exc.not_found:
                    return
                if exc.conflict and attempt < ATTEMPTS:
                    self.sleep(0.2 * attempt)
                    continue
                self._fail(what, exc)
                return
            except kubeapi.ApiUnreachableError as exc:
                self._fail(what, exc)
                return
            left = guard_annotations(stored)
            if not left:
                self.outcome.removed += 1
                verb = "would be removed (server dry run)" if self._server_dry_run else "removed"
                self.say(f"{what} annotations {', '.join(keys)} {verb}")
                return
            if attempt < ATTEMPTS:  # a webhook the apiserver still calls wrote its state back: again
                self.sleep(0.5 * attempt)
        self._fail(what, RuntimeError(f"annotations put back at every write ({', '.join(left)}): is a guard "
                                      "still registered under another name?"))

    def run(self) -> Outcome:
        """Every step, in order; failures are counted and reported, the later steps still run."""
        t = self.targets
        self.progress("removing the webhook configurations")
        self.delete(kubeapi.MUTATING_WEBHOOK_CONFIGURATIONS, t.configuration)
        self.delete(kubeapi.VALIDATING_WEBHOOK_CONFIGURATIONS, t.configuration)
        self.progress("removing the ValidatingAdmissionPolicy floor")
        self.delete(kubeapi.VALIDATING_ADMISSION_POLICY_BINDINGS, t.vap)
        self.delete(kubeapi.VALIDATING_ADMISSION_POLICIES, t.vap)
        self.progress("removing the guard's annotations from every CSINode")
        try:
            csinodes = self.client.list_all(kubeapi.CSINODES, metadata_only=True)
        except (kubeapi.KubeApiError, kubeapi.ApiUnreachableError) as exc:
            self._fail("csinodes.storage.k8s.io", exc)
            csinodes = []
        names = [str((c.get("metadata") or {}).get("name")) for c in csinodes if guard_annotations(c)]
        for i, name in enumerate(names, 1):
            if i % 50 == 0:
                self.progress(f"  {i} of {len(names)} CSINodes")
            self.strip_csinode(name)
        if not names:
            self.say("csinodes.storage.k8s.io: no guard annotation on any CSINode")
        self.progress("removing the audit Lease and the guard's Secrets")
        self.delete(kubeapi.LEASES, t.lease, t.namespace)
        for secret in t.secrets:
            self.delete(kubeapi.SECRETS, secret, t.namespace)
        if t.events:
            self.progress("removing the audit's Events")
            try:
                events = self.client.list_all(kubeapi.EVENTS, namespace=EVENT_NAMESPACE, label_selector=EVENT_LABEL)
            except (kubeapi.KubeApiError, kubeapi.ApiUnreachableError) as exc:
                self._fail("events.events.k8s.io", exc)
                events = []
            for event in events:
                self.delete(kubeapi.EVENTS, str((event.get("metadata") or {}).get("name")), EVENT_NAMESPACE)
        return self.outcome
