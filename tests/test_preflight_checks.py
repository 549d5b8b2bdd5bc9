"""``webhook.kube.preflight``: the checks judged from plain facts (no cluster; tests/k8s/test_preflight.py runs the
command against the real apiserver and the real guard)."""

from __future__ import annotations

import copy
import dataclasses
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509

from webhook.admission.policy import load_policy, parse_policy
from webhook.kube import kubeapi
from webhook.kube.preflight import (
    check_apiserver,
    check_drivers,
    check_kubelets,
    check_scheduler,
    exit_code,
    format_checks,
    run_checks,
)
from webhook.kube.preflight_facts import Check, ClusterFacts, ProbeOutcome, ProbeResult, ServingCertificate, Status
from webhook.kube.preflight_gather import classify_probe_error, probe_object, short_message
from webhook.kube.preflight_guard import check_guard, verify_serving_certificate
from webhook.kube.registration import WebhookTarget, build_webhook_configurations
from webhook.serving import dev_certs


def kubelet_node(version: str) -> dict[str, Any]:
    return {"metadata": {"name": f"n-{version}"}, "status": {"nodeInfo": {"kubeletVersion": version}}}


def facts(**overrides: Any) -> ClusterFacts:
    base = ClusterFacts(
        server_version="v1.36.2", probe=ProbeResult(ProbeOutcome.ACCEPTED, "n/ebs.csi.aws.com"),
        nodes=[kubelet_node("v1.36.2")], scheduler_versions=["v1.36.2"], scheduler_source="pod in kube-system",
        csidrivers=[], driver_versions={}, version_sources={}, webhook_configurations={},
        serving_certificates={}, deployment=None, now=datetime.now(UTC),
    )
    return dataclasses.replace(base, **overrides)


def statuses(checks: list[Check]) -> list[str]:
    return [str(c.status) for c in checks]


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        pytest.param("v1.32.9", "FAIL", id="1.32: the gate does not exist"),
        pytest.param("v1.33.4", "WARN", id="1.33: alpha, off by default"),
        pytest.param("v1.34.1-eks-1a2b3c", "WARN", id="1.34: beta, off by default"),
        pytest.param("v1.35.0", "OK", id="1.35: on by default"),
        pytest.param("v1.36.2", "OK", id="1.36: GA"),
        pytest.param("v1.37.0-alpha.1", "OK", id="later: GA"),
    ],
)
def test_the_apiserver_version_against_the_matrix(version: str, expected: str) -> None:
    row = check_apiserver(facts(server_version=version))[0]
    assert str(row.status) == expected and version in row.checked
    assert bool(row.action) == (expected != "OK")


@pytest.mark.parametrize(
    ("outcome", "expected"),
    [
        (ProbeOutcome.ACCEPTED, "OK"),
        (ProbeOutcome.REFUSED_AFTER_VALIDATION, "OK"),
        (ProbeOutcome.IMMUTABLE, "FAIL"),
        (ProbeOutcome.REFUSED_BY_ADMISSION, "WARN"),
        (ProbeOutcome.NO_CANDIDATE, "WARN"),
        (ProbeOutcome.ERROR, "WARN"),
    ],
)
def test_the_probe_decides_whatever_the_version_says(outcome: ProbeOutcome, expected: str) -> None:
    rows = check_apiserver(facts(server_version="v1.35.1", probe=ProbeResult(outcome, "n/d", "detail")))
    assert statuses(rows) == ["OK", expected]


