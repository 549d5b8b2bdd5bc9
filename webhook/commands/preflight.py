"""``csinode-guard preflight``: the upgrade gate. Reads the cluster (:mod:`webhook.kube.preflight_gather`) and judges
it (:mod:`webhook.kube.preflight`); exit code 0 / 1 / 4 for OK / WARN / FAIL, 3 when the cluster cannot be read (the
table of every command: :mod:`webhook.commands.options`, docs/cli.md)."""

from __future__ import annotations

import shutil
from datetime import UTC, datetime
from pathlib import Path

import click

from webhook.commands.options import (
    EXIT_BLOCKING,
    EXIT_FINDINGS,
    EXIT_OK,
    GuardPolicyUnreadableError,
    NoClusterError,
    cluster_options,
    connect,
    echo_document,
    guard_policy_option,
    output_option,
    served_policy_for,
)
from webhook.kube import kubeapi
from webhook.kube.preflight import TABLE_WIDTH, exit_code, format_checks, run_checks
from webhook.kube.registration import CONFIGURATION_NAME

CannotRunError = NoClusterError
"""No cluster to check: exit code 3."""
EXIT_BY_SEVERITY = {0: EXIT_OK, 1: EXIT_FINDINGS, 2: EXIT_BLOCKING}
"""The worst check's severity (:func:`webhook.kube.preflight.exit_code`: OK 0, WARN 1, FAIL 2) -> the exit code."""


@click.command("preflight")
@click.option("--scheduler-version", metavar="VERSION",
              help="kube-scheduler's version, for managed control planes that hide its pods (e.g. v1.35.2).")
@click.option("--policy", "policy_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              envvar="CSINODE_GUARD_POLICY", show_envvar=True,
              help="A policy file for minVersion and versionSource (default: the GuardPolicy the guard serves, see "
              "--guard-policy).")
@click.option("--name", "configuration_name", default=CONFIGURATION_NAME, show_default=True,
              help="metadata.name of the guard's webhook configurations (as given to register --name).")
@click.option("--namespace", "deployment_namespace", metavar="NAMESPACE",
              help="Namespace of the guard's Deployment (default: the Service's the webhooks call, else "
              "csinode-guard as in deploy/).")
@click.option("--deployment", "deployment_name", metavar="NAME",
              help="Name of the guard's Deployment (default: the Service's name, else csinode-guard as in deploy/).")
@click.option("--before-install", is_flag=True,
              help="Check a cluster the guard is not installed in yet: a guard that is not registered is expected "
              "(one OK row) instead of a FAIL. Without it, a missing guard blocks (exit code 4).")
@output_option(["table", "wide", "json", "yaml"],
               help="table: wrapped to the terminal's width ($COLUMNS); wide: one line per check; json or yaml: "
               "everything, whole.")
@guard_policy_option
@cluster_options
def preflight(
    *, scheduler_version: str | None, policy_path: Path | None, guard_policy: str, configuration_name: str,
    deployment_namespace: str | None, deployment_name: str | None, before_install: bool, output: str,
    kubeconfig: str | None, context: str | None,
) -> None:
    """Check, per component, that mutable CSINode allocatable counts (KEP-4876) will work, and what to do if not.

    \b
    kube-apiserver  /version against the version matrix (docs/operations.md), and a server-side dry run
                    (dryRun=All) of one CSINode's count: does the apiserver accept count changes at all?
    kubelet         nodes per Node.status.nodeInfo.kubeletVersion: too old, or skewed too far
    kube-scheduler  its pods in kube-system, or --scheduler-version
    CSIDriver       nodeAllocatableUpdatePeriodSeconds set; node-plugin versions vs the policy's minVersion
    guard           webhook configurations present, caBundle verifies the serving certificate (TLS
                    handshake, else Secret csinode-guard-tls), matchConditions, failurePolicy; the
                    Deployment's ready replicas (read directly: also before the webhooks exist); its
                    namespace (audit Lease, node history, brakes)

    Exit code: 0 all OK, 1 some WARN, 4 some FAIL (blocking), 3 the cluster could not be read. Needs get/list on those
    objects and update on csinodes (the probe is a dry run: nothing is stored).
    """
    from webhook.kube.preflight_gather import gather_facts  # noqa: PLC0415

    client = connect(kubeconfig, context, failure=CannotRunError, echo_warnings=False)
    try:
        served = served_policy_for(policy_path, guard_policy, client=client)
    except GuardPolicyUnreadableError as exc:
        raise CannotRunError(exc.message) from None
    policy = served.policy
    try:
        with client:
            facts = gather_facts(client, policy, now=datetime.now(UTC), scheduler_version=scheduler_version,
                                 configuration_name=configuration_name,
                                 deployment_namespace=deployment_namespace, deployment_name=deployment_name,
                                 before_install=before_install)
    except kubeapi.ApiUnreachableError as exc:
        raise CannotRunError(f"no answer from the API server: {exc}") from None
    if facts.server_version is None and facts.errors.get("CSINode"):
        raise CannotRunError(f"cannot read the cluster: {facts.server_version_error or facts.errors['CSINode']}")
    checks = run_checks(facts, policy)
    code = EXIT_BY_SEVERITY[exit_code(checks)]
    if output in ("json", "yaml"):
        echo_document({"checks": [c.to_json() for c in checks], "exitCode": code, "policy": served.to_json()},
                      output)
    else:
        width = None if output == "wide" else shutil.get_terminal_size((TABLE_WIDTH, 24)).columns
        click.echo(format_checks(checks, width), nl=False)
        click.echo(f"Judged with {served.describe()}", err=True)  # standard output is the table alone
    raise SystemExit(code)
