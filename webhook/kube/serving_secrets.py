"""The guard's own Secrets and the ``caBundle`` of its own webhook configurations, through the apiserver.

A guard installed without a certificate manager makes its serving certificate and its state key itself
(:mod:`webhook.serving.cluster_certs` decides what goes in them); this module only reads and writes the objects:

- :func:`read_secret` / :func:`create_secret` / :func:`replace_secret`: one Secret in the guard's namespace.
  Several replicas starting at once agree on one Secret through the apiserver's optimistic concurrency: a
  create that loses the race gets ``409 AlreadyExists`` (:class:`SecretRace`, the caller reads the winner's),
  a replace of a stale ``resourceVersion`` gets ``409 Conflict`` (the same).
- :func:`sync_ca_bundle`: every entry of the MutatingWebhookConfiguration and the ValidatingWebhookConfiguration
  of one name gets ``clientConfig.caBundle`` = the CA the guard's certificate is signed by (GET, then PUT with
  the ``resourceVersion`` read, as cert-manager's cainjector does). A configuration not created yet is skipped
  (the install creates the webhook configurations last).

RBAC this needs (deploy/base/rbac.yaml): ``create`` on secrets in the namespace (RBAC cannot restrict a create
by name), ``get``/``update``/``patch`` on the two Secrets by name, ``get``/``update``/``patch`` on the two
webhook configurations by name.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from webhook.kube.kubeapi import (
    JSON,
    MUTATING_WEBHOOK_CONFIGURATIONS,
    SECRETS,
    VALIDATING_WEBHOOK_CONFIGURATIONS,
    ApiRequest,
    KubeApiError,
    KubeClient,
)

__all__ = ["FIELD_MANAGER", "SecretRace", "StoredSecret", "create_secret", "read_secret", "replace_secret",
           "sync_ca_bundle"]

FIELD_MANAGER: Final = "csinode-guard"
"""The field manager of the guard's own writes (shown in ``managedFields``)."""

_LABELS: Final = {"app.kubernetes.io/name": "csinode-guard"}


@dataclass(frozen=True)
class StoredSecret:
    """A Secret as stored: ``name``, ``resource_version`` (for a conditional replace) and its decoded ``data``."""

    name: str
    resource_version: str
    data: Mapping[str, bytes]


class SecretRace(Exception):  # noqa: N818 - an outcome the caller handles, not a failure
    """Another replica wrote the Secret first (``409 AlreadyExists`` on create, ``409 Conflict`` on replace):
    read it again and use what it holds."""


def _decode(obj: JSON) -> StoredSecret:
    meta = obj.get("metadata") or {}
    data = {str(k): base64.b64decode(str(v)) for k, v in (obj.get("data") or {}).items()}
    return StoredSecret(str(meta.get("name") or ""), str(meta.get("resourceVersion") or ""), data)


def _body(namespace: str, name: str, data: Mapping[str, bytes], secret_type: str,
          resource_version: str | None = None) -> JSON:
    metadata: JSON = {"name": name, "namespace": namespace, "labels": dict(_LABELS)}
    if resource_version is not None:
        metadata["resourceVersion"] = resource_version
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata,
        "type": secret_type,
        "data": {k: base64.b64encode(v).decode("ascii") for k, v in sorted(data.items())},
    }


def read_secret(client: KubeClient, namespace: str, name: str) -> StoredSecret | None:
    """The Secret ``namespace/name``, or None when it does not exist. Raises :class:`KubeApiError` otherwise
    (403 when RBAC does not allow it)."""
    try:
        return _decode(client.get(SECRETS, name, namespace))
    except KubeApiError as exc:
        if exc.not_found:
            return None
        raise


def create_secret(client: KubeClient, namespace: str, name: str, data: Mapping[str, bytes],
                  secret_type: str = "Opaque") -> StoredSecret:
    """Create the Secret (``type`` ``secret_type``, the guard's name label); the stored Secret.

    Raises :class:`SecretRace` when it exists already (another replica created it first),
    :class:`KubeApiError` for any other refusal.
    """
    request = ApiRequest("POST", SECRETS.collection_path(namespace), (("fieldManager", FIELD_MANAGER),),
                         _body(namespace, name, data, secret_type))
    try:
        return _decode(client.send(request))
    except KubeApiError as exc:
        if exc.already_exists:
            raise SecretRace(f"secret {namespace}/{name} was created by another replica") from exc
        raise


def replace_secret(client: KubeClient, namespace: str, secret: StoredSecret, data: Mapping[str, bytes],
                   secret_type: str = "Opaque") -> StoredSecret:
    """Replace the data of ``secret`` if it is still at ``secret.resource_version``; the stored Secret.

    Raises :class:`SecretRace` when it changed since it was read (``409 Conflict``), :class:`KubeApiError`
    for any other refusal.
    """
    body = _body(namespace, secret.name, data, secret_type, secret.resource_version)
    request = ApiRequest("PUT", SECRETS.object_path(secret.name, namespace), (("fieldManager", FIELD_MANAGER),),
                         body)
    try:
        return _decode(client.send(request))
    except KubeApiError as exc:
        if exc.conflict or exc.not_found:
            raise SecretRace(f"secret {namespace}/{secret.name} changed since it was read") from exc
        raise


def sync_ca_bundle(client: KubeClient, name: str, ca_bundle_pem: bytes) -> list[str]:
    """Make every webhook of the Mutating- and ValidatingWebhookConfiguration ``name`` trust ``ca_bundle_pem``.

    Returns what it did, one line per configuration (``updated mutatingwebhookconfigurations/NAME``), empty when
    both were current or are not created yet. A configuration that changed between GET and PUT is read again
    (up to 3 times). Raises :class:`KubeApiError` for a refusal (403: RBAC names no such configuration).
    """
    encoded = base64.b64encode(ca_bundle_pem).decode("ascii")
    done: list[str] = []
    for resource in (MUTATING_WEBHOOK_CONFIGURATIONS, VALIDATING_WEBHOOK_CONFIGURATIONS):
        for attempt in range(3):
            try:
                obj = client.get(resource, name)
            except KubeApiError as exc:
                if exc.not_found:
                    break
                raise
            webhooks = [w for w in obj.get("webhooks") or [] if isinstance(w, dict)]
            stale = [w for w in webhooks if (w.get("clientConfig") or {}).get("caBundle") != encoded]
            if not stale:
                break
            for webhook in stale:
                webhook.setdefault("clientConfig", {})["caBundle"] = encoded
            request = ApiRequest("PUT", resource.object_path(name), (("fieldManager", FIELD_MANAGER),), obj)
            try:
                client.send(request)
            except KubeApiError as exc:
                if exc.conflict and attempt < 2:
                    continue
                raise
            done.append(f"updated caBundle of {resource.describe(name)} ({len(stale)} webhook(s))")
            break
    return done
