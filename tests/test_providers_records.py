"""webhook.kube.watch records and store: parsing the API's JSON into slim records, versions, indexes."""

from __future__ import annotations

import threading
from datetime import UTC, datetime
from typing import Any

import pytest

from tests.kube import cluster_object
from webhook.admission.cluster import AttachErrorClass, PodVersionSource
from webhook.kube.watch.records import (
    PodRecord,
    image_tag,
    lowest_version,
    object_key,
    parse_csidriver,
    parse_node,
    parse_pod,
    parse_time,
    parse_version,
    parse_volume_attachment,
)
from webhook.kube.watch.store import Store
from webhook.kube.watch.transport import ApiStatusError, GoneError


@pytest.mark.parametrize(
    ("image", "tag"),
    [
        pytest.param("public.ecr.aws/ebs-csi-driver/aws-ebs-csi-driver:v1.37.0", "v1.37.0", id="registry/repo:tag"),
        pytest.param("aws-ebs-csi-driver:v1.37.0", "v1.37.0", id="repo:tag"),
        pytest.param("registry.k8s.io:443/sig-storage/csi-driver:v2.0.1", "v2.0.1", id="registry port and tag"),
        pytest.param("registry.local:5000/csi-driver", None, id="a registry port is not a tag"),
        pytest.param("repo/driver:v1.2.3@sha256:" + "0" * 64, "v1.2.3", id="tag and digest: the tag"),
        pytest.param("repo/driver@sha256:" + "0" * 64, None, id="digest only: no tag"),
        pytest.param("repo/driver", None, id="no tag at all"),
        pytest.param("repo/driver:", None, id="empty tag"),
    ],
)
def test_image_tag(image: str, tag: str | None) -> None:
    assert image_tag(image) == tag


@pytest.mark.parametrize(
    ("versions", "lowest"),
    [
        pytest.param(["v1.37.0", "v1.36.1"], "v1.36.1", id="mid-rollout: the lower"),
        pytest.param(["v1.37.0", "v1.37.0-rc.1"], "v1.37.0-rc.1", id="a pre-release is lower than its release"),
        pytest.param(["latest", "v1.37.0", "main-abc123"], "v1.37.0", id="unparsable versions are ignored"),
        pytest.param(["latest"], None, id="nothing parsable: unknown"),
        pytest.param([], None, id="no versions: unknown"),
        pytest.param(["1.37.0", "v1.37"], "1.37.0", id="equal precedence: lexically smaller string, any order"),
        pytest.param(["v1.37", "1.37.0"], "1.37.0", id="equal precedence, reversed input"),
        pytest.param(["v1.10.0", "v1.9.0"], "v1.9.0", id="numeric, not lexical, order"),
    ],
)
def test_lowest_version(versions: list[str], lowest: str | None) -> None:
    assert lowest_version(versions) == lowest


def test_parse_version_strips_a_leading_v_and_accepts_short_versions() -> None:
    assert str(parse_version("v1.37")) == "1.37.0"
    assert str(parse_version("V2")) == "2.0.0"
    assert parse_version("v1.37.0-eksbuild.1") is not None
    assert parse_version("sha-deadbeef") is None


def test_parse_node_keeps_labels_and_kubelet_version() -> None:
    record = parse_node(cluster_object("node-m6i-large.json"))
    assert record.labels["node.kubernetes.io/instance-type"] == "m6i.large"
    assert record.kubelet_version == "v1.35.0-eks-3cfe0ce"
    assert parse_node({"metadata": {"name": "bare"}}).kubelet_version == ""


def test_parse_csidriver_period() -> None:
    assert parse_csidriver(cluster_object("csidriver-ebs.json")).update_period == 60.0
    assert parse_csidriver({"metadata": {"name": "x"}, "spec": {}}).update_period is None
    assert parse_csidriver({"spec": {"nodeAllocatableUpdatePeriodSeconds": True}}).update_period is None


def test_parse_volume_attachment_with_a_resource_exhausted_error() -> None:
    record = parse_volume_attachment(cluster_object("volumeattachment-exhausted.json"))
    assert (record.node, record.driver, record.attached) == ("ip-10-0-1-23.ec2.internal", "ebs.csi.aws.com", False)
    assert record.error is not None
    assert record.error.code == 8 and record.error.error_class is AttachErrorClass.CAPACITY
    assert record.error.time == datetime(2026, 11, 29, 21, 40, 19, tzinfo=UTC)
    assert record.error.message.startswith("rpc error: code = ResourceExhausted")


