"""What ``csinode-guard preflight`` reads from the cluster, as :class:`webhook.kube.preflight_facts.ClusterFacts`.

One request per object or one paged LIST per kind through :class:`webhook.kube.kubeapi.KubeClient` (never a call per
node): ``/version``; a server-side dry run (``dryRun=All``) of one CSINode's count; Nodes; kube-scheduler pods
in ``kube-system``; CSIDrivers; the drivers' node-plugin pods where the policy's ``versionSource`` is ``pod``;
both webhook configurations; the guard's Deployment. The guard's serving certificate comes from a TLS
handshake with the webhook's URL or Service (the certificate is only read, not trusted), else from its TLS
Secret. The judging is pure, in :mod:`webhook.kube.preflight` and :mod:`webhook.kube.preflight_guard`.
"""

from __future__ import annotations

import base64
import copy
import json
import socket
import ssl
from collections import Counter
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit

from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from webhook.admission.policy import Policy
from webhook.kube import kubeapi
from webhook.kube.preflight_facts import ClusterFacts, ProbeOutcome, ProbeResult, ServingCertificate
from webhook.kube.registration import CONFIGURATION_NAME, VALIDATING_WEBHOOK_NAME
from webhook.kube.watch.records import image_tag, lowest_version, parse_pod
from webhook.kube.watch.view import label_selector

PROBE_FIELD_MANAGER = "csinode-guard-preflight"
TLS_SECRET = "csinode-guard-tls"
SCHEDULER_SELECTOR = "component=kube-scheduler"
"""Label of kube-scheduler's static pods (kubeadm and most distributions)."""
HANDSHAKE_TIMEOUT = 3.0


def _count_of(entry: Mapping[str, Any]) -> int | None:
    allocatable = entry.get("allocatable")
    count = allocatable.get("count") if isinstance(allocatable, Mapping) else None
    return count if isinstance(count, int) and not isinstance(count, bool) else None


def probe_object(csinodes: Sequence[Mapping[str, Any]]) -> tuple[dict[str, Any], str] | None:
    """The CSINode to send as the dry-run probe, with one driver's count moved by one, and ``node/driver``.

    A bounded count goes one down (the safe direction; up from 0); an unbounded one becomes bounded at 1.
    None when no CSINode has a driver."""
    for obj in csinodes:
        drivers = (obj.get("spec") or {}).get("drivers")
        if not isinstance(drivers, list) or not drivers:
            continue
        probe = copy.deepcopy(dict(obj))
        entry = probe["spec"]["drivers"][0]
        count = _count_of(entry)
        new = 1 if count is None else (count - 1 if count > 0 else 1)
        entry["allocatable"] = {"count": new}
        return probe, f"{obj['metadata']['name']}/{entry.get('name')}"
    return None


def classify_probe_error(exc: kubeapi.KubeApiError) -> ProbeOutcome:
    """What a refused dry-run count update says about the apiserver.

    422 ``field is immutable``: the gate is off. A ValidatingAdmissionPolicy or the guard's *validating* webhook
    runs after the apiserver's validation: the count was mutable. Any other admission refusal (a mutating
    webhook, a webhook that could not be called) happens before validation: inconclusive.
    """
    message = exc.message
    if exc.code == 422 and "immutable" in message.lower():
        return ProbeOutcome.IMMUTABLE
    if "ValidatingAdmissionPolicy" in message or f'admission webhook "{VALIDATING_WEBHOOK_NAME}" denied' in message:
        return ProbeOutcome.REFUSED_AFTER_VALIDATION
    if "admission webhook" in message or "calling webhook" in message:
        return ProbeOutcome.REFUSED_BY_ADMISSION
    return ProbeOutcome.ERROR


