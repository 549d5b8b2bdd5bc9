"""deploy/: every kustomization renders, and the rendered objects hold the properties the product promises."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_helpers import DEPLOY, KUSTOMIZATIONS, REPO, Objects, find, kustomize

NAME = "csinode-guard"
NAMESPACE = "csinode-guard"
LABEL = {"app.kubernetes.io/name": NAME}
SERVE_ARGS = [
    "serve",
    "--no-generate-certs",
    "--cert-dir",
    "/etc/csinode-guard/certs",
    "--state-key-file",
    "/etc/csinode-guard/state-key/key",
    "--dns-name",
    "csinode-guard.csinode-guard.svc",
    "--metrics-port",
    "9090",
    "--port",
    "8443",
]
CLUSTER_SCOPED = {
    "Namespace",
    "CustomResourceDefinition",
    "ClusterRole",
    "ClusterRoleBinding",
    "MutatingWebhookConfiguration",
    "ValidatingWebhookConfiguration",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
}


def _container(objects: Objects) -> dict[str, Any]:
    containers = find(objects, "Deployment", NAME)["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    container: dict[str, Any] = containers[0]
    return container


def _pod_spec(objects: Objects) -> dict[str, Any]:
    spec: dict[str, Any] = find(objects, "Deployment", NAME)["spec"]["template"]["spec"]
    return spec


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_every_kustomization_renders(rendered: dict[str, Objects], kustomization: str) -> None:
    assert rendered[kustomization], f"{kustomization} rendered no objects"


def test_base_holds_every_object_an_installation_needs(rendered: dict[str, Objects]) -> None:
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in rendered["base"])
    assert kinds == [
        ("ClusterRole", "csinode-guard"),
        ("ClusterRole", "csinode-guard-approver"),
        ("ClusterRole", "csinode-guard-ca-injector"),
        ("ClusterRole", "csinode-guard-policy-editor"),
        ("ClusterRole", "csinode-guard-policy-viewer"),
        ("ClusterRole", "csinode-guard-registrar"),
        ("ClusterRoleBinding", "csinode-guard"),
        ("ClusterRoleBinding", "csinode-guard-ca-injector"),
        ("CustomResourceDefinition", "guardpolicies.csinode-guard.io"),
        ("Deployment", NAME),
        ("MutatingWebhookConfiguration", NAME),
        ("MutatingWebhookConfiguration", f"{NAME}-nodes"),
        ("Namespace", NAMESPACE),
        ("NetworkPolicy", NAME),
        ("PodDisruptionBudget", NAME),
        ("Role", "csinode-guard-audit-events"),
        ("Role", "csinode-guard-audit-lease"),
        ("Role", "csinode-guard-brake-approver"),
        ("Role", "csinode-guard-driver-pods"),
        ("Role", "csinode-guard-node-history"),
        ("Role", "csinode-guard-secrets"),
        ("RoleBinding", "csinode-guard-audit-events"),
        ("RoleBinding", "csinode-guard-audit-lease"),
        ("RoleBinding", "csinode-guard-driver-pods"),
        ("RoleBinding", "csinode-guard-node-history"),
        ("RoleBinding", "csinode-guard-secrets"),
        ("Service", NAME),
        ("ServiceAccount", NAME),
        ("ValidatingWebhookConfiguration", NAME),
    ]


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_every_object_carries_the_name_label_and_an_explicit_namespace(
    rendered: dict[str, Objects], kustomization: str
) -> None:
    for obj in rendered[kustomization]:
        meta = obj["metadata"]
        where = f"{obj['kind']} {meta['name']}"
        assert meta.get("labels", {}).get("app.kubernetes.io/name") == NAME, where
        if obj["kind"] in CLUSTER_SCOPED:
            assert "namespace" not in meta, where
        elif obj["kind"] in ("Role", "RoleBinding") and meta["name"] != "csinode-guard-secrets":
            expected = {"csinode-guard-audit-lease": NAMESPACE, "csinode-guard-audit-events": "default",
                        "csinode-guard-node-history": NAMESPACE, "csinode-guard-brake-approver": NAMESPACE}
            assert meta["namespace"] == expected.get(meta["name"], "kube-system"), where
        else:
            assert meta["namespace"] == NAMESPACE, where


def test_the_container_runs_the_documented_serve_command(rendered: dict[str, Objects]) -> None:
    container = _container(rendered["base"])
    assert container["image"] == "csinode-guard:0.1.0"
    assert container["command"] == ["csinode-guard"]
    assert container["args"] == SERVE_ARGS
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
    assert env == {
        "CSINODE_GUARD_TLS_SECRET": "csinode-guard-tls",
        "CSINODE_GUARD_INJECT_CA_BUNDLE": NAME,
        "CSINODE_GUARD_STATE_KEY_SECRET": "csinode-guard-state-key",
        "POD_NAMESPACE": {"fieldRef": {"fieldPath": "metadata.namespace"}},
        "POD_NAME": {"fieldRef": {"fieldPath": "metadata.name"}},  # its name in the GuardPolicy's status.byPod
    }
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"https": 8443, "metrics": 9090}


def test_the_deployment_is_highly_available(rendered: dict[str, Objects]) -> None:
    deployment = find(rendered["base"], "Deployment", NAME)
    assert deployment["spec"]["replicas"] >= 2
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    affinity = _pod_spec(rendered["base"])["affinity"]["podAntiAffinity"]
    terms = [
        t["podAffinityTerm"] for t in affinity.get("preferredDuringSchedulingIgnoredDuringExecution", [])
    ] + affinity.get("requiredDuringSchedulingIgnoredDuringExecution", [])
    assert any(
        t["topologyKey"] == "kubernetes.io/hostname" and t["labelSelector"]["matchLabels"] == LABEL for t in terms
    )
    pdb = find(rendered["base"], "PodDisruptionBudget", NAME)
    assert pdb["spec"]["selector"]["matchLabels"] == LABEL
    assert pdb["spec"]["maxUnavailable"] == 1
    assert deployment["spec"]["replicas"] - pdb["spec"]["maxUnavailable"] >= 1


def test_requests_and_limits_are_set(rendered: dict[str, Objects]) -> None:
    resources = _container(rendered["base"])["resources"]
    assert set(resources["requests"]) == {"cpu", "memory"}
    assert set(resources["limits"]) == {"cpu", "memory"}


def test_probes_use_https_on_the_webhook_port(rendered: dict[str, Objects]) -> None:
    container = _container(rendered["base"])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe, path in (("startupProbe", "/healthz"), ("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        get = container[probe]["httpGet"]
        assert (get["scheme"], get["path"], ports.get(get["port"], get["port"])) == ("HTTPS", path, 8443), probe


def test_the_pod_is_locked_down(rendered: dict[str, Objects]) -> None:
    pod = _pod_spec(rendered["base"])
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod.get("hostNetwork", False) is False
    context = _container(rendered["base"])["securityContext"]
    assert context["readOnlyRootFilesystem"] is True
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"]}
    namespace = find(rendered["base"], "Namespace", NAMESPACE)
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


def test_volumes_match_the_paths_in_the_serve_command(rendered: dict[str, Objects]) -> None:
    objects = rendered["base"]
    volumes = {v["name"]: v for v in _pod_spec(objects)["volumes"]}
    mounts = {m["mountPath"]: m for m in _container(objects)["volumeMounts"]}
    written = ("/etc/csinode-guard/certs", "/etc/csinode-guard/state-key", "/tmp")
    for path in written:  # the guard copies its Secrets there: in memory, never on the node's disk
        assert volumes[mounts[path]["name"]]["emptyDir"]["medium"] == "Memory", path
    assert not any(v.get("configMap") for v in volumes.values()), "the policy is the cluster's GuardPolicy"
    assert all(m.get("readOnly") for path, m in mounts.items() if path not in written)
    assert not any(v.get("secret") for v in volumes.values()), "no Secret the install must make first"


def test_the_cert_manager_overlay_mounts_its_secret_and_turns_the_guards_own_certificate_off(
    rendered: dict[str, Objects]
) -> None:
    objects = rendered["overlays/cert-manager"]
    volumes = {v["name"]: v for v in _pod_spec(objects)["volumes"]}
    mounts = {m["mountPath"]: m for m in _container(objects)["volumeMounts"]}
    certs = volumes[mounts["/etc/csinode-guard/certs"]["name"]]
    assert certs == {"name": "certs", "secret": {"secretName": "csinode-guard-tls", "defaultMode": 0o440}}
    assert mounts["/etc/csinode-guard/certs"]["readOnly"] is True
    assert "subPath" not in mounts["/etc/csinode-guard/certs"], "subPath mounts never see a renewed Secret"
    env = {e["name"]: e.get("value") for e in _container(objects)["env"]}
    assert env["CSINODE_GUARD_TLS_SECRET"] == env["CSINODE_GUARD_INJECT_CA_BUNDLE"] == ""
    assert env["CSINODE_GUARD_STATE_KEY_SECRET"] == "csinode-guard-state-key"


def test_the_service_maps_443_to_the_webhook_port_and_exposes_metrics(rendered: dict[str, Objects]) -> None:
    service = find(rendered["base"], "Service", NAME)
    assert service["spec"]["selector"] == LABEL
    ports = {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["ports"]}
    assert ports == {"https": (443, 8443), "metrics": (9090, 9090)}
    pod_labels = find(rendered["base"], "Deployment", NAME)["spec"]["template"]["metadata"]["labels"]
    assert LABEL.items() <= pod_labels.items()


def test_the_network_policy_opens_the_webhook_port_and_keeps_metrics_for_monitoring(
    rendered: dict[str, Objects],
) -> None:
    spec = find(rendered["base"], "NetworkPolicy", NAME)["spec"]
    assert spec["podSelector"]["matchLabels"] == LABEL
    assert spec["policyTypes"] == ["Ingress"]
    by_port = {rule["ports"][0]["port"]: rule for rule in spec["ingress"]}
    assert set(by_port) == {8443, 9090}
    assert "from" not in by_port[8443], "the apiserver's address is not selectable: 8443 must be open"
    (peer,) = by_port[9090]["from"]
    assert set(peer) == {"namespaceSelector"}
    assert peer["namespaceSelector"]["matchLabels"] == {"csinode-guard.io/scrape-metrics": "true"}


def _grants(objects: Objects, *, by_name: bool = False) -> set[tuple[str, str, str, str]]:
    """(namespace or '*', apiGroup, resource, verb) granted to the guard's ServiceAccount; with ``by_name``, only
    the grants limited to named objects (resource ``<resource>/<name>``), else only the unlimited ones."""
    subject = {"kind": "ServiceAccount", "name": NAME, "namespace": NAMESPACE}
    grants = set()
    for binding in objects:
        if binding["kind"] not in ("ClusterRoleBinding", "RoleBinding") or subject not in binding["subjects"]:
            continue
        ref = binding["roleRef"]
        scope = binding["metadata"].get("namespace", "*")
        role = find(objects, ref["kind"], ref["name"])
        if ref["kind"] == "Role":
            assert role["metadata"]["namespace"] == scope
        for rule in role["rules"]:
            assert "nonResourceURLs" not in rule
            if ("resourceNames" in rule) != by_name:
                continue
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        for name in rule.get("resourceNames", [""]):
                            grants.add((scope, group, f"{resource}/{name}" if by_name else resource, verb))
    return grants


def test_the_guard_can_only_read_what_its_cluster_view_needs_and_write_what_its_audit_needs(
    rendered: dict[str, Objects],
) -> None:
    read = ("get", "list", "watch")
    expected = (
        {("*", "", "nodes", verb) for verb in read}
        | {("*", "storage.k8s.io", "csidrivers", verb) for verb in read}
        | {("*", "storage.k8s.io", "volumeattachments", verb) for verb in read}
        | {("kube-system", "", "pods", verb) for verb in read}
        # unscheduled Pods Pending on volume limits, one cluster-wide watch (a metric; issue 35, item 4)
        | {("*", "", "pods", verb) for verb in ("list", "watch")}
        # RBAC cannot limit a create by name: the guard may create Secrets in its own namespace, nothing else.
        | {(NAMESPACE, "", "secrets", "create")}
        # the audit: the CSINode watch, and an update that lowers a standing count (no create, patch, delete)
        | {("*", "storage.k8s.io", "csinodes", verb) for verb in (*read, "update")}
        # its Leases (leader elections, its policy report; list and delete: the status writer reads every
        # replica's report and removes those of replicas long gone) and its Events about CSINodes (which must
        # live in default)
        | {(NAMESPACE, "coordination.k8s.io", "leases", verb)
           for verb in ("get", "list", "create", "update", "delete")}
        # the GuardPolicy: watched, created from the bundled default when absent (never updated or deleted), and
        # its status written
        | {("*", "csinode-guard.io", "guardpolicies", verb) for verb in (*read, "create")}
        | {("*", "csinode-guard.io", "guardpolicies/status", verb) for verb in ("get", "update")}
        | {("default", "events.k8s.io", "events", "create")}
        # one call or two (serve --validation auto): which other mutators match CSINodes, read only
        | {("*", "admissionregistration.k8s.io", kind, "list")
           for kind in ("mutatingwebhookconfigurations", "mutatingadmissionpolicies")}
        # the nodes' history records: every replica watches them, the audit leader writes them
        | {(NAMESPACE, "", "configmaps", verb) for verb in (*read, "create", "update", "delete")}
    )
    assert _grants(rendered["base"]) == expected


def test_the_guard_keeps_only_its_own_secrets_and_webhook_configurations(rendered: dict[str, Objects]) -> None:
    keep = ("get", "update", "patch")
    group = "admissionregistration.k8s.io"
    expected = (
        {(NAMESPACE, "", f"secrets/{name}", verb) for name in ("csinode-guard-tls", "csinode-guard-state-key")
         for verb in keep}
        # (Leases are not here: each replica reports the policy it serves in a Lease named after its pod, so the
        # guard's Lease rights cover its own namespace, granted without names above; no other subject is bound.)
        | {("*", group, f"{kind}/{NAME}", verb) for verb in keep
           for kind in ("mutatingwebhookconfigurations", "validatingwebhookconfigurations")}
        # the Node entry's configuration (its caBundle is filled in the same way)
        | {("*", group, f"{kind}/{NAME}-nodes", verb) for verb in keep
           for kind in ("mutatingwebhookconfigurations", "validatingwebhookconfigurations")}
    )
    assert _grants(rendered["base"], by_name=True) == expected


def test_the_people_roles_are_bound_to_nobody(rendered: dict[str, Objects]) -> None:
    bound = {o["roleRef"]["name"] for o in rendered["base"] if o["kind"].endswith("RoleBinding")}
    assert bound.isdisjoint({"csinode-guard-approver", "csinode-guard-registrar"})
    approver = find(rendered["base"], "ClusterRole", "csinode-guard-approver")
    assert approver["rules"] == [
        {
            "apiGroups": ["storage.k8s.io"],
            "resources": ["csinodes"],
            "verbs": ["get", "list", "watch", "update", "patch"],
        }
    ]


def test_the_shipped_guardpolicy_is_policies_default_yaml(kubectl: str) -> None:
    source = (REPO / "policies" / "default.yaml").read_text("utf-8")
    copy = (DEPLOY / "policy" / "guardpolicy.yaml").read_text("utf-8")
    assert copy == source, (
        "deploy/policy/guardpolicy.yaml differs from policies/default.yaml; run: "
        "cp policies/default.yaml deploy/policy/guardpolicy.yaml"
    )
    [policy] = kustomize(kubectl, DEPLOY / "policy")
    assert policy == yaml.safe_load(source)


def test_the_shipped_policy_loads() -> None:
    from webhook.admission.policy import load_policy  # noqa: PLC0415 - the policy module is another issue's

    policy = load_policy(DEPLOY / "policy" / "guardpolicy.yaml")
    assert policy.name == "default"


def test_the_shipped_crd_is_the_generated_one(rendered: dict[str, Objects]) -> None:
    from webhook.kube.guardpolicy_crd import crd, crd_yaml  # noqa: PLC0415

    shipped = (DEPLOY / "base" / "guardpolicy-crd.yaml").read_text("utf-8")
    assert shipped == crd_yaml(), (
        "deploy/base/guardpolicy-crd.yaml differs from the generator; run: "
        "csinode-guard policy crd > deploy/base/guardpolicy-crd.yaml"
    )
    assert find(rendered["base"], "CustomResourceDefinition") == crd()


def test_no_key_material_is_committed_under_deploy() -> None:
    for path in DEPLOY.rglob("*"):
        if path.is_file():
            text = path.read_text("utf-8", errors="replace")
            assert "PRIVATE KEY" not in text, path
            assert "BEGIN CERTIFICATE" not in text, path


def test_the_default_installation_ships_no_secret_and_leaves_ca_bundle_to_the_guard(
    rendered: dict[str, Objects]
) -> None:
    objects = rendered["overlays/default"]
    assert not [o for o in objects if o["kind"] == "Secret"], "the guard makes its Secrets itself"
    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        webhooks = find(objects, kind, NAME)["webhooks"]
        assert len(webhooks) == 2, kind
        for webhook in webhooks:
            assert "caBundle" not in webhook["clientConfig"], webhook["name"]


def test_the_cert_manager_overlay_injects_the_ca_of_the_mounted_certificate(rendered: dict[str, Objects]) -> None:
    objects = rendered["overlays/cert-manager"]
    assert not [o for o in objects if o["kind"] == "Secret"], "cert-manager writes the Secret"
    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        configuration = find(objects, kind, NAME)
        namespace, certificate_name = configuration["metadata"]["annotations"]["cert-manager.io/inject-ca-from"].split(
            "/"
        )
        assert len(configuration["webhooks"]) == 2, kind
        for webhook in configuration["webhooks"]:
            assert "caBundle" not in webhook["clientConfig"]
        certificate = find(objects, "Certificate", certificate_name)
        assert certificate["metadata"]["namespace"] == namespace == NAMESPACE
    spec = certificate["spec"]
    assert spec["secretName"] == "csinode-guard-tls"
    assert "csinode-guard.csinode-guard.svc" in spec["dnsNames"]
    assert spec["privateKey"] == {"algorithm": "ECDSA", "size": 256, "rotationPolicy": "Always"}
    issuer = find(objects, "Issuer", spec["issuerRef"]["name"])
    ca = find(objects, "Certificate", "csinode-guard-ca")
    assert issuer["spec"]["ca"]["secretName"] == ca["spec"]["secretName"] and ca["spec"]["isCA"] is True


def test_the_monitoring_overlay_scrapes_the_metrics_port(rendered: dict[str, Objects]) -> None:
    monitor = find(rendered["overlays/monitoring"], "ServiceMonitor", NAME)
    service = find(rendered["base"], "Service", NAME)
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == [NAMESPACE]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert (endpoint["scheme"], endpoint["path"]) == ("http", "/metrics")


def _write_overlay(root: Path, name: str, kustomization: dict[str, Any], files: dict[str, str]) -> Path:
    directory = root / "overlays" / name
    directory.mkdir(parents=True)
    (directory / "kustomization.yaml").write_text(yaml.safe_dump(kustomization), "utf-8")
    for file_name, text in files.items():
        (directory / file_name).write_text(text, "utf-8")
    return directory


def test_an_overlay_can_override_the_image(kubectl: str, tmp_path: Path) -> None:
    root = tmp_path / "deploy"
    shutil.copytree(DEPLOY / "base", root / "base")
    overlay = _write_overlay(
        root,
        "mirror",
        {
            "resources": ["../../base"],
            "images": [{"name": "csinode-guard", "newName": "registry.example/csinode-guard", "newTag": "1.2.3"}],
        },
        {},
    )
    assert _container(kustomize(kubectl, overlay))["image"] == "registry.example/csinode-guard:1.2.3"


def test_the_documented_state_key_generator_feeds_the_deployment(kubectl: str, tmp_path: Path) -> None:
    root = tmp_path / "deploy"
    shutil.copytree(DEPLOY / "base", root / "base")
    overlay = _write_overlay(
        root,
        "with-state-key",
        {
            "resources": ["../../base"],
            "secretGenerator": [
                {
                    "name": "csinode-guard-state-key",
                    "namespace": NAMESPACE,
                    "files": ["key=state-key.txt"],
                    "options": {"disableNameSuffixHash": True},
                }
            ],
        },
        {"state-key.txt": "00" * 32 + "\n"},
    )
    objects = kustomize(kubectl, overlay)
    secret = find(objects, "Secret", "csinode-guard-state-key")
    assert set(secret["data"]) == {"key"}
    env = {e["name"]: e.get("value") for e in _container(objects)["env"]}
    assert env["CSINODE_GUARD_STATE_KEY_SECRET"] == secret["metadata"]["name"], "the guard reads this Secret"


def test_a_fresh_clone_renders_with_no_prior_step(kubectl: str, tmp_path: Path) -> None:
    """What a clone holds of deploy/ (the files git tracks or would add; nothing git-ignored) renders as it is."""
    listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "--cached", "--others", "--exclude-standard",
                             "deploy"], check=True, capture_output=True, text=True, timeout=60).stdout.split()
    assert "deploy/kustomization.yaml" in listed
    root = tmp_path / "clone"
    for name in listed:
        if (REPO / name).is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(REPO / name, root / name)
    result = subprocess.run([kubectl, "kustomize", str(root / "deploy")], capture_output=True, text=True,
                            check=False)
    assert result.returncode == 0, result.stderr
    kinds = {doc["kind"] for doc in yaml.safe_load_all(result.stdout) if doc}
    assert {"Deployment", "MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"} <= kinds


def test_the_vap_overlay_ships_what_policy_export_builds_from_the_default_policy(rendered: dict[str, Objects]) -> None:
    from webhook.admission.policy import load_policy  # noqa: PLC0415
    from webhook.kube.vap import build_vap_objects, export_vap  # noqa: PLC0415

    shipped = (DEPLOY / "overlays" / "vap" / "floor.yaml").read_text("utf-8")
    policy = load_policy(REPO / "policies" / "default.yaml")
    regenerate = "csinode-guard policy export --format vap --output-file deploy/overlays/vap/floor.yaml"
    assert shipped == export_vap(policy), f"regenerate it: {regenerate}"
    assert rendered["overlays/vap"] == build_vap_objects(policy)
