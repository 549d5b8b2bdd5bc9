"""Labels the node's kubelet can set never raise a ceiling: the label value that selected an entry's ceiling is
pinned in the signed state (webhook/admission/ceiling_pin.py), judged under the shipped policy and EBS profile.

Also the enforcement scope: once judged in scope, a node that removes the selector's label from itself stays
enforced, and a node whose labels are unknown is enforced."""

from __future__ import annotations

import copy
from datetime import datetime, timedelta

import pytest
from kube import EBS, NODE, base_csinode, kubelet_update
from test_reregistration import KEYS, POLICY, POLICY_DIR, T0, Node

from webhook.admission.ceiling_pin import pin_ceiling
from webhook.admission.cluster import StaticClusterView
from webhook.admission.evaluation import Decision
from webhook.admission.policy import parse_policy
from webhook.admission.state import STATE_ANNOTATION, Approval, PinnedLabel, decode_state

TYPE = "node.kubernetes.io/instance-type"
CEILING = POLICY.for_driver(EBS).ceiling
BIG, SMALL = "c7i.48xlarge", "m6i.large"  # 128 and 27 in the shipped EBS profile


def on(labels: dict[str, str] | None) -> StaticClusterView:
    nodes = {} if labels is None else {NODE: {"labels": labels}}
    return StaticClusterView(nodes=nodes, driver_versions={NODE: {EBS: "v1.37.0"}})


def approval(max_count: int, expires: datetime = T0 + timedelta(days=1)) -> Approval:
    return Approval(EBS, "resized", 0, max_count, expires, "OPS-1", "alice", T0)


@pytest.mark.parametrize(
    ("labels", "pinned", "approvals", "count", "pin"),
    [
        pytest.param({TYPE: SMALL}, None, (), 27, PinnedLabel(TYPE, SMALL),
                     id="nothing pinned: the label's ceiling, pinned"),
        pytest.param({}, None, (), 27, None, id="label unset: the unknown-type ceiling, nothing pinned"),
        pytest.param({TYPE: BIG}, PinnedLabel(TYPE, SMALL), (), 27, PinnedLabel(TYPE, SMALL),
                     id="the node relabels itself to a bigger type: held at the pinned value's ceiling"),
        pytest.param({TYPE: SMALL}, PinnedLabel(TYPE, BIG), (), 27, PinnedLabel(TYPE, SMALL),
                     id="a smaller type lowers the ceiling and moves the pin"),
        pytest.param({}, PinnedLabel(TYPE, BIG), (), 27, PinnedLabel(TYPE, BIG),
                     id="the label removed: the unknown-type ceiling, the pin stays"),
        pytest.param(None, PinnedLabel(TYPE, BIG), (), 128, PinnedLabel(TYPE, BIG),
                     id="labels unknown: the pinned value's ceiling"),
        pytest.param({TYPE: BIG}, PinnedLabel(TYPE, SMALL), (approval(128),), 128, PinnedLabel(TYPE, BIG),
                     id="an approval covering the count lifts the pin"),
        pytest.param({TYPE: BIG}, PinnedLabel(TYPE, SMALL), (approval(40),), 27, PinnedLabel(TYPE, SMALL),
                     id="an approval up to 40 does not lift it to 128"),
        pytest.param({TYPE: BIG}, PinnedLabel(TYPE, SMALL), (approval(128, T0),), 27, PinnedLabel(TYPE, SMALL),
                     id="an expired approval lifts nothing"),
        pytest.param({TYPE: BIG}, PinnedLabel("other/label", SMALL), (), 128, PinnedLabel(TYPE, BIG),
                     id="a pin of another label (the policy changed) is not used"),
    ],
)
def test_pin_ceiling(labels: dict[str, str] | None, pinned: PinnedLabel | None, approvals: tuple[Approval, ...],
                     count: int, pin: PinnedLabel | None) -> None:
    found = pin_ceiling(CEILING, labels, pinned, approvals, driver=EBS, count=100, now=T0 + timedelta(hours=1))
    assert (found.ceiling, found.pin) == (count, pin)


