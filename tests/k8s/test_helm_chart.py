"""The Helm chart's objects on the real apiserver: ``helm template`` (there is no ``helm install`` here: the client
in ../shared/k8s renders only) applied as an operator would pipe it into ``kubectl apply``.

Rendered into a fresh namespace, every object the apiserver serves is accepted by a server-side dry run (the
apiserver's validation, defaulting and the webhooks' CEL compiled), and the namespaced ones in the fresh
namespace are then applied for real and read back. Cluster-scoped objects stay a dry run: they carry fixed names
(the webhook configurations ``csinode-guard``), and real ones pointing at a Service with no pods behind it
(failurePolicy Fail) would refuse every count increase of the other tests sharing this cluster.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.helm import require_helm, template
from tests.k8s.controlplane import ControlPlane, unique

CRD_GROUPS = ("cert-manager.io/", "monitoring.coreos.com/", "csinode-guard.io/")
"""Kinds of CRDs this control plane may not serve (the chart's own GuardPolicy: its CRD is in crds/, which
``helm template`` leaves out, as ``helm install`` installs it first)."""


@pytest.fixture(scope="module")
def helm() -> str:
    return require_helm()


def _as_list(objects: list[dict[str, Any]]) -> str:
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": objects})


@pytest.mark.parametrize("values", [(), ("--set", "certManager.enabled=true,monitoring.enabled=true,reconcile=clamp")],
                         ids=["defaults", "cert-manager, monitoring, reconcile clamp"])
def test_the_charts_objects_are_accepted_and_the_namespaced_ones_applied_in_a_fresh_namespace(
    control_plane: ControlPlane, helm: str, values: tuple[str, ...]
) -> None:
    cp = control_plane
    namespace = unique("helm")
    objects = template(helm, *values, namespace=namespace)
    served = [o for o in objects if not o["apiVersion"].startswith(CRD_GROUPS)]
    if values:  # the CRD kinds this control plane does not serve (tests/deploy validates them against their schemas)
        assert {o["kind"] for o in objects if o not in served} == {"Certificate", "Issuer", "ServiceMonitor",
                                                                     "PrometheusRule", "GuardPolicy"}
    namespace_object = [o for o in served if o["kind"] == "Namespace"]
    assert [o["metadata"]["name"] for o in namespace_object] == [namespace]
    cp.kubectl("apply", "-f", "-", input=_as_list(namespace_object))  # the chart's own Namespace, for real

    result = cp.kubectl("apply", "--dry-run=server", "-f", "-", input=_as_list(served))
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert len(lines) == len(served) and all(line.endswith("(server dry run)") for line in lines), result.stdout

    mine = [o for o in served if o["metadata"].get("namespace") == namespace]
    assert {o["kind"] for o in mine} >= {"Deployment", "Service", "ServiceAccount", "Role",
                                         "RoleBinding", "PodDisruptionBudget", "NetworkPolicy"}
    cp.kubectl("apply", "-f", "-", input=_as_list(mine))
    stored = cp.kubectl_json("-n", namespace, "get", "deployment", "csinode-guard")
    pod = stored["spec"]["template"]
    assert {e["name"] for e in pod["spec"]["containers"][0]["env"]} >= {"POD_NAME", "POD_NAMESPACE"}
    policy = next(o for o in objects if o["kind"] == "GuardPolicy")
    assert policy["spec"]["writers"]["serviceAccounts"] == [f"{namespace}/csinode-guard"]
    assert f"csinode-guard.{namespace}.svc" in pod["spec"]["containers"][0]["args"]
    namespace_labels = cp.kubectl_json("get", "namespace", namespace)["metadata"]["labels"]
    assert namespace_labels["pod-security.kubernetes.io/enforce"] == "restricted"
