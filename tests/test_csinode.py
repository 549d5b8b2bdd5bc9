"""CSINode objects as kubelet writes them, and what a count change is (webhook.admission.csinode)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from kube import EBS, NODE, base_csinode, driver_entry, kubelet_update

from webhook.admission.csinode import (
    INT32_MAX,
    ChangeKind,
    CountChange,
    CSINodeError,
    diff_drivers,
    format_count,
    parse_csinode,
)

EFS = "efs.csi.aws.com"
GCE = "pd.csi.storage.gke.io"
UID = "9f1c2a7e-3d64-4c1b-8f0e-2b6a5d4c3e21"


def with_drivers(*entries: dict[str, Any]) -> dict[str, Any]:
    obj = base_csinode()
    obj["spec"]["drivers"] = [copy.deepcopy(e) for e in entries]
    return obj


# -- parse_csinode -----------------------------------------------------------------------------------------------


def test_parse_csinode_reads_the_object_kubelet_created() -> None:
    node = parse_csinode(base_csinode())

    assert node.name == NODE
    assert node.uid == UID
    assert node.has_annotations is True
    assert node.annotations["storage.alpha.kubernetes.io/migrated-plugins"].startswith("kubernetes.io/aws-ebs")
    assert list(node.drivers) == [EFS]
    efs = node.drivers[EFS]
    assert (efs.name, efs.node_id, efs.allocatable_count, efs.position) == (EFS, "i-0a1b2c3d4e5f60718", None, 0)


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        pytest.param({"name": EBS, "allocatable": {"count": 25}}, 25, id="a bounded count is read"),
        pytest.param({"name": EBS, "allocatable": {"count": 0}}, 0, id="zero is a count not unbounded"),
        pytest.param({"name": EBS, "allocatable": {"count": INT32_MAX}}, INT32_MAX, id="int32 max is a count"),
        pytest.param({"name": EBS}, None, id="no allocatable is unbounded"),
        pytest.param({"name": EBS, "allocatable": None}, None, id="a null allocatable is unbounded"),
        pytest.param({"name": EBS, "allocatable": {}}, None, id="allocatable without count is unbounded"),
        pytest.param({"name": EBS, "allocatable": {"count": None}}, None, id="a null count is unbounded"),
    ],
)
def test_parse_csinode_reads_allocatable_count(entry: dict[str, Any], expected: int | None) -> None:
    node = parse_csinode(with_drivers(entry))
    assert node.drivers[EBS].allocatable_count == expected


def test_parse_csinode_indexes_drivers_by_name_and_keeps_their_position() -> None:
    node = parse_csinode(with_drivers(driver_entry(EFS, None), driver_entry(EBS, 25), driver_entry(GCE, 15)))

    assert {name: d.position for name, d in node.drivers.items()} == {EFS: 0, EBS: 1, GCE: 2}


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        pytest.param({"metadata": "x"}, r"object\.metadata must be an object", id="metadata is a string"),
        pytest.param(
            {"metadata": {"annotations": ["a"]}},
            r"object\.metadata\.annotations must be an object",
            id="annotations are a list",
        ),
        pytest.param({"spec": "x"}, r"object\.spec must be an object", id="spec is a string"),
        pytest.param(
            {"spec": {"drivers": {EBS: {"name": EBS}}}},
            r"object\.spec\.drivers must be a list",
            id="drivers is a map",
        ),
        pytest.param(
            {"spec": {"drivers": ["ebs"]}},
            r"object\.spec\.drivers\[0\] must be an object with a name",
            id="a driver is a string",
        ),
        pytest.param(
            {"spec": {"drivers": [{"name": EBS}, {"nodeID": "i-1"}]}},
            r"object\.spec\.drivers\[1\] must be an object with a name",
            id="a driver has no name",
        ),
        pytest.param(
            {"spec": {"drivers": [{"name": ""}]}},
            r"object\.spec\.drivers\[0\] must be an object with a name",
            id="a driver has an empty name",
        ),
        pytest.param(
            {"spec": {"drivers": [{"name": EBS}, {"name": EBS}]}},
            r"object\.spec\.drivers has driver 'ebs\.csi\.aws\.com' twice",
            id="a driver name repeats",
        ),
        pytest.param(
            {"spec": {"drivers": [{"name": EBS, "allocatable": 25}]}},
            r"object\.spec\.drivers\[0\]\.allocatable must be an object",
            id="allocatable is a number",
        ),
        pytest.param(
            {"spec": {"drivers": [{"name": EBS, "allocatable": {"count": -1}}]}},
            r"object\.spec\.drivers\[0\]\.allocatable\.count must be an integer from 0 to 2147483647 \(int32\)",
            id="the count is negative",
        ),
        pytest.param(
            {"spec": {"drivers": [{"name": EBS, "allocatable": {"count": "25"}}]}},
            r"allocatable\.count must be an integer from 0 to 2147483647 \(int32\)",
            id="the count is a string",
        ),
        pytest.param(
            {"spec": {"drivers": [{"name": EBS, "allocatable": {"count": 25.0}}]}},
            r"allocatable\.count must be an integer from 0 to 2147483647 \(int32\)",
            id="the count is a float",
        ),
        pytest.param(
            {"spec": {"drivers": [{"name": EBS, "allocatable": {"count": 2147483648}}]}},
            r"allocatable\.count must be an integer from 0 to 2147483647 \(int32\)",
            id="the count is beyond int32",
        ),
        pytest.param(
            {"spec": {"drivers": [{"name": EBS, "allocatable": {"count": True}}]}},
            r"allocatable\.count must be an integer from 0 to 2147483647 \(int32\)",
            id="the count is a boolean",
        ),
    ],
)
def test_parse_csinode_refuses_what_is_not_a_csinode(obj: dict[str, Any], message: str) -> None:
    with pytest.raises(CSINodeError, match=message):
        parse_csinode(obj)


def test_parse_csinode_names_the_side_of_the_request_in_errors() -> None:
    with pytest.raises(CSINodeError, match=r"^oldObject\.spec\.drivers must be a list$"):
        parse_csinode({"spec": {"drivers": "x"}}, "oldObject")


@pytest.mark.parametrize(
    ("obj", "has_annotations"),
    [
        pytest.param({"metadata": {"name": NODE}}, False, id="no annotations key"),
        pytest.param({"metadata": {"name": NODE, "annotations": None}}, False, id="null annotations"),
        pytest.param({"metadata": {"name": NODE, "annotations": {}}}, True, id="empty annotations"),
    ],
)
def test_parse_csinode_tells_whether_annotations_exist(obj: dict[str, Any], has_annotations: bool) -> None:
    node = parse_csinode(obj)
    assert node.annotations == {}
    assert node.has_annotations is has_annotations


def test_parse_csinode_accepts_an_object_without_drivers() -> None:
    for spec in ({}, {"drivers": None}, {"drivers": []}):
        assert parse_csinode({"metadata": {"name": NODE}, "spec": spec}).drivers == {}


# -- diff_drivers ------------------------------------------------------------------------------------------------


def stored_with_ebs(count: int | None) -> dict[str, Any]:
    return kubelet_update(base_csinode(), EBS, count)


def test_diff_matches_drivers_by_name_when_kubelet_re_appends_the_updated_one() -> None:
    stored = with_drivers(driver_entry(EBS, 25), driver_entry(EFS, None), driver_entry(GCE, 15))
    put = kubelet_update(stored, EBS, 23)
    assert [d["name"] for d in put["spec"]["drivers"]] == [EFS, GCE, EBS]

    changes = diff_drivers(parse_csinode(stored), parse_csinode(put))

    assert changes == [CountChange(node=NODE, driver=EBS, old=25, new=23, position=2)]


def test_diff_reports_no_change_when_only_the_order_changes() -> None:
    stored = with_drivers(driver_entry(EBS, 25), driver_entry(EFS, None))
    put = kubelet_update(stored, EBS, 25)

    assert diff_drivers(parse_csinode(stored), parse_csinode(put)) == []


@pytest.mark.parametrize(
    ("old", "new", "kind", "is_increase"),
    [
        pytest.param(25, 26, ChangeKind.INCREASE, True, id="a higher count is an increase"),
        pytest.param(25, 23, ChangeKind.DECREASE, False, id="a lower count is a decrease"),
        pytest.param(25, 0, ChangeKind.DECREASE, False, id="a drop to 0 is a decrease"),
        pytest.param(25, None, ChangeKind.TO_UNBOUNDED, True, id="bounded to unbounded counts as an increase"),
        pytest.param(None, 25, ChangeKind.TO_BOUNDED, False, id="unbounded to bounded counts as a decrease"),
        pytest.param(0, INT32_MAX, ChangeKind.INCREASE, True, id="a jump to int32 max is an increase"),
    ],
)
def test_diff_classifies_the_change(old: int | None, new: int | None, kind: ChangeKind, is_increase: bool) -> None:
    changes = diff_drivers(parse_csinode(stored_with_ebs(old)), parse_csinode(kubelet_update(stored_with_ebs(old),
                                                                                             EBS, new)))

    assert len(changes) == 1
    change = changes[0]
    assert (change.node, change.driver, change.old, change.new) == (NODE, EBS, old, new)
    assert change.kind is kind
    assert change.is_increase is is_increase


@pytest.mark.parametrize(
    ("old_drivers", "new_drivers"),
    [
        pytest.param([EFS], [EFS, EBS], id="a driver that appears is a registration"),
        pytest.param([EFS, EBS], [EFS], id="a driver that disappears is a removal"),
        pytest.param([EBS], [EFS], id="one driver replaced by another is a removal and a registration"),
    ],
)
def test_diff_ignores_registrations_and_removals(old_drivers: list[str], new_drivers: list[str]) -> None:
    old = with_drivers(*(driver_entry(d, 25) for d in old_drivers))
    new = with_drivers(*(driver_entry(d, 99) if d not in old_drivers else driver_entry(d, 25) for d in new_drivers))

    assert diff_drivers(parse_csinode(old), parse_csinode(new)) == []


def test_diff_lists_every_changed_driver_in_the_new_object_order() -> None:
    old = with_drivers(driver_entry(EBS, 25), driver_entry(GCE, 15), driver_entry(EFS, None))
    new = with_drivers(driver_entry(EFS, 4), driver_entry(GCE, 15), driver_entry(EBS, 20))

    changes = diff_drivers(parse_csinode(old), parse_csinode(new))

    assert [(c.driver, c.old, c.new, c.position) for c in changes] == [(EFS, None, 4, 0), (EBS, 25, 20, 2)]


def test_diff_takes_the_node_name_from_the_old_object_when_the_new_one_has_none() -> None:
    old = with_drivers(driver_entry(EBS, 25))
    new = with_drivers(driver_entry(EBS, 20))
    del new["metadata"]["name"]

    assert diff_drivers(parse_csinode(old), parse_csinode(new))[0].node == NODE


@pytest.mark.parametrize(
    ("count", "text"),
    [
        pytest.param(None, "unbounded", id="none renders as unbounded"),
        pytest.param(0, "0", id="zero renders as 0"),
        pytest.param(27, "27", id="a count renders as its number"),
    ],
)
def test_format_count(count: int | None, text: str) -> None:
    assert format_count(count) == text
