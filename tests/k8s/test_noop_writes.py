"""Write amplification on the real apiserver: a clamp back to the stored count writes nothing to etcd.

DESIGN.md "Write amplification": when the guard and a driver disagree for good, kubelet sends its PUT again every
period; a clamp whose result equals the stored object must leave it byte-identical, so that the apiserver
treats the PUT as a no-op (no new revision in etcd, no MODIFIED watch event for the scheduler and every other
watcher). The apiserver takes kubelet's managed fields from kubelet's own request, before mutating admission;
the guard puts them back too. Checked here on etcd's own revision of the key, read from etcd directly.
"""

from __future__ import annotations

import base64
import json
import urllib.request

import pytest

from tests.k8s.controlplane import ControlPlane, Guard, counts, unique

EBS = "ebs.csi.aws.com"


def etcd_revision(cp: ControlPlane, node: str) -> tuple[int, bytes]:
    """``(mod_revision, stored bytes)`` of the CSINode's key, read from etcd's v3 JSON gateway."""
    key = base64.b64encode(f"/registry/csinodes/{node}".encode()).decode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{cp.env['ETCD_CLIENT_PORT']}/v3/kv/range", data=json.dumps({"key": key}).encode()
    )
    (kv,) = json.loads(urllib.request.urlopen(request, timeout=10).read())["kvs"]
    return int(kv["mod_revision"]), base64.b64decode(kv["value"])


@pytest.mark.parametrize(
    "report",
    [
        pytest.param(("kubelet", "0"), id="kubelet reports no limit (unbounded) and is clamped back"),
        pytest.param(("kubelet", "2147483648"), id="kubelet reports an overflowing limit and is clamped back"),
        pytest.param(("replace", None), id="the node PUTs its CSINode without allocatable and is clamped back"),
    ],
)
def test_a_clamp_back_to_the_stored_count_leaves_etcd_untouched(
    control_plane: ControlPlane, guard: Guard, report: tuple[str, str | None]
) -> None:
    node = unique("noop")
    control_plane.create_node(node, {"node.kubernetes.io/instance-type": "m5.large"})
    control_plane.kubelet(node, "install", "--driver", EBS, "--node-id", f"i-{node}", "--max-volumes", "15")
    before = etcd_revision(control_plane, node)

    for _ in range(2):  # the first and every later period alike
        how, value = report
        if how == "kubelet":
            control_plane.kubelet(node, "update", "--driver", EBS, "--max-volumes", str(value))
        else:
            control_plane.replace_count(node, EBS, None)
        assert counts(control_plane.get_csinode(node)) == {EBS: 15}
        assert etcd_revision(control_plane, node) == before, "the clamped PUT wrote a new revision"
    mutated = [r for r in guard.decisions() if r["node"] == node and r["endpoint"] == "mutate"]
    assert [r["decision"] for r in mutated][-2:] == ["clamp", "clamp"]
