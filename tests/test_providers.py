"""webhook.kube.watch: the watch-cache ClusterView, driven by the real kubernetes client against tests.apiserver."""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import pytest
from prometheus_client import REGISTRY

from tests.apiserver import FakeApiServer
from tests.kube import CLUSTER_DATA, EBS, NODE, cluster_object
from webhook.admission.cluster import AttachErrorClass, PodVersionSource, UnknownClusterView
from webhook.kube.watch import (
    CacheSettings,
    KubernetesClusterView,
    OfflineCaches,
    build_cluster_view,
    load_api_client,
)

APISERVER_DATA = CLUSTER_DATA
"""The fake API server of tests/conftest.py holds these objects in this module."""
OTHER_NODE = "ip-10-0-2-45.ec2.internal"
EXHAUSTED_VA = "csi-3f6c0b6f0d3c1e5a9b0e7d2c4a1f8e6b5d9c3a7e1f2b4d6c8e0a2b4c6d8e0f2a"
LONG_AGO = datetime(2000, 1, 1, tzinfo=UTC)
TIMEOUT = 5.0  # seconds; only reached when something is broken

EBS_IMAGE_SOURCE = PodVersionSource(
    driver=EBS, namespace="kube-system", match_labels=(("app", "ebs-csi-node"),), container="ebs-plugin"
)
EBS_LABEL_SOURCE = PodVersionSource(
    driver=EBS, namespace="kube-system", match_labels=(("app", "ebs-csi-node"),), label="app.kubernetes.io/version"
)
FAST = CacheSettings(
    max_staleness=30.0,
    cache_sync_timeout=30.0,
    lookup_budget=0.005,
    backoff_initial=0.01,
    backoff_max=0.05,
    monitor_interval=0.05,
)


