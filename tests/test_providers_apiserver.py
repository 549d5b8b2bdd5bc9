"""tests.apiserver: the fake API server speaks the wire format the real kubernetes client expects."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import urllib3

from tests.apiserver import FakeApiServer, Resource, json_patch, merge_patch, parse_label_selector
from tests.kube import CLUSTER_DATA, NODE, cluster_object

APISERVER_DATA = CLUSTER_DATA
"""The fake API server of tests/conftest.py holds these objects in this module."""


@pytest.fixture
def typed(apiserver: FakeApiServer, tmp_path: Path) -> Any:
    """The kubernetes client's typed APIs (models validate every object they read) against ``apiserver``."""
    from kubernetes import client, config  # noqa: PLC0415

    configuration = client.Configuration()
    config.load_kube_config(
        config_file=apiserver.write_kubeconfig(tmp_path / "kubeconfig"), client_configuration=configuration
    )
    api_client = client.ApiClient(configuration)
    yield client, api_client
    api_client.close()


@pytest.fixture
def http(apiserver: FakeApiServer) -> urllib3.PoolManager:
    return urllib3.PoolManager(headers={"Authorization": "Bearer test-token"}, retries=False)


def test_typed_client_reads_the_fixtures(typed: Any) -> None:
    client, api_client = typed
    nodes = client.CoreV1Api(api_client).list_node()
    assert [n.metadata.name for n in nodes.items] == [NODE]
    assert nodes.items[0].status.node_info.kubelet_version == "v1.35.0-eks-3cfe0ce"
    pods = client.CoreV1Api(api_client).list_namespaced_pod("kube-system", label_selector="app=ebs-csi-node")
    assert [p.spec.containers[0].image for p in pods.items] == [
        "public.ecr.aws/ebs-csi-driver/aws-ebs-csi-driver:v1.37.0"
    ]
    storage = client.StorageV1Api(api_client)
    assert storage.read_csi_driver("ebs.csi.aws.com").spec.node_allocatable_update_period_seconds == 60
    first = storage.list_volume_attachment(limit=1)
    assert len(first.items) == 1 and first.metadata.remaining_item_count == 1
    second = storage.list_volume_attachment(limit=1, _continue=first.metadata._continue)
    assert second.metadata._continue is None
    errors = [va.status.attach_error for va in first.items + second.items if va.status.attach_error]
    assert [e.error_code for e in errors] == [8]


def test_typed_client_writes_and_conflicts(typed: Any, apiserver: FakeApiServer) -> None:
    client, api_client = typed
    core = client.CoreV1Api(api_client)
    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cm"}, "data": {"a": "1"}}
    created = core.create_namespaced_config_map("default", body)
    assert created.metadata.resource_version == str(apiserver.resource_version)
    patched = core.patch_namespaced_config_map("cm", "default", {"data": {"b": "2"}})
    assert patched.data == {"a": "1", "b": "2"}
    stale = dict(body, metadata={"name": "cm", "resourceVersion": created.metadata.resource_version})
    with pytest.raises(client.exceptions.ApiException) as conflict:
        core.replace_namespaced_config_map("cm", "default", stale)
    assert conflict.value.status == 409
    core.delete_namespaced_config_map("cm", "default")
    with pytest.raises(client.exceptions.ApiException) as missing:
        core.read_namespaced_config_map("cm", "default")
    assert missing.value.status == 404
    with pytest.raises(client.exceptions.ApiException) as exists:
        client.StorageV1Api(api_client).create_csi_driver(cluster_object("csidriver-ebs.json"))
    assert exists.value.status == 409


def _watch_lines(http: urllib3.PoolManager, url: str) -> Iterator[dict[str, Any]]:
    """Open a watch now; iterate its decoded events."""
    response = http.request("GET", url, preload_content=False, timeout=urllib3.Timeout(connect=2, read=5))
    assert response.status == 200

    def lines() -> Iterator[dict[str, Any]]:
        buffer = b""
        for chunk in response.stream(4096):
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                yield json.loads(line)

    return lines()


def test_watch_streams_events_bookmarks_and_a_410(apiserver: FakeApiServer, http: urllib3.PoolManager) -> None:
    rv = apiserver.resource_version
    events = _watch_lines(http, f"{apiserver.url}/api/v1/nodes?watch=1&allowWatchBookmarks=true&resourceVersion={rv}")
    node = cluster_object("node-m6i-large.json")
    node["metadata"]["name"] = "n2"
    assert apiserver.wait_for_watches("nodes")
    apiserver.create("nodes", node)
    added = next(events)
    assert (added["type"], added["object"]["metadata"]["name"], added["object"]["kind"]) == ("ADDED", "n2", "Node")
    apiserver.send_bookmark("nodes")
    bookmark = next(events)
    assert bookmark == {
        "type": "BOOKMARK",
        "object": {
            "kind": "Node",
            "apiVersion": "v1",
            "metadata": {"resourceVersion": str(apiserver.resource_version)},
        },
    }
    apiserver.inject_gone("nodes")
    error = next(events)
    assert error["type"] == "ERROR" and error["object"]["code"] == 410 and error["object"]["kind"] == "Status"
    assert list(events) == []  # the stream ends cleanly after the ERROR