def short_message(exc: kubeapi.KubeApiError, limit: int | None = None) -> str:
    """The apiserver's message without the ``<resource> "<name>" is forbidden: `` preamble; whole (the table wraps
    it, ``-o json`` must not lose any of it), or cut to ``limit`` characters when one is given."""
    message = exc.message
    for marker in ("denied request: ", "denied the request: ", " is forbidden: ", " is invalid: "):
        if marker in message:
            message = message.split(marker, 1)[1]
            break
    text = f"{exc.code} {exc.reason}: {message}" if exc.reason else f"{exc.code}: {message}"
    return text if limit is None or len(text) <= limit else text[: limit - 3] + "..."


def run_probe(client: kubeapi.KubeClient, csinodes: Sequence[Mapping[str, Any]]) -> ProbeResult:
    """Send the dry-run probe (``dryRun=All``: every admission stage runs, nothing is stored)."""
    chosen = probe_object(csinodes)
    if chosen is None:
        return ProbeResult(ProbeOutcome.NO_CANDIDATE)
    obj, target = chosen
    try:
        client.replace(kubeapi.CSINODES, obj, dry_run=True, field_manager=PROBE_FIELD_MANAGER)
    except kubeapi.KubeApiError as exc:
        return ProbeResult(classify_probe_error(exc), target, short_message(exc))
    except kubeapi.ApiUnreachableError as exc:
        return ProbeResult(ProbeOutcome.ERROR, target, str(exc))
    return ProbeResult(ProbeOutcome.ACCEPTED, target)


def fetch_certificate(host: str, port: int, timeout: float = HANDSHAKE_TIMEOUT) -> bytes:
    """The leaf certificate (DER) a TLS server at ``host:port`` presents for SNI ``host``. Nothing is trusted or
    sent: the handshake only reads the certificate, which
    :func:`webhook.kube.preflight_guard.verify_serving_certificate` then checks against the webhook's caBundle. Raises
    OSError (ssl.SSLError included)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    with socket.create_connection((host, port), timeout=timeout) as raw:
        sni = None if _is_ip(host) else host
        with context.wrap_socket(raw, server_hostname=sni) as tls:
            der = tls.getpeercert(binary_form=True)
    if not der:
        raise OSError("the server presented no certificate")
    return der


def _is_ip(host: str) -> bool:
    try:
        socket.inet_pton(socket.AF_INET6 if ":" in host else socket.AF_INET, host)
    except OSError:
        return False
    return True


def _secret_certificate(client: kubeapi.KubeClient, namespace: str) -> bytes:
    secret = client.get(kubeapi.SECRETS, TLS_SECRET, namespace)
    pem = base64.b64decode((secret.get("data") or {}).get("tls.crt") or "")
    return x509.load_pem_x509_certificates(pem)[0].public_bytes(Encoding.DER)


def serving_certificate(
    client: kubeapi.KubeClient, webhook: Mapping[str, Any], cache: dict[tuple[str, int], bytes | str]
) -> ServingCertificate:
    """The certificate the guard serves for ``webhook``: TLS handshake with its URL or Service first, then the
    Service's TLS Secret (``csinode-guard-tls``) when the Service is not reachable from here."""
    config = webhook.get("clientConfig") or {}
    if config.get("url"):
        parts = urlsplit(str(config["url"]))
        host, port = parts.hostname or "", parts.port or 443
        service = None
    else:
        service = config.get("service") or {}
        host = f"{service.get('name')}.{service.get('namespace')}.svc"
        port = int(service.get("port") or 443)
    key = (host, port)
    if key not in cache:
        try:
            cache[key] = fetch_certificate(host, port)
        except OSError as exc:
            cache[key] = f"TLS handshake with {host}:{port} failed: {exc}"
    found = cache[key]
    if isinstance(found, bytes):
        return ServingCertificate(found, f"TLS handshake with {host}:{port}", host)
    if service is None:
        return ServingCertificate(None, "", host, found)
    namespace = str(service.get("namespace") or "")
    try:
        return ServingCertificate(_secret_certificate(client, namespace), f"Secret {namespace}/{TLS_SECRET}", host)
    except (kubeapi.KubeApiError, kubeapi.ApiUnreachableError, ValueError, IndexError) as exc:
        return ServingCertificate(None, "", host, f"{found}; Secret {namespace}/{TLS_SECRET}: {exc}")


