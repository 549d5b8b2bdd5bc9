"""``csinode-guard register`` and ``csinode-guard unregister``: apply or remove both webhook configurations.

``register`` sends what :func:`webhook.kube.registration.build_webhook_configurations` builds (the same objects as
``deploy/base/webhooks.yaml``) with the CA bundle of a certificate directory; ``unregister`` deletes them, the
documented emergency switch (docs/operations.md). Both talk to the API through :mod:`webhook.kube.kubeapi`.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import click
from cryptography import x509

from webhook.commands.options import (
    EXIT_FINDINGS,
    api_failure,
    cluster_options,
    connect,
    dry_run_option,
    progress,
)
from webhook.kube import kubeapi
from webhook.kube.one_call import CHOSEN_MODES, VALIDATION_AUTO, choose_validation
from webhook.kube.registration import (
    CONFIGURATION_NAME,
    MUTATE_PATH,
    SERVICE_NAME,
    SERVICE_NAMESPACE,
    SERVICE_PORT,
    VALIDATE_PATH,
    WebhookTarget,
    build_node_webhook_configuration,
    build_webhook_configurations,
    dump_yaml,
    node_configuration_name,
)
from webhook.kube.validation_mode import list_csinode_mutators

FIELD_MANAGER = "csinode-guard"
CA_BUNDLE_FILES = ("ca-bundle.crt", "ca.crt")
"""Looked up in ``--cert-dir`` in this order: ``certs generate``/``certs rotate`` write both; the bundle carries
the old and the new CA during a CA rotation, ``ca.crt`` (e.g. from a Secret) only the current one."""
ATTEMPTS = 3
"""Tries of one get-then-write when another writer changes the object in between (409)."""

def read_ca_bundle(cert_dir: Path) -> tuple[Path, bytes, list[x509.Certificate]]:
    """The first of :data:`CA_BUNDLE_FILES` in ``cert_dir``: its path, PEM bytes and certificates."""
    for name in CA_BUNDLE_FILES:
        path = cert_dir / name
        if path.is_file():
            break
    else:
        raise click.ClickException(
            f"{cert_dir}: neither {' nor '.join(CA_BUNDLE_FILES)} found (create them with "
            f"`csinode-guard certs generate --cert-dir {cert_dir}`)"
        )
    pem = path.read_bytes()
    try:
        certificates = x509.load_pem_x509_certificates(pem)
    except ValueError as exc:
        raise click.ClickException(f"{path}: not PEM certificates: {exc}") from None
    return path, pem, certificates


def _describe_ca(path: Path, certificates: list[x509.Certificate], now: datetime) -> list[str]:
    lines = [f"caBundle: {len(certificates)} certificate(s) from {path}"]
    for cert in certificates:
        expires = cert.not_valid_after_utc
        state = "EXPIRED" if expires <= now else "expires"
        lines.append(f"  {cert.subject.rfc4514_string()}, {state} {expires:%Y-%m-%d %H:%M}Z")
    return lines


def _validate_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme != "https" or not parts.hostname or parts.query or parts.fragment or parts.username:
        raise click.BadParameter(
            "must be https://host[:port][/path], without user, query or fragment (the apiserver's rules for "
            "clientConfig.url)",
            param_hint="--url",
        )
    try:
        port = parts.port
    except ValueError:
        port = -1
    if port is not None and not 1 <= port <= 65535:
        port_text = parts.netloc.rpartition(":")[2]
        raise click.BadParameter(f"port {port_text} is not a TCP port (1-65535)", param_hint="--url")
    path = parts.path.rstrip("/")
    for endpoint in (MUTATE_PATH, VALIDATE_PATH):
        if path.endswith(endpoint):
            raise click.BadParameter(
                f"the path already ends in {endpoint}, but {MUTATE_PATH} and {VALIDATE_PATH} are appended to it "
                f"(this URL would call {path}{MUTATE_PATH}): give the guard's base URL, e.g. "
                f"https://{parts.netloc}{path[: -len(endpoint)]}",
                param_hint="--url",
            )
    return url


def _merged_metadata(desired: Mapping[str, Any], existing: Mapping[str, Any]) -> dict[str, Any]:
    """``desired``'s metadata on top of the labels and annotations others put on ``existing``, with its
    ``resourceVersion`` (the write fails with 409 if the object changed since)."""
    metadata = copy.deepcopy(dict(desired))
    current = existing.get("metadata") or {}
    for key in ("labels", "annotations"):
        merged = {**(current.get(key) or {}), **(metadata.get(key) or {})}
        if merged:
            metadata[key] = merged
    metadata["resourceVersion"] = current.get("resourceVersion")
    return metadata


def apply_configuration(client: kubeapi.KubeClient, obj: Mapping[str, Any], *, dry_run: bool = False) -> str:
    """Create ``obj`` or replace the object of its name (get, then create or PUT with its resourceVersion); with
    ``dry_run``, both as a server-side dry run (``dryRun=All``: validated, nothing stored).

    Returns ``created``, ``configured`` or ``unchanged`` (the apiserver keeps the resourceVersion of an update
    that changes nothing). Retries a lost race (409) up to :data:`ATTEMPTS` times.
    """
    resource = kubeapi.RESOURCES_BY_KIND[str(obj["kind"])]
    name = str(obj["metadata"]["name"])
    for attempt in range(1, ATTEMPTS + 1):
        try:
            try:
                existing = client.get(resource, name)
            except kubeapi.KubeApiError as exc:
                if not exc.not_found:
                    raise
                client.create(resource, obj, field_manager=FIELD_MANAGER, dry_run=dry_run)
                return "created"
            body = dict(copy.deepcopy(obj))
            body["metadata"] = _merged_metadata(obj["metadata"], existing)
            stored = client.replace(resource, body, field_manager=FIELD_MANAGER, dry_run=dry_run)
            before = existing["metadata"].get("resourceVersion")
            return "unchanged" if stored.get("metadata", {}).get("resourceVersion") == before else "configured"
        except kubeapi.KubeApiError as exc:
            if (exc.conflict or exc.already_exists) and attempt < ATTEMPTS:
                time.sleep(0.1 * attempt)
                continue
            raise
    raise AssertionError("unreachable")  # pragma: no cover


@click.command("register")
@click.option(
    "--cert-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("certs"),
    show_default=True,
    envvar="CSINODE_GUARD_CERT_DIR",
    show_envvar=True,
    help="Directory with ca-bundle.crt (or ca.crt): the CA(s) the apiserver trusts for the guard.",
)
@click.option("--service", metavar="NAME", help=f"Service in front of the guard (default {SERVICE_NAME}).")
@click.option("--namespace", metavar="NAMESPACE", help=f"Namespace of that Service (default {SERVICE_NAMESPACE}).")
@click.option(
    "--service-port", type=click.IntRange(1, 65535), help=f"Port of that Service (default {SERVICE_PORT})."
)
@click.option(
    "--url",
    metavar="URL",
    help="Call the guard at https://host[:port] instead of a Service (a guard outside the cluster, for "
    "development); /mutate and /validate are appended.",
)
@click.option("--name", default=CONFIGURATION_NAME, show_default=True, help="Name of both configurations.")
@click.option(
    "--validation",
    type=click.Choice(CHOSEN_MODES),
    default=VALIDATION_AUTO,
    show_default=True,
    help="auto: cel when no other mutating webhook or MutatingAdmissionPolicy matches CSINodes, else webhook "
    "(with --dry-run, which lists nothing: webhook). webhook: every write the validating entries match is sent "
    "to /validate (two calls). cel: the apiserver sends it only where the final counts are not the ones the "
    "state /mutate wrote records (one call for a kubelet write; see docs/registration.md, One call).",
)
@dry_run_option(bare="client", what="client: print the YAML that would be applied, contact no cluster; server: "
                "send it as a server-side dry run (dryRun=All: validated by the apiserver, nothing stored).")
@cluster_options
def register(
    *,
    cert_dir: Path,
    service: str | None,
    namespace: str | None,
    service_port: int | None,
    url: str | None,
    name: str,
    validation: str,
    dry_run: str,
    kubeconfig: str | None,
    context: str | None,
) -> None:
    """Create or update the MutatingWebhookConfiguration and ValidatingWebhookConfiguration of the guard.

    Both are the objects of deploy/base/webhooks.yaml (CREATE, UPDATE and DELETE of csinodes, two entries each:
    increases and other writers with failurePolicy Fail, the node's own registrations/removals/CREATE/DELETE/
    decreases with Ignore, complementary
    matchConditions, timeoutSeconds 5) with clientConfig.caBundle of every entry from --cert-dir. Running it
    again updates them in place (e.g. after `certs rotate --new-ca`); labels and annotations others added are
    kept.

    Needs get, create and update on both kinds (ClusterRole csinode-guard-registrar).

    \b
    Example:
      csinode-guard register --url https://10.0.0.5:8443 --cert-dir certs --dry-run=client
      csinode-guard register --url https://10.0.0.5:8443 --cert-dir certs

    A guard registered with --url is not the Service deploy/ names: to move to the in-cluster installation,
    `csinode-guard unregister` first, then `kubectl apply -k deploy/` (the apiserver refuses a clientConfig with
    both url and service, which is what applying deploy/ over a --url registration would make).
    """
    if url is not None:
        if service is not None or namespace is not None or service_port is not None:
            raise click.UsageError("--url replaces the Service: do not combine it with --service/--namespace/"
                                   "--service-port")
        _validate_url(url)
    path, pem, certificates = read_ca_bundle(cert_dir)
    target = WebhookTarget(
        service_name=service or SERVICE_NAME,
        service_namespace=namespace or SERVICE_NAMESPACE,
        service_port=service_port or SERVICE_PORT,
        ca_bundle=pem,
        url=url,
    )
    described = _describe_ca(path, certificates, datetime.now(UTC))
    if dry_run == "client":
        mode, reason = choose_validation(validation, None if validation == VALIDATION_AUTO else ())
        if validation == VALIDATION_AUTO:
            reason = "auto: --dry-run lists no other mutating webhooks, so two calls (the safe choice)"
        objects = [*build_webhook_configurations(target, name=name, validation=mode),
                   build_node_webhook_configuration(target, name=name)]
        for line in [*described, f"validation {mode}: {reason}"]:
            click.echo(f"# {line}", err=True)
        click.echo(dump_yaml(objects), nl=False)
        return
    for line in described:
        click.echo(line)
    suffix = " (server dry run)" if dry_run == "server" else ""
    with connect(kubeconfig, context) as client:
        mutators = list_csinode_mutators(client, name) if validation == VALIDATION_AUTO else ()
        mode, reason = choose_validation(validation, mutators)
        click.echo(f"validation {mode}: {reason}")
        objects = [*build_webhook_configurations(target, name=name, validation=mode),
                   build_node_webhook_configuration(target, name=name)]
        for obj in objects:
            resource = kubeapi.RESOURCES_BY_KIND[str(obj["kind"])]
            what = resource.describe(str(obj["metadata"]["name"]))
            try:
                outcome = apply_configuration(client, obj, dry_run=dry_run == "server")
            except (kubeapi.KubeApiError, kubeapi.ApiUnreachableError) as exc:
                raise api_failure(f"{what} not applied", exc) from None
            click.echo(f"{what} {outcome}{suffix}")


@click.command("unregister")
@click.option("--name", default=CONFIGURATION_NAME, show_default=True, help="Name of both configurations.")
@dry_run_option(bare="server", what="client: say which configurations exist and would be deleted, delete nothing; "
                "server: ask the API server to check the deletions (dryRun=All), delete nothing.")
@cluster_options
def unregister(*, name: str, dry_run: str, kubeconfig: str | None, context: str | None) -> None:
    """Delete both webhook configurations: the emergency switch.

    The apiserver stops calling the guard within a second or two and every CSINode write goes through
    unchecked; the guard's pods keep running. A configuration that is already gone is not an error. Re-enable
    with `csinode-guard register` or `kubectl apply -k` of your overlay.

    Needs delete on both kinds (ClusterRole csinode-guard-registrar). Says what it does on standard error as it
    goes (the apiserver may take seconds to answer).
    """
    failures = 0
    with connect(kubeconfig, context) as client:
        for resource, named in ((kubeapi.MUTATING_WEBHOOK_CONFIGURATIONS, name),
                                (kubeapi.VALIDATING_WEBHOOK_CONFIGURATIONS, name),
                                (kubeapi.MUTATING_WEBHOOK_CONFIGURATIONS, node_configuration_name(name))):
            what = resource.describe(named)
            progress(f"deleting {what} ...")
            try:
                if dry_run == "client":
                    client.get(resource, named)
                else:
                    client.delete(resource, named, dry_run=dry_run == "server")
            except kubeapi.KubeApiError as exc:
                if exc.not_found:
                    click.echo(f"{what} not found (already removed)")
                    continue
                failures += 1
                click.echo(api_failure(f"{what} not deleted", exc).format_message(), err=True)
                continue
            except kubeapi.ApiUnreachableError as exc:
                failures += 1
                click.echo(api_failure(f"{what} not deleted", exc).format_message(), err=True)
                continue
            done = {"none": "deleted", "client": "would be deleted (client dry run)",
                    "server": "would be deleted (server dry run)"}[dry_run]
            click.echo(f"{what} {done}")
    if failures:
        click.echo(f"Error: {failures} of 3 configurations could not be deleted (see above)", err=True)
        raise SystemExit(EXIT_FINDINGS)
