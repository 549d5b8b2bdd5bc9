"""One-step install on the real apiserver: a guard with its ServiceAccount's permissions only makes its serving
certificate and state key and fills in the caBundle of its webhook configurations; replicas started together end
with one certificate; a certificate close to expiry is renewed.

The RBAC is deploy/'s own (rendered with kustomize, applied as admin), the guard runs as
``system:serviceaccount:csinode-guard:csinode-guard`` (``cluster.sh user-kubeconfig``), and the webhook
configurations are deploy/'s too, with the Service reference replaced by the guard's URL (the apiserver here
cannot reach pods; ``register --url`` does the same). The apiserver's calls reaching the guard over TLS prove it
trusts the injected caBundle.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from tests.k8s.controlplane import REPO, ControlPlane, free_port, unique, wait_until

NAMESPACE = "csinode-guard"
NAME = "csinode-guard"
TLS_SECRET = "csinode-guard-tls"
STATE_KEY_SECRET = "csinode-guard-state-key"
SERVICE_ACCOUNT = f"system:serviceaccount:{NAMESPACE}:{NAME}"
RBAC_KINDS = {"Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}


@dataclass
class SelfCertifyingGuard:
    """``csinode-guard serve --tls-secret ... --inject-ca-bundle ...`` as the guard's ServiceAccount."""

    work: Path
    process: subprocess.Popen[bytes]
    port: int

    @property
    def cert_dir(self) -> Path:
        return self.work / "certs"

    def decisions(self) -> list[dict[str, Any]]:
        path = self.work / "decisions.log"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def served_certificate(self, ca_pem: bytes) -> bytes:
        """The DER certificate the guard presents, verified against ``ca_pem`` for the name ``localhost``."""
        context = ssl.create_default_context(cadata=ca_pem.decode())
        with urllib.request.urlopen(f"https://localhost:{self.port}/readyz", context=context, timeout=5) as answer:
            assert answer.status == 200
        with (
            socket.create_connection(("127.0.0.1", self.port), timeout=5) as raw,
            context.wrap_socket(raw, server_hostname="localhost") as tls,
        ):
            der = tls.getpeercert(binary_form=True)
        assert der is not None
        return der

    def log(self, tail: int | None = 3000) -> str:
        """The guard's log, its last ``tail`` characters (None: all of it)."""
        text = (self.work / "serve.log").read_text(errors="replace")
        return text if tail is None else text[-tail:]


@pytest.fixture
def installed_rbac(control_plane: ControlPlane) -> Iterator[list[dict[str, Any]]]:
    """deploy/'s Namespace, ServiceAccount and RBAC applied as admin; the rendered webhook configurations returned.
    Removes the two configurations and the guard's Secrets afterwards."""
    rendered = [d for d in yaml.safe_load_all(control_plane.kubectl("kustomize", str(REPO / "deploy")).stdout) if d]
    rbac = [d for d in rendered if d["kind"] in RBAC_KINDS]
    control_plane.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": rbac}))
    webhooks = [d for d in rendered if d["kind"].endswith("WebhookConfiguration")]
    _delete_guard_objects(control_plane)
    try:
        yield webhooks
    finally:
        _delete_guard_objects(control_plane)


def _delete_guard_objects(cp: ControlPlane) -> None:
    for kind in ("mutatingwebhookconfiguration", "validatingwebhookconfiguration"):
        cp.kubectl("delete", kind, NAME, "--ignore-not-found", "--wait=false")
    cp.kubectl("delete", "mutatingwebhookconfiguration", f"{NAME}-nodes", "--ignore-not-found", "--wait=false")
    cp.kubectl("-n", NAMESPACE, "delete", "secret", TLS_SECRET, STATE_KEY_SECRET, "--ignore-not-found")


def _apply_webhooks_pointing_at(cp: ControlPlane, webhooks: list[dict[str, Any]], port: int) -> None:
    """deploy/'s configurations (no caBundle), each entry sent to ``https://127.0.0.1:PORT`` instead of the Service."""
    for configuration in webhooks:
        for webhook in configuration["webhooks"]:
            path = webhook["clientConfig"]["service"]["path"]
            webhook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}"}
            assert "caBundle" not in webhook["clientConfig"]
    cp.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": webhooks}))


@contextlib.contextmanager
def _guards(cp: ControlPlane, root: Path, count: int, ports: list[int] | None = None,
            extra_args: tuple[str, ...] = ()) -> Iterator[list[Any]]:
    """``count`` guards started at the same moment as the ServiceAccount, each with an empty directory."""
    kubeconfig = cp.user_kubeconfig(SERVICE_ACCOUNT)
    env = {k: v for k, v in os.environ.items() if k not in {"PROMETHEUS_MULTIPROC_DIR", "KUBECONFIG"}}
    guards = []
    try:
        for index in range(count):
            work = root / f"replica{index}"
            work.mkdir(parents=True)
            port = ports[index] if ports else free_port()
            cmd = [
                sys.executable, "-m", "webhook", "serve", "--host", "127.0.0.1", "--port", str(port),
                "--metrics-port", "0", "--cert-dir", str(work / "certs"), "--no-generate-certs",
                "--state-key-file", str(work / "state-key" / "key"), "--kubeconfig", str(kubeconfig),
                "--tls-secret", TLS_SECRET, "--state-key-secret", STATE_KEY_SECRET, "--inject-ca-bundle", NAME,
                "--namespace", NAMESPACE, "--audit-log", str(work / "decisions.log"), "--workers", "1",
                *extra_args,
            ]
            with (work / "serve.log").open("ab") as log:
                process = subprocess.Popen(cmd, stdout=log, stderr=log, env=env, cwd=work, start_new_session=True)
            guards.append(SelfCertifyingGuard(work, process, port))
        yield guards
    finally:
        for guard in guards:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(guard.process.pid, signal.SIGTERM)
        for guard in guards:
            try:
                guard.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(guard.process.pid, signal.SIGKILL)
                guard.process.wait(timeout=10)