def test_watch_from_a_compacted_resource_version_gets_410(apiserver: FakeApiServer, http: urllib3.PoolManager) -> None:
    old = apiserver.resource_version
    apiserver.delete("nodes", NODE)
    apiserver.compact()
    events = list(_watch_lines(http, f"{apiserver.url}/api/v1/nodes?watch=true&resourceVersion={old}"))
    assert [e["type"] for e in events] == ["ERROR"] and events[0]["object"]["reason"] == "Expired"


def test_watch_without_resource_version_starts_with_synthetic_adds_and_honours_selectors(
    apiserver: FakeApiServer, http: urllib3.PoolManager
) -> None:
    url = f"{apiserver.url}/api/v1/namespaces/kube-system/pods?watch=true&labelSelector=app%3Debs-csi-node"
    events = _watch_lines(http, url)
    first = next(events)
    assert first["type"] == "ADDED" and first["object"]["metadata"]["name"] == "ebs-csi-node-7xk2p"
    assert apiserver.wait_for_watches("pods")
    pod = apiserver.get("pods", "ebs-csi-node-7xk2p", "kube-system")
    assert pod is not None
    pod["metadata"]["labels"]["app"] = "moved"  # leaves the selection: DELETED
    apiserver.update("pods", pod)
    assert next(events)["type"] == "DELETED"
    pod = apiserver.get("pods", "ebs-csi-node-7xk2p", "kube-system")
    assert pod is not None
    pod["metadata"]["labels"]["app"] = "ebs-csi-node"  # enters it again: ADDED
    apiserver.update("pods", pod)
    assert next(events)["type"] == "ADDED"


def test_field_selectors_and_faults(apiserver: FakeApiServer, http: urllib3.PoolManager) -> None:
    url = f"{apiserver.url}/api/v1/pods?fieldSelector=spec.nodeName%3D{NODE},status.phase%3DRunning"
    assert len(json.loads(http.request("GET", url).data)["items"]) == 1
    url = f"{apiserver.url}/api/v1/pods?fieldSelector=metadata.namespace%3Ddefault"
    assert json.loads(http.request("GET", url).data)["items"] == []
    apiserver.fail_next("pods", 503)
    assert http.request("GET", f"{apiserver.url}/api/v1/pods").status == 503
    assert http.request("GET", f"{apiserver.url}/api/v1/pods").status == 200
    apiserver.set_offline("pods")
    with pytest.raises(urllib3.exceptions.ProtocolError):
        http.request("GET", f"{apiserver.url}/api/v1/pods")
    unauthenticated = urllib3.PoolManager(retries=False).request("GET", f"{apiserver.url}/api/v1/nodes")
    assert unauthenticated.status == 401


def test_list_items_carry_no_kind_and_discovery_lists_resources(
    apiserver: FakeApiServer, http: urllib3.PoolManager
) -> None:
    listed = json.loads(http.request("GET", f"{apiserver.url}/apis/storage.k8s.io/v1/csidrivers").data)
    assert listed["kind"] == "CSIDriverList" and int(listed["metadata"]["resourceVersion"]) > 0
    assert "kind" not in listed["items"][0] and "apiVersion" not in listed["items"][0]
    discovery = json.loads(http.request("GET", f"{apiserver.url}/apis/storage.k8s.io/v1").data)
    assert {"csidrivers", "csinodes", "volumeattachments"} <= {r["name"] for r in discovery["resources"]}


def test_custom_resources_can_be_registered(apiserver: FakeApiServer, http: urllib3.PoolManager) -> None:
    apiserver.register(Resource("example.com", "v1", "widgets", "Widget", namespaced=True))
    apiserver.create("widgets", {"metadata": {"name": "w", "namespace": "ns"}, "spec": {"size": 1}})
    got = json.loads(http.request("GET", f"{apiserver.url}/apis/example.com/v1/namespaces/ns/widgets/w").data)
    assert got["apiVersion"] == "example.com/v1" and got["spec"] == {"size": 1}


def test_patch_helpers() -> None:
    assert merge_patch({"a": {"b": 1, "c": 2}}, {"a": {"b": None, "d": 3}}) == {"a": {"c": 2, "d": 3}}
    doc = {"metadata": {"annotations": {"a/b": "1"}}, "list": [1, 2]}
    patched = json_patch(
        doc,
        [
            {"op": "replace", "path": "/metadata/annotations/a~1b", "value": "2"},
            {"op": "add", "path": "/list/-", "value": 3},
            {"op": "remove", "path": "/list/0"},
        ],
    )
    assert patched == {"metadata": {"annotations": {"a/b": "2"}}, "list": [2, 3]}
    assert doc["list"] == [1, 2]


@pytest.mark.parametrize(
    ("selector", "labels", "matches"),
    [
        ("app=ebs-csi-node", {"app": "ebs-csi-node"}, True),
        ("app==ebs-csi-node,tier=node", {"app": "ebs-csi-node"}, False),
        ("app!=x", {}, True),
        ("app in (a, b)", {"app": "b"}, True),
        ("app notin (a,b)", {"app": "b"}, False),
        ("app", {"app": ""}, True),
        ("!app", {"app": ""}, False),
        ("", {}, True),
    ],
)
def test_label_selectors(selector: str, labels: dict[str, str], matches: bool) -> None:
    assert parse_label_selector(selector)({"metadata": {"labels": labels}}) is matches
