"""Another mutating webhook for the reinvocation test: it adds a label to every CSINode UPDATE it is sent.

A plain ``http.server`` over TLS (the cluster CA's serving certificate), registered as a
MutatingWebhookConfiguration whose name sorts after the guard's, so the apiserver calls it after the guard and,
because it changed the object, reinvokes the guard (``reinvocationPolicy: IfNeeded``).

With ``raise_count=(node, driver, count)`` it is instead a webhook that rewrites a count after the guard: on every
UPDATE of CSINode ``node`` it sets ``driver``'s ``allocatable.count`` to ``count``, with ``reinvocationPolicy:
IfNeeded`` so that it also runs after the guard's reinvocation: the final object carries its count, which only
the validating webhook can catch.
"""

from __future__ import annotations

import base64
import contextlib
import json
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from tests.k8s.controlplane import ControlPlane, Guard, unique, wait_until


@dataclass
class Labeler:
    """The running labeler: its configuration name, label key and the AdmissionRequests it received."""

    name: str
    label: str = "test.csinode-guard.io/labelled"
    requests: list[dict[str, Any]] = field(default_factory=list)
    raise_count: tuple[str, str, int] | None = None


def _raise(labeler: Labeler, request: dict[str, Any]) -> list[dict[str, Any]]:
    """The patch setting the count of :attr:`Labeler.raise_count` (none for another object or driver)."""
    assert labeler.raise_count is not None
    node, driver, count = labeler.raise_count
    if request.get("name") != node:
        return []
    drivers = (request["object"].get("spec") or {}).get("drivers") or []
    return [{"op": "add", "path": f"/spec/drivers/{i}/allocatable", "value": {"count": count}}
            for i, d in enumerate(drivers) if d.get("name") == driver]


def _handler(labeler: Labeler) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            request = body["request"]
            labeler.requests.append(request)
            labels = (request["object"].get("metadata") or {}).get("labels")
            path = "/metadata/labels/" + labeler.label.replace("~", "~0").replace("/", "~1")
            patch = [{"op": "add", "path": path, "value": "yes"}] if labels else [
                {"op": "add", "path": "/metadata/labels", "value": {labeler.label: "yes"}}
            ]
            if labeler.raise_count is not None:
                patch = _raise(labeler, request)
            answer = {
                "apiVersion": "admission.k8s.io/v1",
                "kind": "AdmissionReview",
                "response": {
                    "uid": request["uid"],
                    "allowed": True,
                    "patchType": "JSONPatch",
                    "patch": base64.b64encode(json.dumps(patch).encode()).decode(),
                } if patch else {"uid": request["uid"], "allowed": True},
            }
            data = json.dumps(answer).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            return

    return Handler


@contextlib.contextmanager
def running_labeler(cp: ControlPlane, work: Path, guard: Guard,
                    raise_count: tuple[str, str, int] | None = None) -> Iterator[Labeler]:
    """Serve and register the labeler (after ``guard`` in the apiserver's order); removed on exit."""
    work.mkdir(parents=True, exist_ok=True)
    labeler = Labeler(name=unique("zz-labeler"), raise_count=raise_count)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(labeler))
    crt, key = cp.serving_cert("csinode-guard")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(crt, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    config = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": labeler.name},
        "webhooks": [{
            "name": "label.test.csinode-guard.io",
            "clientConfig": {
                "url": f"https://127.0.0.1:{server.server_address[1]}/label",
                "caBundle": base64.b64encode(cp.ca_crt.read_bytes()).decode(),
            },
            "rules": [{"operations": ["UPDATE"], "apiGroups": ["storage.k8s.io"], "apiVersions": ["v1"],
                       "resources": ["csinodes"], "scope": "Cluster"}],
            "failurePolicy": "Fail",
            "sideEffects": "None",
            "admissionReviewVersions": ["v1"],
            "reinvocationPolicy": "Never" if raise_count is None else "IfNeeded",
            "timeoutSeconds": 5,
        }],
    }
    try:
        cp.kubectl("create", "-f", "-", input=json.dumps(config))

        def effective() -> bool:
            seen = len(labeler.requests)
            cp.probe_write()
            return len(labeler.requests) > seen and guard.probe() is not None

        wait_until(effective, timeout=30, what="the labeler is called")
        yield labeler
    finally:
        cp.kubectl("delete", "mutatingwebhookconfiguration", labeler.name, "--ignore-not-found")

        def gone() -> bool:
            seen = len(labeler.requests)
            cp.probe_write()
            return len(labeler.requests) == seen

        wait_until(gone, timeout=30, what="the labeler is no longer called")
        server.shutdown()
        server.server_close()
