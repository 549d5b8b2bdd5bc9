"""``csinode-guard register`` / ``unregister`` as subprocesses, with the real kubernetes client, against the local
API-wire test server (tests/apiserver)."""

from __future__ import annotations

import base64
import re
import subprocess
from pathlib import Path
from typing import Any

import click
import pytest
import yaml

from tests.apiserver import FakeApiServer
from tests.clirun import run_cli
from webhook.cli import main
from webhook.kube.kubeapi import parse_warnings
from webhook.kube.registration import WebhookTarget, build_node_webhook_configuration, build_webhook_configurations
from webhook.serving import cert_rotation, dev_certs

REPO = Path(__file__).resolve().parent.parent
MUTATING = "mutatingwebhookconfigurations.admissionregistration.k8s.io"
VALIDATING = "validatingwebhookconfigurations.admissionregistration.k8s.io"
NAME = "csinode-guard"
NODES = "csinode-guard-nodes"
"""The Node entry's configuration (label provenance), registered and removed with the two CSINode ones."""


@pytest.fixture(scope="module")
def module_certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cert_dir = tmp_path_factory.mktemp("certs")
    dev_certs.ensure_dev_certs(cert_dir)
    return cert_dir


@pytest.fixture
def cert_dir(module_certs: Path, tmp_path: Path) -> Path:
    """A copy of one generated certificate directory (CA, serving certificate, ca-bundle.crt)."""
    target = tmp_path / "certs"
    target.mkdir()
    for path in module_certs.iterdir():
        (target / path.name).write_bytes(path.read_bytes())
    return target