def wait_until(predicate: Callable[[], object], timeout: float = TIMEOUT, what: str = "condition") -> None:
    """Poll ``predicate`` every 5 ms until it is truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.005)


def metric(name: str, **labels: str) -> float:
    """Current value of a sample in the default registry (0 when absent)."""
    return REGISTRY.get_sample_value(name, labels) or 0.0


def driver_pod(name: str, image_tag: str, *, node: str = NODE, phase: str = "Running", **labels: str) -> dict[str, Any]:
    """The ebs-csi-node fixture pod renamed, with another ebs-plugin image tag, node or phase."""
    pod = cluster_object("pod-ebs-csi-node.json")
    pod["metadata"]["name"] = name
    pod["metadata"]["labels"].update(labels)
    pod["spec"]["nodeName"] = node
    pod["spec"]["containers"][0]["image"] = f"public.ecr.aws/ebs-csi-driver/aws-ebs-csi-driver:{image_tag}"
    pod["status"]["phase"] = phase
    return pod


def volume_attachment(
    name: str, *, node: str = NODE, attached: bool = True, code: int | None = None, when: str = "2026-11-29T21:40:19Z"
) -> dict[str, Any]:
    """A VolumeAttachment for (node, ebs) that is attached, or carries an attachError with ``code``."""
    va = cluster_object("volumeattachment-attached.json")
    va["metadata"]["name"] = name
    va["spec"]["nodeName"] = node
    va["status"] = {"attached": attached}
    if code is not None or not attached:
        error: dict[str, Any] = {"message": f"rpc error: code = {code}", "time": when}
        if code is not None:
            error["errorCode"] = code
        va["status"]["attachError"] = error
    return va


@pytest.fixture
def make_view(apiserver: FakeApiServer, kubeconfig: str) -> Iterator[Callable[..., KubernetesClusterView]]:
    """Build and start views on ``apiserver`` (FAST settings plus overrides); all are stopped afterwards."""
    api_client = load_api_client(kubeconfig)
    views: list[KubernetesClusterView] = []

    def make(sources: tuple[PodVersionSource, ...] = (EBS_IMAGE_SOURCE,), **overrides: Any) -> KubernetesClusterView:
        view = KubernetesClusterView(api_client, sources, replace(FAST, **overrides))
        view.start()
        views.append(view)
        return view

    yield make
    apiserver.release_all()  # a request still hanging cannot be interrupted by stop()
    for view in views:
        view.stop(timeout=2.0)
        assert not any(r.alive for r in view._reflectors()), "watch threads still running after stop()"


@pytest.fixture
def view(make_view: Callable[..., KubernetesClusterView]) -> KubernetesClusterView:
    """A started view with the EBS image version source, synced."""
    started = make_view()
    wait_until(started.synced, what="caches to sync")
    return started


# --------------------------------------------------------------------------------------------------
# Fixtures are what a real apiserver returns


@pytest.mark.parametrize("name", sorted(p.name for p in CLUSTER_DATA.glob("*.json")))
def test_fixture_objects_pass_the_client_models_validation(name: str) -> None:
    from kubernetes.client.api_client import ApiClient  # noqa: PLC0415

    obj = cluster_object(name)
    model = ApiClient().deserialize(json.dumps(obj), f"V1{obj['kind']}", "application/json")
    assert model.metadata.name == obj["metadata"]["name"]


# --------------------------------------------------------------------------------------------------
# Sync and lookups


def test_synced_view_answers_every_fact_from_the_fixtures(view: KubernetesClusterView) -> None:
    labels = view.node_labels(NODE)
    assert labels is not None
    assert labels["node.kubernetes.io/instance-type"] == "m6i.large"
    assert labels["eks.amazonaws.com/nodegroup"] == "general-m6i"
    assert view.kubelet_version(NODE) == "v1.35.0-eks-3cfe0ce"
    assert view.driver_update_period(EBS) == 60.0
    assert view.driver_version(NODE, EBS) == "v1.37.0"
    errors = view.attach_errors(NODE, EBS, LONG_AGO)
    assert errors is not None and [e.code for e in errors] == [8]
    assert errors[0].error_class is AttachErrorClass.CAPACITY
    assert errors[0].volume_attachment == EXHAUSTED_VA
    assert errors[0].time == datetime(2026, 11, 29, 21, 40, 19, tzinfo=UTC)
    assert view.attached_volumes(NODE, EBS) == 1
    assert view.ready() and not view.degraded()


def test_absent_objects_are_unknown_or_empty_as_the_protocol_says(view: KubernetesClusterView) -> None:
    assert view.node_labels("no-such-node") is None
    assert view.kubelet_version("no-such-node") is None
    assert view.driver_update_period("pd.csi.storage.gke.io") is None
    assert view.driver_version(OTHER_NODE, EBS) is None  # no driver pod there
    assert view.driver_version(NODE, "pd.csi.storage.gke.io") is None  # no version source
    assert view.attach_errors(OTHER_NODE, EBS, LONG_AGO) == []  # known: no errors
    assert view.attached_volumes(OTHER_NODE, EBS) == 0  # known: nothing attached


def test_node_labels_are_read_only(view: KubernetesClusterView) -> None:
    labels = view.node_labels(NODE)
    with pytest.raises(TypeError):
        labels["x"] = "y"  # type: ignore[index]


def test_requests_list_in_pages_then_watch_with_bookmarks_and_pod_selectors(
    view: KubernetesClusterView, apiserver: FakeApiServer
) -> None:
    for resource in ("nodes", "csidrivers", "volumeattachments", "pods"):
        wait_until(lambda r=resource: apiserver.requests_for(r, watch=True), what=f"{resource} watch")
        first_list = apiserver.requests_for(resource, watch=False)[0]
        assert first_list.query["limit"] == "100"
        watch = apiserver.requests_for(resource, watch=True)[0]
        assert watch.query["allowWatchBookmarks"] == "true"
        assert int(watch.query["resourceVersion"]) > 0
        assert 300 <= int(watch.query["timeoutSeconds"]) < 600
    pod_requests = apiserver.requests_for("pods")
    assert {r.path for r in pod_requests} == {"/api/v1/namespaces/kube-system/pods"}
    assert {r.query["labelSelector"] for r in pod_requests} == {"app=ebs-csi-node"}


def test_list_pages_are_followed_to_the_end(
    make_view: Callable[..., KubernetesClusterView], apiserver: FakeApiServer
) -> None:
    for i in range(7):
        apiserver.create("volumeattachments", volume_attachment(f"csi-paged-{i}"))
    view = make_view(page_size=3)
    wait_until(view.synced)
    assert view.attached_volumes(NODE, EBS) == 8
    pages = apiserver.requests_for("volumeattachments", watch=False)
    assert len(pages) == 3 and "continue" in pages[1].query and "continue" in pages[2].query


def test_watch_events_update_the_cache(view: KubernetesClusterView, apiserver: FakeApiServer) -> None:
    node = cluster_object("node-m6i-large.json")
    node["metadata"]["name"] = OTHER_NODE
    node["metadata"]["labels"]["node.kubernetes.io/instance-type"] = "m6i.xlarge"
    apiserver.create("nodes", node)
    wait_until(lambda: view.node_labels(OTHER_NODE), what="ADDED node")
    assert view.node_labels(OTHER_NODE)["node.kubernetes.io/instance-type"] == "m6i.xlarge"  # type: ignore[index]

    driver = cluster_object("csidriver-ebs.json")
    driver["spec"]["nodeAllocatableUpdatePeriodSeconds"] = 30
    apiserver.apply("csidrivers", driver)
    wait_until(lambda: view.driver_update_period(EBS) == 30.0, what="MODIFIED csidriver")

    apiserver.delete("nodes", OTHER_NODE)
    wait_until(lambda: view.node_labels(OTHER_NODE) is None, what="DELETED node")
    apiserver.delete("csidrivers", EBS)
    wait_until(lambda: view.driver_update_period(EBS) is None, what="DELETED csidriver")


# --------------------------------------------------------------------------------------------------
# Watch restarts


@pytest.mark.parametrize(
    "via",
    [pytest.param("event", id="ERROR event with a 410 Status"), pytest.param("http", id="HTTP 410 answer to a watch")],
)
def test_gone_relists_and_the_watch_continues(view: KubernetesClusterView, apiserver: FakeApiServer, via: str) -> None:
    before = metric("csinode_guard_watch_restarts_total", kind="nodes", reason="gone")
    wait_until(lambda: apiserver.active_watches("nodes") == 1, what="nodes watch")
    apiserver.inject_gone("nodes", via=via)
    if via == "http":
        apiserver.drop_watches("nodes")  # the reconnect then meets the HTTP 410
    wait_until(lambda: len(apiserver.requests_for("nodes", watch=False)) == 2, what="re-list")
    wait_until(lambda: apiserver.active_watches("nodes") == 1, what="new watch")
    assert metric("csinode_guard_watch_restarts_total", kind="nodes", reason="gone") == before + 1
    node = cluster_object("node-m6i-large.json")
    node["metadata"]["labels"]["csinode-guard.test/after"] = "gone"
    apiserver.apply("nodes", node)
    wait_until(lambda: (view.node_labels(NODE) or {}).get("csinode-guard.test/after") == "gone")
    assert view.node_labels(NODE) is not None


def test_dropped_connection_resumes_from_the_last_resource_version(
    view: KubernetesClusterView, apiserver: FakeApiServer
) -> None:
    before = metric("csinode_guard_watch_restarts_total", kind="volumeattachments", reason="dropped")
    wait_until(lambda: apiserver.active_watches("volumeattachments") == 1)
    last_rv = view.volumeattachments.resource_version
    assert apiserver.drop_watches("volumeattachments") == 1
    wait_until(lambda: len(apiserver.requests_for("volumeattachments", watch=True)) == 2, what="reconnect")
    resumed = apiserver.requests_for("volumeattachments", watch=True)[1]
    assert resumed.query["resourceVersion"] == last_rv
    assert len(apiserver.requests_for("volumeattachments", watch=False)) == 1  # no re-list
    assert metric("csinode_guard_watch_restarts_total", kind="volumeattachments", reason="dropped") == before + 1
    apiserver.create("volumeattachments", volume_attachment("csi-after-drop"))
    wait_until(lambda: view.attached_volumes(NODE, EBS) == 2, what="event after reconnect")


def test_restarted_watch_picks_up_a_change_made_while_it_was_down(
    view: KubernetesClusterView, apiserver: FakeApiServer
) -> None:
    apiserver.set_offline("volumeattachments")
    apiserver.drop_watches("volumeattachments")
    wait_until(lambda: view.volumeattachments.down_since is not None, what="watch down")
    fixed = cluster_object("volumeattachment-exhausted.json")
    fixed["status"] = {"attached": True, "attachmentMetadata": {"devicePath": "/dev/xvdab"}}
    apiserver.apply("volumeattachments", fixed)
    assert view.attached_volumes(NODE, EBS) == 1  # the cache still holds the old state
    apiserver.set_offline("volumeattachments", False)
    wait_until(lambda: view.attached_volumes(NODE, EBS) == 2, what="change made while down")
    assert view.attach_errors(NODE, EBS, LONG_AGO) == []
    assert len(apiserver.requests_for("volumeattachments", watch=False)) == 1  # resumed, not re-listed


def test_restarted_watch_relists_when_the_history_was_compacted_while_down(
    view: KubernetesClusterView, apiserver: FakeApiServer
) -> None:
    apiserver.set_offline("nodes")
    apiserver.drop_watches("nodes")
    wait_until(lambda: view.nodes.down_since is not None)
    apiserver.delete("nodes", NODE)
    apiserver.compact()
    apiserver.set_offline("nodes", False)
    wait_until(lambda: view.node_labels(NODE) is None and view.nodes.down_since is None, what="re-list")
    assert len(apiserver.requests_for("nodes", watch=False)) == 2


def test_bookmarks_advance_the_resource_version(view: KubernetesClusterView, apiserver: FakeApiServer) -> None:
    wait_until(lambda: apiserver.active_watches("csidrivers") == 1)
    apiserver.create("nodes", {**cluster_object("node-m6i-large.json"), "metadata": {"name": OTHER_NODE}})
    apiserver.send_bookmark("csidrivers")
    wait_until(lambda: view.csidrivers.resource_version == str(apiserver.resource_version), what="BOOKMARK")
    # Resuming from the bookmark's resourceVersion survives a compaction: no 410, no re-list.
    apiserver.compact()
    apiserver.drop_watches("csidrivers")
    wait_until(lambda: len(apiserver.requests_for("csidrivers", watch=True)) == 2)
    wait_until(lambda: apiserver.active_watches("csidrivers") == 1)
    assert len(apiserver.requests_for("csidrivers", watch=False)) == 1


def test_api_errors_are_retried_with_backoff(
    make_view: Callable[..., KubernetesClusterView], apiserver: FakeApiServer
) -> None:
    apiserver.fail_next("csidrivers", 403, count=3, message='csidrivers is forbidden: User "x" cannot list')
    view = make_view()
    wait_until(view.synced, what="sync after 403s")
    lists = apiserver.requests_for("csidrivers", watch=False)
    assert len(lists) == 4
    gaps = [b.time - a.time for a, b in itertools.pairwise(lists)]
    assert all(gap >= 0.004 for gap in gaps)  # backoff of >= 50 % of 10 ms
    assert view.driver_update_period(EBS) == 60.0


# --------------------------------------------------------------------------------------------------
# Unknown: never synced, stale, or not answerable within the budget


def test_never_synced_cache_answers_unknown_and_readiness_degrades_after_the_timeout(
    make_view: Callable[..., KubernetesClusterView], apiserver: FakeApiServer, caplog: pytest.LogCaptureFixture
) -> None:
    apiserver.hang("volumeattachments")
    caplog.set_level(logging.WARNING, logger="webhook.providers")
    view = make_view(cache_sync_timeout=0.3)
    wait_until(lambda: all(r.synced for r in view._reflectors() if r.kind != "volumeattachments"), what="others")
    assert not view.synced() and not view.ready()
    assert view.readiness() == (False, "waiting for caches: volumeattachments")
    assert view.attach_errors(NODE, EBS, LONG_AGO) is None
    assert view.attached_volumes(NODE, EBS) is None
    assert view.kubelet_version(NODE) == "v1.35.0-eks-3cfe0ce"  # the other caches answer
    wait_until(view.ready, what="degraded readiness")
    assert view.degraded()
    assert view.readiness() == (True, "degraded: volumeattachments not synced")
    assert [r.message for r in caplog.records if "degraded" in r.message] == [
        "cluster caches not synced after 0 s (volumeattachments); ready in degraded mode: their facts are unknown"
    ]
    wait_until(lambda: metric("csinode_guard_cache_degraded") == 1)
    assert metric("csinode_guard_cache_synced", kind="volumeattachments") == 0
    apiserver.release("volumeattachments")
    wait_until(lambda: not view.degraded(), what="leaving degraded mode")
    assert view.ready() and view.synced()
    assert view.readiness() == (True, "synced")
    assert view.attached_volumes(NODE, EBS) == 1
    wait_until(lambda: metric("csinode_guard_cache_degraded") == 0)


def test_cache_whose_watch_is_down_longer_than_max_staleness_answers_unknown(
    make_view: Callable[..., KubernetesClusterView], apiserver: FakeApiServer
) -> None:
    view = make_view(max_staleness=0.3)
    wait_until(view.synced)
    apiserver.set_offline("nodes")
    apiserver.drop_watches("nodes")
    wait_until(lambda: view.nodes.down_since is not None)
    assert view.kubelet_version(NODE) == "v1.35.0-eks-3cfe0ce"  # stale for less than max_staleness: still known
    wait_until(lambda: view.kubelet_version(NODE) is None, what="staleness")
    assert view.node_labels(NODE) is None
    assert view.driver_update_period(EBS) == 60.0  # other kinds are unaffected
    wait_until(lambda: metric("csinode_guard_cache_staleness_seconds", kind="nodes") > 0.3)
    assert view.status()["nodes"]["fresh"] is False
    apiserver.set_offline("nodes", False)
    wait_until(lambda: view.kubelet_version(NODE) is not None, what="recovery")
    wait_until(lambda: metric("csinode_guard_cache_staleness_seconds", kind="nodes") == 0)


class ObservedLock:
    """A store's lock with every timeout a reader asked for recorded: what a lookup is willing to wait is then
    read from the lock instead of from a clock (a loaded machine makes any measured wait longer)."""

    def __init__(self, inner: threading.Lock) -> None:
        self.inner = inner
        self.timeouts: list[float] = []

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        self.timeouts.append(timeout)
        return self.inner.acquire(blocking, timeout)

    def release(self) -> None:
        self.inner.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def observe_lock(view: KubernetesClusterView) -> ObservedLock:
    """The VolumeAttachment store's lock replaced by an :class:`ObservedLock` around it."""
    store = view.volumeattachments.store
    observed = ObservedLock(store.lock)
    store._lock = observed  # type: ignore[assignment]  # the seam
    return observed


