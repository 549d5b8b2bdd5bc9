"""``csinode-guard uninstall``: remove everything of the guard from the cluster but its deployment
(:mod:`webhook.kube.uninstall`); ``kubectl delete -k`` of the overlay removes that (docs/operations.md)."""

from __future__ import annotations

import click

from webhook.commands.options import EXIT_FINDINGS, cluster_options, connect, dry_run_option, progress
from webhook.kube.registration import CONFIGURATION_NAME
from webhook.kube.uninstall import DryRun, Targets, Uninstaller
from webhook.kube.vap import VAP_NAME


@click.command("uninstall")
@click.option("--name", default=CONFIGURATION_NAME, show_default=True,
              help="Name of both webhook configurations (register --name).")
@click.option("--vap-name", default=VAP_NAME, show_default=True,
              help="Name of the ValidatingAdmissionPolicy floor and its binding (policy export --name).")
@click.option("--namespace", default="csinode-guard", show_default=True,
              help="The guard's namespace: its audit Lease and Secrets.")
@click.option("--lease-name", default="csinode-guard-audit", show_default=True, help="The audit Lease.")
@click.option("--keep-secrets", is_flag=True,
              help="Keep Secrets csinode-guard-tls and csinode-guard-state-key (a reinstall then reuses the "
              "serving certificate and the state key).")
@click.option("--keep-events", is_flag=True, help="Keep the audit's Events (they expire with the apiserver's "
              "--event-ttl).")
@dry_run_option(bare="server", what="client: read and print what would be removed, write nothing; server: send "
                "every write as a server-side dry run (dryRun=All), nothing stored.")
@cluster_options
def uninstall(*, name: str, vap_name: str, namespace: str, lease_name: str, keep_secrets: bool, keep_events: bool,
              dry_run: str, kubeconfig: str | None, context: str | None) -> None:
    """Remove the guard from the cluster: webhook configurations, the VAP floor, its CSINode annotations, Lease,
    Secrets and Events.

    \b
    In this order:
      1. the Mutating- and ValidatingWebhookConfiguration (nothing is refused from here on)
      2. the ValidatingAdmissionPolicy floor and its binding (policy export, deploy/overlays/vap)
      3. every csinode-guard.io/ annotation on every CSINode (state, justification, declared versions);
         counts are not touched
      4. the audit Lease, Secrets csinode-guard-tls and csinode-guard-state-key, the audit's Events

    Objects already gone are fine: running it again exits 0. Then remove the deployment itself:
    kubectl delete -k deploy/ --ignore-not-found (docs/operations.md, Uninstall). Needs delete on those objects and
    get/list/update on csinodes (cluster-admin, or the registrar and approver roles together).
    """
    targets = Targets(configuration=name, vap=vap_name, namespace=namespace, lease=lease_name,
                      secrets=() if keep_secrets else Targets().secrets, events=not keep_events)
    with connect(kubeconfig, context) as client:
        outcome = Uninstaller(client, targets, DryRun(dry_run), say=click.echo, progress=progress).run()
    click.echo(f"uninstall: {outcome.removed} removed, {outcome.absent} already absent, {outcome.failed} failed",
               err=True)
    if outcome.failed:
        raise SystemExit(EXIT_FINDINGS)
