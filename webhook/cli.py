"""The ``csinode-guard`` command line: a click group; each subcommand lives in ``webhook.commands``."""

from __future__ import annotations

import click

from webhook import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="csinode-guard")
def main() -> None:
    """csinode-guard: guards writes to CSINode.spec.drivers[].allocatable.count (KEP-4876).

    Options can also be set by environment variable: CSINODE_GUARD_<OPTION> (e.g. CSINODE_GUARD_PORT=8443),
    as each command's --help shows.
    """


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
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


def _register_commands() -> None:
    from webhook.commands import (  # noqa: PLC0415
        audit,
        certs,
        evaluate,
        policy,
        preflight,
        register,
        replay,
        restore,
        serve,
        status,
    )

    main.add_command(serve.serve)
    main.add_command(evaluate.evaluate_command)
    main.add_command(certs.certs)
    main.add_command(policy.policy)
    main.add_command(replay.replay_command)
    main.add_command(audit.audit)
    main.add_command(register.register)
    main.add_command(register.unregister)
    main.add_command(restore.restore)
    main.add_command(preflight.preflight)
    main.add_command(status.status)
    for command in (status.status, preflight.preflight, restore.restore):
        kubectl_plugin.add_command(command)


_register_commands()
