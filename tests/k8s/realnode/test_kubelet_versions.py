"""A driver rollback and upgrade by the DaemonSet's image tag, with ``versionSource: pod`` reading the real
DaemonSet-controlled pods (the kube-controller-manager's DaemonSet controller makes and replaces them).

Why the real kubelet and controller: the version the guard reads comes from pods no test made by hand (their
owner reference, labels and image are the DaemonSet controller's), and the writes it judges come from kubelet's
own sequence across a rollout (removal, registration of the new pod, then its periodic refresh), which decides
when the rolled-back driver's count is presented and how often afterwards.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from tests.k8s.controlplane import Guard, wait_until
from tests.k8s.realnode.cluster import DRIVER, NEW_TAG, OLD_TAG, RealNode
from tests.k8s.realnode.policy import hostpath_policy
from webhook.admission.state import parse_time

STATE = "csinode-guard.io/state"
FREEZE = "20s"


def records(guard: Guard, node: RealNode, **match: Any) -> list[dict[str, Any]]:
    """The guard's /mutate records of ``node``'s driver whose fields equal ``match``."""
    return [r for r in guard.decisions()
            if r.get("node") == node.name and r.get("endpoint") == "mutate" and r.get("driver") == DRIVER
            and all(r.get(k) == v for k, v in match.items())]


def frozen_until(node: RealNode) -> datetime | None:
    state = json.loads(node.cp.get_csinode(node.name)["metadata"]["annotations"][STATE])
    text = state["drivers"][DRIVER].get("frozenUntil")
    return parse_time(text) if text else None


def test_a_rollback_by_image_tag_freezes_increases_and_the_upgrade_raises_after_the_freeze(
    real_node: RealNode, guard_factory: Any, tmp_path: Path
) -> None:
    """v1.18.0-8-g1f2b2e64 registers 5; the DaemonSet goes back to v1.17.0 reporting 7 (one rollout): the
    registration is held at 5 and increases freeze; kubelet's refreshes of 7 are held too; the DaemonSet goes
    forward to v1.18.0-8-g1f2b2e64: still held until the freeze ends, then the next refresh stores 7."""
    node = real_node
    guard: Guard = guard_factory(hostpath_policy(tmp_path / "policy.yaml", ceiling=10, freeze_for=FREEZE))
    node.deploy_driver(attach_limit=5, tag=NEW_TAG)
    first = node.wait_registered(tag=NEW_TAG)
    wait_until(lambda: node.count() == 5, timeout=30, what="registered at 5")
    assert [(r["writerVersion"], r["final"]) for r in records(guard, node, registration=True)] == [(NEW_TAG, 5)]

    node.roll_out(tag=OLD_TAG, attach_limit=7)
    second = node.wait_registered(tag=OLD_TAG, replacing=first)
    assert second["metadata"]["ownerReferences"][0]["kind"] == "DaemonSet"
    [rollback] = wait_until(lambda: records(guard, node, registration=True, writerVersion=OLD_TAG), timeout=30,
                            what="the v1.17.0 registration judged")
    assert (rollback["new"], rollback["final"], rollback["decision"]) == (7, 5, "clamp"), rollback
    assert any(o["rule"] == "writer-version" and "rolled back" in o["message"] for o in rollback["rules"]), rollback
    until = frozen_until(node)
    assert until is not None, "the rollback froze increases"
    refresh = wait_until(lambda: records(guard, node, registration=False, new=7), timeout=30,
                         what="a periodic refresh of the rolled-back driver")[0]
    assert (refresh["final"], refresh["writerVersion"]) == (5, OLD_TAG), refresh
    assert node.count() == 5

    node.roll_out(tag=NEW_TAG)
    node.wait_registered(tag=NEW_TAG, replacing=second)
    wait_until(lambda: node.count() == 7, timeout=120, what="the upgraded driver's 7 stored after the freeze")

    judged = records(guard, node, new=7)
    print("\n" + "\n".join(f'{r["time"]} registration={r["registration"]} {r["writerVersion"]} '
                           f'{r["old"]}->{r["new"]} final={r["final"]} {r["decision"]}' for r in judged))
    print("\n".join(w.line for w in node.kubelet_writes()))
    raised = [r for r in judged if r["final"] == 7]
    assert raised and raised[0]["writerVersion"] == NEW_TAG, judged
    assert parse_time(raised[0]["time"]) >= until, "raised only once the freeze ended"
    held = [r for r in judged if parse_time(r["time"]) < until]
    assert held and all(r["final"] == 5 for r in held), held
    upgrade = [r for r in held if r["registration"] and r["writerVersion"] == NEW_TAG]
    assert all(any(o["rule"] == "count-rollback" and "frozen" in o["message"] for o in r["rules"]) for r in upgrade)
    assert node.ready()
