"""``csinode-guard status``: capacity and usage per (node, driver), from one paged LIST per kind.

The calls live in :mod:`webhook.kube.kubeapi`; the table in :mod:`webhook.admission.capacity` (pure).
"""

from __future__ import annotations

import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import click

from webhook.admission.brake import brake_json
from webhook.admission.capacity import build_report, format_table, report_json
from webhook.admission.cluster import Brake
from webhook.admission.durations import parse_duration
from webhook.admission.state import StateKeys
from webhook.commands.brake import format_brakes, read_brakes
from webhook.commands.options import (
    GuardPolicyUnreadableError,
    NoClusterError,
    api_failure,
    cluster_options,
    connect,
    echo_document,
    guard_policy_option,
    load_state_keys,
    output_option,
    served_policy_for,
    state_key_file_option,
)
from webhook.commands.status_audit import (
    findings_json,
    format_findings,
    read_audit_events,
    read_csidrivers,
    standing_findings,
    status_cluster_view,
)
from webhook.kube import kubeapi

CannotReadError = NoClusterError
"""The cluster could not be read: exit code 3."""


@click.command("status")
@click.option("--node", "nodes", multiple=True, metavar="NAME", help="Only this node (repeatable).")
@click.option("--driver", "drivers", multiple=True, metavar="NAME", help="Only this CSI driver (repeatable).")
@click.option("--selector", "-l", metavar="SELECTOR",
              help="Only nodes whose Node labels match this label selector (as kubectl get nodes -l).")
@output_option(["table", "wide", "json", "yaml"],
               help="table, wide (adds ceiling reason, writer version, attach errors, pending pods), json or yaml.")
@click.option("--policy", "policy_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              envvar="CSINODE_GUARD_POLICY", show_envvar=True,
              help="A policy file to judge with (default: the GuardPolicy the guard serves, see --guard-policy).")
@state_key_file_option("The guard's state HMAC key(s), to verify its signed state; without it the state is shown "
                       "as 'unverified'.")
@click.option("--errors-within", default="1h", show_default=True, metavar="DURATION",
              help="Attach errors this recent are shown.")
@click.option("--namespace", "-n", default="csinode-guard", show_default=True, envvar="CSINODE_GUARD_NAMESPACE",
              show_envvar=True, help="The guard's namespace, where the audit leader records the brakes.")
@guard_policy_option
@cluster_options
def status(
    *,
    nodes: tuple[str, ...],
    drivers: tuple[str, ...],
    selector: str | None,
    output: str,
    policy_path: Path | None,
    guard_policy: str,
    state_key_file: Path | None,
    errors_within: str,
    namespace: str,
    kubeconfig: str | None,
    context: str | None,
) -> None:
    """Show, per node and CSI driver, the reported allocatable count and what it is used for.

    Columns: the reported allocatable.count, the applicable ceiling (and, with -o wide, why), attached volumes
    (VolumeAttachments with status.attached), headroom (the count, at most its ceiling, minus attached), the
    guard's last accepted count and its age from its signed state, frozen or corrected entries with until-when;
    -o wide adds the writer version, recent attach errors by class and Pods Pending on volume limits. Sorted by
    least headroom, with a one-line cluster summary on top. Reads one LIST per kind (CSINodes, Nodes,
    VolumeAttachments, Pending Pods, CSIDrivers, the audit's Events in default); needs get/list on them. Then the
    standing violations: which node and entry the audit (admission's judgement) no longer allows, why, and since
    when (the audit's Event), and the engaged brakes with their evidence (the ConfigMap csinode-guard-brakes in
    --namespace; skipped when it cannot be read).
    """
    keys = load_state_keys(state_key_file) if state_key_file is not None else None
    try:
        window = timedelta(seconds=parse_duration(errors_within))
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--errors-within") from None
    client = connect(kubeconfig, context)
    try:
        served = served_policy_for(policy_path, guard_policy, client=client)
    except GuardPolicyUnreadableError as exc:
        raise CannotReadError(exc.message) from None
    policy = served.policy
    try:
        with client:
            node_objects, csinodes, attachments, pending = read_cluster(client, selector)
            since = read_audit_events(client)
            csidrivers = read_csidrivers(client)
            brakes, verified = status_brakes(client, namespace, keys)
    except (kubeapi.KubeApiError, kubeapi.ApiUnreachableError) as exc:
        raise CannotReadError(api_failure("cannot read the cluster", exc).message) from None
    wanted: set[str] | None = None
    if selector:
        wanted = {str((n.get("metadata") or {}).get("name") or "") for n in node_objects}
    if nodes:
        wanted = set(nodes) if wanted is None else wanted & set(nodes)
    now = datetime.now(UTC)
    report = build_report(csinodes, node_objects, attachments, pending, policy=policy, now=now, keys=keys,
                          errors_within=window, node_names=wanted, driver_names=drivers or None)
    cluster = status_cluster_view(node_objects, attachments, csidrivers, keys)
    cluster.brakes.update(brakes)
    standing = standing_findings(csinodes, cluster, policy, keys, now, node_names=wanted)
    if drivers:
        standing = [f for f in standing if f.driver in drivers]
    if output in ("json", "yaml"):
        document = {**report_json(report), "standingViolations": findings_json(standing, since),
                    "brakes": [brake_json(b, policy.brake) for b in sorted(brakes.values(), key=lambda b: b.driver)],
                    "policy": served.to_json()}
        echo_document(document, output)
    else:
        sys.stdout.write(format_table(report, now, wide=output == "wide") + format_findings(standing, since))
        engaged = {d: b for d, b in brakes.items() if b.engaged}
        if engaged:
            sys.stdout.write("\nBrakes engaged (increases held cluster-wide; csinode-guard brake list):\n"
                             + format_brakes(engaged, now, verified, policy.brake))
        sys.stdout.write(f"Judged with {served.describe()}\n")


def status_brakes(client: kubeapi.KubeClient, namespace: str, keys: StateKeys | None) -> tuple[dict[str, Brake],
                                                                                                bool]:
    """The brakes the audit leader recorded (verified with ``keys``, else read unverified) and whether they were
    verified; none when the record cannot be read (no get on it: ``status`` still shows the rest)."""
    try:
        brakes, _, verified = read_brakes(client, namespace, keys)
    except click.ClickException:
        return {}, keys is not None
    return brakes, verified


def read_cluster(client: kubeapi.KubeClient, selector: str | None) -> tuple[list[kubeapi.JSON], ...]:
    """Nodes (metadata only: the labels are all the ceilings need), CSINodes, VolumeAttachments and Pending Pods:
    one paged LIST per kind, one after the other (on a busy 2-core control plane, four at once took longer than
    the four in turn: benchmarks/bench_status.py)."""
    return (
        client.list_all(kubeapi.NODES, label_selector=selector, metadata_only=True),
        client.list_all(kubeapi.CSINODES),
        client.list_all(kubeapi.VOLUMEATTACHMENTS),
        client.list_all(kubeapi.PODS, field_selector="status.phase=Pending"),
    )
