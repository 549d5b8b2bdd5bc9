"""VolumeAttachments as the external-attacher writes them, for the real-cluster tests: the object created (as
admin) for a node and an attacher (the CSI driver's name), then its ``status`` written through the status
subresource, as csi-attacher does (``status.attachError``: ``time``, ``message``, ``errorCode``, the gRPC code of
the failed ControllerPublishVolume: 8 ResourceExhausted, 9 FailedPrecondition)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from tests.k8s.controlplane import ControlPlane, unique

MESSAGES = {
    8: "rpc error: code = ResourceExhausted desc = attachment limit reached",
    9: "rpc error: code = FailedPrecondition desc = volume is in another zone",
}
"""The attach error message csi-attacher records for each gRPC code used here."""


def create_volume_attachment(cp: ControlPlane, node: str, driver: str) -> str:
    """A VolumeAttachment of a (made-up) PersistentVolume to ``node`` by ``driver``, no status yet; its name."""
    name = unique("va")
    spec = {"attacher": driver, "nodeName": node, "source": {"persistentVolumeName": unique("pv")}}
    obj = {"apiVersion": "storage.k8s.io/v1", "kind": "VolumeAttachment", "metadata": {"name": name}, "spec": spec}
    cp.kubectl("create", "-f", "-", input=json.dumps(obj))
    return name


def write_attach_status(cp: ControlPlane, name: str, status: dict[str, Any]) -> None:
    """Merge ``status`` into the VolumeAttachment's status through its status subresource (``attachError: None``
    removes the error)."""
    cp.kubectl(
        "patch", "volumeattachment", name, "--subresource=status", "--type=merge", "-p", json.dumps({"status": status})
    )


def failed_attach(when: datetime, code: int = 8) -> dict[str, Any]:
    """A failed attach's status, stamped ``when`` (whole seconds, as the API stores it), with gRPC ``code``."""
    error = {"time": when.strftime("%Y-%m-%dT%H:%M:%SZ"), "errorCode": code, "message": MESSAGES[code]}
    return {"attached": False, "attachError": error}


def attach_error(cp: ControlPlane, node: str, driver: str, code: int) -> str:
    """A VolumeAttachment for (node, driver) whose attach failed now with gRPC ``code``; its name."""
    name = create_volume_attachment(cp, node, driver)
    write_attach_status(cp, name, failed_attach(datetime.now(UTC), code))
    return name
