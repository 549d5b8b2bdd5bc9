"""What an operator reads from the CLI itself: every command's --help is plain text (no reStructuredText markup
from the docstrings), and a choice with one value needs no flag."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest
import yaml

from tests.clirun import run_cli
from webhook.cli import main

RST_MARKUP = re.compile(r"``|:(?:mod|func|class|meth|data|attr|ref):`")


def _command_paths(command: click.Command, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    paths = [path]
    if isinstance(command, click.Group):
        ctx = click.Context(command)
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            assert sub is not None, name
            paths += _command_paths(sub, (*path, name))
    return paths


@pytest.mark.parametrize("path", _command_paths(main), ids=lambda p: " ".join(p) or "csinode-guard")
def test_help_shows_no_restructuredtext_markup(path: tuple[str, ...], tmp_path: Path) -> None:
    result = run_cli(*path, "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Usage:")
    assert not RST_MARKUP.findall(result.stdout), result.stdout


def test_evaluate_help_quotes_its_examples_plainly(tmp_path: Path) -> None:
    result = run_cli("evaluate", "--help", cwd=tmp_path)
    assert "'evaluate ... | jq'" in result.stdout


def test_policy_export_without_format_exports_the_one_format(tmp_path: Path) -> None:
    implicit = run_cli("policy", "export", cwd=tmp_path)
    assert implicit.returncode == 0, implicit.stderr
    explicit = run_cli("policy", "export", "--format", "vap", cwd=tmp_path)
    assert implicit.stdout == explicit.stdout
    kinds = [doc["kind"] for doc in yaml.safe_load_all(implicit.stdout) if doc]
    assert kinds == ["ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]
    assert "[default: vap]" in run_cli("policy", "export", "--help", cwd=tmp_path).stdout


@pytest.mark.parametrize("path", _command_paths(main), ids=lambda p: " ".join(p) or "csinode-guard")
def test_help_shows_no_literal_verbatim_marker(path: tuple[str, ...], tmp_path: Path) -> None:
    """click's no-rewrap marker is the backspace character; a docstring that spells it ``\\\\b`` prints a
    literal backslash-b and lets click rewrap the example lines into one paragraph."""
    result = run_cli(*path, "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "\\b" not in result.stdout, result.stdout


def test_completion_help_keeps_one_example_per_line(tmp_path: Path) -> None:
    lines = [line.strip() for line in run_cli("completion", "--help", cwd=tmp_path).stdout.splitlines()]
    assert "fish:  csinode-guard completion fish > ~/.config/fish/completions/csinode-guard.fish" in lines
