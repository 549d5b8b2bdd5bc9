"""``csinode-guard policy``: validate policy files and run table-driven policy tests
(``webhook.simulation.policy_tests``)."""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
import yaml

from webhook.admission.node_labels import node_label_warnings
from webhook.admission.policy import PolicyError, load_policy, load_profile
from webhook.admission.safe_yaml import load_yaml
from webhook.admission.version_trust import version_source_warnings
from webhook.commands.options import (
    EXIT_FINDINGS,
    api_failure,
    cluster_options,
    connect,
    deprecated_alias,
    echo_document,
    output_option,
    served_policy_for,
    take_deprecated,
)
from webhook.kube import kubeapi
from webhook.kube.guardpolicy_crd import crd_yaml
from webhook.kube.guardpolicy_migration import MigrationError, migrate_configmap
from webhook.kube.vap import VAP_NAME, export_vap
from webhook.simulation.policy_test_files import KIND as TEST_KIND
from webhook.simulation.policy_test_files import PolicyTestError, find_test_files, load_test_file
from webhook.simulation.policy_test_report import format_junit, format_text, report_json, totals
from webhook.simulation.policy_tests import run_test_file

F = TypeVar("F", bound=Callable[..., Any])


@click.group("policy")
def policy() -> None:
    """Check policies before they reach a cluster: validate files, run policy tests, export a CEL floor."""


