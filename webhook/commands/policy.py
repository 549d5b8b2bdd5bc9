"""``csinode-guard policy``: validate policy files and run table-driven policy tests (``webhook.policytest``)."""

from __future__ import annotations

import sys
from pathlib import Path

import click
import yaml

from webhook.policy import PolicyError, load_policy, load_profile, load_yaml
from webhook.policytest import (
    KIND as TEST_KIND,
)
from webhook.policytest import (
    PolicyTestError,
    find_test_files,
    format_junit,
    format_text,
    load_test_file,
    run_test_file,
    totals,
)


@click.group("policy")
def policy() -> None:
    """Check policies before they reach a cluster: validate files, run policy tests."""


def _kind(path: Path) -> str | None:
    try:
        doc = load_yaml(path.read_text("utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    kind = doc.get("kind") if isinstance(doc, dict) else None
    return str(kind) if kind else None


def _validate_one(path: Path) -> tuple[bool, str]:
    kind = _kind(path)
    try:
        if kind == "DriverProfile":
            profile = load_profile(path)
            return True, f"{path}: ok (DriverProfile {profile.name!r}, {len(profile.ceilings)} entries)"
        if kind == TEST_KIND:
            doc = load_test_file(path)
            return True, f"{path}: ok (PolicyTest, {len(doc['cases'])} cases)"
        loaded = load_policy(path)
        return True, f"{path}: ok (GuardPolicy {loaded.name!r}, hash {loaded.hash})"
    except PolicyError as exc:
        return False, f"{exc.source}: invalid: at {exc.path or '(document)'}: {exc.constraint}"
    except PolicyTestError as exc:
        return False, f"{exc.source}: invalid: at {exc.path or '(document)'}: {exc.problem}"


@policy.command("validate")
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--quiet", "-q", is_flag=True, help="Print only the files that are invalid.")
def validate(paths: tuple[Path, ...], quiet: bool) -> None:
    """Validate policy files (also driver profiles and policy tests, told apart by their kind).

    A directory stands for every *.yaml/*.yml file below it. An invalid file is reported as
    FILE: invalid: at PATH: CONSTRAINT (PATH is a JSON path inside the document). Exit code 1 when any file is
    invalid.
    """
    bad = 0
    files = find_test_files(list(paths))
    if not files:
        raise click.ClickException("no policy files (*.yaml, *.yml) found in " + ", ".join(map(str, paths)))
    for path in files:
        ok, line = _validate_one(path)
        if not ok:
            bad += 1
        if not ok or not quiet:
            click.echo(line)
    if bad:
        click.echo(f"{bad} invalid file{'s' if bad != 1 else ''}", err=True)
        sys.exit(1)


@policy.command("test")
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path))
@click.option("--policy", "policy_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Run every test file against this policy instead of the one the file names.")
@click.option("--output", type=click.Choice(["text", "junit"]), default="text", show_default=True,
              help="text: readable report; junit: JUnit XML for CI systems.")
@click.option("--output-file", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the report here instead of standard output (the summary still goes to stderr).")
@click.option("--verbose", "-v", is_flag=True, help="Show every step, not only failing ones.")
def test(paths: tuple[Path, ...], policy_path: Path | None, output: str, output_file: Path | None,
         verbose: bool) -> None:
    """Run table-driven policy tests (kind: PolicyTest) from files or directories.

    Each case is a sequence of CSINode writes over time with the cluster facts at each moment; every write goes
    through /mutate, its patch and /validate as in a cluster, and is checked against its expect block. See
    policies/tests/ for examples. Exit code 0 when everything passed, 1 on any failure or unloadable file.
    """
    files = find_test_files(list(paths))
    if not files:
        raise click.ClickException("no test files (*.yaml, *.yml) found")
    results = [run_test_file(f, policy_path) for f in files]
    report = format_junit(results) if output == "junit" else format_text(results, verbose=verbose)
    if output_file is not None:
        output_file.write_text(report, "utf-8")
    else:
        click.echo(report, nl=False)
    t = totals(results)
    if output_file is not None or output == "junit":
        click.echo(f"{t.cases} cases: {t.passed} passed, {t.failed} failed"
                   + (f", {t.errors} could not run" if t.errors else ""), err=True)
    if t.failed or t.errors:
        sys.exit(1)
