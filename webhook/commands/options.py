"""Options and helpers shared by the commands: kubectl's conventions in one place.

- ``--kubeconfig``/``--context`` of the commands that talk to the cluster (``register``, ``unregister``,
  ``restore``, ``status``, ``preflight``, ``uninstall``), the client they select, and how an API failure is shown;
- ``-o/--output`` (:func:`output_option`), ``--dry-run=none|client|server`` (:func:`dry_run_option`);
- ``--state-key-file`` of the commands that verify the guard's signed records (:func:`state_key_file_option`);
- the exit codes of every command (:data:`EXIT_CODES_HELP`, docs/cli.md);
- old spellings kept as hidden aliases for one release, with a deprecation warning on standard error
  (:func:`deprecated_alias`, :class:`OutputChoice`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from webhook.admission.policy import PolicyError
from webhook.admission.state import StateKeys
from webhook.kube import kubeapi
from webhook.kube.guardpolicy import ServedPolicy, served_policy

F = TypeVar("F", bound=Callable[..., Any])

EXIT_OK = 0
"""Done; nothing found."""
EXIT_FINDINGS = 1
"""The command ran and found something, or what it was asked to do failed: an invalid policy, a failing policy
test, no matching audit record, a preflight WARN, a write the API server refused."""
EXIT_USAGE = 2
"""Usage: an unknown option, options that exclude each other, an input file that is not what the command reads."""
EXIT_NO_CLUSTER = 3
"""No cluster: none configured, a configuration that cannot be loaded, or no answer from the API server."""
EXIT_BLOCKING = 4
"""A finding that blocks (preflight FAIL: do not upgrade)."""
EXIT_CODES_HELP = (
    "Exit codes (every command): 0 ok; 1 findings or failure; 2 usage; 3 no cluster (none configured, "
    "cannot load it, no answer); 4 blocking findings (preflight FAIL). See docs/cli.md."
)
"""The epilog of every command's ``--help``."""
DEPRECATED_UNTIL = "0.3.0"
"""The release that drops the deprecated spellings."""


class NoClusterError(click.ClickException):
    """No cluster to talk to (see :data:`EXIT_NO_CLUSTER`): exit code 3."""

    exit_code = EXIT_NO_CLUSTER


def warn_deprecated(old: str, new: str) -> None:
    """``Warning: OLD is deprecated and will be removed in 0.3.0: use NEW`` on standard error."""
    click.echo(f"Warning: {old} is deprecated and will be removed in {DEPRECATED_UNTIL}: use {new}", err=True)


def deprecated_alias(old: str, new: str, *, dest: str, **kwargs: Any) -> Callable[[F], F]:
    """A hidden option ``old`` that sets the parameter ``dest`` (the new option's name) and warns that ``new``
    replaces it. The command reads it as ``dest``: click keeps the value given last of the two."""

    def callback(ctx: click.Context, _param: click.Parameter, value: Any) -> Any:
        if value is None or value == () or value is False:
            return value
        warn_deprecated(old, new)
        return value

    return click.option(old, f"__deprecated_{dest}", hidden=True, callback=callback, expose_value=True,
                        **kwargs)


def take_deprecated(kwargs: dict[str, Any], dest: str) -> Any:
    """Pop the value of :func:`deprecated_alias` ``dest`` from ``kwargs`` (None when not given)."""
    value = kwargs.pop(f"__deprecated_{dest}", None)
    return None if value in ((), False) else value


class OutputChoice(click.Choice[str]):
    """``-o/--output``'s values, with old spellings accepted (``text`` -> ``table``) and a deprecation warning."""

    def __init__(self, choices: list[str], aliases: dict[str, str] | None = None) -> None:
        super().__init__(choices)
        self.aliases = dict(aliases or {})

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        """The value, an alias mapped to its new name (with a warning)."""
        if isinstance(value, str) and value in self.aliases:
            new = self.aliases[value]
            warn_deprecated(f"--output {value}", f"--output {new}")
            return new
        return super().convert(value, param, ctx)


def output_option(choices: list[str], *, default: str = "table", help: str = "",
                  aliases: dict[str, str] | None = None) -> Callable[[F], F]:
    """kubectl's ``-o/--output`` with ``choices`` (table, wide, json, yaml, ...), received as ``output``."""
    return click.option("--output", "-o", "output", type=OutputChoice(choices, aliases), default=default,
                        show_default=True, help=help or f"Output format: {', '.join(choices)}.")


DRY_RUN_CHOICES = ["none", "client", "server"]


