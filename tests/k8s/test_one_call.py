"""``register --validation cel`` on the real apiserver: one webhook call for a kubelet write, nothing given up.

kubelet's own code (``kubelet-csinode``) writes as ``system:node:<node>``; the guard is registered with
``--validation webhook`` (two calls) or ``--validation cel`` (the validating entries carry
``webhook.kube.one_call.NOT_DECIDED_CONDITION``). What must hold in ``cel`` exactly as in ``webhook``: a node's
raised count is held; a state forged to claim the raised count gains nothing (guard up or hanging); a second
mutating webhook that raises the count after the guard is caught by /validate, which the apiserver then calls;
a clamp back to the stored count writes nothing to etcd. And the point of it: a kubelet write the guard admits
reaches the guard once (/mutate) in ``cel``, twice in ``webhook``.
"""

from __future__ import annotations

import json
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from tests.k8s.controlplane import ControlPlane, Guard, counts, fast_policy, unique, wait_until
from tests.k8s.labeler import running_labeler
from tests.k8s.test_noop_writes import etcd_revision

EBS = "ebs.csi.aws.com"
STATE = "csinode-guard.io/state"
M6I_LARGE = {"node.kubernetes.io/instance-type": "m6i.large"}
CEILING = 27  # the shipped policy's profile for m6i.large
MODES = [pytest.param("webhook", id="two calls"), pytest.param("cel", id="one call")]


def registered(guard_factory: Any, tmp_path: Path, mode: str) -> Guard:
    guard: Guard = guard_factory(fast_policy(tmp_path / "fast.yaml", "1s"), register=False)
    guard.register("--validation", mode)
    return guard


def new_node(cp: ControlPlane, prefix: str, count: int) -> str:
    node = unique(prefix)
    cp.create_node(node, M6I_LARGE)
    time.sleep(1.0)  # the guard's Node informer: one event away
    out = cp.kubelet(node, "install", "--driver", EBS, "--node-id", f"i-{node}", "--max-volumes", str(count))
    assert f"OK install driver={EBS}" in out.stdout, out.stdout + out.stderr
    return node


def endpoints(guard: Guard, node: str, since: int) -> list[str]:
    """The endpoints the guard answered for ``node`` after its first ``since`` audit records."""
    return [str(r["endpoint"]) for r in guard.decisions()[since:] if r.get("node") == node]


def stored(cp: ControlPlane, node: str) -> int | None:
    return counts(cp.get_csinode(node)).get(EBS)


@pytest.mark.parametrize("mode", MODES)
def test_an_admitted_kubelet_write_reaches_the_guard_once_with_cel(
    control_plane: ControlPlane, guard_factory: Any, tmp_path: Path, mode: str
) -> None:
    cp = control_plane
    guard = registered(guard_factory, tmp_path, mode)
    node = new_node(cp, "calls", 20)
    want = ["mutate"] if mode == "cel" else ["mutate", "validate"]
    for count in (18, 20):  # a decrease (Ignore entries), then an increase (Fail entries) past minInterval
        time.sleep(1.1)
        seen = len(guard.decisions())
        cp.kubelet(node, "update", "--driver", EBS, "--max-volumes", str(count))
        assert stored(cp, node) == count
        time.sleep(0.5)  # the audit record of a /validate call would be written by now
        assert endpoints(guard, node, seen) == want


@pytest.mark.parametrize("mode", MODES)
def test_a_nodes_raised_count_is_held_in_both_modes(
    control_plane: ControlPlane, guard_factory: Any, tmp_path: Path, mode: str
) -> None:
    cp = control_plane
    registered(guard_factory, tmp_path, mode)
    node = new_node(cp, "raise", CEILING)
    time.sleep(1.1)
    cp.kubelet(node, "update", "--driver", EBS, "--max-volumes", "60", check=False)
    assert stored(cp, node) == CEILING
    cp.replace_count(node, EBS, 39, check=False)  # the node's own PUT, not kubelet's code
    assert stored(cp, node) == CEILING


