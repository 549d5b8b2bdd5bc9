"""``csinode-guard completion bash|zsh|fish``: the shell completion script (click's own shell completion)."""

from __future__ import annotations

import click
from click.shell_completion import get_completion_class

SHELLS = ("bash", "zsh", "fish")


@click.command("completion")
@click.argument("shell", type=click.Choice(SHELLS))
@click.option("--prog-name", default="csinode-guard", show_default=True,
              help="The command the script completes (kubectl-csinode_guard for the kubectl plugin).")
def completion(shell: str, prog_name: str) -> None:
    """Print the completion script for SHELL (click's shell completion: commands, options and their choices).

    \b
    bash:  source <(csinode-guard completion bash)        # or into ~/.bashrc
    zsh:   source <(csinode-guard completion zsh)         # after compinit
    fish:  csinode-guard completion fish > ~/.config/fish/completions/csinode-guard.fish
    """
    command = click.get_current_context().find_root().command  # the group this command was called from
    complete_var = "_" + prog_name.replace("-", "_").upper() + "_COMPLETE"
    cls = get_completion_class(shell)
    if cls is None:  # pragma: no cover - click ships all three
        raise click.UsageError(f"no completion for {shell}")
    click.echo(cls(command, {}, prog_name, complete_var).source())
