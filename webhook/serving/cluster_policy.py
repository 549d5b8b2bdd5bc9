"""Serve the GuardPolicy from the cluster: a watch, a mirror file the workers hot-reload, reports and status.

Without ``--policy``, ``serve`` serves the GuardPolicy ``--guard-policy`` (default ``default``) of the cluster it
talks to. The gunicorn master of each replica:

1. reads it once before any worker starts (:func:`initial_mirror`): its policy document (:mod:`webhook.kube.
   guardpolicy`) goes into a mirror file in a private temporary directory, which every worker's
   :class:`webhook.serving.live_policy.PolicyStore` loads and hot-reloads exactly as a policy file. A GuardPolicy
   the guard refuses (its deeper checks: a driver profile that does not exist) stops the start, as a refused file
   does. When none exists, the mirror holds the bundled default (``policies/default.yaml``, the GuardPolicy the
   kustomize install ships): the guard judges with the policy its documentation describes rather than with
   nothing, and ``status`` and every tool say so;
2. keeps it current (:class:`ClusterPolicy`): a list+watch of GuardPolicies
   (:class:`webhook.kube.watch.reflector.Reflector`, client-go's algorithm); a new generation is written to the
   mirror (atomically: a new file renamed over the old), which every process reloads within
   ``--policy-reload-interval`` seconds and judges with the guard's full checks, as a file: a refused one is
   logged, shown in ``/readyz`` and the ``csinode_guard_policy_file_invalid`` metric, and reported, and the last
   good policy keeps serving; a deleted GuardPolicy leaves the last good one serving (as a missing file), and
   the status writer (below) creates it again with that policy's spec, so that every tool, and the next start,
   reads the policy the guard serves rather than the bundled default; a replica that started serving the bundled
   default because none could be created (the CRD applied after the guard, no RBAC yet) creates it from the
   bundled default the same way once it can;
3. reports what it serves in a Lease of its own and, while it holds the policy-status Lease
   (:class:`webhook.kube.leader.LeaderElector`), writes the GuardPolicy's ``status`` from every replica's report
   (:mod:`webhook.kube.guardpolicy_status`), only when it changes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import tempfile
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from webhook.admission.policy import Policy, PolicyError, load_policy
from webhook.kube.guardpolicy import describe, guardpolicy_path, parse_guardpolicy, policy_document
from webhook.kube.guardpolicy_status import (
    REPORT_LABEL,
    REPORT_RENEW,
    ReplicaReport,
    guardpolicy_status,
    live_reports,
    report_lease,
    report_lease_name,
)
from webhook.kube.kubeapi import ApiRequest, KubeApiError, KubeClient
from webhook.kube.leader import LeaderElector, LeaseSettings, lease_path

log = logging.getLogger("csinode_guard.policy")

MIRROR_FILE = "guardpolicy.json"
BUNDLED_SOURCE = "bundled default (no GuardPolicy)"
LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"
RECREATE_INTERVAL = 10.0
"""Seconds between two attempts of the status writer to create a deleted GuardPolicy again."""
REPORT_GARBAGE = 3600.0
"""Seconds after its last renewal that the status writer deletes a replica's report Lease."""


def replica_identity() -> str:
    """This replica's name in reports: ``$POD_NAME`` (the downward API in deploy/), else ``<hostname>-<pid>``."""
    return os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"


def write_mirror(path: Path, document: Mapping[str, Any]) -> None:
    """Write ``document`` to ``path`` as JSON (a YAML subset), atomically: a new file renamed over the old one,
    so that a worker never reads half of it and its reload notices the new inode."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(document, sort_keys=True, indent=1) + "\n", "utf-8")
    os.replace(tmp, path)


def bundled_document() -> dict[str, Any]:
    """The bundled default policy's document (what the guard serves when no GuardPolicy exists)."""
    loaded = load_policy(None)
    return dict(loaded.document)


@dataclass
class Mirror:
    """The mirror file and what is in it: ``generation`` of the GuardPolicy (0: the bundled default), ``hash``."""

    path: Path
    generation: int
    hash: str
    source: str