def test_parse_volume_attachment_without_error_time_or_code() -> None:
    va = cluster_object("volumeattachment-exhausted.json")
    del va["status"]["attachError"]["errorCode"]  # a cluster before KEP-4876
    record = parse_volume_attachment(va)
    assert record.error is not None and record.error.code is None
    assert record.error.error_class is AttachErrorClass.OTHER
    del va["status"]["attachError"]["time"]  # no time: cannot be judged as recent, not kept
    assert parse_volume_attachment(va).error is None
    attached = parse_volume_attachment(cluster_object("volumeattachment-attached.json"))
    assert attached.attached and attached.error is None


def test_parse_pod_keeps_daemonset_pods_in_any_phase() -> None:
    pod = cluster_object("pod-ebs-csi-node.json")
    record = parse_pod(pod)
    assert record is not None and record.node == "ip-10-0-1-23.ec2.internal"
    assert [name for name, _ in record.images] == ["ebs-plugin", "node-driver-registrar", "liveness-probe"]
    for phase in ("Pending", "Succeeded", "Failed", "Unknown"):  # status is the node's to write: ignored
        pod["status"]["phase"] = phase
        assert parse_pod(pod) == record
    pod["status"]["containerStatuses"] = [{"name": "ebs-plugin", "image": "x/aws-ebs-csi-driver:v9.9.9"}]
    assert parse_pod(pod) == record
    del pod["spec"]["nodeName"]
    assert parse_pod(pod) is None


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda m: m.update(annotations={"kubernetes.io/config.mirror": "abc"}), id="a mirror pod"),
        pytest.param(lambda m: m.pop("ownerReferences"), id="no owner"),
        pytest.param(lambda m: m["ownerReferences"][0].update(kind="Node", apiVersion="v1"), id="owned by its Node"),
        pytest.param(lambda m: m["ownerReferences"][0].update(controller=False), id="not controller"),
        pytest.param(lambda m: m["ownerReferences"][0].update(kind="ReplicaSet"), id="controlled by a ReplicaSet"),
        pytest.param(lambda m: m["ownerReferences"][0].update(apiVersion="extensions/v1beta1"), id="another group"),
    ],
)
def test_parse_pod_refuses_pods_no_daemonset_controls(change: Any) -> None:
    pod = cluster_object("pod-ebs-csi-node.json")
    change(pod["metadata"])
    assert parse_pod(pod) is None


@pytest.mark.parametrize(
    ("source", "version"),
    [
        pytest.param(PodVersionSource("d", "ns", (), container="ebs-plugin"), "v1.37.0", id="named container"),
        pytest.param(
            PodVersionSource("d", "ns", (), container="liveness-probe"), "v2.14.0-eks-1-31-7", id="another container"
        ),
        pytest.param(PodVersionSource("d", "ns", ()), "v1.37.0", id="no container named: the first"),
        pytest.param(PodVersionSource("d", "ns", (), container="missing"), None, id="container absent"),
        pytest.param(PodVersionSource("d", "ns", (), label="app.kubernetes.io/version"), "1.37.0", id="label"),
        pytest.param(PodVersionSource("d", "ns", (), label="missing"), None, id="label absent"),
    ],
)
def test_pod_version_by_source(source: PodVersionSource, version: str | None) -> None:
    record = parse_pod(cluster_object("pod-ebs-csi-node.json"))
    assert isinstance(record, PodRecord)
    assert record.version(source) == version


def test_identical_strings_are_shared_between_records() -> None:
    first, second = parse_node(cluster_object("node-m6i-large.json")), parse_node(cluster_object("node-m6i-large.json"))
    key_a = next(k for k in first.labels if k == "topology.kubernetes.io/zone")
    key_b = next(k for k in second.labels if k == "topology.kubernetes.io/zone")
    assert key_a is key_b
    assert first.labels[key_a] is second.labels[key_b]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2026-11-29T21:40:19Z", datetime(2026, 11, 29, 21, 40, 19, tzinfo=UTC)),
        ("2026-11-29T21:40:19.123456Z", datetime(2026, 11, 29, 21, 40, 19, 123456, tzinfo=UTC)),
        ("2026-11-29T22:40:19+01:00", datetime(2026, 11, 29, 21, 40, 19, tzinfo=UTC)),
        ("yesterday", None),
        (None, None),
    ],
)
def test_parse_time(text: str | None, expected: datetime | None) -> None:
    assert parse_time(text) == expected


