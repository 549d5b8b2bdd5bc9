"""change-rate: an increase of one entry sooner than max(minInterval, the driver's update period)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from kube import EBS, KUBELET, NODE, NODE_GROUPS

from webhook.admission.csinode import CountChange
from webhook.admission.policy import EnforcementAction, Policy, parse_policy
from webhook.admission.rules import change_rate
from webhook.admission.rules.base import BudgetAnswer, RuleContext, Violation, Writer
from webhook.admission.state import Approval, EntryState

T0 = datetime(2026, 11, 30, 2, 0, tzinfo=UTC)
PROCEED = "kubelet retries at its next update period; if the driver flaps, fix its NodeGetInfo"


def make_policy(**rate: Any) -> Policy:
    rules = {"change-rate": {"enforcementAction": "deny", "minInterval": "60s", **rate}}
    doc = {"apiVersion": "csinode-guard.io/v1alpha1", "kind": "GuardPolicy", "spec": {"rules": rules}}
    return parse_policy(doc, "test.yaml")


POLICY = make_policy()


def context(
    old: int | None = 25,
    new: int | None = 26,
    *,
    ago: float | None = 20,
    period: float | None = None,
    policy: Policy = POLICY,
    approvals: tuple[Approval, ...] = (),
) -> RuleContext:
    """A change at T0 of an entry last changed ``ago`` seconds earlier (None: no recorded change)."""
    entry = None if ago is None else EntryState(count=old, changed_at=T0 - timedelta(seconds=ago))
    return RuleContext(
        change=CountChange(node=NODE, driver=EBS, old=old, new=new, position=1),
        policy=policy,
        driver_policy=policy.for_driver(EBS),
        writer=Writer(KUBELET, tuple(NODE_GROUPS), is_node_kubelet=True, is_listed_writer=False),
        entry=entry,
        approvals=approvals,
        driver_version=None,
        node_labels=None,
        attach_errors=None,
        update_period=period,
        now=T0,
    )


def test_an_increase_sooner_than_min_interval_is_a_violation_clamped_to_the_old_count() -> None:
    assert change_rate.check(context(25, 26, ago=20)) == [
        Violation(
            rule="change-rate",
            action=EnforcementAction.DENY,
            why="20s after the last accepted change; the minimum is 1m",
            proceed=PROCEED,
            clamp_to=25,
        )
    ]


@pytest.mark.parametrize(
    ("ago", "violates"),
    [
        pytest.param(0, True, id="right after the last change"),
        pytest.param(59.9, True, id="a moment before min interval"),
        pytest.param(60, False, id="exactly min interval later"),
        pytest.param(3600, False, id="much later"),
    ],
)
def test_min_interval_bounds_increases(ago: float, violates: bool) -> None:
    assert bool(change_rate.check(context(ago=ago))) is violates


@pytest.mark.parametrize(
    ("period", "ago", "violates", "minimum"),
    [
        pytest.param(300, 120, True, "5m", id="a longer CSIDriver update period wins over min interval"),
        pytest.param(300, 300, False, "5m", id="an increase one update period later passes"),
        pytest.param(10, 30, True, "1m", id="a shorter update period does not shorten min interval"),
        pytest.param(None, 30, True, "1m", id="an unknown update period leaves min interval"),
    ],
)
def test_the_interval_is_the_larger_of_min_interval_and_the_update_period(
    period: float | None, ago: float, violates: bool, minimum: str
) -> None:
    ctx = context(ago=ago, period=period)
    found = change_rate.check(ctx)
    assert bool(found) is violates
    assert change_rate.min_interval(ctx) == max(60.0, period or 0.0)
    if found:
        assert found[0].why.endswith(f"the minimum is {minimum}")


@pytest.mark.parametrize(
    ("old", "new", "ago"),
    [
        pytest.param(25, 23, 1, id="a decrease right after a change"),
        pytest.param(25, 0, 1, id="a drop to 0 right after a change"),
        pytest.param(None, 25, 1, id="unbounded to bounded right after a change"),
        pytest.param(25, 26, None, id="an increase of an entry without a recorded change"),
    ],
)
def test_decreases_and_entries_judged_as_new_are_exempt(old: int | None, new: int | None, ago: float | None) -> None:
    assert change_rate.check(context(old, new, ago=ago)) == []


def test_bounded_to_unbounded_counts_as_an_increase() -> None:
    assert [v.clamp_to for v in change_rate.check(context(25, None, ago=5))] == [25]


def test_a_justified_increase_is_not_rate_limited() -> None:
    justified = Approval(
        driver=EBS,
        reason="restore after maintenance",
        min_count=26,
        max_count=26,
        expires=T0 + timedelta(hours=1),
        ticket="OPS-3",
        approved_by="alice",
        approved_at=T0,
    )
    assert change_rate.check(context(25, 26, ago=5, approvals=(justified,))) == []


def test_a_change_recorded_in_the_future_counts_as_just_now() -> None:
    (found,) = change_rate.check(context(ago=-30))
    assert found.why == "0.0s after the last accepted change; the minimum is 1m"


@pytest.mark.parametrize(
    ("rate", "action", "minimum"),
    [
        pytest.param({"minInterval": "15m"}, EnforcementAction.DENY, "15m", id="a longer min interval"),
        pytest.param({"enforcementAction": "warn"}, EnforcementAction.WARN, "1m", id="a warn action"),
        pytest.param({"enforcementAction": "clamp"}, EnforcementAction.CLAMP, "1m", id="a clamp action"),
        pytest.param({"minInterval": 90}, EnforcementAction.DENY, "1m30s", id="min interval in plain seconds"),
    ],
)
def test_the_policy_sets_action_and_min_interval(rate: dict[str, Any], action: EnforcementAction, minimum: str) -> None:
    (found,) = change_rate.check(context(ago=30, policy=make_policy(**rate)))
    assert found.action is action
    assert found.why == f"30s after the last accepted change; the minimum is {minimum}"


BUDGET_PROCEED = "kubelet retries at its next update period; many nodes raising counts at once is worth a look"


@pytest.mark.parametrize(
    ("old", "new", "answer", "violates"),
    [
        pytest.param(25, 26, BudgetAnswer(0.5, 4, room=False), True, id="an increase when the budget has no room"),
        pytest.param(25, None, BudgetAnswer(0.5, 4, room=False), True, id="unbounded when the budget has no room"),
        pytest.param(25, 26, BudgetAnswer(0.5, 4, room=True), False, id="an increase the budget had room for"),
        pytest.param(25, 26, None, False, id="an increase before the budget was asked"),
        pytest.param(25, 24, BudgetAnswer(0.5, 4, room=False), False, id="a decrease"),
    ],
)
def test_the_cluster_budget_is_an_input_of_the_rule(
    old: int, new: int | None, answer: BudgetAnswer | None, violates: bool
) -> None:
    ctx = context(old, new, ago=3600)._replace(cluster_budget=answer)
    expected = [Violation("change-rate", EnforcementAction.DENY, "the cluster-wide increase budget (0.5/s, burst 4, "
                          "1/node) is used up", BUDGET_PROCEED, clamp_to=old)]
    assert change_rate.check_budget(ctx) == (expected if violates else [])
    assert change_rate.check(ctx) == []  # the entry's own pace is judged apart, whatever the budget says


def test_a_registration_takes_nothing_from_the_budget_and_is_never_judged_by_it() -> None:
    ctx = context(None, 26, ago=None)._replace(cluster_budget=BudgetAnswer(0.5, 4, room=False))
    ctx = ctx._replace(change=ctx.change._replace(registration=True))
    assert change_rate.check_budget(ctx) == []
