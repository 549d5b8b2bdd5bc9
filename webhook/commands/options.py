"""Options and helpers shared by the commands that talk to the cluster (``register``, ``unregister``,
``restore``, ``status``, ``preflight``): ``--kubeconfig``/``--context``, the client they select, and how an API
failure is shown.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from webhook.kube import kubeapi

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