def _kind(path: Path) -> str | None:
    try:
        doc = load_yaml(path.read_text("utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    kind = doc.get("kind") if isinstance(doc, dict) else None
    return str(kind) if kind else None


def _validate_one(path: Path) -> tuple[bool, str, list[str]]:
    """(valid, the line for standard output, warnings for standard error)."""
    kind = _kind(path)
    try:
        if kind == "DriverProfile":
            profile = load_profile(path)
            return True, f"{path}: ok (DriverProfile {profile.name!r}, {len(profile.ceilings)} entries)", []
        if kind == TEST_KIND:
            doc = load_test_file(path)
            return True, f"{path}: ok (PolicyTest, {len(doc['cases'])} cases)", []
        loaded = load_policy(path)
        found = [*node_label_warnings(loaded), *version_source_warnings(loaded)]
        warnings = [f"{path}: warning: at {w.path}: {w.message}" for w in found]
        return True, f"{path}: ok (GuardPolicy {loaded.name!r}, hash {loaded.hash})", warnings
    except PolicyError as exc:
        return False, f"{exc.source}: invalid: at {exc.path or '(document)'}: {exc.constraint}", []
    except PolicyTestError as exc:
        return False, f"{exc.source}: invalid: at {exc.path or '(document)'}: {exc.problem}", []


def _files(positional: tuple[Path, ...], filenames: tuple[Path, ...]) -> list[Path]:
    """The input files of a ``policy`` subcommand: ``-f/--filename`` (repeatable) and positional, in that order;
    a usage error (exit code 2) when there are none."""
    files = [*filenames, *positional]
    if not files:
        raise click.UsageError("no input: give files or directories (-f FILE or positional FILE...)")
    return files


def _filename_option(what: str) -> Callable[[F], F]:
    return click.option("--filename", "-f", "filenames", multiple=True, type=click.Path(path_type=Path),
                        help=f"{what} (repeatable; a directory stands for its *.yaml/*.yml files); positional "
                        "files work too.")


@policy.command("validate")
@click.argument("paths", nargs=-1, type=click.Path(path_type=Path))
@_filename_option("Policy, driver profile or policy test file to validate")
@click.option("--quiet", "-q", is_flag=True, help="Print only the files that are invalid.")
def validate(paths: tuple[Path, ...], filenames: tuple[Path, ...], quiet: bool) -> None:
    """Validate policy files (also driver profiles and policy tests, told apart by their kind).

    A directory stands for every *.yaml/*.yml file below it. An invalid file is reported as
    FILE: invalid: at PATH: CONSTRAINT (PATH is a JSON path inside the document). Exit code 1 when any file is
    invalid. A GuardPolicy whose ceiling nodeLabel or enforcementScope.nodeSelector uses a label the node's
    kubelet can set on its own Node (NodeRestriction) gets FILE: warning: at PATH: ... on standard error (exit
    code unchanged); labels under node-restriction.kubernetes.io/ are the ones a kubelet cannot set. So does a
    minVersion judged on versionSource kubelet (the node reports its own kubeletVersion).
    """
    bad = 0
    given = _files(paths, filenames)
    files = find_test_files(given)
    if not files:
        raise click.ClickException("no policy files (*.yaml, *.yml) found in " + ", ".join(map(str, given)))
    for path in files:
        ok, line, warnings = _validate_one(path)
        if not ok:
            bad += 1
        if not ok or not quiet:
            click.echo(line)
        for warning in warnings:
            click.echo(warning, err=True)
    if bad:
        click.echo(f"{bad} invalid file{'s' if bad != 1 else ''}", err=True)
        sys.exit(EXIT_FINDINGS)


@policy.command("test")
@click.argument("paths", nargs=-1, type=click.Path(exists=True, path_type=Path))
@_filename_option("Policy test file (kind: PolicyTest) or directory")
@click.option("--policy", "policy_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Run every test file against this policy instead of the one the file names.")
@output_option(["table", "json", "yaml", "junit"], aliases={"text": "table"},
               help="table: readable report; json/yaml: every file, case and step; junit: JUnit XML for CI systems.")
@click.option("--output-file", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the report here instead of standard output (the summary still goes to stderr).")
@click.option("--verbose", "-v", is_flag=True, help="Show every step, not only failing ones.")
@click.option("--guard-policy", "guard_policy", metavar="NAME",
              help="Run every test file against the cluster's GuardPolicy NAME (the policy the guard serves; the "
              "cluster of --kubeconfig/--context) instead of the one the file names.")
@cluster_options
def test(paths: tuple[Path, ...], filenames: tuple[Path, ...], policy_path: Path | None, output: str,
         output_file: Path | None, verbose: bool, guard_policy: str | None, kubeconfig: str | None,
         context: str | None) -> None:
    """Run table-driven policy tests (kind: PolicyTest) from files or directories.

    Each case is a sequence of CSINode writes over time with the cluster facts at each moment; every write goes
    through /mutate, its patch and /validate as in a cluster, and is checked against its expect block. See
    policies/tests/ for examples. Exit code 0 when everything passed, 1 on any failure or unloadable file.
    """
    files = find_test_files(_files(paths, filenames))
    if not files:
        raise click.ClickException("no test files (*.yaml, *.yml) found")
    if guard_policy is not None and policy_path is not None:
        raise click.UsageError("--policy and --guard-policy exclude each other")
    with contextlib.ExitStack() as stack:
        if guard_policy is not None:
            served = served_policy_for(None, guard_policy, kubeconfig=kubeconfig, context=context)
            directory = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="csinode-guard-policy-")))
            policy_path = directory / f"{served.policy.name}.yaml"
            policy_path.write_text(json.dumps(dict(served.policy.document)), "utf-8")
            click.echo(f"Judged with {served.describe()}", err=True)
        elif policy_path is not None:
            click.echo(f"Judged with {served_policy_for(policy_path, '').describe()}", err=True)
        results = [run_test_file(f, policy_path) for f in files]
    if output in ("json", "yaml"):
        if output_file is not None:
            document = report_json(results)
            text = json.dumps(document, indent=2) + "\n" if output == "json" else yaml.safe_dump(
                document, sort_keys=False, width=10**9)
            output_file.write_text(text, "utf-8")
        else:
            echo_document(report_json(results), output)
    else:
        report = format_junit(results) if output == "junit" else format_text(results, verbose=verbose)
        if output_file is not None:
            output_file.write_text(report, "utf-8")
        else:
            click.echo(report, nl=False)
    t = totals(results)
    if output_file is not None or output != "table":
        click.echo(f"{t.cases} cases: {t.passed} passed, {t.failed} failed"
                   + (f", {t.errors} could not run" if t.errors else ""), err=True)
    if t.failed or t.errors:
        sys.exit(EXIT_FINDINGS)