def test_probe_errors_are_classified_by_where_admission_refused() -> None:
    immutable = kubeapi.KubeApiError(422, "Invalid", 'CSINode.storage.k8s.io "n" is invalid: spec.drivers[0]'
                                     '.allocatable: Invalid value: ...: field is immutable')
    assert classify_probe_error(immutable) is ProbeOutcome.IMMUTABLE
    vap = kubeapi.KubeApiError(403, "Forbidden", "ValidatingAdmissionPolicy 'x' with binding 'x' denied request: no")
    assert classify_probe_error(vap) is ProbeOutcome.REFUSED_AFTER_VALIDATION
    validating = kubeapi.KubeApiError(
        400, "BadRequest", 'admission webhook "increases-and-other-writers.validate.csinode-guard.io" denied the '
        "request: no")
    assert classify_probe_error(validating) is ProbeOutcome.REFUSED_AFTER_VALIDATION
    mutating = kubeapi.KubeApiError(
        400, "BadRequest", 'admission webhook "increases-and-other-writers.mutate.csinode-guard.io" denied the '
        "request: [writer-identity] ...")
    assert classify_probe_error(mutating) is ProbeOutcome.REFUSED_BY_ADMISSION
    down = kubeapi.KubeApiError(500, "InternalError", 'Internal error occurred: failed calling webhook "m": ...')
    assert classify_probe_error(down) is ProbeOutcome.REFUSED_BY_ADMISSION
    assert classify_probe_error(kubeapi.KubeApiError(403, "Forbidden", "cannot update csinodes")) is ProbeOutcome.ERROR
    assert short_message(mutating) == "400 BadRequest: [writer-identity] ..."


def test_the_probe_object_lowers_one_count_and_skips_csinodes_without_drivers() -> None:
    empty = {"metadata": {"name": "a"}, "spec": {"drivers": None}}
    bounded = {"metadata": {"name": "b", "resourceVersion": "9"},
               "spec": {"drivers": [{"name": "d", "nodeID": "x", "allocatable": {"count": 5}}]}}
    obj, target = probe_object([empty, bounded]) or ({}, "")
    assert target == "b/d" and obj["spec"]["drivers"][0]["allocatable"] == {"count": 4}
    assert obj["metadata"]["resourceVersion"] == "9" and bounded["spec"]["drivers"][0]["allocatable"]["count"] == 5
    zero = {"metadata": {"name": "z"}, "spec": {"drivers": [{"name": "d", "nodeID": "x", "allocatable": {"count": 0}}]}}
    assert (probe_object([zero]) or ({}, ""))[0]["spec"]["drivers"][0]["allocatable"] == {"count": 1}
    unbounded = {"metadata": {"name": "u"}, "spec": {"drivers": [{"name": "d", "nodeID": "x"}]}}
    assert (probe_object([unbounded]) or ({}, ""))[0]["spec"]["drivers"][0]["allocatable"] == {"count": 1}
    assert probe_object([empty]) is None


def test_kubelets_per_version_too_old_gated_and_skewed() -> None:
    nodes = [kubelet_node(v) for v in ("v1.36.2", "v1.36.2", "v1.34.3", "v1.32.0", "v1.37.0", "v1.30.1")]
    rows = {c.checked.split(":")[0]: c for c in check_kubelets(facts(nodes=nodes, server_version="v1.36.2"))}
    assert rows["2 nodes at v1.36.2"].status is Status.OK
    assert rows["1 node at v1.34.3"].status is Status.WARN and "feature-gates" in rows["1 node at v1.34.3"].action
    assert rows["1 node at v1.32.0"].status is Status.FAIL
    assert rows["1 node at v1.37.0"].status is Status.FAIL and "newer" in rows["1 node at v1.37.0"].checked
    skewed = check_kubelets(facts(nodes=[kubelet_node("v1.33.0")], server_version="v1.37.1"))[0]
    assert skewed.status is Status.FAIL and "4 minors behind" in skewed.checked
    assert check_kubelets(facts(nodes=[]))[0].status is Status.WARN