def register(cert_dir: Path, kubeconfig: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return run_cli("register", "--cert-dir", str(cert_dir), "--kubeconfig", kubeconfig, *extra, cwd=cert_dir.parent)


def expected(cert_dir: Path, bundle_file: str = "ca-bundle.crt", validation: str = "cel",
             **target: Any) -> list[dict[str, Any]]:
    """What register builds; ``validation`` ``cel`` is what its default (auto) chooses on a cluster where no
    other mutator matches CSINodes, as on this test's apiserver."""
    built = WebhookTarget(ca_bundle=(cert_dir / bundle_file).read_bytes(), **target)
    return [*build_webhook_configurations(built, validation=validation), build_node_webhook_configuration(built)]


def stored(apiserver: FakeApiServer) -> list[dict[str, Any]]:
    objects = [apiserver.get(MUTATING, NAME), apiserver.get(VALIDATING, NAME), apiserver.get(MUTATING, NODES)]
    assert all(objects), objects
    return [o for o in objects if o is not None]


def writes(apiserver: FakeApiServer) -> list[tuple[str, str | None, str | None]]:
    """(method, resource, dryRun) of every request that is not a GET."""
    return [(r.method, r.resource, r.query.get("dryRun")) for r in apiserver.requests if r.method != "GET"]


def ca_bundle(obj: dict[str, Any]) -> bytes:
    return base64.b64decode(obj["webhooks"][0]["clientConfig"]["caBundle"])


# --- register -------------------------------------------------------------------------------------------------


def test_register_creates_both_configurations_with_the_cert_dirs_bundle(
    apiserver: FakeApiServer, kubeconfig: str, cert_dir: Path
) -> None:
    result = register(cert_dir, kubeconfig)

    assert result.returncode == 0, result.stderr
    assert f"{MUTATING}/{NAME} created" in result.stdout
    assert f"{VALIDATING}/{NAME} created" in result.stdout
    assert f"{MUTATING}/{NODES} created" in result.stdout
    assert f"caBundle: 1 certificate(s) from {cert_dir / 'ca-bundle.crt'}" in result.stdout
    assert "validation cel: auto: no other mutating webhook or policy matches CSINodes, so one call" in result.stdout
    objects = stored(apiserver)
    for got, want in zip(objects, expected(cert_dir), strict=True):
        assert got["kind"] == want["kind"]
        assert got["webhooks"] == want["webhooks"]
        assert got["metadata"]["labels"] == want["metadata"]["labels"]
        assert ca_bundle(got) == (cert_dir / "ca-bundle.crt").read_bytes()
    assert writes(apiserver) == [("POST", MUTATING, None), ("POST", VALIDATING, None), ("POST", MUTATING, None)]
    listed = [r for r in apiserver.requests if r.method == "GET" and r.resource == MUTATING and r.name is None]
    assert listed, "auto lists the other mutating webhook configurations before it chooses"
    posts = [r for r in apiserver.requests if r.method == "POST"]
    assert {r.query.get("fieldManager") for r in posts} == {"csinode-guard"}
    assert {r.headers["user-agent"].split("/")[0] for r in apiserver.requests} == {"csinode-guard"}


def test_a_second_register_updates_both_in_place_with_their_resource_version(
    apiserver: FakeApiServer, kubeconfig: str, cert_dir: Path
) -> None:
    assert register(cert_dir, kubeconfig).returncode == 0
    first = stored(apiserver)
    apiserver.patch(MUTATING, NAME, {"metadata": {"labels": {"team": "storage"}, "annotations": {"a": "b"}}})
    rotated = stored(apiserver)[0]["metadata"]["resourceVersion"]
    apiserver.requests.clear()
    cert_rotation.rotate(cert_dir, new_ca=True)  # ca-bundle.crt now carries the new and the old CA

    result = register(cert_dir, kubeconfig)

    assert result.returncode == 0, result.stderr
    assert f"{MUTATING}/{NAME} configured" in result.stdout
    assert f"{VALIDATING}/{NAME} configured" in result.stdout
    assert "caBundle: 2 certificate(s)" in result.stdout
    assert writes(apiserver) == [("PUT", MUTATING, None), ("PUT", VALIDATING, None), ("PUT", MUTATING, None)]
    puts = [r for r in apiserver.requests if r.method == "PUT"]
    assert [p.body["metadata"]["resourceVersion"] for p in puts] == [
        rotated,
        first[1]["metadata"]["resourceVersion"],
        first[2]["metadata"]["resourceVersion"],
    ]
    second = stored(apiserver)
    assert [o["metadata"]["uid"] for o in second] == [o["metadata"]["uid"] for o in first]
    assert [ca_bundle(o) for o in second] == [(cert_dir / "ca-bundle.crt").read_bytes()] * 3
    assert [o["webhooks"] for o in second] == [o["webhooks"] for o in expected(cert_dir)]
    assert second[0]["metadata"]["labels"] == {"app.kubernetes.io/name": "csinode-guard",
                                           "app.kubernetes.io/component": "admission-webhooks", "team": "storage"}
    assert second[0]["metadata"]["annotations"] == {"a": "b"}


OTHER_MUTATOR: dict[str, Any] = {
    "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
    "metadata": {"name": "sidecar-injector"},
    "webhooks": [{"name": "everything.example.com", "sideEffects": "None", "admissionReviewVersions": ["v1"],
                  "clientConfig": {"url": "https://example.com/"},
                  "rules": [{"apiGroups": ["*"], "apiVersions": ["*"], "operations": ["*"], "resources": ["*"]}]}],
}


def test_register_takes_two_calls_when_another_mutating_webhook_matches_csinodes(
    apiserver: FakeApiServer, kubeconfig: str, cert_dir: Path
) -> None:
    apiserver.create(MUTATING, OTHER_MUTATOR)

    result = register(cert_dir, kubeconfig)

    assert result.returncode == 0, result.stderr
    assert ("validation webhook: auto: another mutator can rewrite CSINodes "
            "(sidecar-injector/everything.example.com), so two calls") in result.stdout
    assert stored(apiserver)[1]["webhooks"] == expected(cert_dir, validation="webhook")[1]["webhooks"]


@pytest.mark.parametrize("mode", ["webhook", "cel"])
def test_register_validation_override_is_kept_whatever_else_is_installed(
    apiserver: FakeApiServer, kubeconfig: str, cert_dir: Path, mode: str
) -> None:
    if mode == "cel":
        apiserver.create(MUTATING, OTHER_MUTATOR)

    result = register(cert_dir, kubeconfig, "--validation", mode)

    assert result.returncode == 0, result.stderr
    assert f"validation {mode}: --validation {mode} (override)" in result.stdout
    assert stored(apiserver)[1]["webhooks"] == expected(cert_dir, validation=mode)[1]["webhooks"]


def test_register_retries_when_the_configuration_changed_between_get_and_put(
    apiserver: FakeApiServer, kubeconfig: str, cert_dir: Path
) -> None:
    assert register(cert_dir, kubeconfig).returncode == 0
    apiserver.fail_next(MUTATING, 409, method="PUT", message="the object has been modified")
    apiserver.requests.clear()

    result = register(cert_dir, kubeconfig)

    assert result.returncode == 0, result.stderr
    assert [(r.method, r.resource) for r in apiserver.requests if r.resource == MUTATING and r.name == NAME] == [
        ("GET", MUTATING),
        ("PUT", MUTATING),
        ("GET", MUTATING),
        ("PUT", MUTATING),
    ]


def test_register_falls_back_to_ca_crt(apiserver: FakeApiServer, kubeconfig: str, cert_dir: Path) -> None:
    (cert_dir / "ca-bundle.crt").unlink()

    result = register(cert_dir, kubeconfig)

    assert result.returncode == 0, result.stderr
    assert f"from {cert_dir / 'ca.crt'}" in result.stdout
    assert [ca_bundle(o) for o in stored(apiserver)] == [(cert_dir / "ca.crt").read_bytes()] * 3


def test_register_dry_run_prints_the_yaml_and_contacts_no_cluster(apiserver: FakeApiServer, cert_dir: Path) -> None:
    result = run_cli(
        "register", "--cert-dir", str(cert_dir), "--dry-run=client", "--service", "guard", "--namespace", "kube-system",
        cwd=cert_dir.parent,
    )

    assert result.returncode == 0, result.stderr
    assert list(yaml.safe_load_all(result.stdout)) == expected(
        cert_dir, validation="webhook", service_name="guard", service_namespace="kube-system"
    )
    assert "# validation webhook: auto: --dry-run lists no other mutating webhooks" in result.stderr
    assert apiserver.requests == []
    assert apiserver.list(MUTATING) == [] and apiserver.list(VALIDATING) == []


def test_register_with_url_and_kubeconfig_from_the_environment(
    apiserver: FakeApiServer, kubeconfig: str, cert_dir: Path
) -> None:
    result = run_cli(
        "register", "--cert-dir", str(cert_dir), "--url", "https://10.0.0.5:8443",
        cwd=cert_dir.parent, env={"KUBECONFIG": kubeconfig},
    )

    assert result.returncode == 0, result.stderr
    assert [o["webhooks"][0]["clientConfig"]["url"] for o in stored(apiserver)] == [
        "https://10.0.0.5:8443/mutate",
        "https://10.0.0.5:8443/validate",
        "https://10.0.0.5:8443/node-labels",
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(["--url", "https://h:1", "--service", "x"], "--url replaces the Service", id="url-and-service"),
        pytest.param(["--url", "http://h:1"], "must be https://", id="plain-http-url"),
        pytest.param(["--url", "https://127.0.0.1:99999"], "port 99999 is not a TCP port (1-65535)",
                     id="a port over 65535"),
        pytest.param(["--url", "https://127.0.0.1:0"], "port 0 is not a TCP port", id="port 0"),
        pytest.param(["--url", "https://127.0.0.1:28443/mutate"],
                     "the path already ends in /mutate, but /mutate and /validate are appended to it (this URL "
                     "would call /mutate/mutate): give the guard's base URL, e.g. https://127.0.0.1:28443",
                     id="a URL that already ends in /mutate"),
        pytest.param(["--url", "https://guard.example/base/validate/"], "e.g. https://guard.example/base",
                     id="a URL that already ends in /validate/"),
    ],
)
def test_register_rejects_contradictory_options(
    apiserver: FakeApiServer, kubeconfig: str, cert_dir: Path, args: list[str], message: str
) -> None:
    result = register(cert_dir, kubeconfig, *args)

    assert result.returncode == 2
    assert message in result.stderr
    assert apiserver.requests == []