def test_object_key() -> None:
    assert object_key({"metadata": {"name": "n"}}) == "n"
    assert object_key({"metadata": {"name": "p", "namespace": "kube-system"}}) == "kube-system/p"
    assert object_key({"metadata": {}}) is None
    assert object_key({}) is None


def test_status_errors_map_410_to_gone() -> None:
    assert isinstance(ApiStatusError.from_status({"code": 410, "reason": "Expired"}), GoneError)
    error = ApiStatusError.from_status({"code": 403, "reason": "Forbidden", "message": "no"})
    assert not isinstance(error, GoneError) and error.code == 403
    assert ApiStatusError.from_status("garbage", default_code=503).code == 503


# --------------------------------------------------------------------------------------------------
# Store


def _by_first(value: tuple[str, int]) -> str | None:
    return value[0] or None


def test_store_indexes_follow_upserts_deletes_and_replace() -> None:
    store: Store[tuple[str, int]] = Store("test", {"first": _by_first})
    store.upsert("a", ("x", 1))
    store.upsert("b", ("x", 2))
    store.upsert("c", ("y", 3))
    assert store.count("first", "x", 0.01) == 2
    seen = store.bucket("first", "x", 0.01)
    store.upsert("a", ("y", 1))  # moves between buckets
    assert dict(seen or {}) == {"a": ("x", 1), "b": ("x", 2)}  # a bucket already read never changes
    assert store.count("first", "x", 0.01) == 1 and store.count("first", "y", 0.01) == 2
    store.upsert("b", ("", 2))  # leaves the index
    assert store.count("first", "x", 0.01) == 0
    store.delete("c")
    store.delete("never-there")
    assert store.count("first", "y", 0.01) == 1
    assert store.get("b", 0.01) == (True, ("", 2))
    store.replace({"z": ("q", 9)})
    assert len(store) == 1 and store.get("a", 0.01) == (True, None)
    assert store.bucket("first", "q", 0.01) == {"z": ("q", 9)}


def test_store_read_gives_up_within_its_budget() -> None:
    store: Store[int] = Store("test", {"all": lambda _r: "all"})
    store.upsert("a", 1)
    held = threading.Event()
    release = threading.Event()

    def writer() -> None:
        with store.lock:
            held.set()
            release.wait(5)

    thread = threading.Thread(target=writer)
    thread.start()
    held.wait(5)
    try:
        assert store.get("a", 0.002) == (False, None)
        assert store.bucket("all", "all", 0.002) is None
        assert store.count("all", "all", 0.002) is None
    finally:
        release.set()
        thread.join()
    assert store.get("a", 0.002) == (True, 1)


def test_pod_store_keeps_a_nodes_last_pod_as_departed_until_another_appears() -> None:
    from webhook.kube.watch.pod_store import PodStore  # noqa: PLC0415

    store = PodStore()
    pod = parse_pod(cluster_object("pod-ebs-csi-node.json"))
    assert pod is not None
    node = pod.node
    other = PodRecord(node=node, labels={}, images=(("ebs-plugin", "x:v1.40.0"),))
    store.upsert("kube-system/a", pod)
    store.upsert("kube-system/b", other)
    assert store.departed(node, 1.0) == (True, None)
    store.delete("kube-system/b")  # another pod of the node is still there: nothing departed
    assert store.departed(node, 1.0) == (True, None)
    store.delete("kube-system/a")  # the node's last pod (e.g. the node deleted it)
    assert store.bucket("node", node, 1.0) == {}
    assert store.departed(node, 1.0) == (True, pod)
    store.upsert("kube-system/c", other)  # the DaemonSet's replacement
    assert store.departed(node, 1.0) == (True, None)
    store.replace({"kube-system/d": PodRecord(node="elsewhere", labels={}, images=())})  # a re-list without it
    assert store.departed(node, 1.0) == (True, other)
    store.replace({"kube-system/e": other})
    assert store.departed(node, 1.0) == (True, None)
    with store.lock:
        assert store.departed(node, 0.01) == (False, None)
