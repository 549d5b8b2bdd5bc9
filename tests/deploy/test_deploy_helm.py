"""charts/csinode-guard renders the objects of deploy/: ``helm template`` against ``kubectl kustomize``, object by
object and field by field, for the default values and for each overlay the values select; ``helm lint --strict``;
what each value changes.

The chart is compared with ``deploy/`` plus ``deploy/policy`` (the GuardPolicy, a step of its own with kubectl;
helm installs the chart's ``crds/`` first, so the chart ships the GuardPolicy too), rendered with
``--include-crds``. The comparison accounts for exactly one difference, on purpose: the labels Helm's
conventions add to every object (``helm.sh/chart``, ``app.kubernetes.io/managed-by``). A new file in deploy/base
needs its template in charts/csinode-guard/templates (same name), or in charts/csinode-guard/crds for a CRD.

A failure names the object (kind, namespace/name) and the field path where the two differ.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_helpers import DEPLOY, REPO, Objects, kustomize

from tests.helm import CHART, require_helm, run_helm, template

HELM_LABELS = ("helm.sh/chart", "app.kubernetes.io/managed-by")
UNLABELLED = ("CustomResourceDefinition", "GuardPolicy")
POLICY_CONFIGMAP = re.compile(r"^csinode-guard-policy-[a-z0-9]{10}$")
COPIES = {
    "files/policy.yaml": "policies/default.yaml",
    "crds/guardpolicy-crd.yaml": "deploy/base/guardpolicy-crd.yaml",
    "files/prometheusrule.yaml": "deploy/overlays/monitoring/prometheusrule.yaml",
    "files/dashboards/csinode-guard.json": "deploy/overlays/monitoring/dashboards/csinode-guard.json",
}
CASES = {
    # values -> the kustomizations whose objects together are the same installation
    "defaults": ((), (".", "policy")),
    "monitoring": (("--set", "monitoring.enabled=true"), (".", "overlays/monitoring", "policy")),
    "cert-manager": (("--set", "certManager.enabled=true"), ("overlays/cert-manager", "policy")),
    "cert-manager and monitoring": (
        ("--set", "certManager.enabled=true,monitoring.enabled=true"),
        ("overlays/cert-manager", "overlays/monitoring", "policy"),
    ),
}

Key = tuple[str, str, str]


@pytest.fixture(scope="session")
def helm() -> str:
    """The helm binary (tests/helm.py): skipped when absent, a failure with CSINODE_GUARD_REQUIRE_K8S=1."""
    return require_helm()


@pytest.fixture(scope="session")
def deploy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """deploy/ as a fresh clone has it."""
    root = tmp_path_factory.mktemp("deploy-for-helm") / "deploy"
    shutil.copytree(DEPLOY, root, ignore=shutil.ignore_patterns("*.crt", "*.key", "certs"))
    return root


def key(obj: dict[str, Any]) -> Key:
    meta = obj["metadata"]
    return (obj["kind"], meta.get("namespace", ""), meta["name"])


def describe(k: Key) -> str:
    kind, namespace, name = k
    return f"{kind} {namespace + '/' if namespace else ''}{name}"


def normalise_kustomize(objects: Objects) -> dict[Key, Any]:
    """kustomize's objects by key, the policy ConfigMap's content hash taken out of its name and every reference."""
    hashed = {o["metadata"]["name"] for o in objects if o["kind"] == "ConfigMap"
              and POLICY_CONFIGMAP.match(o["metadata"]["name"])}
    assert len(hashed) <= 1, hashed
    text = json.dumps(objects)
    for name in hashed:
        text = text.replace(f'"{name}"', '"csinode-guard-policy"')
    result: dict[Key, Any] = {}
    for obj in json.loads(text):
        assert key(obj) not in result, f"kustomize rendered {describe(key(obj))} twice"
        result[key(obj)] = obj
    return result


def normalise_helm(objects: Objects) -> dict[Key, Any]:
    """helm's objects by key, with Helm's two convention labels checked and removed. Two kinds carry none, as
    written: the CRD (helm installs ``crds/`` as they are, untemplated) and the GuardPolicy (the policy document
    itself, as ``deploy/policy`` ships it)."""
    result: dict[Key, Any] = {}
    for obj in objects:
        labels = obj["metadata"].get("labels", {})
        if obj["kind"] in UNLABELLED:
            assert not set(HELM_LABELS) & set(labels), describe(key(obj))
        else:
            assert labels.get("helm.sh/chart") == "csinode-guard-0.1.0", describe(key(obj))
            assert labels.get("app.kubernetes.io/managed-by") == "Helm", describe(key(obj))
            for label in HELM_LABELS:
                del labels[label]
        assert key(obj) not in result, f"helm rendered {describe(key(obj))} twice"
        result[key(obj)] = obj
    return result


def differences(left: Any, right: Any, path: str = "") -> list[str]:
    """Every field where ``left`` (kustomize) and ``right`` (helm) differ, as ``path: kustomize X, helm Y``."""
    if isinstance(left, dict) and isinstance(right, dict):
        found = []
        for k in sorted(set(left) | set(right)):
            where = f"{path}.{k}" if path else k
            if k not in right:
                found.append(f"{where}: only in kustomize ({json.dumps(left[k])[:200]})")
            elif k not in left:
                found.append(f"{where}: only in helm ({json.dumps(right[k])[:200]})")
            else:
                found += differences(left[k], right[k], where)
        return found
    if isinstance(left, list) and isinstance(right, list):
        if len(left) != len(right):
            return [f"{path}: {len(left)} items in kustomize, {len(right)} in helm "
                    f"(kustomize {json.dumps(left)[:200]}, helm {json.dumps(right)[:200]})"]
        return [d for i, (a, b) in enumerate(zip(left, right, strict=True)) for d in differences(a, b, f"{path}[{i}]")]
    if left != right or type(left) is not type(right):
        return [f"{path}: kustomize {json.dumps(left)[:300]}, helm {json.dumps(right)[:300]}"]
    return []


def compare(kustomized: dict[Key, Any], helmed: dict[Key, Any]) -> list[str]:
    """Every difference between the two installations, one line per object or field."""
    problems = [f"{describe(k)}: rendered by kustomize only (add it to charts/csinode-guard/templates)"
                for k in sorted(set(kustomized) - set(helmed))]
    problems += [f"{describe(k)}: rendered by helm only" for k in sorted(set(helmed) - set(kustomized))]
    for k in sorted(set(kustomized) & set(helmed)):
        problems += [f"{describe(k)}: {d}" for d in differences(kustomized[k], helmed[k])]
    return problems


@pytest.mark.parametrize("case", list(CASES))
def test_helm_template_renders_the_objects_of_kubectl_kustomize(
    helm: str, kubectl: str, deploy_dir: Path, case: str
) -> None:
    values, kustomizations = CASES[case]
    kustomized: Objects = [o for k in kustomizations for o in kustomize(kubectl, deploy_dir / k)]
    problems = compare(normalise_kustomize(kustomized), normalise_helm(template(helm, "--include-crds", *values)))
    what = f"helm template {' '.join(values)} differs from kubectl kustomize {' + '.join(kustomizations)}"
    assert not problems, f"{what}:\n" + "\n".join(problems)


def test_the_comparison_names_the_object_and_field_that_differ(helm: str, kubectl: str, deploy_dir: Path) -> None:
    """The check can fail, and says where: one value changed on the helm side is reported at its path."""
    kustomized = normalise_kustomize([*kustomize(kubectl, deploy_dir), *kustomize(kubectl, deploy_dir / "policy")])
    helmed = normalise_helm(template(helm, "--include-crds", "--set", "replicas=3"))
    assert compare(kustomized, helmed) == ["Deployment csinode-guard/csinode-guard: spec.replicas: kustomize 2, helm 3"]
    del helmed[("Service", "csinode-guard", "csinode-guard")]
    assert "Service csinode-guard/csinode-guard: rendered by kustomize only" in compare(kustomized, helmed)[0]


def test_every_deploy_base_file_has_its_template() -> None:
    """One template per deploy/base file, so that a change there has an obvious place to be mirrored."""
    base = yaml.safe_load((DEPLOY / "base" / "kustomization.yaml").read_text("utf-8"))
    files = [*base["resources"], *(f for g in base.get("configMapGenerator", []) for f in g["files"])]
    missing = [f for f in files if not (CHART / "templates" / Path(f).name).is_file()
               and not (CHART / "crds" / Path(f).name).is_file()]
    where = "charts/csinode-guard/templates/<same name> (crds/ for a CRD)"
    assert not missing, f"deploy/base files without {where}: {missing}"


@pytest.mark.parametrize(("copy", "original"), sorted(COPIES.items()))
def test_the_charts_copies_are_identical(copy: str, original: str) -> None:
    """Helm reads no file outside the chart: these are copies, kept byte-identical."""
    assert (CHART / copy).read_bytes() == (REPO / original).read_bytes(), \
        f"charts/csinode-guard/{copy} differs from {original}: cp {original} charts/csinode-guard/{copy}"


@pytest.mark.parametrize("values", [(), ("--set", "monitoring.enabled=true,certManager.enabled=true,reconcile=clamp")],
                         ids=["defaults", "everything on"])
def test_helm_lint_strict_passes(helm: str, values: tuple[str, ...]) -> None:
    result = run_helm(helm, "lint", "--strict", str(CHART), *values)
    assert "0 chart(s) failed" in result.stdout, result.stdout


def _objects(objects: Objects) -> dict[Key, Any]:
    return {key(o): o for o in objects}


def test_values_set_replicas_resources_and_the_image(helm: str) -> None:
    objects = _objects(template(helm, "--set", "replicas=3,image.repository=registry.example/guard,image.tag=0.2.0",
                                "--set", "resources.limits.cpu=2,resources.requests.memory=256Mi"))
    deployment = objects[("Deployment", "csinode-guard", "csinode-guard")]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert deployment["spec"]["replicas"] == 3
    assert container["image"] == "registry.example/guard:0.2.0"
    assert container["resources"] == {"requests": {"cpu": "100m", "memory": "256Mi"},
                                      "limits": {"cpu": 2, "memory": "512Mi"}}


def _policy(objects: dict[Key, Any], name: str = "default") -> dict[str, Any]:
    policy: dict[str, Any] = objects[("GuardPolicy", "", name)]
    return policy


def test_reconcile_sets_the_policys_spec_reconcile_and_the_result_validates(helm: str, tmp_path: Path) -> None:
    objects = _objects(template(helm, "--set", "reconcile=clamp"))
    policy = _policy(objects)
    assert policy["spec"]["reconcile"] == "clamp"
    default = yaml.safe_load((REPO / "policies" / "default.yaml").read_text("utf-8"))
    default["spec"]["reconcile"] = "clamp"
    assert policy == default, "only spec.reconcile changed"
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(policy))
    from tests.clirun import run_cli  # noqa: PLC0415 - the CLI as a subprocess

    result = run_cli("policy", "validate", str(path), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_reconcile_value_outside_the_schema_is_refused(helm: str) -> None:
    result = run_helm(helm, "template", "csinode-guard", str(CHART), "--set", "reconcile=repair", check=False)
    assert result.returncode != 0
    assert "reconcile" in result.stderr, result.stderr


def test_a_policy_file_replaces_the_default_and_the_guard_serves_it(helm: str, tmp_path: Path) -> None:
    own = tmp_path / "policy.yaml"
    text = (REPO / "policies" / "default.yaml").read_text("utf-8").replace("name: default", "name: site-policy", 1)
    own.write_text(text)

    def args(objs: dict[Key, Any]) -> list[str]:
        deployment = objs[("Deployment", "csinode-guard", "csinode-guard")]
        return list(deployment["spec"]["template"]["spec"]["containers"][0]["args"])

    default = _objects(template(helm))
    objects = _objects(template(helm, "--set-file", f"policy={own}"))
    assert _policy(objects, "site-policy")["spec"] == _policy(default)["spec"]
    assert ("GuardPolicy", "", "default") not in objects
    assert "--guard-policy" not in args(default), "the guard's default is the GuardPolicy named default"
    flag = args(objects).index("--guard-policy")
    assert args(objects)[flag + 1] == "site-policy"


def test_another_namespace_moves_every_namespaced_object_and_the_guards_own_writer(helm: str) -> None:
    objects = template(helm, namespace="guard-system")
    namespaces = {o["metadata"].get("namespace") for o in objects}
    assert namespaces == {None, "guard-system", "kube-system", "default"}, namespaces
    assert [o["metadata"]["name"] for o in objects if o["kind"] == "Namespace"] == ["guard-system"]
    by_key = _objects(objects)
    assert _policy(by_key)["spec"]["writers"]["serviceAccounts"] == ["guard-system/csinode-guard"]
    args = by_key[("Deployment", "guard-system", "csinode-guard")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "csinode-guard.guard-system.svc" in args
    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        services = {w["clientConfig"]["service"]["namespace"] for w in by_key[(kind, "", "csinode-guard")]["webhooks"]}
        assert services == {"guard-system"}
    subjects = {s["namespace"] for o in objects if o["kind"] in ("RoleBinding", "ClusterRoleBinding")
                for s in o["subjects"]}
    assert subjects == {"guard-system"}


def test_namespace_create_false_leaves_the_namespace_out(helm: str) -> None:
    kinds = {o["kind"] for o in template(helm, "--set", "namespace.create=false")}
    assert "Namespace" not in kinds and "Deployment" in kinds
