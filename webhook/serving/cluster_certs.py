"""The guard's serving certificate and state key, made and kept in its own Secrets (one-step install).

Without a certificate manager, ``serve --tls-secret csinode-guard-tls`` (deploy/base) makes what Gatekeeper's and
Kyverno's controllers make for themselves:

- **Serving certificate** in Secret ``--tls-secret`` (type ``kubernetes.io/tls``: ``tls.crt``, ``tls.key``,
  ``ca.crt``, ``ca.key``, ``ca-bundle.crt``). Absent at start: a new CA (10 years) and serving certificate
  (1 year) for the Service's DNS names, issued as ``certs generate`` issues them (:mod:`webhook.serving.dev_certs`).
  Present: its files are copied into ``--cert-dir``, where the workers load them and pick up changes
  (:class:`webhook.serving.ssl_context.ReloadingSSLContext`). Rotated as ``certs rotate`` rotates
  (:mod:`webhook.serving.cert_rotation`): a serving certificate with less than :data:`RENEW_BEFORE` left (or one
  that lacks a DNS name, or does not match its key or CA) is reissued from the Secret's CA; a CA with less than
  :data:`CA_RENEW_BEFORE` left is replaced, the bundle then trusting the new and the old CA until the old one
  expires.
- **caBundle** of every webhook in the Mutating- and ValidatingWebhookConfiguration ``--inject-ca-bundle``:
  ``ca-bundle.crt``, kept current (a configuration applied after the guard is filled in at the next check).
- **State key** in Secret ``--state-key-secret`` (key ``key``): absent at start, one random 32-byte key (hex), the
  file format of ``--state-key-file``, which it is copied to. Never rotated here (docs/operations.md, "State key").

Several replicas starting at once agree on one certificate and one key: each creates the Secret only if it is
absent, and the apiserver's optimistic concurrency lets one create (or one conditional replace) win; the others
get 409 and use the winner's (:mod:`webhook.kube.serving_secrets`). The checks repeat every
:data:`SYNC_INTERVAL` seconds in the master process, so a certificate another replica renewed reaches every
replica within that time (the old one stays valid meanwhile: same CA).
"""

from __future__ import annotations

import datetime as dt
import logging
import secrets
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from webhook.admission.atomic_files import write_atomic
from webhook.kube import serving_secrets, validation_mode
from webhook.kube.kubeapi import ApiUnreachableError, KubeApiError, KubeClient
from webhook.kube.one_call import VALIDATION_AUTO
from webhook.kube.registration import node_configuration_name
from webhook.serving import cert_rotation, dev_certs, registration_metrics, tls

__all__ = ["CA_RENEW_BEFORE", "RENEW_BEFORE", "SYNC_INTERVAL", "ClusterCertificates", "ClusterSecretsError",
           "SecretNames", "default_namespace"]

log = logging.getLogger("csinode_guard.cluster_certs")

RENEW_BEFORE: Final = dt.timedelta(days=30)
"""A serving certificate with less validity left than this is reissued (the 14-day expiry alert never fires)."""
CA_RENEW_BEFORE: Final = dt.timedelta(days=365)
"""A CA with less validity left than this is replaced (a serving certificate never outlives its CA)."""
SYNC_INTERVAL: Final = 30.0
"""Seconds between two checks of the Secret and the webhook configurations (three GETs per replica)."""
TLS_FILES: Final = ("ca-bundle.crt", "ca.crt", "ca.key", "tls.key", "tls.crt")
"""The files of the certificate directory kept in the Secret, in the order they are written (keys before
certificates, the bundle first: whoever reads the directory trusts a new CA before anything is signed by it)."""
SERVICE_ACCOUNT_NAMESPACE: Final = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
STATE_KEY_DATA_KEY: Final = "key"
_KEY_MODE: Final = 0o600
_CERT_MODE: Final = 0o644


class ClusterSecretsError(Exception):
    """The Secrets or webhook configurations cannot be read or written (RBAC, apiserver unreachable)."""


def default_namespace() -> str:
    """The namespace the pod runs in (its service account's), else ``csinode-guard`` (deploy/)."""
    try:
        return SERVICE_ACCOUNT_NAMESPACE.read_text("utf-8").strip() or tls.DEFAULT_NAMESPACE
    except OSError:
        return tls.DEFAULT_NAMESPACE


@dataclass(frozen=True)
class SecretNames:
    """Which objects the guard keeps: Secrets in ``namespace`` (None: not kept) and the webhook configurations'
    name (None: caBundle not touched); where their files go; the extra DNS names of a new certificate."""

    namespace: str
    cert_dir: Path
    state_key_file: Path
    tls_secret: str | None = None
    state_key_secret: str | None = None
    webhook_configuration: str | None = None
    dns_names: tuple[str, ...] = ()
    validation: str = VALIDATION_AUTO
    """How the ValidatingWebhookConfiguration ``webhook_configuration`` is kept: ``auto`` (one call unless
    another mutator matches CSINodes), ``webhook`` or ``cel`` (:mod:`webhook.kube.validation_mode`)."""

    @property
    def serving_dns_names(self) -> list[str]:
        """The Service's in-cluster names in ``namespace``, then the extra ones."""
        names = [*tls.service_dns_names(tls.DEFAULT_SERVICE, self.namespace), *self.dns_names]
        return list(dict.fromkeys(names))


