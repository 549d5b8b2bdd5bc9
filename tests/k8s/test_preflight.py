"""``csinode-guard preflight`` as a subprocess against the real kube-apiserver, with the real guard registered.

The cluster is v1.36.2 (mutable counts GA), its Nodes report kubelet v1.36.2, its kube-scheduler runs as a
process (no pods: the version comes from ``--scheduler-version``). CSIDrivers are created with unique names.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.k8s.controlplane import ControlPlane, Guard, unique

EBS = "ebs.csi.aws.com"


def preflight(cp: ControlPlane, *args: str, kubeconfig: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``csinode-guard preflight ARGS`` as admin (or ``kubeconfig``)."""
    return subprocess.run(
        [sys.executable, "-m", "webhook", "preflight", *args],
        env={**os.environ, "KUBECONFIG": str(kubeconfig or cp.kubeconfig)},
        capture_output=True, text=True, timeout=120, check=False,
    )


def rows(result: subprocess.CompletedProcess[str]) -> list[dict[str, str]]:
    checks: list[dict[str, str]] = json.loads(result.stdout)["checks"]
    return checks


def find(checks: list[dict[str, str]], component: str, text: str) -> dict[str, str]:
    matches = [c for c in checks if c["component"] == component and text in c["checked"]]
    assert len(matches) == 1, (component, text, checks)
    return matches[0]


def _csidriver(cp: ControlPlane, name: str, period: int | None) -> None:
    spec: dict[str, Any] = {"attachRequired": True}
    if period is not None:
        spec["nodeAllocatableUpdatePeriodSeconds"] = period
    obj = {"apiVersion": "storage.k8s.io/v1", "kind": "CSIDriver", "metadata": {"name": name}, "spec": spec}
    cp.kubectl("create", "-f", "-", input=json.dumps(obj))


def test_preflight_passes_the_matrix_and_checks_the_registered_guard(
    control_plane: ControlPlane, guard: Guard
) -> None:
    node = unique("preflight")
    control_plane.create_node(node)
    control_plane.kubelet(node, "install", "--driver", EBS, "--node-id", "i-pre", "--max-volumes", "25")
    with_period, without_period = unique("period") + ".csi.example.com", unique("noperiod") + ".csi.example.com"
    _csidriver(control_plane, with_period, 30)
    _csidriver(control_plane, without_period, None)
    try:
        result = preflight(control_plane, "-o", "json", "--name", guard.name, "--scheduler-version", "v1.36.2")
        checks = rows(result)
        assert find(checks, "kube-apiserver", "version v1.36.2")["status"] == "OK"
        probe = find(checks, "kube-apiserver", "dry-run count update")
        # As admin the guard refuses the probe (writer-identity) in /mutate, before the apiserver's validation.
        assert probe["status"] == "WARN" and "inconclusive" in probe["checked"], probe
        assert all(c["status"] == "OK" for c in checks if c["component"] == "kubelet"), checks
        assert find(checks, "kube-scheduler", "v1.36.2")["status"] == "OK"
        assert find(checks, f"CSIDriver {with_period}", "nodeAllocatableUpdatePeriodSeconds: 30")["status"] == "OK"
        unset = find(checks, f"CSIDriver {without_period}", "unset")
        assert unset["status"] == "WARN" and "nodeAllocatableUpdatePeriodSeconds" in unset["action"]
        # Two entries per configuration: failurePolicy Fail for increases, Ignore for what is never refused.
        for webhook, failure_policy in (("increases-and-other-writers.mutate.csinode-guard.io", "Fail"),
                                        ("node-registrations.mutate.csinode-guard.io", "Ignore"),
                                        ("increases-and-other-writers.validate.csinode-guard.io", "Fail"),
                                        ("node-registrations.validate.csinode-guard.io", "Ignore")):
            for text in ("matchConditions as registered", f"failurePolicy {failure_policy} as documented",
                         "caBundle verifies"):
                row = [c for c in checks if c["checked"].startswith(f"{webhook}: {text}")]
                assert len(row) == 1 and row[0]["status"] == "OK", (webhook, text, checks)
        handshakes = [c for c in checks
                      if c["component"] == "guard MutatingWebhookConfiguration" and "caBundle verifies" in c["checked"]]
        assert len(handshakes) == 2 and all("TLS handshake with 127.0.0.1" in c["checked"] for c in handshakes)
        assert "registered with a URL" in find(checks, "guard Deployment", "URL")["checked"]
        assert result.returncode == 1, result.stderr  # the WARNs: the probe and the driver without a period

        table = preflight(control_plane, "--name", guard.name, "--scheduler-version", "v1.36.2")
        assert table.returncode == 1
        assert table.stdout.splitlines()[0].split() == ["COMPONENT", "STATUS", "CHECKED", "ACTION"]
        assert table.stdout.rstrip().splitlines()[-1].endswith("0 FAIL")
    finally:
        control_plane.kubectl("delete", "csidriver", with_period, without_period, check=False)


