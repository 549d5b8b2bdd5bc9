"""The guard's own installation, as ``csinode-guard preflight`` judges it from :class:`ClusterFacts`: its webhook
configurations against what ``register`` builds (:mod:`webhook.kube.registration`: matchConditions, failurePolicy), the
caBundle against the serving certificate the apiserver would be shown (verified as the apiserver verifies it:
chain, validity, subjectAltName), and the Deployment's ready replicas. Pure.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature

from webhook.kube.one_call import VALIDATION_CEL
from webhook.kube.preflight_facts import Check, ClusterFacts, Status
from webhook.kube.registration import FAILURE_POLICY, build_webhook_configurations


def verify_serving_certificate(ca_bundle: bytes, der: bytes, host: str, now: datetime) -> str | None:
    """Why ``ca_bundle`` (PEM) does not verify the serving certificate ``der`` for ``host``; None when it does.

    The certificate must be issued and signed by one of the bundle's certificates, valid at ``now``, and name
    ``host`` in its subjectAltName (a DNS name or an IP address, as the apiserver checks it).
    """
    try:
        cas = x509.load_pem_x509_certificates(ca_bundle)
    except ValueError as exc:
        return f"caBundle is not PEM certificates: {exc}"
    try:
        cert = x509.load_der_x509_certificate(der)
    except ValueError as exc:
        return f"the serving certificate does not parse: {exc}"
    issuers = [ca for ca in cas if ca.subject == cert.issuer]
    signed = False
    for ca in issuers:
        try:
            cert.verify_directly_issued_by(ca)
        except (ValueError, TypeError, InvalidSignature):
            continue
        signed = True
        break
    if not signed:
        return f"not signed by a CA in caBundle (issuer {cert.issuer.rfc4514_string()})"
    if now < cert.not_valid_before_utc or now >= cert.not_valid_after_utc:
        return f"not valid now (valid {cert.not_valid_before_utc:%Y-%m-%d} to {cert.not_valid_after_utc:%Y-%m-%d})"
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return "no subjectAltName"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        dns = [n.lower() for n in names.get_values_for_type(x509.DNSName)]
        if host.lower() not in dns:
            return f"{host} is not among its DNS names {dns}"
    else:
        if address not in names.get_values_for_type(x509.IPAddress):
            return f"{host} is not among its IP addresses"
    return None


def _ca_bundle(webhook: Mapping[str, Any]) -> bytes | None:
    import base64  # noqa: PLC0415 - only here

    value = (webhook.get("clientConfig") or {}).get("caBundle")
    if not value:
        return None
    try:
        return base64.b64decode(value)
    except ValueError:
        return None


def check_guard(facts: ClusterFacts) -> list[Check]:
    """The guard's webhook configurations against what ``register`` builds, their CA bundles against the
    serving certificate, and its Deployment's ready replicas."""
    if facts.before_install and not any(facts.webhook_configurations.values()):
        return [Check("guard", "not installed yet (--before-install): its checks run once it is registered",
                      Status.OK)]
    checks: list[Check] = []
    one_call = {  # `register --validation cel`: the validating entries carry one more condition
        str(w["name"]): w["matchConditions"]
        for c in build_webhook_configurations(name=facts.configuration_name, validation=VALIDATION_CEL)
        for w in c["webhooks"]
    }
    for expected in build_webhook_configurations(name=facts.configuration_name):
        kind = str(expected["kind"])
        name = str(expected["metadata"]["name"])
        found = facts.webhook_configurations.get(kind)
        component = f"guard {kind}"
        if found is None:
            checks.append(Check(component, f"{name} not found", Status.FAIL,
                                "install the guard (kubectl apply -k deploy/overlays/...) or csinode-guard register"))
            continue
        present = {str(w.get("name")): w for w in found.get("webhooks") or [] if isinstance(w, Mapping)}
        for want in expected["webhooks"]:
            checks.extend(_check_webhook(facts, component, want, present.get(str(want["name"])),
                                         one_call.get(str(want["name"]))))
    checks.extend(_check_deployment(facts))
    checks.extend(_check_namespace(facts))
    return checks


def _check_namespace(facts: ClusterFacts) -> list[Check]:
    """The guard's namespace: without it no replica holds the audit Lease, so nothing audits or repairs, no node
    history record is written (a node that deletes and re-creates its CSINode is judged without what the guard
    trusted about it) and no brake engages, while admission keeps answering and /readyz says ok."""
    namespace = facts.guard_namespace
    if not namespace or facts.guard_namespace_exists is None:
        return []  # not read: the read error is its own row
    if facts.guard_namespace_exists:
        return [Check("guard namespace", f"{namespace} exists (audit Lease, node history records, brakes)",
                      Status.OK)]
    return [Check("guard namespace", f"{namespace} not found: no replica can lead the audit, so nothing is "
                  "repaired, no node history is kept (a node's re-created CSINode is judged without it) and no "
                  "brake engages", Status.FAIL,
                  f"kubectl create namespace {namespace} (deploy/ and the chart create it; a guard outside the "
                  "cluster keeps them in its --lease-namespace)")]


