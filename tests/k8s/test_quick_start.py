"""The quick start cannot touch a cluster by accident, and a guard whose state key is not the cluster's reports
nothing about the states it cannot verify (issue: a README's first command joined the cluster $KUBECONFIG named,
took the audit Lease and raised false tampering alarms).

1. ``csinode-guard serve`` from an empty directory with ``$KUBECONFIG`` naming this real cluster (as a user of
   its own, to find its requests in the apiserver's audit log) and no ``--kubeconfig`` sends no request at all,
   takes no Lease and says why in its log.
2. A guard given another key than the one that signed the stored states takes no Lease, writes no Event and no
   audit record about them, and says so once as an ERROR, in ``csinode_guard_state_key_foreign`` and in /readyz.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import ssl
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from tests.k8s.controlplane import ControlPlane, unique, wait_until
from tests.k8s.test_audit import audit_events_about, install, metric, new_node
from tests.ports import free_port


def _readyz(port: int, ca: Path) -> dict[str, Any] | None:
    if not ca.exists():  # serve generates its development CA first
        return None
    context = ssl.create_default_context(cafile=str(ca))
    with contextlib.suppress(OSError, ValueError), urllib.request.urlopen(
        f"https://127.0.0.1:{port}/readyz", context=context, timeout=2
    ) as answer:
        return dict(json.loads(answer.read()))
    return None


def _lease_exists(control_plane: ControlPlane, name: str) -> bool:
    return control_plane.kubectl("get", "lease", name, "-n", "default", check=False).returncode == 0


def test_serve_with_only_kubeconfig_in_the_environment_contacts_no_cluster(
    control_plane: ControlPlane, tmp_path: Path
) -> None:
    user = unique("quick-start")
    kubeconfig = control_plane.user_kubeconfig(user, "system:masters")
    lease = unique("audit")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CSINODE_GUARD_")
           and k not in {"PROMETHEUS_MULTIPROC_DIR", "KUBERNETES_SERVICE_HOST"}}
    env["KUBECONFIG"] = str(kubeconfig)
    log = tmp_path / "serve.log"
    with log.open("wb") as err:
        process = subprocess.Popen(
            [sys.executable, "-m", "webhook", "serve", "--host", "127.0.0.1", "--port", str(port),
             "--metrics-port", "0", "--workers", "1", "--audit-log", str(tmp_path / "decisions.log"),
             "--audit-interval", "1", "--lease-namespace", "default", "--lease-name", lease],
            stdout=err, stderr=err, env=env, cwd=tmp_path, start_new_session=True,
        )
    try:
        ready = wait_until(lambda: _readyz(port, tmp_path / "certs" / "ca.crt"), timeout=90,
                           what="the quick start's /readyz")
        assert process.poll() is None
        assert ready["cluster"] == "offline", ready
        text = log.read_text()
        assert "no cluster: serve contacts one only with --kubeconfig or inside a pod" in text, text
        assert '--kubeconfig \\"$KUBECONFIG\\"' in text, "the log says how to use $KUBECONFIG"
        # A request made now is logged after anything the guard sent before: once it is in the audit log,
        # the guard's requests would be too.
        marker = uuid.uuid4().hex
        assert control_plane.probe_write(marker).returncode == 0
        wait_until(lambda: control_plane.audit_events(lambda e: marker in json.dumps(e)), timeout=30,
                   what="the marker write in the apiserver's audit log")
        sent = control_plane.audit_events(lambda e: (e.get("user") or {}).get("username") == user)
        assert sent == [], [e.get("requestURI") for e in sent]
        assert not _lease_exists(control_plane, lease)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        process.wait(30)


def test_a_guard_whose_key_verifies_no_stored_state_takes_no_lease_and_reports_nothing(
    control_plane: ControlPlane, guard_factory: Any, tmp_path: Path
) -> None:
    # States signed with the cluster's key: a guard with that key registered, kubelet registering a driver.
    signer = guard_factory(extra_args=("--no-audit",))
    node = new_node(control_plane, "foreign-key")
    install(control_plane, node, 25)
    assert "csinode-guard.io/state" in control_plane.get_csinode(node)["metadata"]["annotations"]
    signer.close()

    certs = tmp_path / "guard1" / "certs"  # guard_factory's work directory for its second guard
    certs.mkdir(parents=True)
    (certs / "state.key").write_text(uuid.uuid4().hex + uuid.uuid4().hex + "\n")  # not the cluster's key
    lease = unique("audit")
    stranger = guard_factory(register=False, extra_args=("--audit-interval", "1", "--lease-namespace", "default",
                             "--lease-name", lease, "--lease-duration", "6"))

    wait_until(lambda: metric(stranger, "csinode_guard_state_key_foreign") == 1, timeout=30,
               what="the foreign key reported in the metric")
    ready = _readyz(stranger.port, control_plane.ca_crt)
    assert ready is not None and "it is not this cluster's key" in ready["cluster"], ready
    errors = [json.loads(line) for line in stranger.log.read_text().splitlines()
              if line.startswith("{") and "verifies none of the" in line]
    assert [e["level"] for e in errors] == ["ERROR"], "said once, as an ERROR"
    assert not _lease_exists(control_plane, lease)
    assert metric(stranger, "csinode_guard_leader") == 0
    assert metric(stranger, "csinode_guard_audit_passes_total", trigger="start") == 0
    assert audit_events_about(control_plane, node) == []
    assert [r for r in stranger.decisions() if r.get("source") == "audit"] == []
