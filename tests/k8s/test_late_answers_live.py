"""A late answer on the real apiserver: the guard stopped (SIGSTOP) while kube-apiserver waits for it.

The apiserver keeps its connection to the guard alive between calls. A kubelet increase (the ``Fail`` entry)
sent while the guard is stopped waits in that connection's socket; after ``timeoutSeconds`` (5 s) the apiserver
gives up, closes the connection and refuses the write (failurePolicy Fail). Once resumed, the guard judges the
review it finds there: its audit record says ``late`` (the decision did not take effect: etcd keeps the old
count) and ``csinode_guard_late_answers_total`` counts it.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

from tests.k8s.controlplane import ControlPlane, Guard, counts, unique, wait_until
from tests.test_late_answers import late_answers

EBS = "ebs.csi.aws.com"
M6I_LARGE = {"node.kubernetes.io/instance-type": "m6i.large"}



def test_an_increase_answered_after_the_apiservers_timeout_is_recorded_late(
    control_plane: ControlPlane, guard: Guard
) -> None:
    node = unique("late")
    control_plane.create_node(node, M6I_LARGE)
    time.sleep(1.0)  # the guard's Node informer
    control_plane.kubelet(node, "install", "--driver", EBS, "--node-id", "i-1", "--max-volumes", "20")
    assert counts(control_plane.get_csinode(node)) == {EBS: 20}  # judged: the apiserver's connection stays open
    before = {r["uid"] for r in guard.decisions()}
    assert all("late" not in r for r in guard.decisions()), "answers in time are not marked"
    guard.pause()
    try:
        refused = control_plane.kubelet(node, "update", "--driver", EBS, "--max-volumes", "21", check=False)
    finally:
        resumed = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        guard.resume()
    assert refused.returncode != 0, "failurePolicy Fail: the increase is refused while the guard does not answer"
    assert counts(control_plane.get_csinode(node)) == {EBS: 20}

    def late() -> list[dict[str, object]]:
        return [r for r in guard.decisions() if r["node"] == node and r["uid"] not in before and r["time"] >= resumed]

    wait_until(lambda: bool(late()), timeout=15, what="the review that waited in the socket judged")
    records = late()
    assert records and all(r["late"] is True and r["deadlineSeconds"] == 5.0 for r in records), records
    assert {r["lateReason"] for r in records} <= {"client-closed", "deadline"}, records
    assert any(r["new"] == 21 for r in records), records  # the increase the apiserver had already refused
    endpoints = {str(r["endpoint"]) for r in records}
    wait_until(lambda: all(late_answers(guard).get(e, 0) >= 1 for e in endpoints), timeout=10,
               what="csinode_guard_late_answers_total counts them")