def test_lookup_gives_up_after_the_budget_when_the_cache_lock_is_held(view: KubernetesClusterView) -> None:
    before = metric("csinode_guard_cache_lookup_timeouts_total", kind="volumeattachments")
    lock = observe_lock(view)
    with lock.inner:  # a writer stuck inside the store
        assert view.attached_volumes(NODE, EBS) is None
        assert view.attach_errors(NODE, EBS, LONG_AGO) is None
    # Each lookup asked for the lock with the budget (5 ms), never an unbounded wait, then gave up and said so.
    assert lock.timeouts == [FAST.lookup_budget, FAST.lookup_budget]
    assert metric("csinode_guard_cache_lookup_timeouts_total", kind="volumeattachments") == before + 2
    assert view.attached_volumes(NODE, EBS) == 1


def test_lookups_stay_fast_while_the_api_hangs(view: KubernetesClusterView, apiserver: FakeApiServer) -> None:
    wait_until(lambda: apiserver.active_watches("volumeattachments") == 1)
    apiserver.hang("volumeattachments")
    apiserver.drop_watches("volumeattachments")  # the reconnect now hangs
    wait_until(lambda: len(apiserver.requests_for("volumeattachments", watch=True)) == 2)
    requests = len(apiserver.requests_for("volumeattachments"))
    lock = observe_lock(view)
    answers = [view.attached_volumes(NODE, EBS) for _ in range(1000)]
    # Answered from the cache: no request to the hanging API, and the lock, free, was taken at once every time.
    assert answers == [1] * 1000
    assert len(apiserver.requests_for("volumeattachments")) == requests
    assert lock.timeouts == [FAST.lookup_budget] * 1000
    apiserver.release("volumeattachments")