def test_the_scheduler_from_pods_or_the_flag() -> None:
    assert check_scheduler(facts(scheduler_versions=[]))[0].status is Status.WARN
    assert "--scheduler-version" in check_scheduler(facts(scheduler_versions=[]))[0].action
    assert check_scheduler(facts(scheduler_versions=["v1.34.0"]))[0].status is Status.WARN
    assert check_scheduler(facts(scheduler_versions=["v1.31.0"]))[0].status is Status.FAIL
    assert statuses(check_scheduler(facts(scheduler_versions=["v1.36.0", "v1.36.0"]))) == ["OK"]


def test_csidrivers_period_and_node_plugin_versions_against_min_version() -> None:
    doc = load_policy().document
    doc = {**doc, "spec": {**doc["spec"], "drivers": {**doc["spec"]["drivers"],
                                                     "ebs.csi.aws.com": {"minVersion": "v1.37.0"}}}}
    policy = parse_policy(doc, "p.yaml", Path(__file__).resolve().parents[1] / "policies")
    drivers = [{"metadata": {"name": "ebs.csi.aws.com"}, "spec": {"nodeAllocatableUpdatePeriodSeconds": 60}},
               {"metadata": {"name": "disk.csi.azure.com"}, "spec": {}}]
    rows = check_drivers(facts(csidrivers=drivers, driver_versions={
        "ebs.csi.aws.com": {"v1.37.0-eksbuild.1": 3, "v1.36.1": 1}},
        version_sources={"ebs.csi.aws.com": "pods kube-system/app=ebs-csi-node"}), policy)
    by = {(c.component, c.status): c for c in rows}
    assert (("CSIDriver disk.csi.azure.com", Status.WARN)) in by
    assert ("CSIDriver ebs.csi.aws.com", Status.OK) in by
    versions = by[("CSIDriver ebs.csi.aws.com", Status.WARN)]
    assert "below minVersion v1.37.0: v1.36.1 on 1" in versions.checked
    assert "v1.37.0-eksbuild.1 on 3 nodes" in versions.checked
    good = check_drivers(facts(csidrivers=drivers[:1], driver_versions={"ebs.csi.aws.com": {"v1.38.0": 2}}), policy)
    assert statuses(good) == ["OK", "OK"]
    unknown = check_drivers(facts(csidrivers=drivers[:1]), policy)
    assert statuses(unknown) == ["OK", "WARN"] and "versionSource" in unknown[1].action
    assert check_drivers(facts(), policy)[0].status is Status.WARN


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, bytes, bytes]:
    """(caBundle PEM, serving certificate DER for csinode-guard.csinode-guard.svc and 127.0.0.1, another CA)."""
    root = tmp_path_factory.mktemp("certs")
    dev_certs.ensure_dev_certs(root / "a", dns_names=["csinode-guard.csinode-guard.svc"], ip_addresses=["127.0.0.1"])
    dev_certs.ensure_dev_certs(root / "b", dns_names=["localhost"])
    from cryptography.hazmat.primitives.serialization import Encoding  # noqa: PLC0415

    leaf = x509.load_pem_x509_certificate((root / "a" / "tls.crt").read_bytes()).public_bytes(Encoding.DER)
    return (root / "a" / "ca-bundle.crt").read_bytes(), leaf, (root / "b" / "ca.crt").read_bytes()


def test_the_ca_bundle_verifies_the_serving_certificate_for_its_host(certs: tuple[bytes, bytes, bytes]) -> None:
    bundle, leaf, other = certs
    now = datetime.now(UTC)  # not the module's import time: the certificates are valid from 5 min before now
    assert verify_serving_certificate(bundle, leaf, "csinode-guard.csinode-guard.svc", now) is None
    assert verify_serving_certificate(bundle, leaf, "127.0.0.1", now) is None
    assert "not signed by a CA in caBundle" in (verify_serving_certificate(other, leaf, "127.0.0.1", now) or "")
    assert "is not among its DNS names" in (verify_serving_certificate(bundle, leaf, "guard.example", now) or "")
    assert "is not among its IP addresses" in (verify_serving_certificate(bundle, leaf, "10.0.0.1", now) or "")
    assert "not valid now" in (verify_serving_certificate(bundle, leaf, "127.0.0.1", now + timedelta(days=400))
                               or "")
    assert verify_serving_certificate(other + bundle, leaf, "127.0.0.1", now) is None  # during a CA rotation
    assert "not PEM" in (verify_serving_certificate(b"junk", leaf, "127.0.0.1", now) or "")


