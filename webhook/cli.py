"""The ``csinode-guard`` command line: a click group; each subcommand lives in ``webhook.commands``.

A subcommand's module is imported when the subcommand runs (or a help page lists it), not at start: ``register``
does not pay for the server, nor ``serve`` for the file tools (click's documented lazy-loading group).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import click

from webhook import __version__

COMMANDS: Mapping[str, str] = {
    "serve": "webhook.commands.serve:serve",
    "evaluate": "webhook.commands.evaluate:evaluate_command",
    "certs": "webhook.commands.certs:certs",
    "policy": "webhook.commands.policy:policy",
    "replay": "webhook.commands.replay:replay_command",
    "audit": "webhook.commands.audit:audit",
    "register": "webhook.commands.register:register",
    "unregister": "webhook.commands.register:unregister",
    "restore": "webhook.commands.restore:restore",
    "preflight": "webhook.commands.preflight:preflight",
    "status": "webhook.commands.status:status",
    "brake": "webhook.commands.brake:brake",
    "uninstall": "webhook.commands.uninstall:uninstall",
    "completion": "webhook.commands.completion:completion",
}
"""``csinode-guard``'s subcommands: name -> ``module:attribute`` of the click command."""
PLUGIN_COMMANDS = ("status", "preflight", "restore")
"""The subcommands the kubectl plugin offers."""


class LazyGroup(click.Group):
    """A click group whose subcommands, given as ``name -> "module:attribute"``, are imported on first use."""

    def __init__(self, *args: Any, lazy: Mapping[str, str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy)

    def list_commands(self, ctx: click.Context) -> list[str]:
        """Every subcommand's name, sorted (click's help lists them in this order)."""
        return sorted({*super().list_commands(ctx), *self.lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        """The subcommand ``cmd_name`` (its module imported now), or None when there is none."""
        target = self.lazy.get(cmd_name)
        if target is None:
            return super().get_command(ctx, cmd_name)
        module, _, attribute = target.partition(":")
        command = getattr(importlib.import_module(module), attribute)
        if not isinstance(command, click.Command):  # pragma: no cover - COMMANDS names click commands
            raise TypeError(f"{target} is not a click command")
        _add_exit_codes(command)
        return command


def _add_exit_codes(command: click.Command) -> None:
    """The exit code table (``webhook.commands.options.EXIT_CODES_HELP``) as the epilog of ``command`` and, for a
    group, of each of its subcommands."""
    from webhook.commands.options import EXIT_CODES_HELP  # noqa: PLC0415

    if not command.epilog:
        command.epilog = EXIT_CODES_HELP
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            _add_exit_codes(sub)


@click.group(cls=LazyGroup, lazy=COMMANDS,
             context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110},
             epilog="Exit codes (every command): 0 ok; 1 findings or failure; 2 usage; 3 no cluster (none "
             "configured, cannot load it, no answer); 4 blocking findings (preflight FAIL). See docs/cli.md.")
@click.version_option(__version__, prog_name="csinode-guard")
def main() -> None:
    """csinode-guard: guards writes to CSINode.spec.drivers[].allocatable.count (KEP-4876).

    Options can also be set by environment variable: CSINODE_GUARD_<OPTION> (e.g. CSINODE_GUARD_PORT=8443),
    as each command's --help shows. Conventions are kubectl's: -o/--output table|wide|json|yaml, -f/--filename
    for input files, --dry-run=none|client|server; shell completion: csinode-guard completion bash|zsh|fish.
    """


@click.group(cls=LazyGroup, lazy={name: COMMANDS[name] for name in PLUGIN_COMMANDS},
             context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="kubectl csinode-guard")
def kubectl_plugin() -> None:
    """csinode-guard as a kubectl plugin: the commands an operator runs next to kubectl.

    Installed as kubectl-csinode_guard (kubectl and krew turn the underscore into a dash), so that kubectl finds it
    on PATH: kubectl csinode-guard status|preflight|restore. Give --kubeconfig and --context after the command
    (kubectl passes everything after the plugin name on); $KUBECONFIG and ~/.kube/config are found as kubectl finds
    them.
    """


def kubectl_plugin_main() -> None:
    """The ``kubectl-csinode_guard`` console script: :func:`kubectl_plugin`, named as kubectl shows it."""
    kubectl_plugin(prog_name="kubectl csinode-guard")
