"""``csinode-guard restore NODE --driver D``: put a driver's count back to the last count the guard trusted.

The guard's signed state (``csinode-guard.io/state``) records, per driver, the last count it accepted. Restoring
is one ordinary CSINode update, sent as the operator (their kubeconfig), which the guard judges like any other:

1. GET the CSINode; verify its state with the state key(s) and read the driver's trusted count.
2. PUT the object back (with its ``resourceVersion``) with that driver's ``allocatable.count`` set to the
   trusted count and a justification (``csinode-guard.io/justification``) covering exactly that count, so the
   change passes writer-identity, count-rollback and change-rate -- provided the operator is a justifier the
   policy lists. The count ceiling still applies.
3. On 409 Conflict (kubelet wrote in between) read again and redo the plan, a few times.

:func:`webhook.admission.restore_plan.plan_restore` is pure; the command around it does the I/O through
:mod:`webhook.kube.kubeapi`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import click

from webhook.admission.durations import format_duration, parse_duration
from webhook.admission.justification import JUSTIFICATION_ANNOTATION
from webhook.admission.policy import Policy
from webhook.admission.restore_plan import (
    JustificationRequest,
    RestoreError,
    RestorePlan,
    allocatable_count,
    find_driver,
    plan_restore,
)
from webhook.admission.state import STATE_ANNOTATION, StateKeys
from webhook.commands.options import (
    GuardPolicyUnreadableError,
    api_failure,
    cluster_options,
    connect,
    dry_run_option,
    guard_policy_option,
    load_state_keys,
    served_policy_for,
    state_key_file_option,
)
from webhook.kube import kubeapi
from webhook.kube.guardpolicy import ServedPolicy

FIELD_MANAGER = "csinode-guard-restore"
ATTEMPTS = 5
"""GET + PUT rounds before giving up on 409 Conflicts (kubelet writes its CSINode every update period)."""


def _show(count: int | None) -> str:
    return "unbounded" if count is None else str(count)


def _describe(plan: RestorePlan, key_source: str) -> list[str]:
    trusted = plan.trusted
    origin = []
    if trusted.changed_at:
        origin.append(f"accepted {trusted.changed_at}")
    if trusted.writer_version:
        origin.append(f"writer version {trusted.writer_version}")
    how = f"verified with {key_source}" if trusted.verified else "UNVERIFIED (--no-verify)"
    lines = [
        f"csinode {plan.node} (resourceVersion {plan.resource_version}), driver {plan.driver}:",
        f"  last trusted count {_show(trusted.count)}" + (f" ({', '.join(origin)})" if origin else "") + f", {how}",
        f"  spec.drivers[{plan.driver}].allocatable.count: {_show(plan.current)} -> {plan.target}",
        f"  metadata.annotations[{JUSTIFICATION_ANNOTATION}]: {plan.justification}",
    ]
    lines.extend(f"  note: {note}" for note in plan.notes)
    return lines


def _unverified_warning(count: int | None) -> str:
    return (
        f"WARNING: --no-verify: the state's signature was NOT checked. The count {_show(count)} is UNVERIFIED: "
        f"anyone who can edit the {STATE_ANNOTATION} annotation could have put it there."
    )



@click.command("restore")
@click.argument("node")
@click.option("--driver", required=True, metavar="NAME", help="CSI driver whose count to restore.")
@click.option("--reason", required=True, help="Why (recorded in the justification and the guard's state).")
@click.option("--ticket", metavar="ID", help="Ticket or incident id for the justification.")
@click.option(
    "--expires-in",
    default="1h",
    show_default=True,
    metavar="DURATION",
    help="Lifetime of the justification (30m, 1h, 2h30m, ...).",
)
@state_key_file_option("The guard's state HMAC key(s), one per line, as in Secret csinode-guard-state-key.")
@click.option(
    "--no-verify",
    is_flag=True,
    help="Use the state without checking its signature (no key at hand). The count is then unverified.",
)
@dry_run_option(bare="server", what="client: print the change, send no write; server: print it and send it as "
                "a server-side dry run (dryRun=All: the guard judges it, nothing is stored).")
@click.option("--policy", "policy_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="A policy file whose ceiling to check the restored count against (default: the GuardPolicy "
              "the guard serves, see --guard-policy).")
@guard_policy_option
@cluster_options
def restore(
    *,
    node: str,
    driver: str,
    reason: str,
    ticket: str | None,
    expires_in: str,
    state_key_file: Path | None,
    no_verify: bool,
    dry_run: str,
    policy_path: Path | None,
    guard_policy: str,
    kubeconfig: str | None,
    context: str | None,
) -> None:
    """Restore the last count the guard trusted for DRIVER on NODE's CSINode.

    Reads the CSINode, verifies the guard's signed state (csinode-guard.io/state) with --state-key-file and
    takes the driver's last accepted count from it. Then updates the CSINode once, as you: the count set to
    that value, plus a justification (csinode-guard.io/justification) covering exactly that count. The guard
    judges the update like any other, so you must be a justifier in its policy (csinode-guard:approvers by
    default) and hold update on csinodes (ClusterRole csinode-guard-approver). The count ceiling still applies.

    The restored count lasts until kubelet's next update of that driver: fix the driver first.

    \b
    Example:
      kubectl -n csinode-guard get secret csinode-guard-state-key -o jsonpath='{.data.key}' \\
        | base64 -d > state.key
      csinode-guard restore ip-10-0-1-23.ec2.internal --driver ebs.csi.aws.com \\
        --reason "driver reported 39 after a bad config push" --ticket OPS-123 --state-key-file state.key
    """
    if not reason.strip():
        raise click.BadParameter("must say why", param_hint="--reason")
    try:
        lifetime = parse_duration(expires_in)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--expires-in") from None
    if lifetime <= 0:
        raise click.BadParameter("must be positive", param_hint="--expires-in")
    if no_verify and state_key_file is not None:
        raise click.UsageError("--no-verify and --state-key-file exclude each other")
    keys: StateKeys | None = None
    key_source = ""
    if state_key_file is not None:
        keys, key_source = load_state_keys(state_key_file), str(state_key_file)
    elif not no_verify:
        raise click.UsageError(
            "--state-key-file is required to verify the guard's state (the key of Secret "
            "csinode-guard/csinode-guard-state-key); --no-verify uses the state unverified"
        )
    now = datetime.now(UTC)
    request = JustificationRequest(reason.strip(), ticket, now + timedelta(seconds=lifetime))
    with connect(kubeconfig, context) as client:
        try:
            served: ServedPolicy | None = served_policy_for(policy_path, guard_policy, client=client)
        except GuardPolicyUnreadableError as exc:  # advisory only: the guard judges the update either way
            click.echo(f"WARNING: {exc.message}; the restored count is not checked against the policy's ceiling",
                       err=True)
            served = None
        ceiling = None
        if served is not None:
            click.echo(f"Judged with {served.describe()}")
            ceiling = _ceiling(client, served.policy, node, driver)
        plan, stored = _update(client, node, driver, keys, key_source, request, now, dry_run)
        if served is not None and ceiling is not None and plan.target > ceiling[0]:
            click.echo(f"WARNING: {served.policy.name}'s ceiling for {driver} on {node} is {ceiling[0]} "
                       f"({ceiling[1]}): the guard clamps the restored count to it", err=True)
    if stored is None:
        click.echo("client dry run: nothing was sent; --dry-run=server has the API server and the guard judge it")
        return
    _report(plan, stored, dry_run == "server", lifetime)


def _ceiling(client: kubeapi.KubeClient, policy: Policy, node: str, driver: str) -> tuple[int, str] | None:
    """The ceiling (count, why) the policy puts on ``driver`` on ``node`` (its Node's labels), None when none
    does or the Node cannot be read."""
    try:
        labels = (client.get(kubeapi.NODES, node).get("metadata") or {}).get("labels") or {}
    except (kubeapi.KubeApiError, kubeapi.ApiUnreachableError):
        labels = None
    found, why = policy.for_driver(driver).ceiling.resolve(labels)
    return (found, why) if found is not None else None


def _update(
    client: kubeapi.KubeClient,
    node: str,
    driver: str,
    keys: StateKeys | None,
    key_source: str,
    request: JustificationRequest,
    now: datetime,
    dry_run: str,
) -> tuple[RestorePlan, dict[str, Any] | None]:
    """GET, plan and PUT until the PUT is not a 409 Conflict (at most :data:`ATTEMPTS` rounds); with
    ``dry_run`` ``client`` no PUT (None instead of the stored object), ``server`` a server-side dry run."""
    for attempt in range(1, ATTEMPTS + 1):
        try:
            csinode = client.get(kubeapi.CSINODES, node)
        except kubeapi.KubeApiError as exc:
            if exc.not_found:
                raise click.ClickException(f"csinode {node} not found (kubectl get csinodes lists them)") from None
            raise api_failure(f"cannot read csinode {node}", exc) from None
        except kubeapi.ApiUnreachableError as exc:
            raise api_failure(f"cannot read csinode {node}", exc) from None
        try:
            plan = plan_restore(csinode, driver, keys, request, now)
        except RestoreError as exc:
            raise click.ClickException(str(exc)) from None
        if not plan.trusted.verified:
            click.echo(_unverified_warning(plan.trusted.count), err=True)
        for line in _describe(plan, key_source):
            click.echo(line)
        if dry_run == "client":
            return plan, None
        try:
            stored = client.replace(kubeapi.CSINODES, plan.body, dry_run=dry_run == "server",
                                    field_manager=FIELD_MANAGER)
        except kubeapi.KubeApiError as exc:
            if exc.conflict and attempt < ATTEMPTS:
                click.echo(
                    f"csinode {node} changed since it was read (409 Conflict); reading it again "
                    f"(attempt {attempt + 1} of {ATTEMPTS})",
                    err=True,
                )
                time.sleep(0.2 * attempt)
                continue
            what = "the server-side dry run was refused" if dry_run == "server" else \
                "the update was refused; nothing changed"
            raise api_failure(what, exc) from None
        except kubeapi.ApiUnreachableError as exc:
            raise api_failure("the update got no answer; check the CSINode before retrying", exc) from None
        return plan, stored
    raise AssertionError("unreachable")  # pragma: no cover


def _report(plan: RestorePlan, stored: Mapping[str, Any], dry_run: bool, lifetime: float) -> None:
    entry = find_driver(stored, plan.driver)
    result = allocatable_count(entry) if entry is not None else None
    if dry_run:
        click.echo(
            "dry run: the API server accepted the update (dryRun=All, admission webhooks included); "
            "nothing was changed"
        )
    else:
        rv = (stored.get("metadata") or {}).get("resourceVersion")
        click.echo(
            f"restored: {plan.driver} on {plan.node} count {_show(plan.current)} -> {_show(result)} "
            f"(resourceVersion {rv}); the justification expires in {format_duration(lifetime)}"
        )
    if result != plan.target:
        click.echo(
            f"WARNING: the API server {'would store' if dry_run else 'stored'} count {_show(result)}, not "
            f"{plan.target}: a mutating webhook changed it (the guard clamps to the count ceiling; see the "
            "warnings above and its audit log)",
            err=True,
        )
    if not plan.trusted.verified:
        click.echo(_unverified_warning(plan.trusted.count), err=True)
