"""The audit's view of the brakes (webhook.serving.audit_loop.AuditClusterView): the leader restores the counts a
brake covers only once the brake's record has reached its own watch, the record admission reads, so that admission
judges the leader's repair write as the restore it is (and the replicas already hold the increases); and the pass
that restores them starts as soon as the record arrives (trigger ``brake``), not at the next interval."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest

from webhook.admission.cluster import Brake
from webhook.serving.audit_loop import AuditClusterView, awaiting_record, pass_trigger

EBS = "ebs.csi.aws.com"
T0 = datetime(2026, 12, 5, 12, 0, tzinfo=UTC)
BRAKE = Brake(driver=EBS, engaged_at=T0, window_start=T0 - timedelta(hours=1), last_failure_at=T0,
              evidence=(), raised_nodes=6)


class Brakes:
    """What a watch shows (the record as the worker's cache has it) or what the leader decided (its keeper)."""

    def __init__(self, brake: Brake | None) -> None:
        self.shown = brake

    def brake(self, driver: str) -> Brake | None:
        return self.shown if self.shown is not None and driver == self.shown.driver else None


def view(watch: Brake | None, keeper: Brake | None = None, *, leader: bool = True) -> AuditClusterView:
    """The audit's view over a watch showing ``watch``, with the leader's keeper deciding ``keeper`` (or, without
    ``leader``, no keeper: the view of a process that decides nothing)."""
    return AuditClusterView(cast(Any, Brakes(watch)), cast(Any, Brakes(keeper)) if leader else None)


def test_a_brake_the_leader_just_engaged_restores_nothing_until_its_watch_shows_the_record() -> None:
    assert view(watch=None, keeper=BRAKE).brake(EBS) is None
    assert view(watch=BRAKE, keeper=BRAKE).brake(EBS) == BRAKE


def test_an_earlier_engagement_in_the_watch_is_not_this_one() -> None:
    earlier = replace(BRAKE, engaged_at=T0 - timedelta(hours=2))
    assert view(watch=earlier, keeper=BRAKE).brake(EBS) is None


def test_a_brake_the_leader_released_restores_nothing_though_the_watch_still_shows_it() -> None:
    assert view(watch=BRAKE, keeper=None).brake(EBS) is None


def test_without_a_keeper_the_watch_decides_and_other_drivers_have_none() -> None:
    assert view(watch=BRAKE, leader=False).brake(EBS) == BRAKE
    assert view(watch=BRAKE, keeper=BRAKE).brake("other.csi.example.com") is None


def test_the_records_arrival_in_the_watch_starts_the_restoring_pass() -> None:
    """As the leader's loop composes them: the engaging pass leaves the driver awaiting its record; polls while the
    watch lags start nothing (``--audit-interval 0``); the poll after the record arrived starts ``brake``."""
    keeper = {EBS: BRAKE}
    awaiting = awaiting_record(keeper, view(watch=None, keeper=BRAKE))
    assert awaiting == {EBS}

    def poll(watch: Brake | None) -> str | None:
        arrived = bool(awaiting) and not awaiting <= awaiting_record(keeper, view(watch=watch, keeper=BRAKE))
        return pass_trigger(leading=True, relisted=False, reloaded=False, interval_due=False, record_arrived=arrived)

    assert poll(watch=None) is None
    assert poll(watch=BRAKE) == "brake"
    assert awaiting_record(keeper, view(watch=BRAKE, keeper=BRAKE)) == set()  # nothing left for the next poll


def test_a_released_brake_awaits_nothing() -> None:
    released = replace(BRAKE, released_at=T0 + timedelta(minutes=5), released_by="quiet-period")
    assert awaiting_record({EBS: released}, view(watch=None, keeper=None)) == set()


@pytest.mark.parametrize(
    ("flags", "trigger"),
    [
        pytest.param({"leading": False, "relisted": True, "record_arrived": True}, "start", id="start first"),
        pytest.param({"relisted": True, "reloaded": True}, "relist", id="relist before reload"),
        pytest.param({"reloaded": True, "interval_due": True}, "policy-reload", id="reload before interval"),
        pytest.param({"interval_due": True, "record_arrived": True}, "interval", id="interval restores as well"),
        pytest.param({"record_arrived": True}, "brake", id="the record arrived"),
        pytest.param({}, None, id="nothing to do"),
    ],
)
def test_one_pass_per_poll_named_by_the_first_trigger_that_holds(flags: dict[str, bool], trigger: str | None) -> None:
    given = {"leading": True, "relisted": False, "reloaded": False, "interval_due": False, "record_arrived": False}
    assert pass_trigger(**{**given, **flags}) == trigger