def test_as_a_listed_writer_the_probe_proves_counts_are_mutable(
    control_plane: ControlPlane, guard_factory: Any, tmp_path: Path
) -> None:
    import yaml  # noqa: PLC0415

    from tests.k8s.controlplane import DEFAULT_POLICY  # noqa: PLC0415

    doc = yaml.safe_load(DEFAULT_POLICY.read_text("utf-8"))
    doc["spec"]["writers"] = {"groups": ["preflight-writers"]}
    policy = tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump(doc), "utf-8")
    (tmp_path / "profiles").symlink_to(DEFAULT_POLICY.parent / "profiles")
    guard: Guard = guard_factory(policy=policy)
    user = control_plane.user_kubeconfig("preflight-writer", "preflight-writers")
    binding = unique("preflight-admin")
    control_plane.kubectl("create", "clusterrolebinding", binding, "--clusterrole=cluster-admin",
                          "--group=preflight-writers")
    try:
        node = unique("mutable")
        control_plane.create_node(node)
        control_plane.kubelet(node, "install", "--driver", EBS, "--node-id", "i-mut", "--max-volumes", "25")
        before = control_plane.get_csinode(node)
        result = preflight(control_plane, "-o", "json", "--name", guard.name, "--scheduler-version", "v1.36.2",
                           kubeconfig=user)
        probe = find(rows(result), "kube-apiserver", "dry-run count update")
        assert probe["status"] == "OK", probe
        after = control_plane.get_csinode(node)
        assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]  # a dry run
    finally:
        control_plane.kubectl("delete", "clusterrolebinding", binding, check=False)


def test_a_wrong_ca_bundle_and_a_missing_guard_fail(
    control_plane: ControlPlane, guard: Guard, tmp_path: Path
) -> None:
    from webhook.serving import dev_certs  # noqa: PLC0415

    other = tmp_path / "other-ca"
    dev_certs.ensure_dev_certs(other, dns_names=["localhost"])
    bundle = __import__("base64").b64encode((other / "ca.crt").read_bytes()).decode()
    patch = json.dumps([{"op": "replace", "path": "/webhooks/0/clientConfig/caBundle", "value": bundle}])
    control_plane.kubectl("patch", "mutatingwebhookconfiguration", guard.name, "--type=json", "-p", patch)
    result = preflight(control_plane, "-o", "json", "--name", guard.name, "--scheduler-version", "v1.36.2")
    row = find(rows(result), "guard MutatingWebhookConfiguration", "does not verify")
    assert row["status"] == "FAIL" and "not signed by a CA in caBundle" in row["checked"]
    assert result.returncode == 4, "a FAIL blocks: exit code 4 (docs/cli.md)"
    assert json.loads(result.stdout)["exitCode"] == 4

    missing = preflight(control_plane, "-o", "json", "--name", unique("absent"))
    assert missing.returncode == 4
    assert find(rows(missing), "guard ValidatingWebhookConfiguration", "not found")["status"] == "FAIL"


def test_without_cluster_access_it_says_so_with_exit_code_3(control_plane: ControlPlane, tmp_path: Path) -> None:
    dead = tmp_path / "dead.kubeconfig"
    config = control_plane.kubeconfig.read_text("utf-8")
    dead.write_text(config.replace(control_plane.kas_url, "https://127.0.0.1:9"), "utf-8")
    result = preflight(control_plane, kubeconfig=dead)
    assert result.returncode == 3 and "no answer from the API server" in result.stderr, result.stderr
    nothing = subprocess.run([sys.executable, "-m", "webhook", "preflight"], capture_output=True, text=True,
                             timeout=60, check=False, cwd=tmp_path,
                             env={k: v for k, v in {**os.environ, "HOME": str(tmp_path)}.items()
                                  if k not in {"KUBECONFIG", "KUBERNETES_SERVICE_HOST"}})
    assert nothing.returncode == 3 and "no cluster configured" in nothing.stderr, nothing.stderr