# --------------------------------------------------------------------------------------------------
# Driver versions from pods


@pytest.mark.parametrize(
    ("pods", "expected"),
    [
        pytest.param([("ebs-csi-node-new", "v1.36.1")], "v1.36.1", id="mid-rollout: two versions resolve to the lower"),
        pytest.param([("ebs-csi-node-rc", "v1.38.0-rc.1")], "v1.37.0", id="a higher pre-release does not win"),
        pytest.param([("ebs-csi-node-latest", "latest")], "v1.37.0", id="an unparsable tag is ignored"),
        pytest.param([("ebs-csi-node-short", "v1.36")], "v1.36", id="minor and patch are optional"),
    ],
)
def test_driver_version_from_image_tags(
    view: KubernetesClusterView, apiserver: FakeApiServer, pods: list[tuple[str, str]], expected: str
) -> None:
    for name, tag in pods:
        apiserver.create("pods", driver_pod(name, tag))
    wait_until(lambda: len(view._pod_watches[("kube-system", "app=ebs-csi-node")].store) == 1 + len(pods))
    assert view.driver_version(NODE, EBS) == expected


def test_driver_version_counts_daemonset_pods_on_the_node_whatever_their_status(
    view: KubernetesClusterView, apiserver: FakeApiServer
) -> None:
    apiserver.create("pods", driver_pod("ebs-csi-node-other", "v1.29.0", node=OTHER_NODE))
    unlabelled = driver_pod("unrelated-pod", "v1.0.0")
    unlabelled["metadata"]["labels"] = {"app": "something-else"}
    apiserver.create("pods", unlabelled)
    mirror = driver_pod("ebs-csi-node-mirror", "v9.9.9")  # what a node can create: a mirror pod owned by its Node
    mirror["metadata"]["annotations"] = {"kubernetes.io/config.mirror": "0123"}
    mirror["metadata"]["ownerReferences"] = [{"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": "u",
                                              "controller": True}]
    apiserver.create("pods", mirror)
    wait_until(lambda: view.driver_version(OTHER_NODE, EBS) == "v1.29.0")
    assert view.driver_version(NODE, EBS) == "v1.37.0"

    failed = cluster_object("pod-ebs-csi-node.json")
    failed["status"]["phase"] = "Failed"  # the node can write its pods' status: the version stays
    apiserver.apply("pods", failed)
    apiserver.create("pods", driver_pod("ebs-csi-node-pending", "v1.30.0", phase="Pending"))
    wait_until(lambda: view.driver_version(NODE, EBS) == "v1.30.0", what="a Pending DaemonSet pod counting")
    apiserver.delete("pods", "ebs-csi-node-pending", namespace="kube-system")
    wait_until(lambda: view.driver_version(NODE, EBS) == "v1.37.0", what="the deleted pod leaving the cache")

    # The node deletes its pods (NodeRestriction lets it): the last one's version stays until a replacement.
    apiserver.delete("pods", failed["metadata"]["name"], namespace="kube-system")
    wait_until(lambda: len(view._pod_watches[("kube-system", "app=ebs-csi-node")].store) == 1, what="deleted")
    assert view.driver_version(NODE, EBS) == "v1.37.0"
    apiserver.create("pods", driver_pod("ebs-csi-node-replacement", "v1.38.0"))
    wait_until(lambda: view.driver_version(NODE, EBS) == "v1.38.0", what="the replacement counting")


