"""The audit's leader election (webhook.kube.leader) with a controllable clock, over the Lease API's wire format.

Issue 32, attack 7: anyone who may update Leases in the guard's namespace writes ``holderIdentity: mallory,
leaseDurationSeconds: 999999`` and never renews it. client-go's rule (wait the holder's own duration) would stop
every audit and repair for 11.6 days; the guard waits its *own* lease duration and takes the Lease back.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from tests.apiserver import FakeApiServer
from webhook.kube.kubeapi import KubeClient, load_api_client
from webhook.kube.leader import LeaderElector, LeaseSettings, lease_body

SETTINGS = LeaseSettings(namespace="csinode-guard", name="csinode-guard-audit", lease_duration=15.0,
                         renew_deadline=10.0, retry_period=2.0)
T0 = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)


class Clock:
    """A monotonic clock (seconds) and the wall clock that moves with it; only :meth:`advance` moves them."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> datetime:
        return T0 + timedelta(seconds=self.now - 1000.0)

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def client(apiserver: FakeApiServer, kubeconfig: str) -> Iterator[KubeClient]:
    with KubeClient(load_api_client(kubeconfig)) as kube:
        yield kube


def elector(client: KubeClient, clock: Clock, identity: str = "csinode-guard-7d9f-abcde/12") -> LeaderElector:
    return LeaderElector(client, identity, SETTINGS, clock=clock.monotonic, wall_clock=clock.wall)


def lease(apiserver: FakeApiServer) -> dict[str, Any]:
    found = apiserver.get("leases", SETTINGS.name, SETTINGS.namespace)
    assert found is not None
    return found


def write_foreign_lease(apiserver: FakeApiServer, holder: str, duration: int) -> None:
    """What a user with ``update`` on leases writes: a holder and a duration of their choosing."""
    body = lease_body(SETTINGS, holder, T0)
    body["spec"]["leaseDurationSeconds"] = duration
    if apiserver.get("leases", SETTINGS.name, SETTINGS.namespace) is None:
        apiserver.create("leases", body, SETTINGS.namespace)
    else:
        current = lease(apiserver)
        apiserver.update("leases", {**current, "spec": body["spec"]}, SETTINGS.namespace)


def test_attack_7_a_stale_foreign_holder_is_replaced_at_the_guards_own_lease_duration(
    apiserver: FakeApiServer, client: KubeClient
) -> None:
    clock = Clock()
    write_foreign_lease(apiserver, "mallory", 999999)
    candidate = elector(client, clock)

    assert candidate.try_acquire_or_renew() is False  # first sight: the record starts its clock
    clock.advance(SETTINGS.lease_duration - 0.5)
    assert candidate.try_acquire_or_renew() is False  # not yet 15 s unrenewed
    assert candidate.unrenewed_seconds() == SETTINGS.lease_duration - 0.5
    clock.advance(0.5)
    assert candidate.try_acquire_or_renew() is True  # 15 s, not 999999 s
    spec = lease(apiserver)["spec"]
    assert spec["holderIdentity"] == candidate.identity
    assert spec["leaseDurationSeconds"] == 15
    assert spec["leaseTransitions"] == 1


def test_a_foreign_holder_that_keeps_renewing_keeps_the_lease_and_the_gauge_stays_low(
    apiserver: FakeApiServer, client: KubeClient
) -> None:
    """What the guard cannot prevent in code (RBAC does: deploy/ grants update on that Lease to the guard alone):
    a holder that renews. The alert CSINodeGuardAuditLeaderless fires on csinode_guard_leader instead."""
    clock = Clock()
    candidate = elector(client, clock)
    write_foreign_lease(apiserver, "mallory", 999999)
    for _ in range(20):
        assert candidate.try_acquire_or_renew() is False
        clock.advance(SETTINGS.retry_period)
        write_foreign_lease(apiserver, "mallory", 999999)  # a renewal: the record changes
    assert candidate.unrenewed_seconds() < SETTINGS.retry_period + 0.01
    assert lease(apiserver)["spec"]["holderIdentity"] == "mallory"


def test_a_live_replica_is_not_displaced_and_a_dead_one_is_replaced_after_the_lease_duration(
    apiserver: FakeApiServer, client: KubeClient
) -> None:
    clock = Clock()
    first, second = elector(client, clock, "replica-a/1"), elector(client, clock, "replica-b/1")
    assert first.try_acquire_or_renew() is True  # no Lease yet: created
    for _ in range(10):
        clock.advance(SETTINGS.retry_period)
        assert first.try_acquire_or_renew() is True
        assert second.try_acquire_or_renew() is False
    # replica-a dies: no renewal from now on
    clock.advance(SETTINGS.lease_duration - 0.1)
    assert second.try_acquire_or_renew() is False
    clock.advance(0.1)
    assert second.try_acquire_or_renew() is True
    assert lease(apiserver)["spec"]["holderIdentity"] == "replica-b/1"


@pytest.mark.parametrize(("written", "waited"), [(1, 1.0), (5, 5.0), (15, 15.0), (999999, 15.0), (0, 15.0),
                                                  ("x", 15.0), (None, 15.0)])
def test_the_duration_waited_is_the_written_one_capped_at_the_own(client: KubeClient, written: Any,
                                                                  waited: float) -> None:
    """A shorter duration is honoured (a replica that releases the Lease writes 1 s); a longer one, or none that
    reads as a positive number, is the guard's own."""
    assert elector(client, Clock()).effective_duration(written) == waited


def test_a_released_lease_is_taken_at_once(apiserver: FakeApiServer, client: KubeClient) -> None:
    clock = Clock()
    first, second = elector(client, clock, "replica-a/1"), elector(client, clock, "replica-b/1")
    assert first.try_acquire_or_renew() is True
    first._leading = True  # what the campaign thread records after a successful round
    first._release()
    assert second.try_acquire_or_renew() is True