def test_a_guard_behind_a_service_is_checked_through_its_tls_secret_and_deployment(
    control_plane: ControlPlane, guard_factory: Any, tmp_path: Path
) -> None:
    from webhook.serving import dev_certs  # noqa: PLC0415

    guard: Guard = guard_factory(register=False)
    namespace = unique("guard-ns")
    name = unique("svc-guard")
    certs = tmp_path / "certs"  # what `csinode-guard certs generate --dns-name csinode-guard.<ns>.svc` makes
    dev_certs.ensure_dev_certs(certs, dns_names=[f"csinode-guard.{namespace}.svc"])
    control_plane.kubectl("create", "namespace", namespace)
    control_plane.kubectl("create", "secret", "tls", "csinode-guard-tls", "-n", namespace,
                          f"--cert={certs / 'tls.crt'}", f"--key={certs / 'tls.key'}")
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "csinode-guard", "namespace": namespace},
        "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "g"}},
                 "template": {"metadata": {"labels": {"app": "g"}},
                              "spec": {"containers": [{"name": "g", "image": "csinode-guard:0.1.0"}]}}},
    }
    control_plane.kubectl("create", "-f", "-", input=json.dumps(deployment))
    # The Service name does not resolve from here: the handshake fails and the certificate comes from the Secret.
    # Registered only for the length of one preflight run (no count change reaches an unreachable guard meanwhile).
    guard.csinode_guard("register", "--cert-dir", str(certs), "--namespace", namespace, "--name", name)
    try:
        result = preflight(control_plane, "-o", "json", "--name", name, "--scheduler-version", "v1.36.2")
    finally:
        guard.csinode_guard("unregister", "--name", name)
        control_plane.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
    checks = rows(result)
    verified = [c for c in checks if "caBundle verifies the serving cert" in c["checked"]]
    assert len(verified) == 4 and all(f"Secret {namespace}/csinode-guard-tls" in c["checked"] for c in verified)
    assert all(c["status"] == "OK" for c in verified)
    replicas = find(checks, "guard Deployment", "replicas ready")
    assert replicas["status"] == "FAIL" and replicas["checked"] == "0/2 replicas ready"  # no controller runs here
    assert f"kubectl -n {namespace} describe deployment csinode-guard" in replicas["action"]
    assert result.returncode == 4


def test_during_the_install_the_deployment_is_found_before_the_webhooks_exist(control_plane: ControlPlane) -> None:
    """The documented order applies the webhook configurations last: preflight reads the Deployment directly."""
    namespace, name = unique("install-ns"), unique("guard")
    control_plane.kubectl("create", "namespace", namespace)
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": namespace},
        "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "g"}},
                 "template": {"metadata": {"labels": {"app": "g"}},
                              "spec": {"containers": [{"name": "g", "image": "csinode-guard:0.1.0"}]}}},
    }
    control_plane.kubectl("create", "-f", "-", input=json.dumps(deployment))
    try:
        found = rows(preflight(control_plane, "-o", "json", "--name", unique("not-registered"),
                               "--namespace", namespace, "--deployment", name, "--scheduler-version", "v1.36.2"))
        missing = rows(preflight(control_plane, "-o", "json", "--name", unique("not-registered"),
                                 "--namespace", namespace, "--deployment", "other", "--scheduler-version", "v1.36.2"))
    finally:
        control_plane.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
    [replicas] = [c for c in found if c["component"] == "guard Deployment"]
    assert replicas["checked"] == "0/2 replicas ready", replicas
    assert f"kubectl -n {namespace} describe deployment {name}" in replicas["action"]
    [absent] = [c for c in missing if c["component"] == "guard Deployment"]
    assert absent["status"] == "WARN" and absent["checked"] == f"deployment {namespace}/other not found"
    assert "deploy/overlays/default" not in absent["action"]


