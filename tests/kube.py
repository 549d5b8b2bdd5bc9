"""Builders for CSINode objects and AdmissionReviews shaped as kube-apiserver sends them for kubelet PUTs."""

from __future__ import annotations

import base64
import copy
import json
import uuid
from pathlib import Path
from typing import Any

import jsonpatch

DATA = Path(__file__).parent / "data"
CLUSTER_DATA = DATA / "cluster"
"""One small cluster's objects (Nodes, CSIDrivers, kube-system Pods, VolumeAttachments) as the apiserver serves
them: the fake API server holds them where a test module sets ``APISERVER_DATA = CLUSTER_DATA``."""
NODE = "ip-10-0-1-23.ec2.internal"
EBS = "ebs.csi.aws.com"
EBS_NODE_ID = "i-0a1b2c3d4e5f60718"
EBS_TOPOLOGY = ["kubernetes.io/os", "topology.ebs.csi.aws.com/zone", "topology.kubernetes.io/zone"]
KUBELET = f"system:node:{NODE}"
NODE_GROUPS = ["system:nodes", "system:authenticated"]
ABSENT = "absent"


def base_csinode() -> dict[str, Any]:
    """The CSINode kubelet created for NODE, with the EFS driver registered (no allocatable)."""
    loaded: dict[str, Any] = json.loads((DATA / "csinode-kubelet.json").read_text())
    return loaded


def cluster_object(name: str) -> dict[str, Any]:
    """The object of ``CLUSTER_DATA / name`` (e.g. ``node-m6i-large.json``), freshly decoded: the caller may change
    it. Raises ``FileNotFoundError`` for a name that is not there."""
    loaded: dict[str, Any] = json.loads((CLUSTER_DATA / name).read_text())
    return loaded


def driver_entry(name: str, count: int | str | None) -> dict[str, Any]:
    """A spec.drivers[] entry as kubelet writes it; count None -> no allocatable (unbounded)."""
    entry: dict[str, Any] = {"name": name, "nodeID": EBS_NODE_ID, "topologyKeys": list(EBS_TOPOLOGY)}
    if count is None or count == ABSENT:
        return entry
    entry["allocatable"] = {"count": count}
    return entry


def kubelet_update(stored: dict[str, Any], driver: str, count: int | None) -> dict[str, Any]:
    """What kubelet PUTs: the stored object with ``driver`` removed and re-appended with the new count.

    kubelet (nodeinfomanager) keeps labels and annotations it does not own and sends the resourceVersion it read.
    """
    new = copy.deepcopy(stored)
    drivers = [d for d in new["spec"]["drivers"] if d["name"] != driver]
    drivers.append(driver_entry(driver, count))
    new["spec"]["drivers"] = drivers
    return new


def with_annotation(obj: dict[str, Any], key: str, value: str | None) -> dict[str, Any]:
    """A copy of ``obj`` with annotation ``key`` set (or removed when ``value`` is None)."""
    new = copy.deepcopy(obj)
    annotations = new["metadata"].setdefault("annotations", {})
    if value is None:
        annotations.pop(key, None)
    else:
        annotations[key] = value
    return new


def review(
    old: dict[str, Any] | None,
    new: dict[str, Any] | None,
    *,
    user: str = KUBELET,
    groups: list[str] | None = None,
    operation: str = "UPDATE",
    dry_run: bool = False,
    uid: str | None = None,
) -> dict[str, Any]:
    """An admission.k8s.io/v1 AdmissionReview for storage.k8s.io/v1 csinodes, as kube-apiserver sends it."""
    name = (new or old or {}).get("metadata", {}).get("name", NODE)
    gvk = {"group": "storage.k8s.io", "version": "v1", "kind": "CSINode"}
    gvr = {"group": "storage.k8s.io", "version": "v1", "resource": "csinodes"}
    options_kind = {"UPDATE": "UpdateOptions", "CREATE": "CreateOptions", "DELETE": "DeleteOptions"}[operation]
    options: dict[str, Any] = {"kind": options_kind, "apiVersion": "meta.k8s.io/v1"}
    if operation != "DELETE" and user.startswith("system:node:"):
        options["fieldManager"] = "kubelet"
    return {
        "kind": "AdmissionReview",
        "apiVersion": "admission.k8s.io/v1",
        "request": {
            "uid": uid or str(uuid.uuid4()),
            "kind": gvk,
            "resource": gvr,
            "requestKind": gvk,
            "requestResource": gvr,
            "name": name,
            "operation": operation,
            "userInfo": {
                "username": user,
                "groups": groups if groups is not None else (NODE_GROUPS if user == KUBELET else
                                                             ["system:authenticated"]),
                "extra": {"authentication.kubernetes.io/credential-id": ["X509SHA256=4f0c2e1d"]}
                if user.startswith("system:node:")
                else {},
            },
            "object": new,
            "oldObject": old,
            "dryRun": dry_run,
            "options": options,
        },
    }


def apply_response(obj: dict[str, Any], response: dict[str, Any]) -> dict[str, Any]:
    """The object the apiserver stores after a /mutate response (applies its JSONPatch, if any)."""
    patch = response["response"].get("patch")
    if not patch:
        return copy.deepcopy(obj)
    ops = json.loads(base64.b64decode(patch))
    result: dict[str, Any] = jsonpatch.apply_patch(obj, ops)
    return result


def counts(obj: dict[str, Any]) -> dict[str, int | None]:
    """driver -> allocatable count (None = unbounded) of a CSINode object."""
    return {d["name"]: (d.get("allocatable") or {}).get("count") for d in obj["spec"]["drivers"]}


def count_of(obj: dict[str, Any], driver: str) -> int | None:
    """``allocatable.count`` of ``driver`` in ``obj`` (None: unbounded). Raises KeyError when it is not there."""
    for entry in (obj.get("spec") or {}).get("drivers") or []:
        if entry.get("name") == driver:
            allocatable = entry.get("allocatable") or {}
            count: int | None = allocatable.get("count")
            return count
    raise KeyError(driver)


def without_driver(obj: dict[str, Any], driver: str) -> dict[str, Any]:
    """What kubelet PUTs when the node plugin of ``driver`` goes away (a plugin restart's first write)."""
    new = copy.deepcopy(obj)
    new["spec"]["drivers"] = [d for d in new["spec"]["drivers"] if d["name"] != driver]
    return new