def test_register_without_certificates_says_how_to_make_them(kubeconfig: str, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()

    result = run_cli("register", "--cert-dir", "empty", "--kubeconfig", kubeconfig, cwd=tmp_path)

    assert result.returncode == 1
    assert "neither ca-bundle.crt nor ca.crt found" in result.stderr
    assert "csinode-guard certs generate --cert-dir empty" in result.stderr


def test_register_with_a_bundle_that_is_not_pem_fails(kubeconfig: str, cert_dir: Path) -> None:
    (cert_dir / "ca-bundle.crt").write_text("not a certificate\n")

    result = register(cert_dir, kubeconfig)

    assert result.returncode == 1
    assert "ca-bundle.crt: not PEM certificates" in result.stderr


def test_register_without_a_cluster_exits_3_no_cluster(cert_dir: Path, tmp_path: Path) -> None:
    home = tmp_path / "home-without-kubeconfig"
    home.mkdir()
    result = run_cli("register", "--cert-dir", str(cert_dir), cwd=cert_dir.parent, env={"HOME": str(home)})

    assert result.returncode == 3
    assert "no cluster configured: pass --kubeconfig, set KUBECONFIG" in result.stderr


def test_register_shows_the_api_servers_refusal(apiserver: FakeApiServer, kubeconfig: str, cert_dir: Path) -> None:
    message = 'mutatingwebhookconfigurations.admissionregistration.k8s.io is forbidden: User "bob" cannot create'
    apiserver.fail_next(MUTATING, 403, method="POST", message=message)

    result = register(cert_dir, kubeconfig)

    assert result.returncode == 1
    assert f"{MUTATING}/{NAME} not applied: the API server answered 403 Forbidden: {message}" in result.stderr
    assert apiserver.list(VALIDATING) == []  # stops at the first failure


# --- unregister -----------------------------------------------------------------------------------------------


def test_unregister_deletes_both_and_a_second_run_is_not_an_error(
    apiserver: FakeApiServer, kubeconfig: str, cert_dir: Path
) -> None:
    assert register(cert_dir, kubeconfig).returncode == 0

    first = run_cli("unregister", "--kubeconfig", kubeconfig, cwd=cert_dir.parent)
    second = run_cli("unregister", "--kubeconfig", kubeconfig, cwd=cert_dir.parent)

    assert first.returncode == 0, first.stderr
    assert first.stdout.splitlines() == [
        f"{MUTATING}/{NAME} deleted", f"{VALIDATING}/{NAME} deleted", f"{MUTATING}/{NODES} deleted",
    ]
    assert apiserver.list(MUTATING) == [] and apiserver.list(VALIDATING) == []
    assert second.returncode == 0, second.stderr
    assert second.stdout.splitlines() == [
        f"{MUTATING}/{NAME} not found (already removed)",
        f"{VALIDATING}/{NAME} not found (already removed)",
        f"{MUTATING}/{NODES} not found (already removed)",
    ]


def test_unregister_dry_run_asks_the_server_and_deletes_nothing(
    apiserver: FakeApiServer, kubeconfig: str, cert_dir: Path
) -> None:
    assert register(cert_dir, kubeconfig).returncode == 0
    apiserver.requests.clear()

    result = run_cli("unregister", "--dry-run=server", "--kubeconfig", kubeconfig, cwd=cert_dir.parent)

    assert result.returncode == 0, result.stderr
    assert "would be deleted (server dry run)" in result.stdout
    assert writes(apiserver) == [
        ("DELETE", MUTATING, "All"), ("DELETE", VALIDATING, "All"), ("DELETE", MUTATING, "All"),
    ]
    assert len(stored(apiserver)) == 3


def test_the_deprecated_bare_dry_run_of_unregister_is_a_server_dry_run_and_warns(
    apiserver: FakeApiServer, kubeconfig: str, cert_dir: Path
) -> None:
    assert register(cert_dir, kubeconfig).returncode == 0
    apiserver.requests.clear()

    result = run_cli("unregister", "--dry-run", "--kubeconfig", kubeconfig, cwd=cert_dir.parent)

    assert result.returncode == 0, result.stderr
    assert "--dry-run without a value is deprecated and will be removed in 0.3.0: use --dry-run=server" in (
        result.stderr)
    assert writes(apiserver) == [("DELETE", MUTATING, "All"), ("DELETE", VALIDATING, "All"),
                                 ("DELETE", MUTATING, "All")]  # the third: the Node entry's configuration
    assert len(stored(apiserver)) == 3


def test_unregister_client_dry_run_sends_no_write_and_says_what_it_does_on_stderr(
    apiserver: FakeApiServer, kubeconfig: str, cert_dir: Path
) -> None:
    assert register(cert_dir, kubeconfig).returncode == 0
    apiserver.requests.clear()

    result = run_cli("unregister", "--dry-run=client", "--kubeconfig", kubeconfig, cwd=cert_dir.parent)

    assert result.returncode == 0, result.stderr
    assert "would be deleted (client dry run)" in result.stdout
    assert f"deleting {MUTATING}/" in result.stderr, "progress on standard error"
    assert writes(apiserver) == [] and len(stored(apiserver)) == 3


def test_register_server_dry_run_is_checked_by_the_apiserver_and_stores_nothing(
    apiserver: FakeApiServer, kubeconfig: str, cert_dir: Path
) -> None:
    result = register(cert_dir, kubeconfig, "--dry-run=server")

    assert result.returncode == 0, result.stderr
    assert "created (server dry run)" in result.stdout
    assert [w[2] for w in writes(apiserver)] == ["All", "All", "All"]
    assert apiserver.get(MUTATING, NAME) is None and apiserver.get(VALIDATING, NAME) is None
    assert apiserver.get(MUTATING, NODES) is None


def test_unregister_deletes_the_other_configuration_when_one_deletion_is_refused(
    apiserver: FakeApiServer, kubeconfig: str, cert_dir: Path
) -> None:
    assert register(cert_dir, kubeconfig).returncode == 0
    apiserver.fail_next(MUTATING, 403, method="DELETE", message="forbidden: cannot delete")

    result = run_cli("unregister", "--kubeconfig", kubeconfig, cwd=cert_dir.parent)

    assert result.returncode == 1
    assert f"{MUTATING}/{NAME} not deleted: the API server answered 403 Forbidden: forbidden: cannot delete" in (
        result.stderr
    )
    assert f"{VALIDATING}/{NAME} deleted" in result.stdout
    assert apiserver.get(MUTATING, NAME) is not None and apiserver.get(VALIDATING, NAME) is None


# --- kubeapi helpers ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "texts"),
    [
        pytest.param(['299 - "clamped to 27"'], ["clamped to 27"], id="one-warning"),
        pytest.param(['299 - "a, b", 299 - "c \\"q\\""'], ["a, b", 'c "q"'], id="two-in-one-header-with-escapes"),
        pytest.param(["garbage"], [], id="not-a-warning"),
    ],
)
def test_warning_headers_are_parsed_into_texts(headers: list[str], texts: list[str]) -> None:
    assert parse_warnings(headers) == texts