class ClusterCertificates:
    """Keeps the certificate directory, the state key file and the caBundle in line with the Secrets.

    :meth:`bootstrap` runs once before the workers start (they load the files); :meth:`start` then repeats
    :meth:`sync_tls` and :meth:`sync_ca_bundle` every ``interval`` seconds from a daemon thread.
    """

    def __init__(self, names: SecretNames, client: KubeClient, interval: float = SYNC_INTERVAL) -> None:
        self.names = names
        self.client = client
        self.interval = interval
        self._stop = threading.Event()
        self._last_reason: str | None = None

    # ------------------------------------------------------------------ once, at start
    def bootstrap(self, attempts: int = 10, wait: float = 2.0) -> None:
        """Make the files exist (creating the Secrets if absent) and fill in the caBundle.

        An unreachable apiserver is retried ``attempts`` times, ``wait`` seconds apart. Raises
        :class:`ClusterSecretsError` with the reason when it still fails, or at once for a refusal (RBAC).
        """
        for attempt in range(1, attempts + 1):
            try:
                if self.names.state_key_secret:
                    self.sync_state_key()
                if self.names.tls_secret:
                    self.sync_tls()
                    self.sync_ca_bundle()
                return
            except ApiUnreachableError as exc:
                if attempt == attempts:
                    raise ClusterSecretsError(f"the apiserver is unreachable: {exc}") from exc
                log.warning("apiserver unreachable (%s); trying again in %gs", exc, wait)
                time.sleep(wait)
            except (KubeApiError, serving_secrets.SecretRace) as exc:
                raise ClusterSecretsError(self._explain(exc)) from exc

    def _explain(self, exc: Exception) -> str:
        if isinstance(exc, KubeApiError) and exc.code == 403:
            return (f"{exc.message} (the guard's RBAC in deploy/base/rbac.yaml lets it create and keep Secrets "
                    f"{self.names.tls_secret} and {self.names.state_key_secret} in {self.names.namespace} and "
                    f"update the webhook configurations named {self.names.webhook_configuration})")
        return str(exc)

    # ------------------------------------------------------------------ the state key
    def sync_state_key(self) -> None:
        """Copy the state key Secret into the state key file, creating the Secret with one random key first when
        it is absent (another replica's, created at the same moment, wins)."""
        name = self.names.state_key_secret
        assert name is not None
        stored = serving_secrets.read_secret(self.client, self.names.namespace, name)
        if stored is None:
            key = secrets.token_bytes(32).hex().encode() + b"\n"
            try:
                stored = serving_secrets.create_secret(self.client, self.names.namespace, name,
                                                       {STATE_KEY_DATA_KEY: key})
                log.info("created the state key Secret %s/%s", self.names.namespace, name)
            except serving_secrets.SecretRace:
                stored = serving_secrets.read_secret(self.client, self.names.namespace, name)
        if stored is None or STATE_KEY_DATA_KEY not in stored.data:
            raise ClusterSecretsError(f"secret {self.names.namespace}/{name} holds no key {STATE_KEY_DATA_KEY!r}")
        _write_if_changed(self.names.state_key_file, stored.data[STATE_KEY_DATA_KEY], _KEY_MODE)

    # ------------------------------------------------------------------ the serving certificate
    def sync_tls(self, now: dt.datetime | None = None) -> bool:
        """Bring the certificate directory and the TLS Secret in line; True when this replica wrote the Secret.

        Reads the Secret and copies it into the directory; issues what is missing, unusable or due
        (module docstring); writes the result back only when something was issued (create if absent, else a
        replace conditional on the version read). On 409 (another replica was faster) it starts over with
        the winner's Secret. Raises :class:`KubeApiError`, ``ApiUnreachableError``,
        :class:`ClusterSecretsError` after three lost races in a row.
        """
        name = self.names.tls_secret
        assert name is not None
        namespace = self.names.namespace
        for _ in range(3):
            stored = serving_secrets.read_secret(self.client, namespace, name)
            if stored is not None:
                self._write_local(stored.data)
            issued = self._issue(fresh=stored is None, now=now)
            if not issued:
                return False
            data = {n: (self.names.cert_dir / n).read_bytes() for n in TLS_FILES}
            try:
                if stored is None:
                    serving_secrets.create_secret(self.client, namespace, name, data, "kubernetes.io/tls")
                    log.info("created the serving certificate Secret %s/%s (%s)", namespace, name,
                             ", ".join(issued))
                else:
                    serving_secrets.replace_secret(self.client, namespace, stored, data, "kubernetes.io/tls")
                    log.info("renewed the serving certificate in Secret %s/%s: %s", namespace, name,
                             ", ".join(issued))
                return True
            except serving_secrets.SecretRace as race:
                log.info("%s: using its certificate", race)
        raise ClusterSecretsError(f"secret {namespace}/{name} kept changing while this replica wrote it")

    def _write_local(self, data: Mapping[str, bytes]) -> None:
        self.names.cert_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        for file in TLS_FILES:
            if file in data:
                _write_if_changed(self.names.cert_dir / file, data[file],
                                  _KEY_MODE if file.endswith(".key") else _CERT_MODE)

    def _issue(self, *, fresh: bool, now: dt.datetime | None) -> list[str]:
        """Issue into the directory what it lacks; what was issued (empty: nothing to write back)."""
        now = tls.as_utc(now)
        cert_dir = self.names.cert_dir
        names = self.names.serving_dns_names
        if fresh:
            dev_certs.ensure_dev_certs(cert_dir, names, force=True, now=now)
            return ["a new CA and serving certificate"]
        issued: list[str] = []
        try:
            paths = dev_certs.ensure_dev_certs(cert_dir, names, now=now)
        except tls.CertificateError as exc:
            log.warning("the Secret's CA cannot be used (%s): issuing a new CA", exc)
            dev_certs.ensure_dev_certs(cert_dir, names, force=True, now=now)
            return ["a new CA and serving certificate"]
        if paths.written:
            issued.append("the missing or unusable files " + ", ".join(p.name for p in paths.written))
        ca_cert = tls.load_certs(paths.ca_cert)[0]
        bundle = tls.load_certs(paths.ca_bundle)
        if len(bundle) > 1 and all(c.not_valid_after_utc <= now for c in bundle[1:]):
            cert_rotation.rotate(cert_dir, names, finish=True, now=now)
            issued.append("a CA bundle without the expired previous CA")
        elif ca_cert.not_valid_after_utc - now < CA_RENEW_BEFORE and len(bundle) == 1:
            cert_rotation.rotate(cert_dir, names, new_ca=True, now=now)
            return [*issued, "a new CA (the previous one stays trusted until it expires)"]
        if tls.certificate_not_after(paths.tls_cert) - now < RENEW_BEFORE:
            cert_rotation.rotate(cert_dir, names, now=now)
            issued.append("a serving certificate renewed before its expiry")
        return issued

    # ------------------------------------------------------------------ the webhook configurations
    def sync_ca_bundle(self) -> None:
        """Fill in the caBundle of the webhook configurations from ``ca-bundle.crt`` (skipped without a name)."""
        if not self.names.webhook_configuration:
            return
        pem = (self.names.cert_dir / "ca-bundle.crt").read_bytes()
        for line in serving_secrets.sync_ca_bundle(self.client, self.names.webhook_configuration, pem):
            log.info("%s", line)
        # The Node entry's configuration (<name>-nodes): created by the same install, filled in the same way.
        nodes = node_configuration_name(self.names.webhook_configuration)
        for line in serving_secrets.sync_ca_bundle(self.client, nodes, pem):
            log.info("%s", line)
        self.sync_validation()

    def sync_validation(self) -> None:
        """Keep the ValidatingWebhookConfiguration in the mode ``names.validation`` chooses, re-checking the other
        mutators of CSINodes on every pass; log and count a switch (skipped without a configuration name)."""
        name = self.names.webhook_configuration
        if not name:
            return
        result = validation_mode.sync_validation(self.client, name, self.names.validation)
        if not result.exists:
            return
        if result.switched:
            log.warning("switched validatingwebhookconfigurations/%s from %s to %s (%s)", name,
                        result.before or "a mixed mode", result.mode, result.reason)
        elif self._last_reason != result.reason:
            log.info("validatingwebhookconfigurations/%s stays %s (%s)", name, result.mode, result.reason)
        self._last_reason = result.reason
        registration_metrics.record_mode(result.mode, result.switched)

    # ------------------------------------------------------------------ repeated
    def start(self) -> threading.Thread:
        """Repeat the checks every ``interval`` seconds from a daemon thread (call in the serving process)."""
        thread = threading.Thread(target=self._loop, name="csinode-guard-certificates", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        """End the loop of :meth:`start` after its current check."""
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                if self.names.tls_secret:
                    self.sync_tls()
                    self.sync_ca_bundle()
            except (KubeApiError, ApiUnreachableError, ClusterSecretsError, tls.CertificateError, OSError) as exc:
                log.warning("serving certificate check failed (serving the current one): %s", exc)


def _write_if_changed(path: Path, data: bytes, mode: int) -> None:
    try:
        if path.read_bytes() == data:
            return
    except OSError:
        pass
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_atomic(path, data, mode)
