"""Options and helpers shared by the commands that talk to the cluster (``register``, ``unregister``,
``restore``, ``status``, ``preflight``): ``--kubeconfig``/``--context``, the client they select, and how an API
failure is shown.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from webhook.admission.policy import PolicyError
from webhook.kube import kubeapi
from webhook.kube.guardpolicy import ServedPolicy, served_policy

F = TypeVar("F", bound=Callable[..., Any])


def cluster_options(command: F) -> F:
    """``--kubeconfig`` and ``--context`` (also ``$CSINODE_GUARD_KUBECONFIG``/``$KUBECONFIG`` and
    ``$CSINODE_GUARD_CONTEXT``) added to a click command, which receives them as ``kubeconfig`` and ``context``
    (``str | None``); :func:`connect` turns them into a client."""
    command = click.option(
        "--context",
        metavar="NAME",
        envvar="CSINODE_GUARD_CONTEXT",
        help="kubeconfig context to use (default: the current context).",
    )(command)
    command = click.option(
        "--kubeconfig",
        metavar="PATH",
        envvar=["CSINODE_GUARD_KUBECONFIG", "KUBECONFIG"],
        help="kubeconfig file (default: $KUBECONFIG, else the in-cluster service account, else ~/.kube/config, "
        "as kubectl).",
    )(command)
    return command


def connect(
    kubeconfig: str | None,
    context: str | None,
    *,
    failure: type[click.ClickException] | None = None,
    echo_warnings: bool = True,
) -> kubeapi.KubeClient:
    """A :class:`~webhook.kube.kubeapi.KubeClient` for the options of :func:`cluster_options` (found as kubectl finds
    its cluster: :func:`webhook.kube.kubeapi.load_api_client`), not yet used: nothing is sent before its first call.

    Raises ``click.UsageError`` (exit code 2) when no cluster is configured and ``click.ClickException`` (exit
    code 1) ``cannot load the cluster configuration: ...`` when the configuration cannot be read or loaded; with
    ``failure``, that class for both (e.g. preflight's exit code 3). With ``echo_warnings`` the apiserver's HTTP
    ``Warning`` headers (deprecations, admission webhook warnings) are shown on standard error.
    """
    try:
        api_client = kubeapi.load_api_client(kubeconfig, context)
    except kubeapi.ClusterNotConfiguredError as exc:
        raise (failure or click.UsageError)(str(exc)) from None
    except kubeapi.ClusterConfigError as exc:
        raise (failure or click.ClickException)(f"cannot load the cluster configuration: {exc}") from None
    return kubeapi.KubeClient(api_client, on_warning=_echo_warning if echo_warnings else None)


def _echo_warning(text: str) -> None:
    click.echo(f"Warning: {text}", err=True)


def api_failure(what: str, exc: kubeapi.KubeApiError | kubeapi.ApiUnreachableError) -> click.ClickException:
    """A ``click.ClickException`` (exit code 1) ``WHAT: the API server answered CODE REASON: MESSAGE`` from the
    apiserver's ``Status`` (``kubeapi.KubeApiError``), or ``WHAT: no answer from the API server: ...`` when no
    HTTP answer came (``kubeapi.ApiUnreachableError``). Returned, not raised: the caller raises or prints it."""
    if isinstance(exc, kubeapi.ApiUnreachableError):
        return click.ClickException(f"{what}: no answer from the API server: {exc}")
    reason = f" {exc.reason}" if exc.reason else ""
    return click.ClickException(f"{what}: the API server answered {exc.code}{reason}: {exc.message}")


class GuardPolicyUnreadableError(click.ClickException):
    """The cluster could not say which policy the guard serves (exit code 1 unless a command maps it)."""


def guard_policy_option(command: F) -> F:
    """``--guard-policy NAME`` (also ``$CSINODE_GUARD_GUARD_POLICY``; default ``default``): the GuardPolicy the
    guard serves, which a command given a cluster judges with unless ``--policy FILE`` is given. The command
    receives it as ``guard_policy``."""
    return click.option(
        "--guard-policy",
        "guard_policy",
        default="default",
        show_default=True,
        metavar="NAME",
        envvar="CSINODE_GUARD_GUARD_POLICY",
        help="The cluster's GuardPolicy to judge with (the one the guard serves) when --policy is not given.",
    )(command)


def served_policy_for(
    policy_path: Path | None,
    name: str,
    *,
    client: kubeapi.KubeClient | None = None,
    kubeconfig: str | None = None,
    context: str | None = None,
) -> ServedPolicy:
    """The policy a command judges with (:func:`webhook.kube.guardpolicy.served_policy`): ``policy_path``; else
    GuardPolicy ``name`` of the cluster (``client``, else the one ``kubeconfig``/``context`` select; with no
    cluster configured, or none there, the bundled default, which the guard also serves then). Raises
    ``click.ClickException`` (exit 1) for a refused policy, :class:`GuardPolicyUnreadableError` for a cluster that
    cannot say."""
    if policy_path is None and client is None:
        try:
            client = connect(kubeconfig, context, echo_warnings=False)
        except click.UsageError:  # no cluster configured: judge offline with the bundled default
            client = None
    try:
        return served_policy(policy_path, client, name)
    except PolicyError as exc:
        if policy_path is not None:
            raise click.ClickException(f"policy refused: {exc}") from None
        raise click.ClickException(
            f"GuardPolicy {name} is refused by the guard's checks, which keep serving the last good policy "
            f"(its hash is in `kubectl get guardpolicy {name} -o yaml`, status.byPod): {exc}; "
            "pass --policy FILE to judge with a file"
        ) from None
    except (kubeapi.KubeApiError, kubeapi.ApiUnreachableError) as exc:
        failure = api_failure(f"cannot read GuardPolicy {name} (pass --policy FILE to judge with a file)", exc)
        raise GuardPolicyUnreadableError(failure.message) from None
