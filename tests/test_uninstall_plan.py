"""What ``uninstall`` writes back to a CSINode (webhook/kube/uninstall.py): only the guard's annotations go;
other annotations, labels, the resourceVersion (the write stays conditional) and every count stay."""

from __future__ import annotations

from tests.kube import EBS, base_csinode, kubelet_update, with_annotation
from webhook.kube.uninstall import guard_annotations, without_guard_annotations


def test_only_the_guards_annotations_are_removed() -> None:
    obj = with_annotation(kubelet_update(base_csinode(), EBS, 25), "csinode-guard.io/state", "{}")
    obj = with_annotation(obj, "csinode-guard.io/justification", "[]")
    obj = with_annotation(obj, "example.com/owner", "storage-team")
    obj["metadata"]["resourceVersion"] = "42"

    stripped = without_guard_annotations(obj)

    assert guard_annotations(obj) == ["csinode-guard.io/justification", "csinode-guard.io/state"]
    assert guard_annotations(stripped) == []
    kept = {k: v for k, v in obj["metadata"]["annotations"].items() if not k.startswith("csinode-guard.io/")}
    assert stripped["metadata"]["annotations"] == kept and kept["example.com/owner"] == "storage-team"
    assert "storage.alpha.kubernetes.io/migrated-plugins" in kept, "kubelet's own annotation stays"
    assert stripped["metadata"]["resourceVersion"] == "42"
    assert stripped["spec"] == obj["spec"]
    assert "csinode-guard.io/state" in obj["metadata"]["annotations"], "the input is not changed"


def test_an_object_with_only_the_guards_annotations_keeps_none() -> None:
    obj = kubelet_update(base_csinode(), EBS, 25)
    obj["metadata"]["annotations"] = {"csinode-guard.io/state": "{}"}
    assert "annotations" not in without_guard_annotations(obj)["metadata"]
