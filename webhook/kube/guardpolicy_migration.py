"""Carry a policy kept in the old install's ConfigMap over into the GuardPolicy, once (``policy migrate``).

Installations before the GuardPolicy kept the policy in ConfigMap ``csinode-guard-policy-<hash>`` (kustomize's
configMapGenerator; key ``policy.yaml``) in the guard's namespace. :func:`migrate_configmap` reads it, checks it
as the guard does, and creates the GuardPolicy from it. A GuardPolicy that already exists is replaced only when
it is the untouched bundled default a replica made at start (generation 1, the bundled policy's hash: nobody has
edited it) or with ``force``; anything else was written by a person and is left alone.
"""

from __future__ import annotations

from typing import Any

import yaml

from webhook.admission.policy import PolicyError, load_policy, parse_policy
from webhook.admission.safe_yaml import load_yaml
from webhook.kube.guardpolicy import describe, guardpolicy_path, parse_guardpolicy, policy_document
from webhook.kube.kubeapi import ApiRequest, KubeApiError, KubeClient

CONFIGMAP_PREFIX = "csinode-guard-policy"
POLICY_KEY = "policy.yaml"


class MigrationError(Exception):
    """Nothing to carry over, a policy the guard would refuse, or a GuardPolicy edited since (without force)."""


def _configmap(client: KubeClient, namespace: str, name: str | None) -> dict[str, Any]:
    if name is not None:
        try:
            return client.send(ApiRequest("GET", f"/api/v1/namespaces/{namespace}/configmaps/{name}"))
        except KubeApiError as exc:
            if exc.not_found:
                raise MigrationError(f"ConfigMap {namespace}/{name} not found") from None
            raise
    listed = client.send(ApiRequest("GET", f"/api/v1/namespaces/{namespace}/configmaps"))
    candidates = [
        c for c in listed.get("items") or []
        if str((c.get("metadata") or {}).get("name") or "").startswith(CONFIGMAP_PREFIX)
        and POLICY_KEY in (c.get("data") or {})
    ]
    if not candidates:
        raise MigrationError(f"no ConfigMap {CONFIGMAP_PREFIX}* with a {POLICY_KEY} in namespace {namespace}: "
                             "nothing to carry over")
    candidates.sort(key=lambda c: str((c.get("metadata") or {}).get("creationTimestamp") or ""))
    newest: dict[str, Any] = candidates[-1]
    return newest


def migrate_configmap(client: KubeClient, namespace: str, configmap: str | None, name: str, *,
                      force: bool = False, dry_run: bool = False) -> str:
    """Create (or replace, see the module docstring) GuardPolicy ``name`` from the ConfigMap's policy; returns
    one line saying what was done. Raises :class:`MigrationError` and the API's errors."""
    source = _configmap(client, namespace, configmap)
    where = f"ConfigMap {namespace}/{source['metadata']['name']}"
    try:
        document = load_yaml(str(source["data"][POLICY_KEY]))
        policy = parse_policy(document, where)
    except PolicyError as exc:
        raise MigrationError(f"the guard would refuse the policy of {exc}; fix it first") from None
    except yaml.YAMLError as exc:
        raise MigrationError(f"{where}: {POLICY_KEY} is not YAML: {exc}") from None
    body = {**policy_document(document), "metadata": {"name": name}}
    try:
        existing: dict[str, Any] | None = client.send(ApiRequest("GET", guardpolicy_path(name)))
    except KubeApiError as exc:
        if not exc.not_found:
            raise
        existing = None
    verb = "would create" if dry_run else "created"
    query = (("dryRun", "All"),) if dry_run else ()
    if existing is None:
        client.send(ApiRequest("POST", guardpolicy_path(), query, body=body))
        return f"{verb} guardpolicy/{name} from {where} (policy hash {policy.hash})"
    generation = int((existing.get("metadata") or {}).get("generation") or 0)
    try:
        current_hash = parse_guardpolicy(existing).hash
    except PolicyError:
        current_hash = ""
    untouched = generation == 1 and current_hash == _bundled_hash(name)
    if current_hash == parse_policy(body, where).hash:
        return f"guardpolicy/{name} already holds the policy of {where} (policy hash {current_hash}): nothing to do"
    if not (untouched or force):
        raise MigrationError(
            f"{describe(existing)} exists and was edited (policy hash {current_hash or 'refused'}); it is left "
            f"alone: compare it with {where} and pass --force to replace it"
        )
    replaced = {**existing, "spec": body["spec"]}
    client.send(ApiRequest("PUT", guardpolicy_path(name), query, body=replaced))
    verb = "would replace" if dry_run else "replaced"
    return (f"{verb} {describe(existing)} ({'the bundled default' if untouched else 'edited, --force'}) with the "
            f"policy of {where} (policy hash {policy.hash})")


def _bundled_hash(name: str) -> str:
    """The hash of the bundled default as a replica creates it under ``name``."""
    bundled = dict(load_policy(None).document)
    return parse_policy({**bundled, "metadata": {"name": name}}, "(bundled)").hash