def forged(cp: ControlPlane, node: str, count: int) -> dict[str, Any]:
    """The node's CSINode with ``count`` and its state's text edited to record ``count``: what CEL reads."""
    obj: dict[str, Any] = cp.kubectl_json("get", "csinode", node, kubeconfig=cp.node_kubeconfig(node))
    state = obj["metadata"]["annotations"][STATE]
    assert f'"count":{CEILING},' in state
    obj["metadata"]["annotations"][STATE] = state.replace(f'"count":{CEILING},', f'"count":{count},')
    for entry in obj["spec"]["drivers"]:
        if entry["name"] == EBS:
            entry["allocatable"] = {"count": count}
    return obj


def test_a_state_forged_to_claim_the_raised_count_gains_nothing(
    control_plane: ControlPlane, guard_factory: Any, tmp_path: Path
) -> None:
    cp = control_plane
    guard = registered(guard_factory, tmp_path, "cel")
    node = new_node(cp, "forge", CEILING)
    before = cp.get_csinode(node)["metadata"]["annotations"][STATE]
    for down in (False, True):  # the guard answering, then hanging (SIGSTOP): no answer within timeoutSeconds
        if down:
            guard.pause()
        try:
            put = cp.kubectl("replace", "-f", "-", kubeconfig=cp.node_kubeconfig(node), check=False,
                             input=json.dumps(forged(cp, node, 39)))
        finally:
            if down:
                guard.resume()
        assert put.returncode != 0, put.stdout
        assert ("state-integrity" in put.stderr) if not down else ("increases-and-other-writers" in put.stderr)
        after = cp.get_csinode(node)
        assert counts(after) == {EBS: CEILING}
        assert after["metadata"]["annotations"][STATE] == before


@pytest.mark.parametrize("mode", MODES)
def test_a_second_mutating_webhook_raising_the_count_after_the_guard_is_caught_by_validate(
    control_plane: ControlPlane, guard_factory: Any, tmp_path: Path, mode: str
) -> None:
    cp = control_plane
    guard = registered(guard_factory, tmp_path, mode)
    node = new_node(cp, "later", 20)
    time.sleep(1.1)
    with running_labeler(cp, tmp_path / "raiser", guard, raise_count=(node, EBS, 60)) as raiser:
        seen = len(guard.decisions())
        write = cp.kubelet(node, "update", "--driver", EBS, "--max-volumes", "21", check=False)
        assert write.returncode != 0, write.stdout
        assert any(r["name"] == node for r in raiser.requests)
        assert stored(cp, node) == 20
        validated = wait_until(
            lambda: [r for r in guard.decisions()[seen:] if r.get("node") == node and r["endpoint"] == "validate"],
            timeout=10, what="a /validate record",
        )
        assert {r["decision"] for r in validated} == {"deny"}


def test_a_clamp_back_to_the_stored_count_leaves_etcd_untouched_with_cel(
    control_plane: ControlPlane, guard_factory: Any, tmp_path: Path
) -> None:
    cp = control_plane
    guard = registered(guard_factory, tmp_path, "cel")
    node = new_node(cp, "noop", 15)
    before = etcd_revision(cp, node)
    for _ in range(2):
        cp.kubelet(node, "update", "--driver", EBS, "--max-volumes", "0")  # unbounded: clamped back
        assert stored(cp, node) == 15
        assert etcd_revision(cp, node) == before, "the clamped PUT wrote a new revision"
    mutated = [r for r in guard.decisions() if r.get("node") == node and r["endpoint"] == "mutate"]
    assert [r["decision"] for r in mutated][-2:] == ["clamp", "clamp"]