@policy.command("crd")
def crd_command() -> None:
    """Print the GuardPolicy CustomResourceDefinition, generated from the policy JSON Schema the guard validates
    with (deploy/base/guardpolicy-crd.yaml is this output: csinode-guard policy crd > deploy/base/guardpolicy-crd.yaml).
    """
    click.echo(crd_yaml(), nl=False)


@policy.command("migrate")
@click.option("--namespace", default="csinode-guard", show_default=True,
              help="Namespace of the guard's old policy ConfigMap (csinode-guard-policy-<hash>, key policy.yaml).")
@click.option("--configmap", metavar="NAME",
              help="The ConfigMap to carry over (default: the newest csinode-guard-policy-* with a policy.yaml).")
@click.option("--guard-policy", "guard_policy", default="default", show_default=True, metavar="NAME",
              help="The GuardPolicy to create (or replace, see --force).")
@click.option("--force", is_flag=True,
              help="Replace a GuardPolicy that someone has edited (by default only one absent, or the untouched "
              "bundled default a replica created, is replaced).")
@click.option("--dry-run", is_flag=True, help="Show what would be done; change nothing.")
@cluster_options
def migrate(namespace: str, configmap: str | None, guard_policy: str, force: bool, dry_run: bool,
            kubeconfig: str | None, context: str | None) -> None:
    """Carry the policy of an installation that kept it in a ConfigMap over into the GuardPolicy, once.

    Reads policy.yaml of the ConfigMap, checks it as the guard does, and creates GuardPolicy NAME from it; when
    the GuardPolicy exists only as the bundled default a replica created at start (generation 1, the bundled
    policy's hash), it is replaced; an edited one is left alone unless --force. The ConfigMap is not deleted
    (docs/operations.md, "Moving from the policy ConfigMap").
    """
    client = connect(kubeconfig, context)
    with client:
        try:
            result = migrate_configmap(client, namespace, configmap, guard_policy, force=force, dry_run=dry_run)
        except MigrationError as exc:
            raise click.ClickException(str(exc)) from None
        except (kubeapi.KubeApiError, kubeapi.ApiUnreachableError) as exc:
            raise api_failure("migration failed", exc) from None
    click.echo(result)


@policy.command("export")
@click.argument("path", required=False, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--filename", "-f", "filename", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="The policy to export (or give it as the argument; default: the bundled default policy).")
@deprecated_alias("--policy", "-f/--filename", dest="filename",
                  type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--format", "export_format", type=click.Choice(["vap"]), default="vap",
              show_default=True, help="vap: a ValidatingAdmissionPolicy + ValidatingAdmissionPolicyBinding "
              "(admissionregistration.k8s.io/v1) enforcing the history-free part of the policy.")
@click.option("--name", default=VAP_NAME, show_default=True, help="metadata.name of both objects.")
@click.option("--output-file", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the YAML here instead of standard output.")
def export(path: Path | None, filename: Path | None, export_format: str, name: str, output_file: Path | None,
           **kwargs: Path | None) -> None:
    """Export the policy's history-free rules as objects the apiserver enforces itself.

    The ValidatingAdmissionPolicy refuses, per driver the policy enforces: a bounded count becoming unbounded,
    an increase to 2147483647, an increase above the driver's highest possible ceiling, an increase larger than
    maxStepUp, and count changes by anyone but the node's kubelet or the policy's writers. It holds while the
    guard is down or unregistered; registrations, removals, CREATE and DELETE always pass. What it cannot
    express is listed in a comment at the top. Apply with kubectl apply -f, or deploy/overlays/vap; uninstall
    removes it.

    \b
    Example:
      csinode-guard policy export -f policy.yaml --output-file floor.yaml
      csinode-guard policy export policy.yaml | kubectl apply -f -
    """
    del export_format  # one format so far
    legacy = take_deprecated(kwargs, "filename")
    given = [p for p in (path, filename, legacy) if p is not None]
    if len(given) > 1:
        raise click.UsageError("give the policy once: as the argument or with -f/--filename")
    try:
        loaded = load_policy(given[0] if given else None)
    except PolicyError as exc:
        raise click.ClickException(str(exc)) from None
    text = export_vap(loaded, name=name)
    if output_file is not None:
        output_file.write_text(text, "utf-8")
    else:
        click.echo(text, nl=False)