def dry_run_option(*, bare: str, what: str) -> Callable[[F], F]:
    """kubectl's ``--dry-run=none|client|server`` (received as ``dry_run``); ``--dry-run`` alone means ``bare``
    (this command's old flag, deprecated). ``what`` says what client and server mean here."""

    def callback(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
        if value == "__bare__":
            warn_deprecated("--dry-run without a value", f"--dry-run={bare}")
            return bare
        return value

    return click.option("--dry-run", "dry_run", type=click.Choice([*DRY_RUN_CHOICES, "__bare__"]),
                        default="none", is_flag=False, flag_value="__bare__", show_default=True,
                        callback=callback, metavar="none|client|server",
                        help=f"none: write; {what}")


def echo_document(document: Any, output: str) -> None:
    """``document`` on standard output as ``json`` (indented, never truncated) or ``yaml``."""
    if output == "yaml":
        import yaml  # noqa: PLC0415

        click.echo(yaml.safe_dump(document, sort_keys=False, allow_unicode=True, width=10**9), nl=False)
    else:
        import json  # noqa: PLC0415

        click.echo(json.dumps(document, indent=2, default=str))


def progress(message: str) -> None:
    """One progress line on standard error (for steps that may take seconds)."""
    click.echo(message, err=True)


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

    Raises :class:`NoClusterError` (exit code 3) when no cluster is configured, or ``cannot load the cluster
    configuration: ...`` when the configuration cannot be read or loaded (with ``failure``, that class instead);
    ``click.UsageError`` (exit code 2) for ``--context`` without a kubeconfig. With ``echo_warnings`` the
    apiserver's HTTP ``Warning`` headers (deprecations, admission webhook warnings) are shown on standard error.
    """
    try:
        api_client = kubeapi.load_api_client(kubeconfig, context)
    except kubeapi.ClusterNotConfiguredError as exc:
        if "needs a kubeconfig" in str(exc):
            raise click.UsageError(str(exc)) from None
        raise (failure or NoClusterError)(str(exc)) from None
    except kubeapi.ClusterConfigError as exc:
        raise (failure or NoClusterError)(f"cannot load the cluster configuration: {exc}") from None
    return kubeapi.KubeClient(api_client, on_warning=_echo_warning if echo_warnings else None)


def _echo_warning(text: str) -> None:
    click.echo(f"Warning: {text}", err=True)


def api_failure(what: str, exc: kubeapi.KubeApiError | kubeapi.ApiUnreachableError) -> click.ClickException:
    """A ``click.ClickException`` (exit code 1) ``WHAT: the API server answered CODE REASON: MESSAGE`` from the
    apiserver's ``Status`` (``kubeapi.KubeApiError``), or a :class:`NoClusterError` (exit code 3) ``WHAT: no
    answer from the API server: ...`` when no HTTP answer came (``kubeapi.ApiUnreachableError``). Returned, not
    raised: the caller raises or prints it."""
    if isinstance(exc, kubeapi.ApiUnreachableError):
        return NoClusterError(f"{what}: no answer from the API server: {exc}")
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
        except NoClusterError as exc:
            if exc.message.startswith("cannot load"):  # a configuration that is there but broken: say so
                raise
            client = None  # no cluster configured: judge offline with the bundled default
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


def state_key_file_option(help: str) -> Callable[[F], F]:
    """``--state-key-file FILE`` (also ``$CSINODE_GUARD_STATE_KEY_FILE``): the guard's state HMAC key(s), one per
    line as in Secret ``csinode-guard-state-key``. The file must exist; the command receives the path as
    ``state_key_file`` (None when not given) and loads it with :func:`load_state_keys`."""
    return click.option(
        "--state-key-file",
        type=click.Path(exists=True, dir_okay=False, path_type=Path),
        envvar="CSINODE_GUARD_STATE_KEY_FILE",
        show_envvar=True,
        help=help,
    )


def load_state_keys(path: Path) -> StateKeys:
    """The keys in ``path`` (:func:`webhook.admission.state_key.ensure_state_key`: one key per line, the first
    signs). Raises ``click.BadParameter`` (exit 2, naming ``--state-key-file``) for a file that is not a key."""
    from webhook.admission.state_key import StateKeyError, ensure_state_key  # noqa: PLC0415

    try:
        return StateKeys(ensure_state_key(path))
    except (StateKeyError, ValueError, OSError) as exc:
        raise click.BadParameter(str(exc), param_hint="--state-key-file") from None