def test_a_node_that_labels_itself_a_bigger_instance_type_gains_nothing() -> None:
    # Attack 1: ceiling 27 for an m6i.large; the node sets instance-type=c7i.48xlarge on its own Node (allowed by
    # NodeRestriction), then uninstall/install --max-volumes 128 and periodic updates.
    node = Node(base_csinode())
    node.view = on({TYPE: SMALL})
    assert node.put(kubelet_update(node.obj, EBS, 25), timedelta(0)).response.allowed
    assert node.state.entries[EBS].pinned == PinnedLabel(TYPE, SMALL)

    node.view = on({TYPE: BIG})
    for minute in range(1, 12):
        decision = node.restart_plugin(128, timedelta(minutes=minute * 2))
        assert decision.response.allowed is True
        assert node.count is not None and node.count <= 27
        node.put(kubelet_update(node.obj, EBS, 128), timedelta(minutes=minute * 2 + 1, seconds=30))
        assert node.count is not None and node.count <= 27
    assert node.count == 27
    assert node.state.entries[EBS].pinned == PinnedLabel(TYPE, SMALL)
    assert any("pinned for this node" in o.message for o in decision.outcomes if o.rule == "count-ceiling")


def test_the_first_label_a_cloud_controller_manager_sets_lifts_the_unknown_type_ceiling() -> None:
    node = Node(base_csinode())
    node.view = on({})  # a new Node: no instance-type label until the cloud-controller-manager initialises it
    assert node.put(kubelet_update(node.obj, EBS, 39), timedelta(0)).response.allowed
    assert node.count == 27  # the unknown-type ceiling
    assert node.state.entries[EBS].pinned is None

    node.view = on({TYPE: BIG})
    decision = node.put(kubelet_update(node.obj, EBS, 39), timedelta(minutes=2))
    assert decision.decision is Decision.ALLOW
    assert node.count == 39
    assert node.state.entries[EBS].pinned == PinnedLabel(TYPE, BIG)


def test_a_node_whose_labels_are_unknown_is_judged_with_its_pinned_ceiling() -> None:
    node = Node(base_csinode())
    node.view = on({TYPE: BIG})
    assert node.put(kubelet_update(node.obj, EBS, 100), timedelta(0)).response.allowed
    node.view = on(None)  # the Node is missing from the cache

    node.put(kubelet_update(node.obj, EBS, 116), timedelta(minutes=2))
    assert node.count == 116  # within the pinned 128 (and maxStepUp 16)
    node.put(kubelet_update(node.obj, EBS, 200), timedelta(minutes=4))
    assert node.count == 128
    assert node.state.entries[EBS].pinned == PinnedLabel(TYPE, BIG)


CANARY_DOC = copy.deepcopy(POLICY.document)
CANARY_DOC["spec"]["enforcementScope"] = {"nodeSelector": {"matchLabels": {"csinode-guard.io/enforce": "true"}}}
CANARY = parse_policy(CANARY_DOC, "canary.yaml", POLICY_DIR)


def test_a_node_that_removes_the_scope_label_from_itself_stays_enforced() -> None:
    # Attack 6: enforcementScope on a label the node can remove; the node removes it, then 27 -> 60.
    node = Node(base_csinode(), CANARY)
    node.view = on({TYPE: SMALL, "csinode-guard.io/enforce": "true"})
    assert node.put(kubelet_update(node.obj, EBS, 27), timedelta(0)).response.allowed
    assert node.state.scope == '{"csinode-guard.io/enforce":"true"}'

    node.view = on({TYPE: SMALL})
    decision = node.put(kubelet_update(node.obj, EBS, 60), timedelta(minutes=5))

    assert decision.in_scope is True
    assert node.count == 27
    assert node.state.scope == '{"csinode-guard.io/enforce":"true"}'


def test_a_node_never_in_scope_is_judged_in_dryrun() -> None:
    node = Node(base_csinode(), CANARY)
    node.view = on({TYPE: SMALL})
    assert node.put(kubelet_update(node.obj, EBS, 60), timedelta(0)).in_scope is False
    assert node.count == 60
    raw = node.obj["metadata"]["annotations"][STATE_ANNOTATION]
    state = decode_state(raw, node.obj["metadata"]["uid"], KEYS).state
    assert state is not None and state.scope is None