def test_at_its_bounds_the_condition_stays_within_the_apiservers_cost_budget(control_plane: ControlPlane) -> None:
    """The largest object CEL still decides (8 entries with 63-character names, an 8 KiB state) is decided without
    exhausting the apiserver's per-expression cost budget; one entry or one byte more and /validate is called.

    Only a validating configuration is registered, ``--validation cel``, pointing at a port where nothing listens:
    a write it skips is stored, a write it calls is refused (``failurePolicy: Fail``), and so is one whose
    condition errors. The writes are the admin's (the ``Fail`` entry's), server-side dry runs."""
    from webhook.admission.state import EntryState, GuardState, StateKeys, encode_state  # noqa: PLC0415
    from webhook.kube import one_call  # noqa: PLC0415
    from webhook.kube.registration import WebhookTarget, build_validating_webhook_configuration  # noqa: PLC0415

    cp = control_plane
    node = unique("cost")
    names = [f"{i}{'a' * 55}.csi.io" for i in range(one_call.MAX_DRIVERS + 1)]
    assert all(len(n) == 63 for n in names)
    drivers = [{"name": n, "nodeID": f"i-{i}", "allocatable": {"count": 10}} for i, n in enumerate(names)]
    cp.kubectl("create", "-f", "-", input=json.dumps({
        "apiVersion": "storage.k8s.io/v1", "kind": "CSINode", "metadata": {"name": node},
        "spec": {"drivers": drivers[:-1]}}))
    uid = cp.get_csinode(node)["metadata"]["uid"]
    now = datetime.now(UTC)
    encoded = encode_state(GuardState(uid, {n: EntryState(11, now) for n in names}), StateKeys([b"k" * 32]))
    state = encoded[:-1] + " " * (one_call.MAX_STATE_BYTES - len(encoded)) + "}"  # JSON whitespace: 8 KiB exactly

    def write(entries: list[dict[str, Any]], annotation: str) -> subprocess.CompletedProcess[str]:
        obj = cp.get_csinode(node)
        obj["spec"]["drivers"] = [{**e, "allocatable": {"count": 11}} for e in entries]
        obj["metadata"].setdefault("annotations", {})[STATE] = annotation
        return cp.kubectl("replace", "--dry-run=server", "-f", "-", check=False, input=json.dumps(obj))

    configuration = build_validating_webhook_configuration(
        WebhookTarget(ca_bundle=cp.ca_crt.read_bytes(), url="https://127.0.0.1:1"), name=unique("cost"),
        validation=one_call.VALIDATION_CEL)
    cp.kubectl("create", "-f", "-", input=json.dumps(configuration))
    try:
        wait_until(lambda: write(drivers[:-1], "{}").returncode != 0, timeout=30, what="the configuration applied")
        decided = write(drivers[:-1], state)
        assert decided.returncode == 0, decided.stderr
        assert write(drivers, state).returncode != 0  # one entry more: called (and refused: nothing listens)
        assert write(drivers[:-1], state + " ").returncode != 0  # one byte more
    finally:
        cp.kubectl("delete", "validatingwebhookconfiguration", configuration["metadata"]["name"])
        cp.kubectl("delete", "csinode", node)


def test_with_the_guard_hanging_the_nodes_decrease_still_goes_through_after_both_calls_time_out(
    control_plane: ControlPlane, guard_factory: Any, tmp_path: Path
) -> None:
    """Under the ``Ignore`` entries a hanging guard blocks nothing, with one call as with two: /mutate times out,
    the state still records the old count, so CEL cannot decide and /validate is called (and times out) too."""
    cp = control_plane
    guard = registered(guard_factory, tmp_path, "cel")
    node = new_node(cp, "hang", 20)
    guard.pause()
    try:
        started = time.monotonic()
        cp.kubelet(node, "update", "--driver", EBS, "--max-volumes", "18")
        elapsed = time.monotonic() - started
    finally:
        guard.resume()
    assert stored(cp, node) == 18
    assert elapsed >= 2 * 5 - 0.5, f"{elapsed:.1f}s: the validating call was skipped"  # timeoutSeconds 5, twice
