"""``policy validate`` warns about labels the node's own kubelet can set (NodeRestriction), through the CLI."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.clirun import REPO, run_cli
from webhook.admission.node_labels import kubelet_can_set

DEFAULT = REPO / "policies" / "default.yaml"
EBS = "ebs.csi.aws.com"


@pytest.mark.parametrize(
    ("label", "settable"),
    [
        pytest.param("node.kubernetes.io/instance-type", True, id="instance type"),
        pytest.param("beta.kubernetes.io/instance-type", True, id="the beta instance type"),
        pytest.param("topology.kubernetes.io/zone", True, id="zone"),
        pytest.param("topology.kubernetes.io/region", True, id="region"),
        pytest.param("kubernetes.io/hostname", True, id="hostname"),
        pytest.param("kubernetes.io/arch", True, id="arch"),
        pytest.param("kubernetes.io/os", True, id="os"),
        pytest.param("node.kubernetes.io/anything", True, id="anything under node.kubernetes.io"),
        pytest.param("x.kubelet.kubernetes.io/y", True, id="a subdomain of kubelet.kubernetes.io"),
        pytest.param("csinode-guard.io/enforce", True, id="a label outside kubernetes.io"),
        pytest.param("enforce", True, id="an unprefixed label"),
        pytest.param("node-restriction.kubernetes.io/instance-type", False, id="node-restriction.kubernetes.io"),
        pytest.param("a.node-restriction.kubernetes.io/x", False, id="a subdomain of node-restriction"),
        pytest.param("node-role.kubernetes.io/worker", False, id="another kubernetes.io label"),
        pytest.param("example.k8s.io/tier", False, id="a k8s.io label"),
        pytest.param("kubernetes.io/zone", False, id="not a kubelet label though under kubernetes.io"),
    ],
)
def test_which_labels_the_kubelet_can_set_on_its_own_node(label: str, settable: bool) -> None:
    assert kubelet_can_set(label) is settable


def _policy(tmp_path: Path, edit: Any) -> Path:
    doc = yaml.safe_load(DEFAULT.read_text("utf-8"))
    edit(doc["spec"])
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False), "utf-8")
    (tmp_path / "profiles").symlink_to(DEFAULT.parent / "profiles")
    return path


def test_the_bundled_policy_warns_that_its_instance_type_ceilings_are_pinned_not_trusted(tmp_path: Path) -> None:
    result = run_cli("policy", "validate", str(DEFAULT), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"{DEFAULT}: ok (GuardPolicy 'default'")
    warnings = result.stderr.splitlines()
    assert [w.split(": ")[2] for w in warnings] == [
        f"at $.spec.drivers['{d}'].ceiling.nodeLabel"
        for d in ("ebs.csi.aws.com", "pd.csi.storage.gke.io", "disk.csi.azure.com")
    ]
    for warning in warnings:
        assert warning.startswith(f"{DEFAULT}: warning: ")
        assert "node.kubernetes.io/instance-type can be set by the node's own kubelet" in warning
        assert "pinned, not trusted" in warning and "node-restriction.kubernetes.io/" in warning


def test_a_scope_and_a_profile_selecting_by_kubelet_labels_are_named_and_the_safe_prefix_is_quiet(
    tmp_path: Path,
) -> None:
    def edit(spec: dict[str, Any]) -> None:
        spec["enforcementScope"] = {"nodeSelector": {"matchLabels": {
            "csinode-guard.io/enforce": "true", "node-restriction.kubernetes.io/csinode-guard": "enforce"}}}
        for name, settings in spec["drivers"].items():
            settings["ceiling"].pop("nodeLabel", None)
            if name == "pd.csi.storage.gke.io":
                settings["ceiling"]["nodeLabel"] = "node-restriction.kubernetes.io/machine-type"

    result = run_cli("policy", "validate", "-q", str(_policy(tmp_path, edit)), cwd=tmp_path)
    assert result.returncode == 0 and result.stdout == "", (result.stdout, result.stderr)
    paths = [w.split(": ")[2] for w in result.stderr.splitlines()]
    # ebs and azure name a profile that selects by the instance type; pd's own label is safe and not named
    assert paths == ["at $.spec.drivers['ebs.csi.aws.com'].ceiling.profile",
                     "at $.spec.drivers['disk.csi.azure.com'].ceiling.profile",
                     "at $.spec.enforcementScope.nodeSelector.matchLabels['csinode-guard.io/enforce']"]
    scope = result.stderr.splitlines()[-1]
    assert "can be set and removed by the node's own kubelet" in scope
    assert "node-restriction.kubernetes.io/" in scope


def test_a_policy_selecting_only_by_safe_labels_has_no_warning(tmp_path: Path) -> None:
    def edit(spec: dict[str, Any]) -> None:
        for settings in spec["drivers"].values():
            settings["ceiling"] = {"max": settings["ceiling"]["max"],
                                   "nodeLabel": "node-restriction.kubernetes.io/instance-type",
                                   "values": {"m6i.large": 27}}

    result = run_cli("policy", "validate", str(_policy(tmp_path, edit)), cwd=tmp_path)
    assert result.returncode == 0 and result.stderr == "", result.stderr


def test_a_min_version_judged_on_the_kubelets_own_version_is_named(tmp_path: Path) -> None:
    def edit(spec: dict[str, Any]) -> None:
        spec["defaults"]["minVersion"] = "v1.30.0"  # versionSource kubelet in the defaults
        spec["drivers"][EBS]["minVersion"] = "v1.40.0"  # versionSource pod: not named
        spec["drivers"]["pd.csi.storage.gke.io"]["versionSource"] = {"type": "kubelet"}

    result = run_cli("policy", "validate", str(_policy(tmp_path, edit)), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    named = [w for w in result.stderr.splitlines() if "versionSource kubelet" in w]
    assert [w.split(": ")[2] for w in named] == ["at $.spec.defaults.versionSource",
                                                  "at $.spec.drivers['pd.csi.storage.gke.io'].versionSource"]
    assert "drivers the policy does not name" in named[0] and "not a node that lies" in named[0]
