"""The test policy of the real-node scenarios: the bundled default plus csi-driver-host-path, whose node plugin
runs on the real nodes, with a ceiling and ``versionSource: pod`` over the plugin's DaemonSet pods."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.k8s.controlplane import ADMIN_USER, policy_file
from tests.k8s.realnode.cluster import DRIVER, NAMESPACE, PLUGIN_LABELS


def hostpath_policy(
    path: Path, *, ceiling: int, freeze_for: str | None = None, reconcile: str | None = None
) -> Path:
    """Write the bundled policy with a ``hostpath.csi.k8s.io`` entry to ``path`` (returned): ``ceiling.max``
    ``ceiling``; its version from the image tag of container ``hostpath`` in the DaemonSet-controlled pods
    labelled :data:`PLUGIN_LABELS` in kube-system; ``change-rate.minInterval`` 1 s (the CSIDriver's 10 s period
    is the interval then); ``writer-version.freezeFor`` ``freeze_for`` when given; ``spec.reconcile``
    ``reconcile`` when given, with the admin user (the test guards' identity) as a writer, as the guard's
    ServiceAccount is in ``deploy/``. Written again with other values, a running guard reloads it."""

    def edit(doc: dict[str, Any]) -> None:
        spec = doc["spec"]
        spec["rules"]["change-rate"]["minInterval"] = "1s"
        if freeze_for is not None:
            spec["rules"]["writer-version"]["freezeFor"] = freeze_for
        if reconcile is not None:
            spec["reconcile"] = reconcile
            spec["writers"]["users"] = [ADMIN_USER]
        spec["drivers"][DRIVER] = {
            "versionSource": {"type": "pod", "namespace": NAMESPACE, "selector": {"matchLabels": dict(PLUGIN_LABELS)},
                              "container": "hostpath"},
            "ceiling": {"max": ceiling},
        }

    return policy_file(path, edit)