def _check_webhook(
    facts: ClusterFacts, component: str, want: Mapping[str, Any], have: Mapping[str, Any] | None,
    one_call: Any = None,
) -> list[Check]:
    """``one_call``: the entry's matchConditions as ``register --validation cel`` builds them (also as
    registered by this release)."""
    name = str(want["name"])
    if have is None:
        return [Check(component, f"webhook {name} missing", Status.FAIL, "csinode-guard register")]
    checks = []
    conditions = have.get("matchConditions") or []
    if not conditions:
        checks.append(Check(component, f"{name}: no matchConditions: every CSINode write, registrations among "
                            "them, reaches the guard", Status.FAIL, "csinode-guard register (re-applies them)"))
    elif one_call is not None and list(conditions) == list(one_call) and list(one_call) != list(
            want["matchConditions"]):
        checks.append(Check(component, f"{name}: matchConditions as registered by this release (--validation cel)",
                            Status.OK))
    elif list(conditions) != list(want["matchConditions"]):
        checks.append(Check(component, f"{name}: matchConditions differ from this release's", Status.WARN,
                            "csinode-guard register (re-applies them)"))
    else:
        checks.append(Check(component, f"{name}: matchConditions as registered by this release", Status.OK))
    policy = have.get("failurePolicy", "Fail")
    if policy != want["failurePolicy"]:
        # Either way round is a FAIL: Ignore on the increases entry lets every increase through unchecked while
        # the guard is down; Fail on the never-refused entry makes a down guard block kubelet's CSINode CREATE
        # and driver registrations (the node goes NotReady, kubelet exits).
        harm = ("increases pass unchecked while the guard is down" if want["failurePolicy"] == FAILURE_POLICY
                else "a down guard blocks kubelet's CSINode creation and driver registrations")
        checks.append(Check(component, f"{name}: failurePolicy {policy}, documented {want['failurePolicy']}: {harm}",
                            Status.FAIL, "csinode-guard register (see docs/operations.md for why)"))
    else:
        checks.append(Check(component, f"{name}: failurePolicy {policy} as documented", Status.OK))
    ca_bundle = _ca_bundle(have)
    served = facts.serving_certificates.get(name)
    if ca_bundle is None:
        checks.append(Check(component, f"{name}: no caBundle", Status.FAIL,
                            "csinode-guard register --cert-dir ..., or check cert-manager's cainjector"))
    elif served is None or served.der is None:
        why = served.error if served is not None else "not fetched"
        checks.append(Check(component, f"{name}: serving certificate not checked ({why})", Status.WARN,
                            "run preflight where the guard's Service is reachable, or allow reading its TLS Secret"))
    else:
        problem = verify_serving_certificate(ca_bundle, served.der, served.host, facts.now)
        if problem is None:
            checks.append(Check(component, f"{name}: caBundle verifies the serving cert ({served.source})",
                                Status.OK))
        else:
            checks.append(Check(component, f"{name}: caBundle does not verify the serving certificate "
                                f"({served.source}): {problem}", Status.FAIL,
                                "csinode-guard register --cert-dir <the guard's certs> (or fix the certificate)"))
    return checks


def _check_deployment(facts: ClusterFacts) -> list[Check]:
    deployment = facts.deployment
    if deployment is None:
        if facts.deployment_note.startswith("registered with a URL"):
            return [Check("guard Deployment", facts.deployment_note, Status.OK)]
        return [Check("guard Deployment", facts.deployment_note or "not found", Status.WARN,
                      "kubectl apply -k deploy/ (count changes are refused while no replica serves), or name it: "
                      "--namespace/--deployment")]
    spec = deployment.get("spec") or {}
    status = deployment.get("status") or {}
    meta = deployment.get("metadata") or {}
    where = f"-n {meta.get('namespace') or 'csinode-guard'} "
    name = str(meta.get("name") or "csinode-guard")
    wanted = int(spec.get("replicas", 1) or 0)
    ready = int(status.get("readyReplicas") or 0)
    checked = f"{ready}/{wanted} replicas ready"
    if ready == 0:
        return [Check("guard Deployment", checked, Status.FAIL,
                      f"kubectl {where}describe deployment {name} (with failurePolicy Fail, count changes are "
                      "refused meanwhile)")]
    if ready < wanted:
        return [Check("guard Deployment", checked, Status.WARN, f"kubectl {where}get pods")]
    return [Check("guard Deployment", checked, Status.OK)]

