"""The GuardPolicy custom resource on the apiserver: read it as a policy, and which policy a tool judges with.

A GuardPolicy object (``csinode-guard.io/v1alpha1``, cluster-scoped, :mod:`webhook.kube.guardpolicy_crd`) carries
the same document a policy file does, plus what the apiserver adds. :func:`policy_document` keeps what the policy
is made of (``apiVersion``, ``kind``, ``metadata.name``, ``spec``), so its hash is the same as the hash of the
file it was applied from, and :func:`parse_guardpolicy` runs the guard's full checks on it (the schema, then the
deeper ones: profiles that exist, ceilings below ``max``, versions that parse). Driver profiles come from those
shipped with the guard.

:func:`served_policy` is how every tool picks its policy: a file given with ``--policy``; else, given a cluster,
the GuardPolicy the guard serves (``default`` unless told otherwise); else (no cluster, or none exists there)
the bundled default, which is what the guard itself serves when no GuardPolicy exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from webhook.admission.policy import Policy, PolicyError, load_policy, parse_policy
from webhook.kube.guardpolicy_crd import GROUP, KIND, PLURAL, VERSION
from webhook.kube.kubeapi import ApiRequest, KubeApiError, KubeClient, load_configuration

DEFAULT_NAME = "default"


def guardpolicy_path(name: str | None = None) -> str:
    """``/apis/csinode-guard.io/v1alpha1/guardpolicies[/<name>]``."""
    base = f"/apis/{GROUP}/{VERSION}/{PLURAL}"
    return f"{base}/{name}" if name else base


def policy_document(obj: dict[str, Any]) -> dict[str, Any]:
    """What a GuardPolicy object's policy is made of: ``apiVersion``, ``kind``, ``metadata.name`` and ``spec``
    (never ``status``, ``resourceVersion``, ``managedFields``: they would change the policy hash)."""
    name = str((obj.get("metadata") or {}).get("name") or "")
    return {
        "apiVersion": obj.get("apiVersion", f"{GROUP}/{VERSION}"),
        "kind": obj.get("kind", KIND),
        "metadata": {"name": name},
        "spec": obj.get("spec") or {},
    }


def describe(obj: dict[str, Any]) -> str:
    """``guardpolicy/NAME generation G``: the source named in a refusal, the log and the audit records."""
    metadata = obj.get("metadata") or {}
    return f"guardpolicy/{metadata.get('name', '')} generation {metadata.get('generation', '?')}"


def parse_guardpolicy(obj: dict[str, Any]) -> Policy:
    """The :class:`Policy` of a GuardPolicy object; raises :class:`PolicyError` (source ``guardpolicy/NAME
    generation G``, the JSON path, the constraint) when the guard would refuse it."""
    source = describe(obj)
    try:
        return parse_policy(policy_document(obj), source)
    except PolicyError:
        raise
    except (TypeError, ValueError, OverflowError, RecursionError) as exc:
        raise PolicyError(source, "", f"not a valid policy: {exc}") from None


def fetch_guardpolicy(client: KubeClient, name: str) -> dict[str, Any] | None:
    """The GuardPolicy ``name``, or None when there is none (or the CRD is not installed). Raises
    :class:`~webhook.kube.kubeapi.KubeApiError` for any other refusal and ``ApiUnreachableError``."""
    try:
        return client.send(ApiRequest("GET", guardpolicy_path(name)))
    except KubeApiError as exc:
        if exc.not_found:
            return None
        raise


@dataclass(frozen=True)
class ServedPolicy:
    """The policy a tool judges with and where it came from (``origin``: ``file``, ``cluster`` or
    ``bundled``)."""

    policy: Policy
    origin: str
    generation: int | None = None

    def describe(self) -> str:
        """One line for a tool's output: ``policy default (hash 0123abcd…, guardpolicy/default generation 3)``."""
        if self.origin == "cluster":
            where = self.policy.source
        elif self.origin == "file":
            where = f"file {self.policy.source}"
        else:
            where = "the bundled default: no GuardPolicy in the cluster" if self.generation == 0 else \
                "the bundled default"
        return f"policy {self.policy.name} (hash {self.policy.hash}, {where})"

    def to_json(self) -> dict[str, Any]:
        """``{"name", "hash", "source", "origin"}`` (and ``generation`` for a GuardPolicy) for JSON output."""
        out: dict[str, Any] = {"name": self.policy.name, "hash": self.policy.hash, "source": self.policy.source,
                               "origin": self.origin}
        if self.origin == "cluster":
            out["generation"] = self.generation
        return out


def served_policy(path: Path | None, client: KubeClient | None, name: str = DEFAULT_NAME) -> ServedPolicy:
    """The policy a tool judges with (see the module docstring). Raises :class:`PolicyError` when the file or
    the GuardPolicy is refused, :class:`KubeApiError`/``ApiUnreachableError`` when the cluster cannot say."""
    if path is not None:
        return ServedPolicy(load_policy(path), "file")
    if client is None:
        return ServedPolicy(load_policy(None), "bundled")
    obj = fetch_guardpolicy(client, name)
    if obj is None:
        return ServedPolicy(load_policy(None), "bundled", generation=0)
    generation = int((obj.get("metadata") or {}).get("generation") or 0)
    return ServedPolicy(parse_guardpolicy(obj), "cluster", generation)


def serving_api_client(kubeconfig: str | None) -> Any | None:
    """A ``kubernetes.client.ApiClient`` for ``serve`` (``kubeconfig``, else ``$KUBECONFIG``, else the in-cluster
    service account; never ``~/.kube/config``, as the watch caches), or None when no cluster is configured."""
    configuration = load_configuration(kubeconfig, home_fallback=False)
    if configuration is None:
        return None
    from kubernetes.client.api_client import ApiClient  # noqa: PLC0415 - heavy; only when needed

    return ApiClient(configuration)
