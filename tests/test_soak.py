"""The soak benchmark's own arithmetic: its schedule, the apiserver counters it reads, the RSS slope, the tally of
the guard's audit records (``benchmarks/soak.py``; the soak itself runs minutes against a real control plane)."""

from __future__ import annotations

import os

from benchmarks.soak import (
    HIGH,
    INITIAL,
    LOW,
    delta,
    group_rss_mb,
    mutate_tally,
    schedule,
    slope_per_10min,
    write_counters,
)

# The lines kube-apiserver v1.36 writes for CSINodes (copied from its /metrics), with neighbours that must not count.
METRICS = """\
# HELP apiserver_request_total [STABLE] Counter of apiserver requests
apiserver_request_total{code="200",component="apiserver",dry_run="",group="storage.k8s.io",resource="csinodes",\
scope="resource",subresource="",system_client="",verb="GET",version="v1"} 7
apiserver_request_total{code="200",component="apiserver",dry_run="",group="storage.k8s.io",resource="csinodes",\
scope="resource",subresource="",system_client="",verb="PUT",version="v1"} 2
apiserver_request_total{code="200",component="apiserver",dry_run="",group="",resource="nodes",\
scope="resource",subresource="status",system_client="",verb="PATCH",version="v1"} 5
etcd_requests_total{group="storage.k8s.io",operation="update",resource="csinodes"} 2
etcd_requests_total{group="storage.k8s.io",operation="get",resource="csinodes"} 10
etcd_requests_total{group="",operation="update",resource="nodes"} 9
etcd_request_duration_seconds_count{group="storage.k8s.io",operation="update",resource="csinodes"} 2
"""


def test_write_counters_reads_csinode_puts_and_etcd_updates_only() -> None:
    assert write_counters(METRICS) == {"GET 200": 7, "PUT 200": 2, "etcd update": 2, "etcd get": 10}


def test_delta_keeps_what_moved() -> None:
    before = write_counters(METRICS)
    after = dict(before, **{"PUT 200": 5.0, "etcd update": 3.0})
    assert delta(before, after) == {"PUT 200": 3, "etcd update": 1}


def test_schedule_is_seeded_in_bounds_and_changes_every_time() -> None:
    changes = schedule(nodes=50, seconds=600, per_minute=6, seed=1)
    assert changes == schedule(nodes=50, seconds=600, per_minute=6, seed=1)
    assert changes != schedule(nodes=50, seconds=600, per_minute=6, seed=2)
    assert len(changes) == 60
    assert [c.at for c in changes] == sorted(c.at for c in changes)
    assert all(5 <= c.at <= 595 and LOW <= c.value <= HIGH and 0 <= c.node < 50 for c in changes)
    last = [INITIAL] * 50
    ups = downs = 0
    for c in changes:
        assert c.value != last[c.node]
        ups, downs = ups + (c.value > last[c.node]), downs + (c.value < last[c.node])
        last[c.node] = c.value
    assert ups and downs


def test_slope_in_mb_per_10_minutes() -> None:
    assert slope_per_10min([(0, 100.0), (300, 101.0), (600, 102.0)]) == 2.0
    assert slope_per_10min([(0, 100.0), (600, 100.0)]) == 0.0
    assert slope_per_10min([(0, 100.0)]) == 0.0


def test_group_rss_counts_this_process_group() -> None:
    rss = group_rss_mb(os.getpgrp())
    with open(f"/proc/{os.getpid()}/status") as f:
        own = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
    assert rss >= own > 1


def test_mutate_tally_sorts_records_by_what_happened_to_the_count() -> None:
    def record(old: int | None, new: int | None, final: int | None, **extra: object) -> dict[str, object]:
        return {"endpoint": "mutate", "node": "n1", "change": "increase", "allowed": True, "old": old, "new": new,
                "final": final, **extra}

    records = [
        record(20, 19, 19),
        record(20, 22, 20),
        record(25, 30, 27),
        record(20, 22, 20, endpoint="validate"),
        record(20, 22, 20, node="other"),
        record(20, 22, 20, dryRun=True),
        record(20, 22, 20, allowed=False),
        {"endpoint": "mutate", "node": "n1", "change": None, "allowed": True},
    ]
    assert mutate_tally(records, {"n1"}) == {
        "admitted": 1, "clamped-to-stored": 1, "clamped-other": 1, "refused": 1, "unchanged": 1,
    }
