"""writer-version: counts from outdated or rolled-back driver versions."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from kube import EBS, KUBELET, NODE, NODE_GROUPS

from webhook.admission.csinode import CountChange
from webhook.admission.policy import EnforcementAction, Policy, parse_policy
from webhook.admission.rules import writer_version
from webhook.admission.rules.base import RuleContext, Violation, Writer
from webhook.admission.state import Approval, EntryState

T0 = datetime(2026, 11, 30, 2, 0, tzinfo=UTC)
DENY, WARN, DRYRUN = EnforcementAction.DENY, EnforcementAction.WARN, EnforcementAction.DRYRUN


def make_policy(*, min_version: str | None = "v1.30.0", **rules: dict[str, Any]) -> Policy:
    spec: dict[str, Any] = {"rules": {"writer-version": {"freezeFor": "6h", **rules.get("version", {})}}}
    if min_version is not None:
        spec["drivers"] = {EBS: {"minVersion": min_version}}
    return parse_policy({"apiVersion": "csinode-guard.io/v1alpha1", "kind": "GuardPolicy", "spec": spec}, "test.yaml")


POLICY = make_policy()


def entry(version: str | None) -> EntryState:
    return EntryState(count=25, changed_at=T0 - timedelta(hours=1), writer_version=version)


JUSTIFIED = Approval(
    driver=EBS,
    reason="driver v1.37 breaks attach on this AMI",
    min_count=0,
    max_count=40,
    expires=T0 + timedelta(hours=1),
    ticket="OPS-9",
    approved_by="alice",
    approved_at=T0 - timedelta(minutes=1),
)


def context(
    old: int | None = 25,
    new: int | None = 26,
    *,
    version: str | None = "v1.37.0",
    recorded: str | None = None,
    policy: Policy = POLICY,
    approvals: tuple[Approval, ...] = (),
) -> RuleContext:
    return RuleContext(
        change=CountChange(node=NODE, driver=EBS, old=old, new=new, position=1),
        policy=policy,
        driver_policy=policy.for_driver(EBS),
        writer=Writer(KUBELET, tuple(NODE_GROUPS), is_node_kubelet=True, is_listed_writer=False),
        entry=entry(recorded) if recorded is not None else None,
        approvals=approvals,
        driver_version=version,
        node_labels=None,
        attach_errors=None,
        update_period=None,
        now=T0,
    )


def rules_and_actions(found: list[Violation]) -> list[tuple[str, EnforcementAction, bool]]:
    return [(v.rule, v.action, v.freeze) for v in found]


# -- minVersion ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "version",
    [
        pytest.param("v1.30.0", id="exactly minVersion"),
        pytest.param("v1.37.0", id="newer than minVersion"),
        pytest.param("1.30", id="minVersion written differently"),
        pytest.param("v1.30.1-eksbuild.1", id="a vendor build of a newer patch"),
    ],
)
def test_a_version_at_or_above_min_version_passes(version: str) -> None:
    assert writer_version.check(context(version=version)) == []


@pytest.mark.parametrize(
    ("old", "new", "action"),
    [
        pytest.param(25, 26, DENY, id="an increase keeps deny"),
        pytest.param(25, None, DENY, id="bounded to unbounded keeps deny"),
        pytest.param(25, 23, WARN, id="a decrease is at most a warning"),
        pytest.param(None, 25, WARN, id="unbounded to bounded is at most a warning"),
    ],
)
def test_a_version_below_min_version_is_a_violation(
    old: int | None, new: int | None, action: EnforcementAction
) -> None:
    found = writer_version.check(context(old, new, version="v1.29.4"))

    assert found == [
        Violation(
            rule="writer-version",
            action=action,
            why="driver version v1.29.4 is below minVersion v1.30.0",
            proceed="upgrade ebs.csi.aws.com on this node to v1.30.0 or later",
        )
    ]


def test_a_vendor_build_of_min_version_itself_meets_it() -> None:
    found = writer_version.check(context(version="v1.30.0-eks-1a2b3c"))
    assert found == []


def test_a_release_candidate_of_min_version_sorts_below_it() -> None:
    found = writer_version.check(context(version="v1.30.0-rc.1"))
    assert rules_and_actions(found) == [("writer-version", DENY, False)]


def test_a_dryrun_action_stays_dryrun_for_a_decrease() -> None:
    policy = make_policy(version={"enforcementAction": "dryrun"})
    found = writer_version.check(context(25, 23, version="v1.0.0", policy=policy))
    assert rules_and_actions(found) == [("writer-version", DRYRUN, False)]


def test_no_min_version_means_any_version_passes() -> None:
    assert writer_version.check(context(version="v0.0.1", policy=make_policy(min_version=None))) == []


# -- version rollback ----------------------------------------------------------------------------------------------


def test_a_version_older_than_the_last_accepted_change_is_a_rollback_that_freezes() -> None:
    found = writer_version.check(context(version="v1.31.0", recorded="v1.37.0"))

    assert found == [
        Violation(
            rule="writer-version",
            action=DENY,
            why="driver version rolled back v1.37.0 -> v1.31.0; increases are frozen for 6h",
            proceed="roll the driver forward, or have an approver justify the rollback",
            clamp_to=25,  # the last accepted count: what a deny keeps, and where a registration is clamped to
            freeze=True,
        )
    ]


@pytest.mark.parametrize(
    ("version", "recorded"),
    [
        pytest.param("v1.37.0", "v1.37.0", id="the same version"),
        pytest.param("v1.38.0", "v1.37.0", id="an upgrade"),
        pytest.param("v1.37.0", "v1.37.0-eks-1a2b3c", id="from a vendor build to its release"),
    ],
)
def test_the_same_or_a_newer_version_is_not_a_rollback(version: str, recorded: str) -> None:
    assert writer_version.check(context(version=version, recorded=recorded)) == []


def test_a_rollback_on_a_decrease_is_a_warning_that_still_freezes() -> None:
    found = writer_version.check(context(25, 20, version="v1.31.0", recorded="v1.37.0"))
    assert rules_and_actions(found) == [("writer-version", WARN, True)]


def test_a_justified_rollback_is_recorded_as_dryrun_and_still_freezes() -> None:
    found = writer_version.check(context(version="v1.31.0", recorded="v1.37.0", approvals=(JUSTIFIED,)))

    assert found == [
        Violation(
            rule="writer-version",
            action=DRYRUN,
            why="driver version rolled back v1.37.0 -> v1.31.0 (justified); increases are frozen for 6h",
            proceed="none needed",
            freeze=True,
        )
    ]


def test_the_freeze_duration_in_the_message_follows_the_policy() -> None:
    policy = make_policy(version={"freezeFor": "90m"})
    (found,) = writer_version.check(context(version="v1.31.0", recorded="v1.37.0", policy=policy))
    assert found.why.endswith("increases are frozen for 1h30m")


def test_below_min_version_and_rolled_back_gives_two_findings() -> None:
    found = writer_version.check(context(version="v1.29.0", recorded="v1.37.0"))
    assert rules_and_actions(found) == [("writer-version", DENY, False), ("writer-version", DENY, True)]


def test_an_entry_without_a_recorded_version_cannot_roll_back() -> None:
    assert writer_version.check(context(version="v1.31.0", recorded=None)) == []


# -- unknown versions ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "recorded"),
    [
        pytest.param(None, None, id="no version known"),
        pytest.param("latest", None, id="a version that does not parse"),
        pytest.param("v1.31.0", "main", id="a recorded version that does not parse"),
    ],
)
def test_an_unknown_version_passes_when_on_unknown_is_allow(version: str | None, recorded: str | None) -> None:
    assert writer_version.check(context(version=version, recorded=recorded)) == []


@pytest.mark.parametrize(
    ("on_unknown", "action"),
    [
        pytest.param("deny", DENY, id="on unknown deny denies"),
        pytest.param("warn", WARN, id="on unknown warn warns"),
        pytest.param("dryrun", DRYRUN, id="on unknown dryrun records"),
    ],
)
def test_an_unknown_version_follows_on_unknown_for_increases(on_unknown: str, action: EnforcementAction) -> None:
    policy = make_policy(version={"onUnknown": on_unknown})

    found = writer_version.check(context(version=None, policy=policy))

    assert found == [
        Violation(
            rule="writer-version",
            action=action,
            why="the driver's version on this node is unknown",
            proceed="publish the version (annotation source) or set writer-version.onUnknown: allow",
        )
    ]


def test_a_version_that_does_not_parse_follows_on_unknown_for_increases() -> None:
    policy = make_policy(version={"onUnknown": "deny"})
    (found,) = writer_version.check(context(version="latest", policy=policy))
    assert found.action is DENY
    assert found.why.startswith("the driver's version cannot be compared (not a semantic version: 'latest')")


@pytest.mark.parametrize(
    "version",
    [pytest.param(None, id="no version known"), pytest.param("latest", id="a version that does not parse")],
)
def test_an_unknown_version_never_blocks_a_decrease(version: str | None) -> None:
    policy = make_policy(version={"onUnknown": "deny"})
    assert writer_version.check(context(25, 20, version=version, policy=policy)) == []
