"""Recovery after a correction, gated by attaches, on the real apiserver: the external-attacher's VolumeAttachment
status (``status.attachError.errorCode`` 8, ResourceExhausted) holds the next recovery step while an attach at the
corrected count keeps failing, and lets it through once the attach succeeds.

The VolumeAttachment is created as admin and its status written through the ``status`` subresource, as the
external-attacher writes it (a new ``attachError.time`` on every failed retry; ``attached: true`` and no
``attachError`` once the volume attaches). kubelet's writes are kubelet's own code (``kubelet-csinode``).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tests.k8s.attachments import create_volume_attachment, failed_attach, write_attach_status
from tests.k8s.controlplane import ControlPlane, Guard, counts, fast_policy, judged_dry_run, unique, wait_until
from webhook.admission.state import parse_time

EBS = "ebs.csi.aws.com"


def test_a_recovery_step_waits_until_the_failing_attach_succeeds(
    control_plane: ControlPlane, guard_factory: Any, tmp_path: Path
) -> None:
    cp = control_plane
    guard: Guard = guard_factory(fast_policy(tmp_path / "policy.yaml"))
    node = unique("recovery")
    cp.create_node(node)
    cp.kubelet(node, "install", "--driver", EBS, "--node-id", "i-1", "--max-volumes", "26")

    va_name = create_volume_attachment(cp, node, EBS)
    try:
        write_attach_status(cp, va_name, failed_attach(datetime.now(UTC)))
        wait_until(
            lambda: judged_dry_run(cp, guard, node, EBS, 20).get("correction") == "resource-exhausted",
            what="the attach error in the guard's cache",
        )
        cp.kubelet(node, "update", "--driver", EBS, "--max-volumes", "20")
        stored = cp.get_csinode(node)
        assert counts(stored) == {EBS: 20}
        correction = json.loads(stored["metadata"]["annotations"]["csinode-guard.io/state"])["drivers"][EBS][
            "correction"
        ]
        assert (correction["from"], correction["to"], correction["basis"]) == (26, 20, "resource-exhausted")
        corrected_at = parse_time(correction["at"])

        # The external-attacher retries the attach, which fails again at the corrected count (stamped after the
        # correction: attachError.time has whole seconds).
        retried = wait_until(
            lambda: (now := datetime.now(UTC).replace(microsecond=0)) > corrected_at and now,
            what="a whole second after the correction",
        )
        write_attach_status(cp, va_name, failed_attach(retried))

        last: list[dict[str, Any]] = []

        def held_by_the_gate() -> bool:
            # held by count-rollback alone (change-rate's 2 s interval has passed), at the stored count
            last[:] = [judged_dry_run(cp, guard, node, EBS, 22)]
            found = [r for r in last[0]["rules"] if r["result"] == "violation"]
            return (
                last[0]["final"] == 20
                and [r["rule"] for r in found] == ["count-rollback"]
                and (
                    "attach failures with errorCode 8 since the last step" in found[0]["message"]
                    and va_name in found[0]["message"]
                )
            )

        try:
            wait_until(held_by_the_gate, what="the retried attach failure holding the recovery step")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; last decision: {last}") from None
        held = cp.kubelet(node, "update", "--driver", EBS, "--max-volumes", "22")
        assert "[count-rollback]" in held.stderr and "errorCode 8" in held.stderr, "the clamp's warning reaches kubelet"
        assert counts(cp.get_csinode(node)) == {EBS: 20}

        # The volume attaches: the external-attacher sets attached and removes the error.
        write_attach_status(cp, va_name, {"attached": True, "attachError": None})
        assert "attachError" not in cp.kubectl_json("get", "volumeattachment", va_name)["status"]
        wait_until(
            lambda: judged_dry_run(cp, guard, node, EBS, 22)["decision"] == "allow",
            what="the recovery step once the attach succeeded",
        )
        cp.kubelet(node, "update", "--driver", EBS, "--max-volumes", "22")
        assert counts(cp.get_csinode(node)) == {EBS: 22}
    finally:
        cp.kubectl("delete", "volumeattachment", va_name, "--ignore-not-found")