def test_driver_version_from_a_pod_label_and_hot_reloaded_sources(
    view: KubernetesClusterView, apiserver: FakeApiServer
) -> None:
    watch_before = view._pod_watches[("kube-system", "app=ebs-csi-node")]
    view.set_pod_sources([EBS_LABEL_SOURCE])
    assert view._pod_watches[("kube-system", "app=ebs-csi-node")] is watch_before  # same selector: kept
    assert view.driver_version(NODE, EBS) == "1.37.0"
    assert len(apiserver.requests_for("pods", watch=False)) == 1

    other = PodVersionSource(
        driver="efs.csi.aws.com",
        namespace="kube-system",
        match_labels=(("app", "efs-csi-node"),),
        container="efs-plugin",
    )
    efs = driver_pod("efs-csi-node-abcde", "v2.1.0", app="efs-csi-node")
    efs["spec"]["containers"][0]["name"] = "efs-plugin"
    efs["spec"]["containers"][0]["image"] = (
        "public.ecr.aws/efs-csi-driver/amazon/aws-efs-csi-driver:v2.1.0@sha256:" + "ab" * 32
    )
    apiserver.create("pods", efs)
    view.set_pod_sources([other])
    assert view.driver_version(NODE, EBS) is None  # no source for EBS any more
    wait_until(lambda: view.driver_version(NODE, "efs.csi.aws.com") == "v2.1.0", what="new pod watch")
    wait_until(lambda: not watch_before.alive, what="unused pod watch to stop")
    assert {r.query["labelSelector"] for r in apiserver.requests_for("pods")} == {
        "app=ebs-csi-node",
        "app=efs-csi-node",
    }


