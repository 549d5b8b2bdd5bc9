"""Helpers of the monitoring tests: a guard scraped by the suite's Prometheus, CSINode writes through the real
apiserver in bulk, short-lived serving certificates and restricted identities for the guard."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tests.k8s.controlplane import ControlPlane, Guard, unique
from tests.k8s.prometheus import Prometheus, alert_rules

EBS = "ebs.csi.aws.com"


@contextlib.contextmanager
def scraped(prometheus: Prometheus, *guards: Guard, namespace: str | None = None) -> Iterator[str]:
    """Scrape every guard's metrics port as one replica (label ``pod`` = its configuration name) of one
    installation (label ``namespace``, new and unique unless given); yields the namespace."""
    namespace = namespace or unique("ns")
    with contextlib.ExitStack() as stack:
        for guard in guards:
            stack.enter_context(prometheus.scrape(f"127.0.0.1:{guard.metrics_port}", namespace=namespace,
                                                  pod=guard.name))
        yield namespace


def admin_writes(control_plane: ControlPlane, node: str, counts: list[int], *, dry_run: bool = False) -> list[int]:
    """GET/PUT the CSINode ``node`` as the cluster admin once per count (the EBS entry's ``allocatable.count``
    set to it) with the kubernetes client; returns the HTTP status of each PUT (200, or 403 when refused)."""
    from kubernetes import client  # noqa: PLC0415
    from kubernetes.client.exceptions import ApiException  # noqa: PLC0415

    storage = client.StorageV1Api(control_plane.api_client())
    statuses = []
    for count in counts:
        stored = storage.read_csi_node(node)
        for entry in stored.spec.drivers:
            if entry.name == EBS:
                entry.allocatable = client.V1VolumeNodeResources(count=count)
        try:
            storage.replace_csi_node(node, stored, dry_run="All" if dry_run else None)
            statuses.append(200)
        except ApiException as exc:
            statuses.append(exc.status)
    return statuses


def short_lived_cert(control_plane: ControlPlane, cert_dir: Path, days: int) -> dt.datetime:
    """Replace ``cert_dir``'s tls.crt/tls.key by a serving certificate for 127.0.0.1 signed by the cluster CA and
    valid ``days`` days from now (the guard reloads it); returns its notAfter (UTC)."""
    from cryptography import x509  # noqa: PLC0415
    from cryptography.hazmat.primitives import serialization  # noqa: PLC0415

    from webhook.serving import dev_certs  # noqa: PLC0415

    ca_cert = x509.load_pem_x509_certificate(control_plane.ca_crt.read_bytes())
    ca_key = serialization.load_pem_private_key(Path(control_plane.env["CA_KEY"]).read_bytes(), password=None)
    key, cert = dev_certs.generate_serving_cert(ca_key, ca_cert, ["csinode-guard"], ["127.0.0.1"],  # type: ignore[arg-type]
                                                valid_days=days)
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    (cert_dir / "tls.key.new").write_bytes(key_pem)
    (cert_dir / "tls.crt.new").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (cert_dir / "tls.key.new").replace(cert_dir / "tls.key")
    (cert_dir / "tls.crt.new").replace(cert_dir / "tls.crt")
    return cert.not_valid_after_utc


def restricted_kubeconfig(control_plane: ControlPlane, name: str, forbidden: str) -> Path:
    """A kubeconfig of user ``name`` allowed to read what the guard watches except resource ``forbidden`` (e.g.
    ``volumeattachments``): its cache of that kind can never list, so it never syncs."""
    resources = {"": ["nodes", "pods", "secrets", "configmaps", "events"],
                 "storage.k8s.io": ["csidrivers", "csinodes", "volumeattachments"],
                 "coordination.k8s.io": ["leases"]}
    rules = [{"apiGroups": [group], "resources": [r for r in names if r != forbidden],
              "verbs": ["get", "list", "watch"]} for group, names in resources.items()]
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": name},
            "rules": rules}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": name},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
               "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": name}]}
    for doc in (role, binding):
        control_plane.kubectl("apply", "-f", "-", input=json.dumps(doc))
    return control_plane.user_kubeconfig(name)


def active(alerts: list[dict[str, Any]], keep: Callable[[dict[str, str]], bool]) -> list[dict[str, Any]]:
    """The alerts whose labels ``keep`` accepts, as ``{alertname, state, labels}`` (for readable failures)."""
    return [{"alertname": a["labels"]["alertname"], "state": a["state"], "labels": a["labels"]}
            for a in alerts if keep(a["labels"])]


GLOBAL_ALERTS = {"CSINodeGuardDown", "CSINodeGuardSingleReplica"}
"""Alerts on the whole job (no namespace label): with no target up, Down holds for every namespace."""


def condition(prometheus: Prometheus, alert: str, namespace: str) -> list[dict[str, Any]]:
    """The alert's own expression evaluated now (no ``for:``), restricted to ``namespace`` where it has one."""
    answer = prometheus.query(alert_rules()[alert]["expr"])
    return [s for s in answer if s["metric"].get("namespace", namespace) == namespace]


def assert_alert_active(prometheus: Prometheus, alert: str, namespace: str, timeout: float = 60, **labels: str) -> None:
    """The alert becomes active for ``namespace`` (or globally), and its expression is true on its own."""
    rule = alert_rules()[alert]
    if alert not in GLOBAL_ALERTS:
        labels = {"namespace": namespace, **labels}
    found = prometheus.wait_for_alert(alert, timeout=timeout, **labels)
    assert found["state"] == ("pending" if rule.get("for") else "firing"), found
    assert found["labels"]["severity"] == rule["labels"]["severity"]
    assert condition(prometheus, alert, namespace), f"{alert}: {rule['expr']} is not true"
