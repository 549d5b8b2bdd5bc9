"""Subcommands of the ``csinode-guard`` CLI, one module per command group."""