# --------------------------------------------------------------------------------------------------
# Attach errors and attached volumes


def test_attach_errors_are_classified_and_filtered_by_time(
    view: KubernetesClusterView, apiserver: FakeApiServer
) -> None:
    codes = {
        "csi-permission": 7,
        "csi-precondition": 9,
        "csi-deadline": 4,
        "csi-unavailable": 14,
        "csi-internal": 13,
        "csi-no-code": None,
    }
    for name, code in codes.items():
        apiserver.create(
            "volumeattachments", volume_attachment(name, attached=False, code=code, when="2026-11-29T22:00:00Z")
        )
    apiserver.create("volumeattachments", volume_attachment("csi-elsewhere", node=OTHER_NODE, attached=False, code=8))
    wait_until(lambda: len(view.attach_errors(NODE, EBS, LONG_AGO) or []) == 7, what="attach errors")
    errors = view.attach_errors(NODE, EBS, LONG_AGO)
    assert errors is not None
    by_name = {e.volume_attachment: e.error_class for e in errors}
    assert by_name == {
        EXHAUSTED_VA: AttachErrorClass.CAPACITY,
        "csi-permission": AttachErrorClass.PERMISSION,
        "csi-precondition": AttachErrorClass.PRECONDITION,
        "csi-deadline": AttachErrorClass.TRANSIENT,
        "csi-unavailable": AttachErrorClass.TRANSIENT,
        "csi-internal": AttachErrorClass.OTHER,
        "csi-no-code": AttachErrorClass.OTHER,
    }
    assert errors[0].volume_attachment == EXHAUSTED_VA  # oldest first
    recent = view.attach_errors(NODE, EBS, datetime(2026, 11, 29, 21, 50, tzinfo=UTC))
    assert recent is not None and EXHAUSTED_VA not in {e.volume_attachment for e in recent} and len(recent) == 6
    naive = view.attach_errors(NODE, EBS, datetime(2026, 11, 29, 21, 50))  # naive is UTC
    assert naive == recent
    assert view.attached_volumes(NODE, EBS) == 1
    wait_until(lambda: metric("csinode_guard_attach_errors", driver=EBS, **{"class": "transient"}) == 2)
    assert metric("csinode_guard_attach_errors", driver=EBS, **{"class": "capacity"}) == 2
    apiserver.delete("volumeattachments", "csi-deadline")
    wait_until(lambda: metric("csinode_guard_attach_errors", driver=EBS, **{"class": "transient"}) == 1)