def driver_versions(
    client: kubeapi.KubeClient, policy: Policy, drivers: Sequence[str], csinodes: Sequence[Mapping[str, Any]]
) -> tuple[dict[str, dict[str, int]], dict[str, str]]:
    """Per driver: version -> number of nodes, from the policy's version source, and a description of the source.

    ``pod``: one LIST of the source's pods (namespace, label selector); a node's version is the lowest its
    DaemonSet-controlled pods report (read as the guard reads them: :func:`parse_pod`). ``annotation``: the
    CSINodes' driver-versions annotation (as written; the guard trusts it only from trusted principals).
    ``kubelet``: not read.
    """
    versions: dict[str, dict[str, int]] = {}
    sources: dict[str, str] = {}
    for driver in drivers:
        source = policy.for_driver(driver).version_source
        found: Counter[str] = Counter()
        if source.type == "pod" and source.pod is not None:
            sources[driver] = f"pods {source.pod.namespace}/{label_selector(source.pod.match_labels)}"
            pods = client.list_all(kubeapi.PODS, namespace=source.pod.namespace,
                                   label_selector=label_selector(source.pod.match_labels))
            per_node: dict[str, list[str]] = {}
            for obj in pods:
                record = parse_pod(obj)
                version = record.version(source.pod) if record is not None else None
                if record is not None and version:
                    per_node.setdefault(record.node, []).append(version)
            for values in per_node.values():
                lowest = lowest_version(values)
                if lowest:
                    found[lowest] += 1
        elif source.type == "annotation":
            sources[driver] = f"annotation {source.annotation}"
            for csinode in csinodes:
                raw = ((csinode.get("metadata") or {}).get("annotations") or {}).get(source.annotation)
                try:
                    decoded = json.loads(raw) if raw else {}
                except ValueError:
                    continue
                if isinstance(decoded, dict) and isinstance(decoded.get(driver), str):
                    found[decoded[driver]] += 1
        else:
            sources[driver] = source.type
        versions[driver] = dict(found)
    return versions, sources


def scheduler_versions(client: kubeapi.KubeClient) -> list[str]:
    """Image tags of kube-scheduler's pods in ``kube-system`` (``registry.k8s.io/kube-scheduler:v1.36.2``)."""
    found = []
    for pod in client.list_all(kubeapi.PODS, namespace="kube-system", label_selector=SCHEDULER_SELECTOR):
        for container in (pod.get("spec") or {}).get("containers") or []:
            tag = image_tag(str(container.get("image") or ""))
            if tag:
                found.append(tag)
                break
    return found


def _get_or_none(client: kubeapi.KubeClient, resource: kubeapi.ApiResource, name: str,
                 namespace: str | None = None) -> dict[str, Any] | None:
    try:
        return client.get(resource, name, namespace)
    except kubeapi.KubeApiError as exc:
        if exc.not_found:
            return None
        raise


DEFAULT_DEPLOYMENT = "csinode-guard"
"""The namespace and name of the guard's Deployment in deploy/."""


