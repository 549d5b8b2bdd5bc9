"""count-ceiling: unbounded after bounded, int32 max, above the ceiling, steps above maxStepUp."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from kube import EBS, KUBELET, NODE, NODE_GROUPS

from webhook.admission.csinode import INT32_MAX, CountChange
from webhook.admission.policy import EnforcementAction, Policy, parse_policy
from webhook.admission.rules import count_ceiling
from webhook.admission.rules.base import RuleContext, Violation, Writer
from webhook.admission.state import Approval

T0 = datetime(2026, 11, 30, 2, 0, tzinfo=UTC)
GCE = "pd.csi.storage.gke.io"
VSPHERE = "csi.vsphere.vmware.com"
OTHER = "nfs.csi.k8s.io"
INSTANCE_TYPE = "node.kubernetes.io/instance-type"
CLAMP, DENY, WARN = EnforcementAction.CLAMP, EnforcementAction.DENY, EnforcementAction.WARN
LIMIT_PROCEED = "fix the driver's volume limit (e.g. --volume-attach-limit), or raise the ceiling in the policy"
STEP_PROCEED = "let the count rise in smaller steps, or have an approver justify the jump"


def make_policy(**spec: Any) -> Policy:
    return parse_policy({"apiVersion": "csinode-guard.io/v1alpha1", "kind": "GuardPolicy", "spec": spec}, "test.yaml")


# The ceilings of policies/default.yaml without its driver profiles, so that these tests do not move with them.
POLICY = make_policy(
    defaults={"maxStepUp": 16},
    drivers={
        EBS: {"ceiling": {"max": 128, "nodeLabel": INSTANCE_TYPE, "unknown": 27}},
        GCE: {
            "ceiling": {
                "max": 127,
                "nodeLabel": INSTANCE_TYPE,
                "patterns": [{"match": "e2-micro", "ceiling": 15}, {"match": "e2-small", "ceiling": 15}],
            }
        },
        "disk.csi.azure.com": {"ceiling": {"max": 64, "nodeLabel": INSTANCE_TYPE, "unknown": 16}},
        VSPHERE: {"ceiling": {"max": 255}},
    },
)


def context(
    old: int | None,
    new: int | None,
    *,
    driver: str = EBS,
    labels: Mapping[str, str] | None = None,
    policy: Policy = POLICY,
    approvals: tuple[Approval, ...] = (),
) -> RuleContext:
    return RuleContext(
        change=CountChange(node=NODE, driver=driver, old=old, new=new, position=1),
        policy=policy,
        driver_policy=policy.for_driver(driver),
        writer=Writer(KUBELET, tuple(NODE_GROUPS), is_node_kubelet=True, is_listed_writer=False),
        entry=None,
        approvals=approvals,
        driver_version=None,
        node_labels=labels,
        attach_errors=None,
        update_period=None,
        now=T0,
    )


def summary(found: list[Violation]) -> list[tuple[EnforcementAction, int | None]]:
    return [(v.action, v.clamp_to) for v in found]


# -- ceilings ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("driver", "old", "new", "labels"),
    [
        pytest.param(EBS, 25, 27, None, id="EBS at the ceiling for an unknown node"),
        pytest.param(EBS, 20, 23, {INSTANCE_TYPE: "m5.large"}, id="EBS below the ceiling for an unlisted type"),
        pytest.param(GCE, 10, 15, {INSTANCE_TYPE: "e2-micro"}, id="GCE PD at the shared-core ceiling"),
        pytest.param(GCE, 120, 127, {INSTANCE_TYPE: "n2-standard-8"}, id="GCE PD at the driver ceiling"),
        pytest.param(VSPHERE, 250, 255, None, id="vSphere at its ceiling"),
        pytest.param(OTHER, 1000, 1016, None, id="a driver the policy does not name has no ceiling"),
    ],
)
def test_counts_within_the_ceiling_pass(driver: str, old: int, new: int, labels: Mapping[str, str] | None) -> None:
    assert count_ceiling.check(context(old, new, driver=driver, labels=labels)) == []


@pytest.mark.parametrize(
    ("driver", "new", "labels", "ceiling", "why"),
    [
        pytest.param(EBS, 28, None, 27, "ceiling for unknown node", id="EBS above the ceiling for an unknown node"),
        pytest.param(
            EBS,
            30,
            {INSTANCE_TYPE: "m5.large"},
            27,
            "ceiling for node.kubernetes.io/instance-type=m5.large not listed",
            id="EBS above the ceiling for an unlisted instance type",
        ),
        pytest.param(
            EBS,
            30,
            {"kubernetes.io/os": "linux"},
            27,
            "ceiling for node.kubernetes.io/instance-type=(unset) not listed",
            id="EBS above the ceiling for a node without the instance type label",
        ),
        pytest.param(
            GCE,
            20,
            {INSTANCE_TYPE: "e2-small"},
            15,
            "node.kubernetes.io/instance-type=e2-small matches e2-small",
            id="GCE PD above the shared-core ceiling",
        ),
        pytest.param(GCE, 128, None, 127, "driver ceiling", id="GCE PD above the driver ceiling"),
        pytest.param(
            "disk.csi.azure.com",
            17,
            None,
            16,
            "ceiling for unknown node",
            id="Azure Disk above the ceiling for an unknown VM size",
        ),
        pytest.param(VSPHERE, 256, None, 255, "driver ceiling", id="vSphere above its ceiling"),
    ],
)
def test_a_count_above_the_ceiling_is_clamped_to_the_ceiling(
    driver: str, new: int, labels: Mapping[str, str] | None, ceiling: int, why: str
) -> None:
    old = new - 3
    found = count_ceiling.check(context(old, new, driver=driver, labels=labels))

    assert found == [
        Violation(
            rule="count-ceiling",
            action=CLAMP,
            why=f"above the ceiling {ceiling} ({why})",
            proceed=LIMIT_PROCEED,
            clamp_to=ceiling,
        )
    ]


def test_a_ceiling_by_label_value_wins_over_patterns_and_the_unknown_fallback() -> None:
    policy = make_policy(
        drivers={
            EBS: {
                "ceiling": {
                    "max": 128,
                    "nodeLabel": INSTANCE_TYPE,
                    "unknown": 27,
                    "values": {"m7i.large": 31},
                    "patterns": [{"match": "m7i.*", "ceiling": 20}],
                }
            }
        }
    )
    labels = {INSTANCE_TYPE: "m7i.large"}

    assert count_ceiling.check(context(28, 31, labels=labels, policy=policy)) == []
    (found,) = count_ceiling.check(context(28, 32, labels=labels, policy=policy))
    assert (found.clamp_to, found.why) == (31, "above the ceiling 31 (node.kubernetes.io/instance-type=m7i.large)")
    (found,) = count_ceiling.check(context(10, 21, labels={INSTANCE_TYPE: "m7i.xlarge"}, policy=policy))
    assert (found.clamp_to, found.why) == (
        20,
        "above the ceiling 20 (node.kubernetes.io/instance-type=m7i.xlarge matches m7i.*)",
    )


@pytest.mark.parametrize(
    ("action", "old", "new", "expected"),
    [
        pytest.param("clamp", 200, 150, CLAMP, id="a clamp stays a clamp for a decrease: it lowers further"),
        pytest.param("deny", 200, 150, WARN, id="a deny becomes a warning for a decrease"),
        pytest.param("deny", None, 150, WARN, id="a deny becomes a warning for unbounded to bounded"),
        pytest.param("deny", 100, 150, DENY, id="a deny stays a deny for an increase"),
        pytest.param("warn", 100, 150, WARN, id="a warn stays a warn"),
    ],
)
def test_the_enforcement_action_is_softened_for_decreases(
    action: str, old: int | None, new: int, expected: EnforcementAction
) -> None:
    policy = make_policy(
        rules={"count-ceiling": {"enforcementAction": action}}, drivers={EBS: {"ceiling": {"max": 128}}}
    )
    (found,) = count_ceiling.check(context(old, new, policy=policy))
    assert (found.action, found.clamp_to) == (expected, 128)


# -- unbounded and int32 max -----------------------------------------------------------------------------------------


def test_bounded_to_unbounded_is_clamped_back_to_the_old_count() -> None:
    found = count_ceiling.check(context(25, None))

    assert found == [
        Violation(
            rule="count-ceiling",
            action=CLAMP,
            why="the count was removed (unbounded) after being bounded",
            proceed="fix the driver's NodeGetInfo max_volumes_per_node; the old count stays",
            clamp_to=25,
        )
    ]


@pytest.mark.parametrize(
    ("driver", "old", "clamp_to"),
    [
        pytest.param(EBS, 25, 25, id="a bounded entry goes back to its old count"),
        pytest.param(EBS, None, 27, id="an unbounded entry goes to the ceiling"),
        pytest.param(OTHER, None, None, id="an unbounded entry without a ceiling cannot be clamped"),
    ],
)
def test_int32_max_is_kubelets_overflow_cut_off_not_a_limit(driver: str, old: int | None, clamp_to: int | None) -> None:
    found = count_ceiling.check(context(old, INT32_MAX, driver=driver))

    assert len(found) == 1
    assert found[0].why == "2147483647 is kubelet's cut-off for an overflowing NodeGetInfo value"
    assert found[0].proceed == "fix the driver's NodeGetInfo max_volumes_per_node"
    assert found[0].clamp_to == clamp_to


def test_int32_max_is_reported_once_and_not_also_as_above_the_ceiling_or_a_big_step() -> None:
    assert [v.why for v in count_ceiling.check(context(25, INT32_MAX))] == [
        "2147483647 is kubelet's cut-off for an overflowing NodeGetInfo value"
    ]


def test_one_below_int32_max_is_judged_against_the_ceiling() -> None:
    assert summary(count_ceiling.check(context(100, INT32_MAX - 1, driver=OTHER))) == [(CLAMP, 116)]


# -- maxStepUp -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        pytest.param(5, 21, [], id="a step of exactly maxStepUp passes"),
        pytest.param(5, 22, [(CLAMP, 21)], id="a step one above maxStepUp is clamped to old plus the step"),
        pytest.param(0, 17, [(CLAMP, 16)], id="a step from 0 is limited too"),
        pytest.param(30, 10, [], id="a decrease is never a step up"),
        pytest.param(None, 25, [], id="unbounded to bounded is not a step up"),
    ],
)
def test_an_increase_larger_than_max_step_up_is_clamped(
    old: int | None, new: int, expected: list[tuple[EnforcementAction, int]]
) -> None:
    assert summary(count_ceiling.check(context(old, new, driver=OTHER))) == expected


def test_the_step_violation_explains_the_step() -> None:
    assert count_ceiling.check(context(5, 22, driver=OTHER)) == [
        Violation(
            rule="count-ceiling",
            action=CLAMP,
            why="an increase of 17 is larger than maxStepUp 16 (from 5)",
            proceed=STEP_PROCEED,
            clamp_to=21,
        )
    ]


def test_above_the_ceiling_and_a_big_step_are_two_findings() -> None:
    found = count_ceiling.check(context(5, 39))
    assert [(v.why.split(" (")[0], v.clamp_to) for v in found] == [
        ("above the ceiling 27", 27),
        ("an increase of 34 is larger than maxStepUp 16", 21),
    ]


def test_a_justification_covering_the_new_count_allows_a_big_step_but_not_above_the_ceiling() -> None:
    justified = Approval(
        driver=EBS,
        reason="new instance type",
        min_count=0,
        max_count=40,
        expires=T0 + timedelta(hours=1),
        ticket="OPS-2",
        approved_by="alice",
        approved_at=T0,
    )
    assert count_ceiling.check(context(2, 27, approvals=(justified,))) == []
    assert summary(count_ceiling.check(context(2, 39, approvals=(justified,)))) == [(CLAMP, 27)]


def test_max_step_up_null_in_a_driver_override_removes_the_step_limit() -> None:
    policy = make_policy(defaults={"maxStepUp": 4}, drivers={OTHER: {"maxStepUp": None}})
    assert count_ceiling.check(context(0, 1000, driver=OTHER, policy=policy)) == []
    assert summary(count_ceiling.check(context(0, 1000, driver=EBS, policy=policy))) == [(CLAMP, 4)]