def initial_mirror(client: KubeClient, name: str, *, create: bool = True) -> Mirror:
    """Read GuardPolicy ``name`` and write the mirror file in a new private directory (removed at exit by the
    caller's process). With ``create``, a GuardPolicy that does not exist is created from the bundled default
    (``kubectl apply -k deploy/`` cannot create a custom resource in the same step as its CRD); when that fails
    too (the CRD not installed, no RBAC), the mirror holds the bundled default. Raises :class:`PolicyError` when
    the guard refuses the GuardPolicy and ``KubeApiError``/``ApiUnreachableError`` when it cannot be read (other
    than absent)."""
    directory = Path(tempfile.mkdtemp(prefix="csinode-guard-guardpolicy-"))
    path = directory / MIRROR_FILE
    try:
        obj: dict[str, Any] | None = client.send(ApiRequest("GET", guardpolicy_path(name)))
    except KubeApiError as exc:
        if not exc.not_found:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        obj = None
    if obj is None and create:
        obj = _create_default(client, name)
    if obj is None:
        document = bundled_document()
        write_mirror(path, document)
        policy = load_policy(path)
        log.warning("no GuardPolicy %s in the cluster: serving the bundled default policy (hash %s) until one "
                    "is created", name, policy.hash)
        return Mirror(path, 0, policy.hash, BUNDLED_SOURCE)
    try:
        policy = parse_guardpolicy(obj)
    except PolicyError:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    write_mirror(path, policy_document(obj))
    generation = int((obj.get("metadata") or {}).get("generation") or 0)
    log.info("serving %s (hash %s), followed by a watch", describe(obj), policy.hash)
    return Mirror(path, generation, policy.hash, describe(obj))


def _create_default(client: KubeClient, name: str) -> dict[str, Any] | None:
    """Create GuardPolicy ``name`` from the bundled default; the object (also when another replica was first),
    or None when it cannot be created."""
    try:
        created = create_guardpolicy(client, name, bundled_document())
    except KubeApiError as exc:
        if exc.already_exists:
            try:
                return client.send(ApiRequest("GET", guardpolicy_path(name)))
            except KubeApiError:
                return None
        log.info("GuardPolicy %s not created from the bundled default: %s", name, exc)
        return None
    log.warning("no GuardPolicy %s in the cluster: created it from the bundled default policy", name)
    return created


def create_guardpolicy(
    client: KubeClient,
    name: str,
    document: Mapping[str, Any],
    *,
    labels: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """POST GuardPolicy ``name`` with the ``spec`` of ``document`` (a policy document: apiVersion, kind, spec),
    labelled as the guard's (plus ``labels``), with ``annotations``, and annotated as ``kubectl create
    --save-config`` does (a later ``kubectl apply`` of an edit then merges against it, without kubectl's warning
    about a missing annotation). Returns the created object; raises ``KubeApiError`` (``already_exists`` when
    someone was first) or ``ApiUnreachableError``."""
    body: dict[str, Any] = {
        "apiVersion": document.get("apiVersion"),
        "kind": document.get("kind"),
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "csinode-guard", **(labels or {})}},
        "spec": document.get("spec") or {},
    }
    body["metadata"]["annotations"] = {**(annotations or {}),
                                       LAST_APPLIED: json.dumps(body, sort_keys=True, separators=(",", ":"))}
    created: dict[str, Any] = client.send(ApiRequest("POST", guardpolicy_path(), body=body))
    return created