def _table_cells(table: str) -> list[tuple[str, str, str]]:
    """(component, CHECKED, ACTION) per check of a wrapped table, continuation lines (no STATUS) joined, sliced at
    the header's column starts."""
    lines = table.splitlines()
    header = lines[0]
    starts = [header.index(word) for word in ("STATUS", "CHECKED", "ACTION")]
    cells: list[list[str]] = []
    for line in lines[1:]:
        if not line.strip():
            break
        component, status = line[:starts[0]].strip(), line[starts[0]:starts[1]].strip()
        checked, action = line[starts[1]:starts[2]].strip(), line[starts[2]:].strip()
        if status:
            cells.append([component, checked, action])
        else:
            for index, text in ((0, component), (1, checked), (2, action)):
                cells[-1][index] += " " + text if text else ""
    return [(c[0].strip(), c[1].strip(), c[2].strip()) for c in cells]


def test_the_table_fits_the_terminal_and_json_and_wide_keep_the_whole_text(
    control_plane: ControlPlane, tmp_path: Path
) -> None:
    absent = unique("absent")

    def run(*args: str, columns: int = 80) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "webhook", "preflight", "--scheduler-version", "v1.36.2", "--name", absent, *args],
            env={**os.environ, "KUBECONFIG": str(control_plane.kubeconfig), "COLUMNS": str(columns)},
            capture_output=True, text=True, timeout=120, check=False,
        )

    checks = rows(run("-o", "json"))
    longest = max(len(c["checked"]) for c in checks)
    assert longest > 60, "a check long enough to need wrapping"
    for columns in (80, 120):
        table = run(columns=columns).stdout
        assert max(len(line) for line in table.splitlines()) <= columns, table
        cells = _table_cells(table)
        assert ["".join(c[0].split()) for c in cells] == ["".join(c["component"].split()) for c in checks]
        for (_, checked, action), check in zip(cells, checks, strict=True):
            assert checked.split() == check["checked"].split() or "".join(checked.split()) == "".join(
                check["checked"].split()), (checked, check["checked"])
            assert "".join(action.split()) == "".join((check["action"] or "-").split())
            assert "..." not in checked or "..." in check["checked"]
    wide = run("-o", "wide").stdout.splitlines()
    for check in checks:
        assert any(check["checked"] in line for line in wide), check["checked"]


def test_before_install_a_guard_not_registered_is_expected_and_does_not_block(control_plane: ControlPlane) -> None:
    """README's "check a cluster, then install": nothing of the guard exists yet. Without --before-install that
    blocks (exit code 4), with it the guard is one OK row and no FAIL is left on a healthy cluster."""
    name = unique("not-installed")
    blocked = preflight(control_plane, "-o", "json", "--name", name, "--scheduler-version", "v1.36.2")
    assert blocked.returncode == 4
    assert find(rows(blocked), "guard MutatingWebhookConfiguration", "not found")["status"] == "FAIL"

    before = preflight(control_plane, "-o", "json", "--name", name, "--scheduler-version", "v1.36.2",
                       "--before-install")
    checks = rows(before)
    assert [c for c in checks if c["component"].startswith("guard")] == [
        {**find(checks, "guard", "not installed yet"), "status": "OK"}
    ]
    assert before.returncode != 4 and not [c for c in checks if c["status"] == "FAIL"], checks


def test_a_registered_guard_without_its_namespace_fails_it_would_keep_no_history(
    control_plane: ControlPlane, guard: Guard
) -> None:
    """A guard outside the cluster (registered with a URL) keeps its audit Lease, node history and brakes in its
    namespace: without it, admission answers and /readyz says ok, but nothing audits and a node's re-created
    CSINode is judged without its history. preflight says so (FAIL); with the namespace it is OK."""
    present = rows(preflight(control_plane, "-o", "json", "--name", guard.name, "--scheduler-version", "v1.36.2"))
    assert find(present, "guard namespace", "csinode-guard exists")["status"] == "OK"

    absent_namespace = unique("no-such-ns")
    missing = preflight(control_plane, "-o", "json", "--name", guard.name, "--scheduler-version", "v1.36.2",
                        "--namespace", absent_namespace)
    row = find(rows(missing), "guard namespace", f"{absent_namespace} not found")
    assert row["status"] == "FAIL" and "node history" in row["checked"], row
    assert f"kubectl create namespace {absent_namespace}" in row["action"]
    assert missing.returncode == 4