def test_observe_headroom_records_allocatable_minus_attached_per_driver(view: KubernetesClusterView) -> None:
    def bucket(le: str) -> float:
        return metric("csinode_guard_attach_headroom_volumes_bucket", driver=EBS, le=le)

    before = {le: bucket(le) for le in ("-1.0", "16.0", "32.0")}
    assert view.observe_headroom(EBS, 25, NODE) == 24
    assert view.observe_headroom(EBS, 0, NODE) == -1
    assert view.observe_headroom(EBS, None, NODE) is None  # unbounded: nothing recorded
    assert view.observe_headroom(EBS, 25, OTHER_NODE) == 25  # nothing attached there
    assert bucket("-1.0") == before["-1.0"] + 1
    assert bucket("16.0") == before["16.0"] + 1
    assert bucket("32.0") == before["32.0"] + 3
    # One series per driver only: no node label anywhere.
    families = [m for m in REGISTRY.collect() if m.name.startswith("csinode_guard_")]
    assert all("node" not in sample.labels for family in families for sample in family.samples)


def test_cache_metrics_are_published(view: KubernetesClusterView) -> None:
    for kind in ("nodes", "csidrivers", "volumeattachments", "pods"):
        wait_until(lambda k=kind: metric("csinode_guard_cache_synced", kind=k) == 1, what=f"{kind} synced metric")
    assert metric("csinode_guard_cache_objects", kind="volumeattachments") == 2
    assert metric("csinode_guard_cache_objects", kind="pods") == 1
    assert view.status()["nodes"] == {"synced": True, "fresh": True, "staleness_seconds": 0.0, "objects": 1}


