"""writer-identity: only the node's own kubelet, or principals the policy names, change counts."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from kube import EBS, KUBELET, NODE, NODE_GROUPS

from webhook.admission.csinode import CountChange
from webhook.admission.policy import EnforcementAction, Policy, parse_policy
from webhook.admission.rules import writer_identity
from webhook.admission.rules.base import RuleContext, Violation, Writer
from webhook.admission.state import Approval

T0 = datetime(2026, 11, 30, 2, 0, tzinfo=UTC)
PROCEED = (
    "let the node's kubelet report the count, add the principal to spec.writers, "
    "or have an approver set a csinode-guard.io/justification"
)


def make_policy(**spec: Any) -> Policy:
    return parse_policy({"apiVersion": "csinode-guard.io/v1alpha1", "kind": "GuardPolicy", "spec": spec}, "test.yaml")


DEFAULT = make_policy()
LISTED = make_policy(
    writers={
        "users": ["capacity-operator"],
        "groups": ["storage-admins"],
        "serviceAccounts": ["kube-system/csi-limits-controller"],
    }
)


def approval(count_range: tuple[int, int] = (0, 40), *, driver: str = EBS, expires_in: float = 3600) -> Approval:
    return Approval(
        driver=driver,
        reason="replaced ENI configuration",
        min_count=count_range[0],
        max_count=count_range[1],
        expires=T0 + timedelta(seconds=expires_in),
        ticket="OPS-1",
        approved_by="alice",
        approved_at=T0 - timedelta(minutes=5),
    )


def context(
    old: int | None = 25,
    new: int | None = 26,
    *,
    user: str = KUBELET,
    groups: tuple[str, ...] = tuple(NODE_GROUPS),
    policy: Policy = DEFAULT,
    approvals: tuple[Approval, ...] = (),
) -> RuleContext:
    writer = Writer(
        username=user,
        groups=groups,
        is_node_kubelet=user == f"system:node:{NODE}" and "system:nodes" in groups,
        is_listed_writer=policy.writers.contains(user, groups),
    )
    return RuleContext(
        change=CountChange(node=NODE, driver=EBS, old=old, new=new, position=1),
        policy=policy,
        driver_policy=policy.for_driver(EBS),
        writer=writer,
        entry=None,
        approvals=approvals,
        driver_version=None,
        node_labels=None,
        attach_errors=None,
        update_period=None,
        now=T0,
    )


@pytest.mark.parametrize(
    ("old", "new"),
    [
        pytest.param(25, 26, id="an increase"),
        pytest.param(25, 23, id="a decrease"),
        pytest.param(25, None, id="bounded to unbounded"),
        pytest.param(None, 25, id="unbounded to bounded"),
    ],
)
def test_the_nodes_own_kubelet_may_change_counts(old: int | None, new: int | None) -> None:
    assert writer_identity.check(context(old, new)) == []


@pytest.mark.parametrize(
    ("user", "groups"),
    [
        pytest.param("capacity-operator", ("system:authenticated",), id="a listed user"),
        pytest.param("bob", ("storage-admins", "system:authenticated"), id="a member of a listed group"),
        pytest.param(
            "system:serviceaccount:kube-system:csi-limits-controller",
            ("system:serviceaccounts", "system:serviceaccounts:kube-system"),
            id="a listed service account",
        ),
    ],
)
def test_principals_the_policy_lists_may_change_counts(user: str, groups: tuple[str, ...]) -> None:
    assert writer_identity.check(context(user=user, groups=groups, policy=LISTED)) == []


@pytest.mark.parametrize(
    ("user", "groups", "why"),
    [
        pytest.param(
            "system:node:ip-10-0-9-9.ec2.internal",
            tuple(NODE_GROUPS),
            "written by another node's kubelet (system:node:ip-10-0-9-9.ec2.internal)",
            id="another node's kubelet",
        ),
        pytest.param(
            "alice",
            ("system:authenticated",),
            "written by alice, which is not the node's kubelet nor a writer the policy lists",
            id="a user the policy does not list",
        ),
        pytest.param(
            "system:serviceaccount:kube-system:other-controller",
            ("system:serviceaccounts",),
            "written by system:serviceaccount:kube-system:other-controller, which is not the node's kubelet nor a "
            "writer the policy lists",
            id="a service account the policy does not list",
        ),
        pytest.param(
            "",
            (),
            "written by (anonymous), which is not the node's kubelet nor a writer the policy lists",
            id="an anonymous writer",
        ),
        pytest.param(
            KUBELET,
            ("system:authenticated",),
            f"written as {KUBELET} but without the group system:nodes, so not as the node's kubelet",
            id="the node's name without the system:nodes group",
        ),
    ],
)
def test_other_writers_are_a_violation(user: str, groups: tuple[str, ...], why: str) -> None:
    found = writer_identity.check(context(user=user, groups=groups, policy=LISTED))

    assert found == [
        # clamp_to: the count a denial keeps, which is what a deny does where writes are never refused.
        Violation(rule="writer-identity", action=EnforcementAction.DENY, why=why, proceed=PROCEED, clamp_to=25)
    ]


def test_a_decrease_by_another_writer_is_a_violation_too() -> None:
    found = writer_identity.check(context(25, 10, user="alice", groups=("system:authenticated",)))
    assert [v.rule for v in found] == ["writer-identity"]
    assert found[0].action is EnforcementAction.DENY


def test_a_violation_keeps_the_old_count_and_never_freezes() -> None:
    (found,) = writer_identity.check(context(user="alice"))
    assert found.clamp_to == 25
    assert found.freeze is False


def test_a_decrease_by_another_writer_has_nothing_to_clamp_to() -> None:
    (found,) = writer_identity.check(context(25, 10, user="alice"))
    assert found.clamp_to is None


@pytest.mark.parametrize(
    "action",
    [pytest.param(a, id=f"enforcement action {a.value}") for a in (EnforcementAction.WARN, EnforcementAction.DRYRUN)],
)
def test_the_violation_carries_the_configured_enforcement_action(action: EnforcementAction) -> None:
    policy = make_policy(rules={"writer-identity": {"enforcementAction": action.value}})
    (found,) = writer_identity.check(context(user="alice", policy=policy))
    assert found.action is action


def test_a_driver_override_sets_the_enforcement_action_for_that_driver_only() -> None:
    policy = make_policy(drivers={EBS: {"rules": {"writer-identity": {"enforcementAction": "warn"}}}})
    (found,) = writer_identity.check(context(user="alice", policy=policy))
    assert found.action is EnforcementAction.WARN
    assert policy.for_driver("other.csi.example.com").rules.identity_action is EnforcementAction.DENY


def test_a_recorded_approval_covering_the_new_count_justifies_another_writer() -> None:
    assert writer_identity.check(context(25, 30, user="alice", approvals=(approval((30, 30)),))) == []


@pytest.mark.parametrize(
    "recorded",
    [
        pytest.param(approval((0, 29)), id="an approval whose range stops below the new count"),
        pytest.param(approval((31, 40)), id="an approval whose range starts above the new count"),
        pytest.param(approval(driver="pd.csi.storage.gke.io"), id="an approval for another driver"),
        pytest.param(approval(expires_in=0), id="an approval that expires right now"),
        pytest.param(approval(expires_in=-60), id="an approval that expired"),
    ],
)
def test_an_approval_that_does_not_cover_the_change_does_not_justify(recorded: Approval) -> None:
    assert [v.rule for v in writer_identity.check(context(25, 30, user="alice", approvals=(recorded,)))] == [
        "writer-identity"
    ]


def test_no_approval_justifies_an_unbounded_count() -> None:
    found = writer_identity.check(context(25, None, user="alice", approvals=(approval((0, 2147483647)),)))
    assert [v.rule for v in found] == ["writer-identity"]