def gather_facts(
    client: kubeapi.KubeClient,
    policy: Policy,
    *,
    now: datetime,
    scheduler_version: str | None = None,
    configuration_name: str = CONFIGURATION_NAME,
    deployment_namespace: str | None = None,
    deployment_name: str | None = None,
    before_install: bool = False,
) -> ClusterFacts:
    """Read everything :func:`webhook.kube.preflight.run_checks` judges. Raises :class:`kubeapi.ApiUnreachableError`
    when the apiserver does not answer at all; a refused read becomes an entry of ``errors``.

    The guard's Deployment is read directly, also while no webhook configuration exists yet (the install creates
    them last): ``deployment_namespace``/``deployment_name``, each defaulting to the namespace and name of the
    Service the configurations call, else to deploy/'s ``csinode-guard``/``csinode-guard``; not looked for when
    the configurations call a URL and neither is given."""
    errors: dict[str, str] = {}
    server_version: str | None = None
    version_error = ""
    try:
        server_version = str(client.get_path("/version").get("gitVersion") or "") or None
    except kubeapi.KubeApiError as exc:
        version_error = str(exc)

    def read(component: str, call: Any, default: Any) -> Any:
        try:
            return call()
        except kubeapi.KubeApiError as exc:
            errors[component] = str(exc)
            return default

    csinodes: list[dict[str, Any]] = read("CSINode", lambda: client.list_all(kubeapi.CSINODES), [])
    probe = run_probe(client, csinodes) if "CSINode" not in errors else ProbeResult(
        ProbeOutcome.ERROR, "", errors["CSINode"])
    nodes = read("kubelet", lambda: client.list_all(kubeapi.NODES), [])
    if scheduler_version:
        schedulers, scheduler_source = [scheduler_version], "--scheduler-version"
    else:
        schedulers = read("kube-scheduler", lambda: scheduler_versions(client), [])
        scheduler_source = "pod in kube-system"
    csidrivers = read("CSIDriver", lambda: client.list_all(kubeapi.CSIDRIVERS), [])
    names = [str((d.get("metadata") or {}).get("name") or "") for d in csidrivers]
    versions, sources = read("driver versions", lambda: driver_versions(client, policy, names, csinodes), ({}, {}))
    configurations: dict[str, dict[str, Any] | None] = {}
    for resource in (kubeapi.MUTATING_WEBHOOK_CONFIGURATIONS, kubeapi.VALIDATING_WEBHOOK_CONFIGURATIONS):
        configurations[resource.kind] = read(
            f"guard {resource.kind}", lambda r=resource: _get_or_none(client, r, configuration_name), None)
    certificates: dict[str, ServingCertificate] = {}
    cache: dict[tuple[str, int], bytes | str] = {}
    service: Mapping[str, Any] | None = None
    url = ""
    for configuration in configurations.values():
        for webhook in (configuration or {}).get("webhooks") or []:
            certificates[str(webhook.get("name"))] = serving_certificate(client, webhook, cache)
            config = webhook.get("clientConfig") or {}
            service = service or config.get("service")
            url = url or str(config.get("url") or "")
    note = ""
    namespace = deployment_namespace or str((service or {}).get("namespace") or DEFAULT_DEPLOYMENT)
    name = deployment_name or str((service or {}).get("name") or DEFAULT_DEPLOYMENT)
    deployment = None
    if service is None and url and not (deployment_namespace or deployment_name):
        note = f"registered with a URL ({url}): not a Deployment in this cluster"
    else:
        deployment = read("guard Deployment",
                          lambda: _get_or_none(client, kubeapi.DEPLOYMENTS, name, namespace), None)
        if deployment is None and "guard Deployment" not in errors:
            note = f"deployment {namespace}/{name} not found"
    # The guard's namespace: the Deployment's, or (a guard registered with a URL, outside the cluster) serve's
    # default --lease-namespace, which is the same name.
    namespace_found = read("guard namespace",
                           lambda: _get_or_none(client, kubeapi.NAMESPACES, namespace) is not None, None)
    return ClusterFacts(
        server_version=server_version,
        server_version_error=version_error,
        probe=probe,
        nodes=nodes,
        scheduler_versions=schedulers,
        scheduler_source=scheduler_source,
        csidrivers=csidrivers,
        driver_versions=versions,
        version_sources=sources,
        webhook_configurations=configurations,
        serving_certificates=certificates,
        deployment=deployment,
        deployment_note=note,
        now=now,
        errors=errors,
        configuration_name=configuration_name,
        guard_namespace=namespace,
        guard_namespace_exists=namespace_found,
        before_install=before_install,
    )