# --------------------------------------------------------------------------------------------------
# Configuration and lifecycle


def test_without_any_cluster_configuration_the_view_is_offline(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    caplog.set_level(logging.INFO, logger="webhook.providers")
    view, caches = build_cluster_view(None, [EBS_IMAGE_SOURCE], 120, 60)
    assert isinstance(view, UnknownClusterView) and isinstance(caches, OfflineCaches)
    assert caches.ready() and not caches.synced() and not caches.degraded()
    assert caches.readiness() == (True, "offline")
    assert caches.observe_headroom(EBS, 25, NODE) is None
    assert view.kubelet_version(NODE) is None
    assert len([r for r in caplog.records if r.name.startswith("webhook.providers")]) == 1
    caches.stop()


def test_kubeconfig_from_the_environment_builds_a_started_view(
    apiserver: FakeApiServer, kubeconfig: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", kubeconfig)
    view, caches = build_cluster_view(None, [EBS_IMAGE_SOURCE], max_staleness=7, cache_sync_timeout=9, settings=FAST)
    try:
        assert isinstance(view, KubernetesClusterView) and caches is view
        assert view._settings.max_staleness == 7 and view._settings.cache_sync_timeout == 9
        wait_until(caches.ready)
        assert view.driver_version(NODE, EBS) == "v1.37.0"
        assert {r.headers["user-agent"] for r in apiserver.requests_for("nodes")} == {"csinode-guard/0.1.0"}
        assert {r.headers["authorization"] for r in apiserver.requests_for("nodes")} == {"Bearer test-token"}
    finally:
        caches.stop()


def test_stop_ends_every_thread_promptly(make_view: Callable[..., KubernetesClusterView]) -> None:
    # Every wait a thread can be in lasts an hour or more (backoff, monitor) or minutes (a watch's read timeout):
    # threads that end at all inside stop()'s timeout were woken by it, not by a wait running out.
    view = make_view(monitor_interval=3600.0, backoff_initial=3600.0, backoff_max=3600.0)
    wait_until(view.synced)
    assert view._settings.watch_read_timeout >= 60 and view._settings.watch_timeout >= 60
    view.stop(timeout=TIMEOUT)
    assert not any(r.alive for r in view._reflectors())
    assert view._monitor is not None and not view._monitor.is_alive()


def test_an_undecodable_watch_line_restarts_the_watch_from_its_resource_version(
    view: KubernetesClusterView, apiserver: FakeApiServer
) -> None:
    before = metric("csinode_guard_watch_restarts_total", kind="nodes", reason="decode")
    wait_until(lambda: apiserver.active_watches("nodes") == 1)
    last_rv = view.nodes.resource_version
    apiserver.inject_line("nodes", b"{not json")
    wait_until(lambda: len(apiserver.requests_for("nodes", watch=True)) == 2, what="watch restart")
    assert apiserver.requests_for("nodes", watch=True)[1].query["resourceVersion"] == last_rv
    assert metric("csinode_guard_watch_restarts_total", kind="nodes", reason="decode") == before + 1
    assert view.kubelet_version(NODE) == "v1.35.0-eks-3cfe0ce"
