"""The Grafana dashboard's queries against the suite's real Prometheus, after a rollout scenario on the real
apiserver: every panel answers with data, so a renamed metric or label breaks this test, not the on-call's
dashboard. The recording rules the panels read are evaluated by the same Prometheus.

The same queries are rendered into a picture (:mod:`dashboard.picture`), by default into a temporary file; the
repository's docs/dashboard.png comes from a longer run of the scenario:
``CSINODE_GUARD_DASHBOARD_PNG=docs/dashboard.png .venv/bin/python -m pytest -n 0 \
tests/k8s/test_monitoring_dashboard.py``.
"""

from __future__ import annotations

import json
import os
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from dashboard import build, picture
from dashboard.panels import ROWS, expand
from tests.k8s.controlplane import ADMIN_USER, ControlPlane, fast_policy, unique, wait_until
from tests.k8s.monitoring import EBS, admin_writes, assert_alert_active, scraped
from tests.k8s.prometheus import Prometheus, rule_groups

VERSIONS = "csinode-guard.io/driver-versions"

def _volume_attachment(cp: ControlPlane, node: str, status: dict[str, Any]) -> None:
    name = unique("va")
    cp.kubectl("create", "-f", "-", input=json.dumps({
        "apiVersion": "storage.k8s.io/v1", "kind": "VolumeAttachment", "metadata": {"name": name},
        "spec": {"attacher": EBS, "nodeName": node, "source": {"persistentVolumeName": unique("pv")}},
    }))
    cp.kubectl("patch", "volumeattachment", name, "--subresource=status", "--type=merge",
               "-p", json.dumps({"status": status}))


def _attach_error(code: int, message: str) -> dict[str, Any]:
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"attached": False, "attachError": {"time": now, "message": message, "errorCode": code}}


def _rollout(cp: ControlPlane) -> str:
    """What a rollout produces on one node: a registration, attachments and attach errors of two classes, a
    decrease, reports above the ceiling (clamped, then clamped back to the stored count), a stranger's increase
    (denied), and a driver version rollback (frozen). Returns the node."""
    node = unique("dash")
    cp.create_node(node)
    cp.kubelet(node, "init")
    cp.kubectl("annotate", "csinode", node, f"{VERSIONS}={json.dumps({EBS: 'v1.37.0'})}")
    cp.kubelet(node, "install", "--driver", EBS, "--node-id", f"i-{node}", "--max-volumes", "25")
    for _ in range(2):
        _volume_attachment(cp, node, {"attached": True})
    _volume_attachment(cp, node, _attach_error(8, "rpc error: code = ResourceExhausted desc = attachment limit"))
    _volume_attachment(cp, node, _attach_error(7, "rpc error: code = PermissionDenied desc = not authorized"))
    time.sleep(1.5)  # the VolumeAttachment cache sees them before the next judged write
    cp.kubelet(node, "update", "--driver", EBS, "--max-volumes", "24")
    for _ in range(3):
        time.sleep(2.1)  # change-rate's minInterval of the fast policy
        cp.kubelet(node, "update", "--driver", EBS, "--max-volumes", "39")
    assert admin_writes(cp, node, [30]) == [403]
    cp.kubectl("annotate", "--overwrite", "csinode", node, f"{VERSIONS}={json.dumps({EBS: 'v1.30.0'})}")
    # The node plugin rolled back: kubelet removes the driver and registers it again with the older binary's
    # count. The registration is judged (held at the stored count) and the entry frozen.
    cp.kubelet(node, "uninstall", "--driver", EBS)
    cp.kubelet(node, "install", "--driver", EBS, "--node-id", f"i-{node}", "--max-volumes", "25")
    return node


def test_every_dashboard_query_answers_after_a_rollout(
    guard_factory: Any, prometheus: Prometheus, control_plane: ControlPlane, tmp_path: Path
) -> None:
    assert build.main(["--check"]) == 0, "the committed dashboard JSON is stale: run python -m dashboard.build"
    shipped = json.loads(build.OUTPUT.read_text())
    queries = {p["title"]: [t["expr"] for t in p["targets"]] for p in shipped["panels"] if p["type"] != "row"}
    assert queries == {p.title: [q.expr for q in p.queries] for r in ROWS for p in r.panels}

    # A count stored while no guard judged it: the guard's audit reports it as a standing violation.
    unjudged = unique("dash")
    control_plane.create_node(unjudged)
    control_plane.kubelet(unjudged, "install", "--driver", EBS, "--node-id", f"i-{unjudged}", "--max-volumes", "39")
    # With reconcile: clamp the audit tries to lower it; the guard's identity here (the admin) is not a listed
    # writer, so its own webhook refuses the repair: a refused repair, on the dashboard.
    policy = fast_policy(tmp_path / "policy.yaml", reporter=ADMIN_USER)
    document = yaml.safe_load(policy.read_text())
    document["spec"]["reconcile"] = "clamp"
    policy.write_text(yaml.safe_dump(document, sort_keys=False))
    guard = guard_factory(policy,
                          extra_args=("--audit-interval", "2", "--lease-namespace", "default",
                                      "--lease-name", unique("dash-audit"), "--lease-duration", "6"))
    started = time.time()
    out = os.environ.get("CSINODE_GUARD_DASHBOARD_PNG")
    with scraped(prometheus, guard) as namespace:
        for _ in range(6 if out else 1):  # the picture: a few nodes rolled out one after another
            _rollout(control_plane)

        def missing() -> list[str]:
            return [f"{title}: {expr}" for title, exprs in queries.items()
                    for expr in exprs if not prometheus.query(expand(expr, namespace))]

        deadline = time.monotonic() + 60  # rates need two scrapes; recording rules one more evaluation
        while (without := missing()) and time.monotonic() < deadline:
            time.sleep(1)
        assert without == [], f"panels without data: {without}"
        for group in rule_groups():  # the recording rules the panels read, evaluated on this installation
            for rule in group["rules"]:
                if "record" in rule:
                    assert prometheus.query(f'{rule["record"]}{{namespace="{namespace}"}}'), rule["record"]
        def decisions() -> set[str]:  # a series needs two scrapes and one evaluation to be recorded
            return {s["metric"]["decision"] for s in prometheus.query(
                f'csinode_guard:requests:rate5m{{namespace="{namespace}"}}')}

        wait_until(lambda: {"allow", "clamp", "deny"} <= decisions(), timeout=30, what="every decision recorded")
        # What the scenario did is what the alerts say: kubelet resending refused counts, an entry frozen.
        assert_alert_active(prometheus, "CSINodeGuardPersistentDisagreement", namespace, driver=EBS)
        assert_alert_active(prometheus, "CSINodeGuardEntriesFrozen", namespace, driver=EBS)
        classes = {s["metric"]["class"] for s in prometheus.query(
            f'csinode_guard_attach_errors{{namespace="{namespace}"}} > 0')}
        assert classes == {"capacity", "permission"}, classes
        drawn = picture.render(prometheus.query_range, Path(out) if out else tmp_path / "dashboard.png", namespace,
                               started, time.time() + 5)
        assert drawn.read_bytes().startswith(b"\x89PNG"), drawn