# --- the runbook ----------------------------------------------------------------------------------------------


def test_the_runbook_uses_only_options_the_commands_have() -> None:
    text = (REPO / "docs" / "operations.md").read_text("utf-8").replace("\\\n", " ")
    used: dict[str, set[str]] = {}
    for command, rest in re.findall(r"csinode-guard (register|unregister|restore)\b([^`\n#]*)", text):
        used.setdefault(command, set()).update(re.findall(r"(--[a-z][a-z-]*)", rest))
    assert set(used) == {"register", "unregister", "restore"}
    ctx = click.Context(main)
    for command, options in used.items():
        found = main.get_command(ctx, command)
        assert found is not None, command
        known = {opt for param in found.params for opt in param.opts}
        assert options <= known, (command, options - known)


def test_unregister_finds_the_cluster_in_the_home_kubeconfig_as_kubectl_does(
    apiserver: FakeApiServer, kubeconfig: str, cert_dir: Path, tmp_path: Path
) -> None:
    home = tmp_path / "operator-home"
    (home / ".kube").mkdir(parents=True)
    (home / ".kube" / "config").write_text(Path(kubeconfig).read_text())
    assert register(cert_dir, kubeconfig).returncode == 0

    result = run_cli("unregister", cwd=tmp_path, env={"HOME": str(home)})

    assert result.returncode == 0, result.stderr
    assert apiserver.list("mutatingwebhookconfigurations") == []
    assert apiserver.list("validatingwebhookconfigurations") == []
