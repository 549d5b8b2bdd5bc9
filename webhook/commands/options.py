"""Options and helpers shared by the commands that talk to the cluster (``register``, ``unregister``,
``restore``, ``status``, ``preflight``): ``--kubeconfig``/``--context``, the client they select, and how an API
failure is shown.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from webhook import kubeapi

F = TypeVar("F", bound=Callable[..., Any])


def cluster_options(command: F) -> F:
    """``--kubeconfig`` and ``--context``, shared by the commands that talk to the cluster."""
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


def connect(kubeconfig: str | None, context: str | None) -> kubeapi.KubeClient:
    """A :class:`~webhook.kubeapi.KubeClient` for the options of :func:`cluster_options`, or a usage error."""
    try:
        api_client = kubeapi.load_api_client(kubeconfig, context)
    except kubeapi.ClusterNotConfiguredError as exc:
        raise click.UsageError(str(exc)) from None
    except (kubeapi.ClusterConfigError, OSError, ValueError) as exc:
        raise click.ClickException(f"cannot load the cluster configuration: {exc}") from None
    return kubeapi.KubeClient(api_client, on_warning=_echo_warning)


def _echo_warning(text: str) -> None:
    click.echo(f"Warning: {text}", err=True)


def api_failure(what: str, exc: kubeapi.KubeApiError | kubeapi.ApiUnreachableError) -> click.ClickException:
    """A ClickException that shows the apiserver's Status message (or why no answer came)."""
    if isinstance(exc, kubeapi.ApiUnreachableError):
        return click.ClickException(f"{what}: no answer from the API server: {exc}")
    reason = f" {exc.reason}" if exc.reason else ""
    return click.ClickException(f"{what}: the API server answered {exc.code}{reason}: {exc.message}")
