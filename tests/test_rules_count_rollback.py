"""count-rollback: increases that undo a recent correction, increases while frozen, drops to 0."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from kube import EBS, KUBELET, NODE, NODE_GROUPS

from webhook.admission.cluster import AttachError
from webhook.admission.csinode import CountChange
from webhook.admission.policy import EnforcementAction, Policy, parse_policy
from webhook.admission.rules import count_rollback
from webhook.admission.rules.base import RuleContext, Violation, Writer
from webhook.admission.state import Approval, Correction, EntryState

T0 = datetime(2026, 11, 30, 2, 0, tzinfo=UTC)
DENY, WARN, CLAMP = EnforcementAction.DENY, EnforcementAction.WARN, EnforcementAction.CLAMP


def make_policy(**rollback: Any) -> Policy:
    rules = {"count-rollback": {"enforcementAction": "deny", "window": "1h", "recoveryStep": 2, **rollback}}
    doc = {"apiVersion": "csinode-guard.io/v1alpha1", "kind": "GuardPolicy", "spec": {"rules": rules}}
    return parse_policy(doc, "test.yaml")


POLICY = make_policy()


def corrected(
    before: int | None = 25,
    after: int = 20,
    *,
    ago: float = 600,
    basis: str = "resource-exhausted",
    count: int | None = None,
) -> EntryState:
    """An entry corrected from ``before`` to ``after`` ``ago`` seconds before T0 (now at ``count``)."""
    at = T0 - timedelta(seconds=ago)
    return EntryState(
        count=after if count is None else count,
        changed_at=at,
        writer_version="v1.37.0",
        correction=Correction(at=at, before=before, after=after, basis=basis),
    )


def frozen(until: timedelta) -> EntryState:
    return EntryState(count=23, changed_at=T0 - timedelta(hours=1), writer_version="v1.30.0", frozen_until=T0 + until)


def approval(low: int, high: int) -> Approval:
    return Approval(
        driver=EBS,
        reason="node drained for hardware replacement",
        min_count=low,
        max_count=high,
        expires=T0 + timedelta(hours=2),
        ticket="OPS-7",
        approved_by="alice",
        approved_at=T0 - timedelta(minutes=1),
    )


def context(
    old: int | None,
    new: int | None,
    *,
    entry: EntryState | None = None,
    approvals: tuple[Approval, ...] = (),
    policy: Policy = POLICY,
    attach_errors: tuple[AttachError, ...] | None = (),
    now: datetime = T0,
) -> RuleContext:
    return RuleContext(
        change=CountChange(node=NODE, driver=EBS, old=old, new=new, position=1),
        policy=policy,
        driver_policy=policy.for_driver(EBS),
        writer=Writer(KUBELET, tuple(NODE_GROUPS), is_node_kubelet=True, is_listed_writer=False),
        entry=entry,
        approvals=approvals,
        driver_version="v1.37.0",
        node_labels=None,
        attach_errors=attach_errors,
        update_period=None,
        now=now,
    )


def summary(found: list[Violation]) -> list[tuple[EnforcementAction, int | None]]:
    return [(v.action, v.clamp_to) for v in found]


# -- drops to 0 ----------------------------------------------------------------------------------------------------


def test_a_drop_to_zero_without_justification_is_a_warning_by_default() -> None:
    found = count_rollback.check(context(25, 0))

    assert found == [
        Violation(
            rule="count-rollback",
            action=WARN,
            why="a drop to 0 stops every new attach on this node",
            proceed="have an approver set a csinode-guard.io/justification covering 0",
            clamp_to=25,
        )
    ]


@pytest.mark.parametrize(
    ("action", "expected"),
    [
        pytest.param("deny", DENY, id="drop to zero configured to deny"),
        pytest.param("clamp", CLAMP, id="drop to zero configured to clamp back to the old count"),
        pytest.param("dryrun", EnforcementAction.DRYRUN, id="drop to zero configured to dryrun"),
    ],
)
def test_a_drop_to_zero_has_its_own_enforcement_action(action: str, expected: EnforcementAction) -> None:
    policy = make_policy(dropToZero={"enforcementAction": action})
    assert summary(count_rollback.check(context(25, 0, policy=policy))) == [(expected, 25)]


def test_a_drop_to_zero_from_unbounded_cannot_be_clamped_back() -> None:
    assert summary(count_rollback.check(context(None, 0))) == [(WARN, None)]


def test_a_justified_drop_to_zero_passes() -> None:
    assert count_rollback.check(context(25, 0, approvals=(approval(0, 0),))) == []


def test_a_justification_that_does_not_cover_zero_does_not_justify_a_drop_to_zero() -> None:
    assert summary(count_rollback.check(context(25, 0, approvals=(approval(1, 10),)))) == [(WARN, 25)]


@pytest.mark.parametrize(
    ("old", "new"),
    [
        pytest.param(25, 1, id="a decrease to 1"),
        pytest.param(None, 20, id="unbounded to bounded"),
        pytest.param(25, 10, id="a large decrease"),
    ],
)
def test_other_decreases_pass(old: int | None, new: int) -> None:
    assert count_rollback.check(context(old, new, entry=frozen(timedelta(hours=1)))) == []


# -- frozen entries ------------------------------------------------------------------------------------------------


def test_any_increase_while_frozen_is_a_violation_clamped_to_the_old_count() -> None:
    found = count_rollback.check(context(23, 24, entry=frozen(timedelta(hours=1))))

    assert found == [
        Violation(
            rule="count-rollback",
            action=DENY,
            why="increases are frozen until 2026-11-30T03:00:00.000Z after a driver version rollback",
            proceed="wait for the freeze to end (rolling the driver forward does not lift it), or have an approver "
            "justify the increase",
            clamp_to=23,
        )
    ]


def test_bounded_to_unbounded_while_frozen_is_a_violation() -> None:
    assert summary(count_rollback.check(context(23, None, entry=frozen(timedelta(hours=1))))) == [(DENY, 23)]


@pytest.mark.parametrize(
    "until",
    [
        pytest.param(timedelta(0), id="a freeze that ends right now"),
        pytest.param(-timedelta(minutes=1), id="an ended freeze"),
    ],
)
def test_an_increase_after_the_freeze_passes(until: timedelta) -> None:
    assert count_rollback.check(context(23, 30, entry=frozen(until))) == []


def test_a_justified_increase_while_frozen_passes() -> None:
    assert count_rollback.check(context(23, 24, entry=frozen(timedelta(hours=1)), approvals=(approval(24, 24),))) == []


# -- recovery after a correction -----------------------------------------------------------------------------------


def test_an_increase_back_to_the_pre_correction_count_is_a_violation() -> None:
    found = count_rollback.check(context(20, 25, entry=corrected(25, 20)))

    assert found == [
        Violation(
            rule="count-rollback",
            action=DENY,
            why="back to 25 undoes the correction 25 -> 20 at 2026-11-30T01:50:00.000Z within 1h",
            proceed="have an approver justify the restore, or wait for the window to pass",
            clamp_to=22,
        )
    ]


@pytest.mark.parametrize(
    ("old", "new", "clamp_to"),
    [
        pytest.param(20, 30, 22, id="above the pre-correction count clamps to one recovery step"),
        pytest.param(23, 25, 24, id="one step that would reach the pre-correction count stops one below it"),
        pytest.param(24, 25, 24, id="one below the pre-correction count cannot rise further"),
        pytest.param(20, None, 22, id="bounded to unbounded undoes the correction too"),
    ],
)
def test_restoring_the_pre_correction_count_is_clamped_below_it(old: int, new: int | None, clamp_to: int) -> None:
    found = count_rollback.check(context(old, new, entry=corrected(25, 20, count=old)))
    assert summary(found) == [(DENY, clamp_to)]
    assert found[0].why.startswith(f"back to {new if new is not None else 'unbounded'} undoes the correction 25 -> 20")


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        pytest.param(20, 21, [], id="a rise of 1 passes"),
        pytest.param(20, 22, [], id="a rise of exactly recoveryStep passes"),
        pytest.param(20, 23, [(DENY, 22)], id="a rise above recoveryStep is clamped to one step"),
        pytest.param(10, 24, [(DENY, 12)], id="a large rise that stays below the pre-correction count"),
    ],
)
def test_recovery_within_the_window_rises_at_most_recovery_step_per_change(
    old: int, new: int, expected: list[tuple[EnforcementAction, int]]
) -> None:
    found = count_rollback.check(context(old, new, entry=corrected(25, 10, count=old)))
    assert summary(found) == expected


def test_the_recovery_violation_explains_the_step() -> None:
    (found,) = count_rollback.check(context(20, 23, entry=corrected(25, 20)))
    assert found.why == (
        "rises by 3 within 1h after the correction 25 -> 20 at 2026-11-30T01:50:00.000Z; recoveryStep is 2"
    )
    assert found.proceed == "let the count recover in smaller steps"


def test_after_a_correction_from_unbounded_any_increase_in_the_window_is_limited() -> None:
    found = count_rollback.check(context(20, 21, entry=corrected(None, 20)))
    assert summary(found) == [(DENY, 22)]
    assert found[0].why.startswith("back to 21 undoes the correction unbounded -> 20")


@pytest.mark.parametrize(
    ("ago", "violates"),
    [
        pytest.param(3599, True, id="one second before the window ends"),
        pytest.param(3600, False, id="when the window ends"),
        pytest.param(7200, False, id="long after the window"),
    ],
)
def test_the_window_bounds_the_recovery_limit(ago: float, violates: bool) -> None:
    found = count_rollback.check(context(20, 25, entry=corrected(25, 20, ago=ago)))
    assert bool(found) is violates


def test_the_window_follows_the_policy() -> None:
    policy = make_policy(window="15m")
    assert count_rollback.check(context(20, 25, entry=corrected(25, 20, ago=900), policy=policy)) == []
    assert count_rollback.check(context(20, 25, entry=corrected(25, 20, ago=899), policy=policy)) != []


def test_the_recovery_step_follows_the_policy() -> None:
    policy = make_policy(recoveryStep=5)
    assert count_rollback.check(context(10, 15, entry=corrected(25, 10), policy=policy)) == []
    assert summary(count_rollback.check(context(10, 16, entry=corrected(25, 10), policy=policy))) == [(DENY, 15)]


@pytest.mark.parametrize(
    "basis", [pytest.param("resource-exhausted", id="evidence"), pytest.param("justification", id="a justification")]
)
def test_a_justified_restore_passes_whatever_backed_the_correction(basis: str) -> None:
    entry = corrected(25, 20, basis=basis)
    assert count_rollback.check(context(20, 25, entry=entry, approvals=(approval(20, 25),))) == []


def test_an_entry_without_a_correction_or_freeze_passes_any_increase() -> None:
    entry = EntryState(count=20, changed_at=T0 - timedelta(minutes=5), writer_version="v1.37.0")
    assert count_rollback.check(context(20, 40, entry=entry)) == []


def test_an_entry_judged_as_new_passes_any_increase() -> None:
    assert count_rollback.check(context(20, 40, entry=None)) == []


def test_the_enforcement_action_follows_the_policy() -> None:
    policy = make_policy(enforcementAction="clamp")
    assert summary(count_rollback.check(context(20, 25, entry=corrected(25, 20), policy=policy))) == [(CLAMP, 22)]
    assert summary(count_rollback.check(context(23, 24, entry=frozen(timedelta(hours=1)), policy=policy))) == [
        (CLAMP, 23)
    ]


# -- recovery gated by attaches ------------------------------------------------------------------------------------


def failure(ago: float, code: int | None = 8, name: str = "csi-3f9a0c2b") -> AttachError:
    """An attach error stamped ``ago`` seconds before T0, as the external-attacher writes it."""
    return AttachError(code=code, time=T0 - timedelta(seconds=ago), volume_attachment=name)


def stepped(*, corrected_ago: float, stepped_ago: float, count: int = 22) -> EntryState:
    """An entry corrected 25 -> 20 ``corrected_ago`` seconds before T0, then raised to ``count`` by a recovery step
    ``stepped_ago`` seconds before T0."""
    at = T0 - timedelta(seconds=corrected_ago)
    return EntryState(
        count=count,
        changed_at=T0 - timedelta(seconds=stepped_ago),
        writer_version="v1.37.0",
        correction=Correction(at=at, before=25, after=20, basis="resource-exhausted"),
    )


def test_a_capacity_failure_since_the_correction_holds_the_step_at_the_stored_count() -> None:
    found = count_rollback.check(context(20, 22, entry=corrected(25, 20), attach_errors=(failure(120),)))

    assert found == [
        Violation(
            rule="count-rollback",
            action=DENY,
            why="attach failures with errorCode 8 since the last step (2026-11-30T01:50:00.000Z): recovery waits for "
            "attaches to succeed; newest at 2026-11-30T01:58:00.000Z on csi-3f9a0c2b, 1 in all; the window ends at "
            "2026-11-30T02:50:00.000Z",
            proceed="it passes once attaches succeed (no errorCode 8 after the last step), or with an approver's "
            "justification",
            clamp_to=20,
        )
    ]


@pytest.mark.parametrize(
    ("errors", "expected"),
    [
        pytest.param((), [], id="no attach error since the correction lets the step through"),
        pytest.param((failure(600),), [], id="the error stamped at the correction is the one it answered"),
        pytest.param((failure(900),), [], id="an error before the correction does not hold the step"),
        pytest.param((failure(599),), [(DENY, 20)], id="an error a second after the correction holds the step"),
        pytest.param((failure(60, code=9),), [], id="a precondition failure is not a capacity failure"),
        pytest.param((failure(60, code=None),), [], id="an error without a code is not a capacity failure"),
        pytest.param(
            (failure(60, code=4), failure(30, name="csi-2")), [(DENY, 20)], id="one capacity error among others"
        ),
    ],
)
def test_only_capacity_failures_after_the_last_step_hold_a_recovery_step(
    errors: tuple[AttachError, ...], expected: list[tuple[EnforcementAction, int]]
) -> None:
    found = count_rollback.check(context(20, 22, entry=corrected(25, 20), attach_errors=errors))
    assert summary(found) == expected


@pytest.mark.parametrize(
    ("error_ago", "held"),
    [
        pytest.param(1500, False, id="a failure between the correction and the last step was answered by it"),
        pytest.param(300, True, id="a failure after the last step holds the next one"),
    ],
)
def test_the_gate_counts_from_the_last_recovery_step(error_ago: float, held: bool) -> None:
    entry = stepped(corrected_ago=1800, stepped_ago=600)
    found = count_rollback.check(context(22, 24, entry=entry, attach_errors=(failure(error_ago),)))
    assert summary(found) == ([(DENY, 22)] if held else [])
    if held:
        assert "since the last step (2026-11-30T01:50:00.000Z)" in found[0].why


def test_a_step_is_judged_again_at_each_write_as_the_errors_change() -> None:
    """The same entry, one write while the attach fails and one after it succeeded (its error cleared)."""
    entry = corrected(25, 20, ago=600)
    while_failing = context(20, 22, entry=entry, attach_errors=(failure(60),))
    after_success = context(20, 22, entry=entry, attach_errors=(), now=T0 + timedelta(minutes=2))
    assert summary(count_rollback.check(while_failing)) == [(DENY, 20)]
    assert count_rollback.check(after_success) == []


def test_unknown_attach_errors_hold_the_step_and_say_so() -> None:
    (found,) = count_rollback.check(context(20, 22, entry=corrected(25, 20), attach_errors=None))
    assert (found.action, found.clamp_to) == (DENY, 20)
    assert found.why == (
        "the VolumeAttachments are unknown to the guard, so attaches since the last step (2026-11-30T01:50:00.000Z) "
        "cannot earn a recovery step; the window ends at 2026-11-30T02:50:00.000Z"
    )
    assert found.proceed == (
        "judged again at the next write once the guard sees them, or with an approver's justification"
    )


def test_a_held_step_back_towards_the_pre_correction_count_is_held_at_the_stored_count() -> None:
    found = count_rollback.check(context(20, 25, entry=corrected(25, 20), attach_errors=(failure(60),)))
    assert summary(found) == [(DENY, 20)]
    assert len(found) == 1


@pytest.mark.parametrize(
    ("old", "new", "entry"),
    [
        pytest.param(20, 22, corrected(25, 20, ago=3600), id="the window has passed"),
        pytest.param(20, 18, corrected(25, 20), id="a decrease"),
        pytest.param(20, 22, EntryState(count=20, changed_at=T0 - timedelta(minutes=5)), id="no correction"),
    ],
)
def test_the_gate_holds_only_increases_inside_the_window_after_a_correction(
    old: int, new: int, entry: EntryState
) -> None:
    assert count_rollback.check(context(old, new, entry=entry, attach_errors=(failure(60),))) == []
    assert count_rollback.check(context(old, new, entry=entry, attach_errors=None)) == []


def test_a_justified_step_passes_the_gate() -> None:
    entry = corrected(25, 20)
    assert count_rollback.check(context(20, 22, entry=entry, approvals=(approval(20, 22),), attach_errors=None)) == []


@pytest.mark.parametrize(
    "errors", [pytest.param((failure(60),), id="a capacity failure"), pytest.param(None, id="unknown errors")]
)
def test_recovery_gate_time_paces_by_recovery_step_alone(errors: tuple[AttachError, ...] | None) -> None:
    policy = make_policy(recoveryGate="time")
    entry = corrected(25, 20)
    assert count_rollback.check(context(20, 22, entry=entry, attach_errors=errors, policy=policy)) == []
    assert summary(count_rollback.check(context(20, 23, entry=entry, attach_errors=errors, policy=policy))) == [
        (DENY, 22)
    ]


def test_the_gate_follows_the_rollback_enforcement_action() -> None:
    policy = make_policy(enforcementAction="warn")
    found = count_rollback.check(context(20, 22, entry=corrected(25, 20), attach_errors=(failure(60),), policy=policy))
    assert summary(found) == [(WARN, 20)]
