"""``csinode-guard brake list`` and ``csinode-guard brake release DRIVER --reason TEXT``: the automatic brake.

The audit leader engages and releases brakes (docs/brake.md) and records them in the ConfigMap
``csinode-guard-brakes`` in the guard's namespace. ``list`` reads it; ``release`` asks the leader to release an
engaged brake by setting a request annotation on that object (who asks comes from a SelfSubjectReview), which only
the Role ``csinode-guard-brake-approver`` allows; the leader honours it at its next poll, writes an audit-log
record and an Event, and removes the request.
"""

from __future__ import annotations

import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click

from webhook.admission.brake import (
    RECORD_KEY,
    ReleaseRequest,
    brake_json,
    decode_brakes,
    encode_release_request,
    quiet_release_at,
    read_brakes_unverified,
)
from webhook.admission.cluster import Brake
from webhook.admission.durations import format_duration
from webhook.admission.policy import BrakeSettings
from webhook.admission.state import StateKeys, format_time
from webhook.commands.options import (
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
from webhook.kube import kubeapi
from webhook.kube.brakes import read_brakes_object, request_release, who_am_i
from webhook.kube.guardpolicy import ServedPolicy

NAMESPACE_HELP = "The guard's namespace, where the audit leader records the brakes."


def _namespace_option(command: Any) -> Any:
    return click.option(
        "--namespace",
        "-n",
        default="csinode-guard",
        show_default=True,
        envvar="CSINODE_GUARD_NAMESPACE",
        show_envvar=True,
        help=NAMESPACE_HELP,
    )(command)


@click.group("brake")
def brake() -> None:
    """The automatic brake: which drivers' increases are held cluster-wide, and releasing one (docs/brake.md)."""


def read_brakes(
    client: kubeapi.KubeClient, namespace: str, keys: StateKeys | None
) -> tuple[dict[str, Brake], dict[str, Any] | None, bool]:
    """``(brakes by driver, the ConfigMap or None, verified)``: the record verified with ``keys``, else read
    unverified. Raises ``click.ClickException`` (exit 1) for an API refusal,
    :class:`~webhook.commands.options.NoClusterError` (exit 3) when no answer came."""
    try:
        obj = read_brakes_object(client, namespace)
    except (kubeapi.KubeApiError, kubeapi.ApiUnreachableError) as exc:
        raise api_failure("cannot read the brakes", exc) from None
    if obj is None:
        return {}, None, keys is not None
    value = (obj.get("data") or {}).get(RECORD_KEY)
    if keys is not None:
        return decode_brakes(value, keys) or {}, dict(obj), True
    return read_brakes_unverified(value) or {}, dict(obj), False


def format_brakes(
    brakes: dict[str, Brake], now: datetime, verified: bool, settings: BrakeSettings | None = None
) -> str:
    """The brakes as a table (engaged first; columns as wide as their longest value, as kubectl prints), each
    engaged one followed by its evidence: which nodes, which increases, which failures. With the policy's
    ``settings`` an engaged brake also says when the quiet period releases it (:func:`quiet_release_at`)."""
    if not brakes:
        return "No brake has engaged.\n"
    rows: list[tuple[tuple[str, str, str, str, str], list[str]]] = []
    for b in sorted(brakes.values(), key=lambda b: (not b.engaged, b.driver)):
        evidence = f"{len(b.evidence)}/{b.raised_nodes}"
        if b.engaged:
            detail = f"last capacity-class failure {format_duration((now - b.last_failure_at).total_seconds())} ago"
            if settings is not None:
                detail += "; " + _release_detail(b, settings, now)
            below = [
                f"  {e.node}: increase {e.before} -> {'unbounded' if e.after is None else e.after} at "
                f"{format_time(e.raised_at)}; errorCode {e.code} on {e.volume_attachment} at {format_time(e.failed_at)}"
                for e in b.evidence
            ]
            rows.append(((b.driver, "engaged", format_time(b.engaged_at), evidence, detail), below))
        else:
            released = format_time(b.released_at) if b.released_at is not None else ""
            rows.append(((b.driver, "released", released, evidence, f"by {b.released_by}: {b.release_reason}"), []))
    header = ("DRIVER", "STATE", "SINCE", "EVIDENCE", "DETAIL")
    widths = [max(len(r[i]) for r in [header, *(cells for cells, _ in rows)]) for i in range(4)]

    def line(cells: tuple[str, ...]) -> str:
        return "   ".join(cells[i].ljust(widths[i]) for i in range(4)) + "   " + cells[4]

    lines = [line(header)]
    for cells, below in rows:
        lines.append(line(cells))
        lines.extend(below)
    if not verified:
        lines.append("(unverified: give --state-key-file to check the leader's signature)")
    return "\n".join(lines) + "\n"


def _release_detail(brake: Brake, settings: BrakeSettings, now: datetime) -> str:
    if not settings.enabled:
        return "spec.brake.enabled is false: the leader releases it at its next pass"
    release = quiet_release_at(brake, settings)
    if release is None or release <= now:
        return f"quiet for {format_duration(settings.quiet_period)}: the leader releases it at its next pass"
    return (
        f"the quiet period ({format_duration(settings.quiet_period)}) releases it at {format_time(release)} "
        f"(in {format_duration((release - now).total_seconds())}) unless another one comes"
    )


@brake.command("list")
@output_option(["table", "json", "yaml"])
@state_key_file_option("The guard's state HMAC key(s), to verify the record; without it it is shown as unverified.")
@click.option(
    "--policy",
    "policy_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    envvar="CSINODE_GUARD_POLICY",
    show_envvar=True,
    help="A policy file whose spec.brake says when a brake releases (default: the GuardPolicy the guard serves, "
    "see --guard-policy).",
)
@guard_policy_option
@_namespace_option
@cluster_options
def list_brakes(
    *,
    output: str,
    state_key_file: Path | None,
    policy_path: Path | None,
    guard_policy: str,
    namespace: str,
    kubeconfig: str | None,
    context: str | None,
) -> None:
    """Show every driver's brake: engaged (increases held cluster-wide, with the evidence and when the quiet
    period releases it) or released (by whom, why). Reads the ConfigMap csinode-guard-brakes (get on it) and the
    policy's spec.brake from the GuardPolicy the guard serves (get on guardpolicies; without it the release time
    is not shown)."""
    keys = load_state_keys(state_key_file) if state_key_file is not None else None
    client = connect(kubeconfig, context)
    with client:
        brakes, _, verified = read_brakes(client, namespace, keys)
        served, unknown = _served_policy(policy_path, guard_policy, client)
    settings = served.policy.brake if served is not None else None
    if output in ("json", "yaml"):
        echo_document(
            {
                "verified": verified,
                "brakes": [brake_json(b, settings) for b in sorted(brakes.values(), key=lambda b: b.driver)],
                "policy": served.to_json() if served is not None else None,
            },
            output,
        )
        return
    sys.stdout.write(format_brakes(brakes, datetime.now(UTC), verified, settings))
    if any(b.engaged for b in brakes.values()):
        sys.stdout.write(f"Quiet period from {served.describe()}\n" if served is not None else
                         f"(when the quiet period releases them is not shown: {unknown})\n")


def _served_policy(
    policy_path: Path | None, guard_policy: str, client: kubeapi.KubeClient
) -> tuple[ServedPolicy | None, str]:
    """The policy whose spec.brake applies, or ``(None, why not)`` when the cluster cannot say (a file given with
    ``--policy`` that is refused is an error)."""
    try:
        return served_policy_for(policy_path, guard_policy, client=client), ""
    except click.ClickException as exc:
        if policy_path is not None:
            raise
        return None, exc.message


@brake.command("release")
@click.argument("driver")
@click.option("--reason", required=True, metavar="TEXT", help="Why the brake can go (recorded in the audit log).")
@output_option(["table", "json", "yaml"])
@_namespace_option
@cluster_options
def release(
    *, driver: str, reason: str, output: str, namespace: str, kubeconfig: str | None, context: str | None
) -> None:
    """Ask the audit leader to release DRIVER's engaged brake now (before its quiet period ends).

    Sets the csinode-guard.io/brake-release annotation on the ConfigMap csinode-guard-brakes, naming the driver,
    the engagement, the reason and you (from a SelfSubjectReview); the Role csinode-guard-brake-approver allows
    it (nodes never have it). The leader honours it within a second or two, writes an audit-log record and an
    Event, and removes the request. Exit 1 when no brake of DRIVER is engaged or the apiserver refuses.
    """
    if not reason.strip():
        raise click.BadParameter("give the reason", param_hint="--reason")
    client = connect(kubeconfig, context)
    with client:
        brakes, obj, _ = read_brakes(client, namespace, None)
        current = brakes.get(driver)
        if obj is None or current is None or not current.engaged:
            raise click.ClickException(f"no brake of {driver} is engaged")
        try:
            requester = who_am_i(client)
            request = ReleaseRequest(driver, current.engaged_at, reason.strip(), requester)
            request_release(client, namespace, obj, encode_release_request(request))
        except (kubeapi.KubeApiError, kubeapi.ApiUnreachableError) as exc:
            raise api_failure(f"cannot ask for the release of the brake on {driver}", exc) from None
    document = {
        "driver": driver,
        "engagedAt": format_time(current.engaged_at),
        "reason": request.reason,
        "requester": requester,
        "requested": True,
    }
    if output in ("json", "yaml"):
        echo_document(document, output)
        return
    click.echo(
        f"asked the audit leader to release the brake on {driver} (engaged at "
        f"{format_time(current.engaged_at)}) as {requester or '(unknown)'}: {request.reason}"
    )