class ClusterPolicy:
    """The master's loop of steps 2 and 3 of the module docstring, every ``interval`` seconds in a daemon thread.

    ``served_hash()`` is the hash of the policy the master's own store serves (it reloads the mirror like the
    workers do). ``namespace`` holds the report Leases and the policy-status Lease ``status_lease``.

    A GuardPolicy deleted while the guard runs is created again by the replica holding the status Lease once it
    has been gone ``recreate_after`` seconds (0: never), with the spec of the last generation the guard accepted
    (what it serves) and the labels and annotations it last had (a Helm release's ownership among them), at
    most once every ``RECREATE_INTERVAL`` seconds; an error in the log says so. A replica that started on the
    bundled default (none existed and none could be created: the CRD was applied after the guard, or its RBAC
    came later) creates it the same way from the bundled default once its watch lists GuardPolicies, so that the
    tools read the policy the guard serves; a warning in the log says so. A deletion cannot switch the
    guard's policy, only hide it from the tools, which read the object; and the next start would otherwise
    create ``default`` from the bundled default, a different policy. The wait lets an uninstall that deletes the
    guard's Deployment and its GuardPolicy together finish first: the guard is gone before it would act.
    """

    def __init__(self, client: KubeClient, api_client: Any, name: str, mirror: Mirror, *,
                 served_hash: Callable[[], str], namespace: str, status_lease: str, interval: float,
                 cache_settings: Any, identity: str | None = None, recreate_after: float = 60.0) -> None:
        from webhook.kube.watch.reflector import Reflector  # noqa: PLC0415
        from webhook.kube.watch.store import Store  # noqa: PLC0415
        from webhook.kube.watch.transport import CollectionClient  # noqa: PLC0415

        self.client = client
        self.name = name
        self.mirror = mirror
        self.namespace = namespace
        self.interval = max(0.2, interval)
        self.identity = identity or replica_identity()
        self._served_hash = served_hash
        self._generations: dict[str, tuple[int, str]] = {mirror.hash: (mirror.generation, mirror.source)}
        self._judged: tuple[str, Policy | PolicyError] | None = None  # (resourceVersion, verdict)
        self._error = ""
        self._missing_logged = False
        self._last_good: dict[str, Any] | None = _accepted_document(mirror)
        self._recreate_error = ""  # logged once until it changes
        self._recreated_at = float("-inf")
        self.recreate_after = recreate_after
        self._gone_since: float | None = None  # monotonic; when the watch first showed it gone
        self._metadata: dict[str, Any] = {}  # the labels and annotations it last had
        self._last_report: tuple[ReplicaReport, float] | None = None
        self._report_error = ""  # each logged once until it changes
        self._status_error = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.store: Store[dict[str, Any]] = Store("guardpolicies")
        self.reflector = Reflector("guardpolicies", CollectionClient(api_client, guardpolicy_path()),
                                   _as_dict, self.store, cache_settings, name="guardpolicies")
        self.elector = LeaderElector(client, self.identity, LeaseSettings(namespace=namespace, name=status_lease))

    def start(self) -> None:
        """Start the watch, the status election and the loop (once)."""
        if self._thread is not None:
            return
        self.reflector.start()
        self.elector.start()
        self._thread = threading.Thread(target=self._run, name="csinode-guard-guardpolicy", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the loop, the watch and the election (giving the status Lease up), and end this replica's report
        (its Lease expires at once: a replica that left is no longer counted in ``status.replicas``)."""
        self._stop.set()
        self.reflector.stop()
        self.elector.stop()
        path = lease_path(self.namespace, report_lease_name(self.identity))
        try:
            lease = self.client.send(ApiRequest("GET", path))
            spec = {**(lease.get("spec") or {}), "leaseDurationSeconds": 1,
                    "renewTime": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")}
            self.client.send(ApiRequest("PUT", path, body={**lease, "spec": spec}))
        except Exception as exc:  # best effort: the report then expires after REPORT_EXPIRY seconds
            log.info("policy report Lease not ended (%s); it expires on its own", exc)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.step()
            except Exception:  # never let the loop die: the next round tries again
                log.exception("GuardPolicy loop failed; retrying")

    def current_object(self) -> dict[str, Any] | None:
        """The GuardPolicy as the watch last saw it (None: absent, or the watch has not listed yet)."""
        available, obj = self.store.get(self.name, 1.0)
        return obj if available else None

    def step(self) -> None:
        """One round: follow the GuardPolicy into the mirror, report, and (as the leader) write its status."""
        obj = self.current_object()
        if obj is None:
            if self.reflector.synced and self.mirror.generation and not self._missing_logged:
                log.error("GuardPolicy %s is gone; the last good policy (generation %d, hash %s) keeps serving",
                          self.name, self.mirror.generation, self.mirror.hash)
                self._missing_logged = True
            self._report()
            if self.reflector.synced:
                self._recreate()
            return
        self._missing_logged = False
        self._gone_since = None
        self._recreate_error = ""
        metadata = obj.get("metadata") or {}
        self._metadata = {"labels": dict(metadata.get("labels") or {}),
                          "annotations": {k: v for k, v in (metadata.get("annotations") or {}).items()
                                          if k != LAST_APPLIED}}
        verdict = self._judge(obj)
        generation = int((obj.get("metadata") or {}).get("generation") or 0)
        if generation != self.mirror.generation:
            # Written refused or not: every process's store judges it as it judges a file (a refused one is shown
            # in /readyz and csinode_guard_policy_file_invalid, and the last good policy keeps serving).
            write_mirror(self.mirror.path, policy_document(obj))
            self.mirror.generation, self.mirror.source = generation, describe(obj)
        if isinstance(verdict, PolicyError):
            self._error = f"generation {generation} refused: at {verdict.path or '(document)'}: {verdict.constraint}"
        else:
            self._error = ""
            self._last_good = policy_document(obj)
            if self._generations.get(verdict.hash, (None,))[0] != generation:
                self._generations[verdict.hash] = (generation, describe(obj))
                self.mirror.hash = verdict.hash
                log.info("GuardPolicy %s generation %d accepted (hash %s); the workers reload it",
                         self.name, generation, verdict.hash)
        self._report()
        if self.elector.is_leader:
            self._write_status(obj, verdict)

    def _recreate(self) -> None:
        """With the GuardPolicy gone: once ``recreate_after`` seconds passed, the leader creates it again from the
        last accepted generation's spec."""
        import time  # noqa: PLC0415

        now = time.monotonic()
        if self._gone_since is None:
            self._gone_since = now
        if (not self.recreate_after or self._last_good is None or not self.elector.is_leader
                or now - self._gone_since < self.recreate_after or now - self._recreated_at < RECREATE_INTERVAL):
            return
        self._recreated_at = now
        try:
            create_guardpolicy(self.client, self.name, self._last_good, **self._metadata)
        except Exception as exc:  # refused, or the apiserver away: tried again after RECREATE_INTERVAL
            if isinstance(exc, KubeApiError) and exc.already_exists:  # someone was first: the watch brings it
                return
            how = "again" if self.mirror.generation else "from the bundled default"
            text = f"GuardPolicy {self.name} not created {how}: {exc}"
            if text != self._recreate_error:
                log.warning("%s (retried every %.0f s)", text, RECREATE_INTERVAL)
                self._recreate_error = text
            return
        self._recreate_error = ""
        if not self.mirror.generation:  # no GuardPolicy was ever served: the bundled default
            log.warning("no GuardPolicy %s in the cluster: created it from the bundled default policy the guard "
                        "serves; edit it to change the guard's policy", self.name)
            return
        log.error("GuardPolicy %s was deleted; created it again with the policy the guard serves (hash %s, from "
                  "generation %d): delete the guard's deployment to remove the guard, or edit the GuardPolicy to "
                  "change its policy", self.name, self.mirror.hash, self.mirror.generation)

    def _judge(self, obj: dict[str, Any]) -> Policy | PolicyError:
        version = str((obj.get("metadata") or {}).get("resourceVersion") or "")
        if self._judged is not None and self._judged[0] == version:
            return self._judged[1]
        verdict: Policy | PolicyError
        try:
            verdict = parse_guardpolicy(obj)
        except PolicyError as exc:
            verdict = exc
            log.error("GuardPolicy edit refused; the last good policy (generation %d, hash %s) keeps serving: %s",
                      self.mirror.generation, self.mirror.hash, exc,
                      extra={"file": exc.source, "path": exc.path, "constraint": exc.constraint})
        self._judged = (version, verdict)
        return verdict

    def served(self) -> ReplicaReport:
        """What this replica serves now: the generation and source of the hash its own store serves."""
        served_hash = self._served_hash()
        generation, source = self._generations.get(served_hash, (0, "unknown"))
        return ReplicaReport(self.identity, generation, served_hash, source, self._error)

    def _report(self) -> None:
        """Write this replica's report Lease when the report changed, or renew it every REPORT_RENEW seconds."""
        import time  # noqa: PLC0415

        report = self.served()
        now_mono = time.monotonic()
        if self._last_report is not None:
            before, at = self._last_report
            if before == report and now_mono - at < REPORT_RENEW:
                return
        now = datetime.now(UTC)
        changed = self._last_report is None or self._last_report[0] != report
        path = lease_path(self.namespace, report_lease_name(self.identity))
        try:
            try:
                lease: dict[str, Any] | None = self.client.send(ApiRequest("GET", path))
            except KubeApiError as exc:
                if not exc.not_found:
                    raise
                lease = None
            stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
            if not changed and lease is not None:
                stamp = str(((lease.get("metadata") or {}).get("annotations") or {}).get(
                    "csinode-guard.io/reported-at") or stamp)
            stamped = ReplicaReport(report.replica, report.generation, report.policy_hash, report.source,
                                    report.error, stamp)
            body = report_lease(self.namespace, self.name, stamped, now, base=lease)
            if lease is None:
                self.client.send(ApiRequest("POST", lease_path(self.namespace), body=body))
            else:
                self.client.send(ApiRequest("PUT", path, body=body))
        except Exception as exc:  # the namespace missing, RBAC, the apiserver away: tried again next round
            text = str(exc)
            log.log(logging.WARNING if text != self._report_error else logging.DEBUG,
                    "policy report Lease %s/%s not written: %s", self.namespace, report_lease_name(self.identity),
                    text)
            self._report_error = text
            return
        self._report_error = ""
        self._last_report = (report, now_mono)

    def _write_status(self, obj: dict[str, Any], verdict: Policy | PolicyError) -> None:
        """As the leader: the status made of every live report, written when it differs from the stored one."""
        try:
            leases = self.client.send(ApiRequest(
                "GET", lease_path(self.namespace), (("labelSelector", f"{REPORT_LABEL}={self.name}"),)))
            items = leases.get("items") or []
            reports = live_reports(items, datetime.now(UTC))
            self._collect(items, datetime.now(UTC))
            status = guardpolicy_status(obj, verdict, reports, datetime.now(UTC))
            if _comparable(status) == _comparable(obj.get("status") or {}):
                return
            body = {**obj, "status": status}
            self.client.send(ApiRequest("PUT", guardpolicy_path(self.name) + "/status", body=body))
        except KubeApiError as exc:
            if exc.code != 409:  # a conflict: the watch brings the newer object, the next round writes again
                self._status_failed(exc)
        except Exception as exc:
            self._status_failed(exc)

    def _collect(self, leases: list[dict[str, Any]], now: datetime) -> None:
        """Delete the report Leases of replicas gone for more than :data:`REPORT_GARBAGE` seconds (each pod of a
        rollout has a name of its own; their reports would pile up)."""
        for lease in leases:
            renewed = str((lease.get("spec") or {}).get("renewTime") or "")
            try:
                age = (now - datetime.strptime(renewed, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC)).total_seconds()
            except ValueError:
                continue
            if age > REPORT_GARBAGE:
                name = str((lease.get("metadata") or {}).get("name") or "")
                with contextlib.suppress(KubeApiError):
                    self.client.send(ApiRequest("DELETE", lease_path(self.namespace, name)))

    def _status_failed(self, exc: Exception) -> None:
        text = str(exc)
        log.log(logging.WARNING if text != self._status_error else logging.DEBUG,
                "GuardPolicy %s status not written: %s", self.name, text)
        self._status_error = text


def _accepted_document(mirror: Mirror) -> dict[str, Any] | None:
    """The policy document a start from a GuardPolicy put in the mirror (the guard accepted it: the start stops
    otherwise), or the bundled default's when none existed (generation 0); None when the mirror cannot be read."""
    if not mirror.generation:
        return bundled_document()
    try:
        document: dict[str, Any] = json.loads(mirror.path.read_text())
    except (OSError, ValueError):
        return None
    return document


def _as_dict(obj: Mapping[str, Any]) -> dict[str, Any]:
    return dict(obj)


def _comparable(status: Mapping[str, Any]) -> Any:
    """``status`` without the conditions' lastTransitionTime (kept by guardpolicy_status while unchanged)."""
    out = dict(status)
    out["conditions"] = [{k: v for k, v in c.items() if k != "lastTransitionTime"}
                         for c in status.get("conditions") or [] if isinstance(c, Mapping)]
    return json.loads(json.dumps(out, sort_keys=True))

