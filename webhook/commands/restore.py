"""``csinode-guard restore NODE --driver D``: put a driver's count back to the last count the guard trusted.

The guard's signed state (``csinode-guard.io/state``) records, per driver, the last count it accepted. Restoring
is one ordinary CSINode update, sent as the operator (their kubeconfig), which the guard judges like any other:

1. GET the CSINode; verify its state with the state key(s) and read the driver's trusted count.
2. PUT the object back (with its ``resourceVersion``) with that driver's ``allocatable.count`` set to the
   trusted count and a justification (``csinode-guard.io/justification``) covering exactly that count, so the
   change passes writer-identity, count-rollback and change-rate -- provided the operator is a justifier the
   policy lists. The count ceiling still applies.
3. On 409 Conflict (kubelet wrote in between) read again and redo the plan, a few times.

:func:`plan_restore` is pure; the command around it does the I/O through :mod:`webhook.kubeapi`.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import click

from webhook import kubeapi
from webhook.commands.options import api_failure, cluster_options, connect
from webhook.durations import format_duration, parse_duration
from webhook.justification import JUSTIFICATION_ANNOTATION, JustificationError, parse_justifications
from webhook.state import STATE_ANNOTATION, StateKeys, StateProblem, decode_state, format_time

FIELD_MANAGER = "csinode-guard-restore"
ATTEMPTS = 5
"""GET + PUT rounds before giving up on 409 Conflicts (kubelet writes its CSINode every update period)."""


class RestoreError(Exception):
    """Why a count cannot be restored (the message is for the operator)."""


@dataclass(frozen=True)
class TrustedCount:
    """The driver's entry in the guard's state: the last accepted ``count`` (None = unbounded)."""

    count: int | None
    changed_at: str | None
    writer_version: str | None
    verified: bool


@dataclass(frozen=True)
class JustificationRequest:
    """What the operator states for the justification restore adds."""

    reason: str
    ticket: str | None
    expires: datetime


@dataclass(frozen=True)
class RestorePlan:
    """The update :func:`plan_restore` decided on: ``body`` is the whole CSINode to PUT."""

    node: str
    driver: str
    trusted: TrustedCount
    current: int | None
    body: dict[str, Any]
    justification: str
    notes: tuple[str, ...]

    @property
    def resource_version(self) -> str:
        """The resourceVersion the PUT is conditional on."""
        return str(self.body["metadata"].get("resourceVersion"))

    @property
    def target(self) -> int:
        """The count written: the trusted count (never None in a plan)."""
        assert self.trusted.count is not None
        return self.trusted.count


def find_driver(csinode: Mapping[str, Any], driver: str) -> dict[str, Any] | None:
    """The ``spec.drivers`` entry named ``driver`` (by name, never by index), or None."""
    for entry in (csinode.get("spec") or {}).get("drivers") or []:
        if isinstance(entry, dict) and entry.get("name") == driver:
            return entry
    return None


def allocatable_count(entry: Mapping[str, Any]) -> int | None:
    """``allocatable.count`` of a driver entry; None when absent (unbounded)."""
    count = (entry.get("allocatable") or {}).get("count")
    return count if isinstance(count, int) and not isinstance(count, bool) else None


def _show(count: int | None) -> str:
    return "unbounded" if count is None else str(count)


def read_trusted_count(csinode: Mapping[str, Any], driver: str, keys: StateKeys | None) -> TrustedCount:
    """The trusted count of ``driver`` from the state on ``csinode``; verified unless ``keys`` is None.

    Raises :class:`RestoreError` when there is no state, it does not verify (or, unverified, cannot be read),
    it belongs to another object, or it has no entry for ``driver``.
    """
    metadata = csinode.get("metadata") or {}
    node = metadata.get("name", "?")
    uid = str(metadata.get("uid") or "")
    value = (metadata.get("annotations") or {}).get(STATE_ANNOTATION)
    if not value:
        raise RestoreError(
            f"CSINode {node} has no {STATE_ANNOTATION} annotation: the guard has not accepted a count change there "
            "(or the state was removed), so there is no trusted count to restore"
        )
    if keys is None:
        return _read_unverified(value, uid, node, driver)
    decoded = decode_state(value, uid, keys)
    if decoded.state is None:
        problem = decoded.problem or StateProblem.MALFORMED
        hint = {
            StateProblem.BAD_SIGNATURE: "wrong --state-key-file, or the state was edited by someone else",
            StateProblem.OTHER_OBJECT: "the state was copied from another CSINode, or the CSINode was recreated",
            StateProblem.UNSUPPORTED_VERSION: "written by a newer csinode-guard; use that version's restore",
        }.get(problem, "the annotation was edited by someone other than the guard")
        raise RestoreError(
            f"the state on CSINode {node} does not verify ({problem.value}: {decoded.detail}); {hint}. "
            "Nothing was changed"
        )
    entry = decoded.state.entries.get(driver)
    if entry is None:
        raise RestoreError(_no_entry(node, driver, sorted(decoded.state.entries)))
    return TrustedCount(entry.count, format_time(entry.changed_at), entry.writer_version, verified=True)


def _no_entry(node: str, driver: str, known: list[str]) -> str:
    listed = ", ".join(known) if known else "none"
    return (
        f"the guard's state on CSINode {node} has no entry for {driver} (entries: {listed}): it has not accepted "
        "a count change of that driver, so there is no trusted count to restore"
    )


def _read_unverified(value: str, uid: str, node: str, driver: str) -> TrustedCount:
    """The entry read without checking the signature (``--no-verify``); the structure is still checked."""
    try:
        doc = json.loads(value)
    except (ValueError, RecursionError) as exc:
        raise RestoreError(f"the state on CSINode {node} is not JSON: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("drivers"), dict):
        raise RestoreError(f"the state on CSINode {node} is malformed (no drivers object)")
    if doc.get("uid") != uid:
        raise RestoreError(
            f"the state on CSINode {node} was recorded for another object (uid {doc.get('uid')!r}, this CSINode "
            f"is {uid!r}): it says nothing about this node"
        )
    raw = doc["drivers"].get(driver)
    if raw is None:
        raise RestoreError(_no_entry(node, driver, sorted(map(str, doc["drivers"]))))
    if not isinstance(raw, dict):
        raise RestoreError(f"the state's entry for {driver} on CSINode {node} is malformed (not an object)")
    count = raw.get("count")
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 0):
        raise RestoreError(f"the state's entry for {driver} on CSINode {node} has no valid count: {count!r}")
    changed_at, version = raw.get("changedAt"), raw.get("writerVersion")
    return TrustedCount(
        count,
        str(changed_at) if changed_at is not None else None,
        str(version) if version is not None else None,
        verified=False,
    )


def build_justifications(
    existing: str | None, driver: str, count: int, request: JustificationRequest, now: datetime
) -> tuple[str, list[str]]:
    """The justification annotation value with a new entry for exactly ``count`` of ``driver``, and notes.

    Valid unexpired entries already on the object are kept (in order, unchanged); expired ones are dropped. An
    annotation that does not parse is replaced (the guard would reject any update that changes it otherwise).
    """
    notes: list[str] = []
    kept: list[Any] = []
    if existing:
        try:
            parsed = parse_justifications(existing)
        except JustificationError as exc:
            notes.append(f"replacing the {JUSTIFICATION_ANNOTATION} annotation, which does not parse: {exc}")
        else:
            raw = json.loads(existing)
            raw_entries = raw if isinstance(raw, list) else [raw]
            for entry, justification in zip(raw_entries, parsed, strict=True):
                if justification.expires > now:
                    kept.append(entry)
            if len(kept) < len(raw_entries):
                notes.append(f"dropping {len(raw_entries) - len(kept)} expired justification(s)")
    new: dict[str, Any] = {
        "driver": driver,
        "reason": request.reason,
        "minCount": count,
        "maxCount": count,
        "expires": format_time(request.expires),
    }
    if request.ticket:
        new["ticket"] = request.ticket
    kept.append(new)
    return json.dumps(kept, separators=(",", ":")), notes


def plan_restore(
    csinode: Mapping[str, Any],
    driver: str,
    keys: StateKeys | None,
    request: JustificationRequest,
    now: datetime,
) -> RestorePlan:
    """The update that restores ``driver``'s trusted count on ``csinode`` (as read, with its resourceVersion).

    Raises :class:`RestoreError` when the driver is not in the CSINode, there is no usable state or entry, the
    trusted count is unbounded, or the count already equals it.
    """
    metadata = csinode.get("metadata") or {}
    node = str(metadata.get("name", "?"))
    entry = find_driver(csinode, driver)
    if entry is None:
        names = [str(d.get("name")) for d in (csinode.get("spec") or {}).get("drivers") or [] if isinstance(d, dict)]
        listed = ", ".join(names) if names else "none"
        raise RestoreError(f"driver {driver} is not in CSINode {node} (drivers: {listed})")
    trusted = read_trusted_count(csinode, driver, keys)
    current = allocatable_count(entry)
    if trusted.count is None:
        raise RestoreError(
            f"the last trusted count of {driver} on {node} is unbounded: restore writes bounded counts only (a "
            "justification covers a count range, and count-ceiling does not let a bounded count become unbounded)"
        )
    if current == trusted.count:
        raise RestoreError(
            f"nothing to restore: {driver} on {node} already has count {current}, the last trusted count"
        )
    body = copy.deepcopy(dict(csinode))
    target = find_driver(body, driver)
    assert target is not None
    allocatable = target.get("allocatable")
    if not isinstance(allocatable, dict):
        allocatable = target["allocatable"] = {}
    allocatable["count"] = trusted.count
    annotations = body["metadata"].setdefault("annotations", {})
    value, notes = build_justifications(annotations.get(JUSTIFICATION_ANNOTATION), driver, trusted.count, request, now)
    annotations[JUSTIFICATION_ANNOTATION] = value
    return RestorePlan(node, driver, trusted, current, body, value, tuple(notes))


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


def _load_keys(path: Path) -> tuple[StateKeys, str]:
    from webhook.tls import StateKeyError, ensure_state_key  # noqa: PLC0415

    try:
        return StateKeys(ensure_state_key(path)), str(path)
    except (StateKeyError, ValueError, OSError) as exc:
        raise click.BadParameter(str(exc), param_hint="--state-key-file") from None


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
@click.option(
    "--state-key-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    envvar="CSINODE_GUARD_STATE_KEY_FILE",
    show_envvar=True,
    help="The guard's state HMAC key(s), one per line, as in Secret csinode-guard-state-key.",
)
@click.option(
    "--no-verify",
    is_flag=True,
    help="Use the state without checking its signature (no key at hand). The count is then unverified.",
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Print the change and send it as a server-side dry run (dryRun=All: the guard judges it, nothing is "
    "stored).",
)
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
    dry_run: bool,
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
        keys, key_source = _load_keys(state_key_file)
    elif not no_verify:
        raise click.UsageError(
            "--state-key-file is required to verify the guard's state (the key of Secret "
            "csinode-guard/csinode-guard-state-key); --no-verify uses the state unverified"
        )
    now = datetime.now(UTC)
    request = JustificationRequest(reason.strip(), ticket, now + timedelta(seconds=lifetime))
    with connect(kubeconfig, context) as client:
        plan, stored = _update(client, node, driver, keys, key_source, request, now, dry_run)
    _report(plan, stored, dry_run, lifetime)


def _update(
    client: kubeapi.KubeClient,
    node: str,
    driver: str,
    keys: StateKeys | None,
    key_source: str,
    request: JustificationRequest,
    now: datetime,
    dry_run: bool,
) -> tuple[RestorePlan, dict[str, Any]]:
    """GET, plan and PUT until the PUT is not a 409 Conflict (at most :data:`ATTEMPTS` rounds)."""
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
        try:
            stored = client.replace(kubeapi.CSINODES, plan.body, dry_run=dry_run, field_manager=FIELD_MANAGER)
        except kubeapi.KubeApiError as exc:
            if exc.conflict and attempt < ATTEMPTS:
                click.echo(
                    f"csinode {node} changed since it was read (409 Conflict); reading it again "
                    f"(attempt {attempt + 1} of {ATTEMPTS})",
                    err=True,
                )
                time.sleep(0.2 * attempt)
                continue
            what = "the server-side dry run was refused" if dry_run else "the update was refused; nothing changed"
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