ENTRIES = ("increases-and-other-writers.mutate.csinode-guard.io", "node-registrations.mutate.csinode-guard.io",
           "increases-and-other-writers.validate.csinode-guard.io", "node-registrations.validate.csinode-guard.io")
"""Two entries per configuration: failurePolicy Fail for increases, Ignore for what must never be refused."""


def _registered(bundle: bytes, *, entry: int = 0, **webhook_changes: Any) -> dict[str, Any]:
    objects = build_webhook_configurations(WebhookTarget(ca_bundle=bundle))
    for obj in objects:
        obj["webhooks"][entry].update(webhook_changes)
    return {obj["kind"]: obj for obj in objects}


def test_the_guard_as_registered_passes(certs: tuple[bytes, bytes, bytes]) -> None:
    bundle, leaf, _ = certs
    served = {name: ServingCertificate(leaf, "TLS handshake", "csinode-guard.csinode-guard.svc")
              for name in ENTRIES}
    ready = {"spec": {"replicas": 2}, "status": {"readyReplicas": 2}}
    rows = check_guard(facts(webhook_configurations=_registered(bundle), serving_certificates=served,
                             deployment=ready))
    assert statuses(rows) == ["OK"] * 13, rows  # 3 rows for each of the 4 entries, then the Deployment
    assert [r.checked.split(":")[0] for r in rows[:-1]] == [n for n in ENTRIES for _ in range(3)]
    assert [r.checked for r in rows if "failurePolicy" in r.checked] == [
        "increases-and-other-writers.mutate.csinode-guard.io: failurePolicy Fail as documented",
        "node-registrations.mutate.csinode-guard.io: failurePolicy Ignore as documented",
        "increases-and-other-writers.validate.csinode-guard.io: failurePolicy Fail as documented",
        "node-registrations.validate.csinode-guard.io: failurePolicy Ignore as documented",
    ]
    assert rows[-1].checked == "2/2 replicas ready"


def test_guard_problems_are_named(certs: tuple[bytes, bytes, bytes]) -> None:
    bundle, leaf, other = certs
    served = {name: ServingCertificate(leaf, "TLS handshake", "csinode-guard.csinode-guard.svc")
              for name in ENTRIES}
    loose = check_guard(facts(webhook_configurations=_registered(bundle, matchConditions=[],
                                                                 failurePolicy="Ignore"),
                              serving_certificates=served, deployment={"spec": {"replicas": 2},
                                                                       "status": {"readyReplicas": 1}}))
    assert [c.status for c in loose if "no matchConditions" in c.checked] == [Status.FAIL, Status.FAIL]
    assert [c.status for c in loose if "failurePolicy Ignore, documented Fail" in c.checked] == [Status.FAIL] * 2
    blocking = check_guard(facts(webhook_configurations=_registered(bundle, entry=1, failurePolicy="Fail"),
                                 serving_certificates=served))
    assert [(c.checked.split(":")[0], c.status) for c in blocking if "failurePolicy Fail, documented Ignore" in
            c.checked] == [("node-registrations.mutate.csinode-guard.io", Status.FAIL),
                           ("node-registrations.validate.csinode-guard.io", Status.FAIL)]
    assert all("blocks kubelet's CSINode creation" in c.checked for c in blocking if "documented Ignore" in c.checked)
    unconditioned = check_guard(facts(webhook_configurations=_registered(bundle, entry=1, matchConditions=[]),
                                      serving_certificates=served))
    assert [c.checked.split(":")[0] for c in unconditioned if c.status is Status.FAIL] == [
        "node-registrations.mutate.csinode-guard.io", "node-registrations.validate.csinode-guard.io"]
    assert loose[-1].status is Status.WARN and loose[-1].checked == "1/2 replicas ready"
    wrong_ca = check_guard(facts(webhook_configurations=_registered(other), serving_certificates=served))
    assert [c.status for c in wrong_ca if "does not verify" in c.checked] == [Status.FAIL] * 4
    absent = check_guard(facts(webhook_configurations={}, deployment={"spec": {"replicas": 2}, "status": {}}))
    assert statuses(absent) == ["FAIL", "FAIL", "FAIL"] and absent[-1].checked == "0/2 replicas ready"
    unreachable = {n: ServingCertificate(None, "", "h", "TLS handshake with h:443 failed: refused") for n in served}
    rows = check_guard(facts(webhook_configurations=_registered(bundle), serving_certificates=unreachable))
    assert [c.status for c in rows if "not checked" in c.checked] == [Status.WARN] * 4
    bundle_less = _registered(bundle)
    for obj in bundle_less.values():
        del obj["webhooks"][0]["clientConfig"]["caBundle"]
    assert [c.status for c in check_guard(facts(webhook_configurations=bundle_less)) if "no caBundle" in c.checked] \
        == [Status.FAIL, Status.FAIL]