def _secret(cp: ControlPlane, name: str) -> dict[str, Any] | None:
    result = cp.kubectl("-n", NAMESPACE, "get", "secret", name, "-o", "json", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


def _data(secret: dict[str, Any], key: str) -> bytes:
    return base64.b64decode(secret["data"][key])


def _wait_ready(guard: SelfCertifyingGuard, cp: ControlPlane) -> None:
    def ready() -> bool:
        assert guard.process.poll() is None, f"serve exited {guard.process.returncode}: {guard.log()}"
        secret = _secret(cp, TLS_SECRET)
        if secret is None:
            return False
        with contextlib.suppress(OSError, ssl.SSLError):
            guard.served_certificate(_data(secret, "ca.crt"))
            return True
        return False

    wait_until(ready, timeout=90, interval=0.3, what="guard ready with a certificate from its Secret")


def _ca_bundles(cp: ControlPlane) -> list[str | None]:
    bundles = []
    for kind in ("mutatingwebhookconfiguration", "validatingwebhookconfiguration"):
        configuration = cp.kubectl_json("get", kind, NAME)
        bundles += [w["clientConfig"].get("caBundle") for w in configuration["webhooks"]]
    nodes = cp.kubectl_json("get", "mutatingwebhookconfiguration", f"{NAME}-nodes")  # the Node entry's own
    return bundles + [w["clientConfig"].get("caBundle") for w in nodes["webhooks"]]


def test_two_guards_with_only_their_service_accounts_rights_make_one_certificate_and_fill_in_the_ca_bundle(
    control_plane: ControlPlane, installed_rbac: list[dict[str, Any]], tmp_path: Path
) -> None:
    cp = control_plane
    sa = cp.user_kubeconfig(SERVICE_ACCOUNT)
    # The ServiceAccount reads no other Secret and can change no other webhook configuration.
    for verb, what in (("get", "secrets/someone-elses"), ("list", "secrets"),
                       ("update", "mutatingwebhookconfigurations/someone-elses")):
        answer = cp.kubectl("auth", "can-i", verb, what, "-n", NAMESPACE, kubeconfig=sa, check=False)
        assert answer.stdout.strip() == "no", (verb, what, answer.stdout)
    assert _secret(cp, TLS_SECRET) is None and _secret(cp, STATE_KEY_SECRET) is None

    ports = [free_port(), free_port()]
    _apply_webhooks_pointing_at(cp, installed_rbac, ports[0])
    assert _ca_bundles(cp) == [None] * 5
    with _guards(cp, tmp_path, 2, ports) as guards:
        for guard in guards:
            _wait_ready(guard, cp)
        tls_secret = _secret(cp, TLS_SECRET)
        assert tls_secret is not None and tls_secret["type"] == "kubernetes.io/tls"
        assert set(tls_secret["data"]) == {"tls.crt", "tls.key", "ca.crt", "ca.key", "ca-bundle.crt"}
        served = {guard.served_certificate(_data(tls_secret, "ca.crt")) for guard in guards}
        stored = x509.load_pem_x509_certificate(_data(tls_secret, "tls.crt"))
        assert served == {stored.public_bytes(encoding=Encoding.DER)}, "both replicas serve the one stored certificate"
        names = stored.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert "csinode-guard.csinode-guard.svc" in names.get_values_for_type(x509.DNSName)
        state_secret = _secret(cp, STATE_KEY_SECRET)
        assert state_secret is not None
        key = _data(state_secret, "key")
        assert len(bytes.fromhex(key.decode().strip())) == 32
        assert {(g.work / "state-key" / "key").read_bytes() for g in guards} == {key}, "one state key"

        expected = base64.b64encode(_data(tls_secret, "ca-bundle.crt")).decode()
        wait_until(lambda: _ca_bundles(cp) == [expected] * 5, timeout=60, what="caBundle filled in")
        created = [line for g in guards for line in g.log(None).splitlines() if "created the serving" in line]
        assert len(created) == 1, created

        # The apiserver trusts the injected CA: kubelet's registration reaches the guard (failurePolicy Ignore
        # would let it pass silently otherwise) and is judged.
        node = unique("install")
        cp.create_node(node)
        cp.kubelet(node, "install", "--driver", "ebs.csi.aws.com", "--node-id", "i-1", "--max-volumes", "5")
        wait_until(lambda: any(r.get("node") == node for r in guards[0].decisions()), timeout=30,
                   what="the apiserver's call reached the guard over TLS")


def test_a_serving_certificate_close_to_expiry_is_renewed_from_the_same_ca(
    control_plane: ControlPlane, installed_rbac: list[dict[str, Any]], tmp_path: Path
) -> None:
    from webhook.serving import dev_certs  # noqa: PLC0415

    cp = control_plane
    with tempfile.TemporaryDirectory() as made:
        paths = dev_certs.ensure_dev_certs(made, ["csinode-guard.csinode-guard.svc"], valid_days=10)
        old = {name: (Path(made) / name).read_bytes() for name in ("tls.crt", "tls.key", "ca.crt", "ca.key")}
        old["ca-bundle.crt"] = paths.ca_bundle.read_bytes()
    cp.kubectl("-n", NAMESPACE, "create", "secret", "generic", TLS_SECRET, "--type", "kubernetes.io/tls",
               *[f"--from-literal={k}={v.decode()}" for k, v in old.items()])
    with _guards(cp, tmp_path, 1) as (guard,):
        _wait_ready(guard, cp)
        secret = _secret(cp, TLS_SECRET)
        assert secret is not None
        assert _data(secret, "ca.crt") == old["ca.crt"] and _data(secret, "ca.key") == old["ca.key"]
        renewed = x509.load_pem_x509_certificate(_data(secret, "tls.crt"))
        assert renewed.not_valid_after_utc - dt.datetime.now(dt.UTC) > dt.timedelta(days=300)
        assert guard.served_certificate(old["ca.crt"]) == renewed.public_bytes(encoding=Encoding.DER)
        assert "renewed the serving certificate" in guard.log(None)



def _validating_conditions(cp: ControlPlane) -> list[list[str]]:
    configuration = cp.kubectl_json("get", "validatingwebhookconfiguration", NAME)
    return [[c["name"] for c in w.get("matchConditions") or []] for w in configuration["webhooks"]]


def test_the_guard_keeps_one_call_while_no_other_mutator_matches_csinodes_and_two_while_one_does(
    control_plane: ControlPlane, installed_rbac: list[dict[str, Any]], tmp_path: Path
) -> None:
    """deploy/'s default (``serve --validation auto``) with deploy/'s RBAC: the keeper puts the one-call
    matchCondition on both validating entries at start, removes it within one pass of another
    MutatingWebhookConfiguration that matches CSINodes appearing (and says so in its log and metric), and puts it
    back when that one goes. The other webhook's own matchCondition is ``false``: the apiserver never calls it
    (it only has to exist), so the rest of this worker's tests are not slowed by it."""
    from webhook.kube.one_call import NOT_DECIDED_CONDITION_NAME  # noqa: PLC0415

    cp = control_plane
    port = free_port()
    _apply_webhooks_pointing_at(cp, installed_rbac, port)
    assert all(NOT_DECIDED_CONDITION_NAME not in names for names in _validating_conditions(cp)), "deploy/ ships two"
    other = {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": unique("other-mutator")},
        "webhooks": [{
            "name": "rewrites.csinodes.example.com", "admissionReviewVersions": ["v1"], "sideEffects": "None",
            "failurePolicy": "Ignore", "clientConfig": {"url": "https://127.0.0.1:9/mutate"},
            "rules": [{"apiGroups": ["storage.k8s.io"], "apiVersions": ["v1"], "operations": ["UPDATE"],
                       "resources": ["csinodes"]}],
            "matchConditions": [{"name": "never", "expression": "false"}],
        }],
    }
    with _guards(cp, tmp_path, 1, [port], ("--cluster-sync-interval", "1")) as (guard,):
        _wait_ready(guard, cp)
        wait_until(lambda: all(NOT_DECIDED_CONDITION_NAME in n for n in _validating_conditions(cp)), timeout=60,
                   what="one call at start: no other mutator")
        cp.kubectl("apply", "-f", "-", input=json.dumps(other))
        try:
            wait_until(lambda: all(NOT_DECIDED_CONDITION_NAME not in n for n in _validating_conditions(cp)),
                       timeout=60, what="two calls once another mutator matches CSINodes")
            assert f"{other['metadata']['name']}/rewrites.csinodes.example.com" in guard.log(None)
            assert "switched validatingwebhookconfigurations/csinode-guard from cel to webhook" in guard.log(None)
        finally:
            cp.kubectl("delete", "mutatingwebhookconfiguration", other["metadata"]["name"], "--ignore-not-found")
        wait_until(lambda: all(NOT_DECIDED_CONDITION_NAME in n for n in _validating_conditions(cp)), timeout=60,
                   what="one call again once it is gone")
        # The caBundle and every other condition are as the keeper found them: only the one condition moves.
        shipped = next(c for c in installed_rbac if c["kind"] == "ValidatingWebhookConfiguration")
        assert [n[:-1] for n in _validating_conditions(cp)] == [
            [c["name"] for c in w["matchConditions"]] for w in shipped["webhooks"]
        ]
