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
    read_brakes_unverified,
)
from webhook.admission.cluster import Brake
from webhook.admission.durations import format_duration
from webhook.admission.state import StateKeys, format_time
from webhook.commands.options import api_failure, cluster_options, connect, echo_document, output_option
from webhook.kube import kubeapi
from webhook.kube.brakes import read_brakes_object, request_release, who_am_i

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


def format_brakes(brakes: dict[str, Brake], now: datetime, verified: bool) -> str:
    """The brakes as a table (engaged first), each engaged one followed by its evidence: which nodes, which
    increases, which failures."""
    if not brakes:
        return "No brake has engaged.\n"
    lines = [f"{'DRIVER':<32} {'STATE':<9} {'SINCE':<26} {'EVIDENCE':<10} DETAIL"]
    for b in sorted(brakes.values(), key=lambda b: (not b.engaged, b.driver)):
        if b.engaged:
            detail = f"last capacity-class failure {format_duration((now - b.last_failure_at).total_seconds())} ago"
            lines.append(
                f"{b.driver:<32} {'engaged':<9} {format_time(b.engaged_at):<26} "
                f"{len(b.evidence)}/{b.raised_nodes:<8} {detail}"
            )
            for e in b.evidence:
                after = "unbounded" if e.after is None else str(e.after)
                lines.append(
                    f"  {e.node}: increase {e.before} -> {after} at {format_time(e.raised_at)}; "
                    f"errorCode {e.code} on {e.volume_attachment} at {format_time(e.failed_at)}"
                )
        else:
            released = format_time(b.released_at) if b.released_at is not None else ""
            lines.append(
                f"{b.driver:<32} {'released':<9} {released:<26} {len(b.evidence)}/{b.raised_nodes:<8} "
                f"by {b.released_by}: {b.release_reason}"
            )
    if not verified:
        lines.append("(unverified: give --state-key-file to check the leader's signature)")
    return "\n".join(lines) + "\n"


@brake.command("list")
@output_option(["table", "json", "yaml"])
@click.option(
    "--state-key-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    envvar="CSINODE_GUARD_STATE_KEY_FILE",
    show_envvar=True,
    help="The guard's state HMAC key(s), to verify the record; without it it is shown as unverified.",
)
@_namespace_option
@cluster_options
def list_brakes(
    *, output: str, state_key_file: Path | None, namespace: str, kubeconfig: str | None, context: str | None
) -> None:
    """Show every driver's brake: engaged (increases held cluster-wide, with the evidence) or released (by whom,
    why). Reads the ConfigMap csinode-guard-brakes (get on it)."""
    keys = _keys(state_key_file) if state_key_file is not None else None
    client = connect(kubeconfig, context)
    with client:
        brakes, _, verified = read_brakes(client, namespace, keys)
    if output in ("json", "yaml"):
        echo_document(
            {"verified": verified, "brakes": [brake_json(b) for b in sorted(brakes.values(), key=lambda b: b.driver)]},
            output,
        )
        return
    sys.stdout.write(format_brakes(brakes, datetime.now(UTC), verified))


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


def _keys(path: Path) -> StateKeys:
    from webhook.admission.state_key import StateKeyError, ensure_state_key  # noqa: PLC0415

    try:
        return StateKeys(ensure_state_key(path))
    except (StateKeyError, ValueError, OSError) as exc:
        raise click.BadParameter(str(exc), param_hint="--state-key-file") from None