def test_exit_codes_and_the_table() -> None:
    assert exit_code([Check("a", "x", Status.OK)]) == 0
    assert exit_code([Check("a", "x", Status.OK), Check("b", "y", Status.WARN)]) == 1
    assert exit_code([Check("a", "x", Status.WARN), Check("b", "y", Status.FAIL)]) == 2
    text = format_checks([Check("kube-apiserver", "version v1.36.2", Status.OK),
                          Check("kubelet", "1 node at v1.32.0: too old", Status.FAIL, "upgrade")])
    lines = text.splitlines()
    assert lines[0].split() == ["COMPONENT", "STATUS", "CHECKED", "ACTION"]
    assert lines[1].split()[:2] == ["kube-apiserver", "OK"] and lines[1].endswith("-")
    assert lines[-1] == "1 OK, 0 WARN, 1 FAIL"
    rows = run_checks(facts(errors={"kubelet": "403 Forbidden: nodes is forbidden"}), load_policy())
    assert not [c for c in rows if c.component == "kubelet" and "could not read" not in c.checked]
    assert [c.status for c in rows if c.checked.startswith("could not read")] == [Status.WARN]



def test_the_guard_registered_with_cel_validation_passes_and_half_of_it_is_named(
    certs: tuple[bytes, bytes, bytes],
) -> None:
    bundle, leaf, _ = certs
    served = {name: ServingCertificate(leaf, "TLS handshake", "csinode-guard.csinode-guard.svc")
              for name in ENTRIES}
    objects = build_webhook_configurations(WebhookTarget(ca_bundle=bundle), validation="cel")
    registered = {obj["kind"]: obj for obj in objects}
    rows = check_guard(facts(webhook_configurations=registered, serving_certificates=served))
    conditions = [r for r in rows if "matchConditions" in r.checked]
    assert [r.status for r in conditions] == [Status.OK] * 4, conditions
    assert [r.checked.split(": ")[1] for r in conditions] == ["matchConditions as registered by this release"] * 2 + [
        "matchConditions as registered by this release (--validation cel)"] * 2
    half = copy.deepcopy(registered)  # the extra condition on one validating entry only: not what register builds
    half["ValidatingWebhookConfiguration"]["webhooks"][1]["matchConditions"].pop()
    half["ValidatingWebhookConfiguration"]["webhooks"][0]["matchConditions"].pop(1)
    rows = check_guard(facts(webhook_configurations=half, serving_certificates=served))
    assert [r.checked.split(":")[0] for r in rows if "matchConditions differ" in r.checked] == [ENTRIES[2]]
