"""The README and the documentation site: the README keeps CI's two commands, stays a few screens long, links
only to what exists and shows only commands and options the CLI has; the site builds with ``mkdocs build
--strict`` (every link and anchor resolves, every page is in the navigation), and its generated references cover
every field of the policy schema and every subcommand.

mkdocs comes from the ``docs`` extra (``pip install -e '.[docs]'``, in the README's test command): without it the
site tests are skipped, unless ``CSINODE_GUARD_REQUIRE_TOOLS=1`` (``.ci/run``) makes that a failure.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_helpers import REPO

README = REPO / "README.md"
DOCS = REPO / "docs"
README_MAX_LINES = 170


def _anchor(heading: str) -> str:
    """GitHub's heading anchor (mkdocs.yml's slugify makes the site's the same): lower case, punctuation dropped,
    spaces to hyphens."""
    text = re.sub(r"\s*\{[^}]*\}\s*$", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _headings(path: Path) -> set[str]:
    anchors, in_code = set(), False
    for line in path.read_text("utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and re.match(r"#{1,6} ", line):
            anchors.add(_anchor(line.lstrip("#")))
    return anchors


def _code_blocks(text: str) -> list[str]:
    return re.findall(r"```[a-z]*\n(.*?)```", text, re.S)


def _readme_command(tag: str) -> str:
    """The line after ``# TAG:`` in the README, as ``.ci/run``'s readme_command extracts it."""
    lines = README.read_text("utf-8").splitlines()
    for index, line in enumerate(lines):
        if line.startswith(f"# {tag}:"):
            return lines[index + 1]
    raise AssertionError(f"README lost its '# {tag}:' line (.ci/run runs the line after it)")


def test_the_readme_keeps_the_run_and_test_commands_ci_runs() -> None:
    run = _readme_command("run")
    assert run.startswith("python3 -m venv .venv && .venv/bin/pip install . && ") and "csinode-guard serve" in run
    test = _readme_command("test")
    # Every test runs on a fresh machine: the tools the Prometheus/promtool tests need are installed first, and
    # the docs extra for the site tests.
    assert test.startswith("bash ci/deploy-checks.sh install && "), test
    assert ".[test,docs]" in test and "-m pytest" in test


def test_the_readme_fits_on_a_few_screens() -> None:
    lines = README.read_text("utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines: move detail into docs/"


def test_every_relative_link_in_the_readme_resolves() -> None:
    links = re.findall(r"\]\(([^)#:]+)(?:#([^)]+))?\)", README.read_text("utf-8"))
    assert links
    for target, anchor in links:
        path = REPO / target
        assert path.exists(), f"README links to {target}, which does not exist"
        if anchor:
            assert anchor in _headings(path), f"README links to {target}#{anchor}: no such heading"


def _readme_cli_lines() -> list[list[str]]:
    """Every ``csinode-guard ...`` command in the README's code blocks, split as the shell would."""
    commands = []
    for block in _code_blocks(README.read_text("utf-8")):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                words = shlex.split(part.split("#", 1)[0], posix=True) if "csinode-guard" in part else []
                for index, word in enumerate(words):
                    if word.endswith("csinode-guard") and not word.startswith(("charts/", "deploy/")) \
                            and index + 1 < len(words) and words[0] != "helm":
                        commands.append(words[index + 1:])
                        break
    return commands


def _help(words: list[str]) -> tuple[list[str], str]:
    """``(the subcommand path, its --help)`` for the words after ``csinode-guard``."""
    path: list[str] = []
    text = ""
    for word in words:
        if word.startswith("-"):
            break
        result = subprocess.run([sys.executable, "-m", "webhook", *path, word, "--help"], capture_output=True,
                                text=True, timeout=60, check=False, cwd=REPO)
        if result.returncode != 0:
            break  # an argument (a file, a node name), not a subcommand
        path.append(word)
        text = result.stdout
    return path, text


@pytest.mark.parametrize("words", _readme_cli_lines(), ids=lambda w: " ".join(w)[:60])
def test_every_readme_command_and_option_exists(words: list[str]) -> None:
    path, text = _help(words)
    assert path, f"csinode-guard {' '.join(words)}: no such subcommand"
    for option in (w.split("=", 1)[0] for w in words if w.startswith("-")):
        assert re.search(rf"(^|[\s,]){re.escape(option)}([\s,=\[]|$)", text, re.M), \
            f"csinode-guard {' '.join(path)} has no option {option}"


def test_every_page_the_readme_names_is_in_the_site_navigation() -> None:
    config = yaml.safe_load(re.sub(r"!!python/\S+ ", "", (REPO / "mkdocs.yml").read_text("utf-8")))

    def pages(nav: Any) -> set[str]:
        if isinstance(nav, str):
            return {nav}
        if isinstance(nav, list):
            return set().union(*(pages(item) for item in nav))
        return set().union(*(pages(value) for value in nav.values()))

    in_nav = pages(config["nav"])
    linked = {t.removeprefix("docs/") for t in re.findall(r"\]\((docs/[^)#]+\.md)", README.read_text("utf-8"))}
    assert linked and linked <= in_nav, linked - in_nav
    on_disk = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert on_disk - in_nav == set(), f"docs pages missing from mkdocs.yml's nav: {on_disk - in_nav}"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``mkdocs build --strict`` of the repository's site: warnings (a broken link or anchor, a page out of the
    navigation) fail the build."""
    if importlib.util.find_spec("mkdocs") is None:
        message = "mkdocs not installed (pip install -e '.[docs]')"
        if os.environ.get("CSINODE_GUARD_REQUIRE_TOOLS") == "1":
            pytest.fail(message)
        pytest.skip(message)
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                            capture_output=True, text=True, timeout=300, check=False, cwd=REPO,
                            env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr[-4000:]}"
    return out


def _text(html: str) -> str:
    return re.sub(r"<[^>]+>", "", html)


def _schema_paths(schema: dict[str, Any], defs: dict[str, Any], prefix: str = "") -> set[str]:
    """Every property name of the schema (and of its definitions), as the reference lists its fields."""
    names: set[str] = set()
    for name, sub in schema.get("properties", {}).items():
        names.add(name)
        if isinstance(sub, dict):
            names |= _schema_paths(sub, defs)
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            names |= _schema_paths(schema[key], defs)
    for key in ("oneOf", "anyOf", "allOf"):
        for part in schema.get(key, []):
            names |= _schema_paths(part, defs)
    return names


def test_the_site_builds_strictly_and_its_policy_reference_has_every_schema_field(site: Path) -> None:
    page = _text((site / "reference" / "policy" / "index.html").read_text("utf-8"))
    for name in ("guardpolicy", "clusterfacts"):
        schema = json.loads((REPO / "webhook" / "schema" / f"{name}.schema.json").read_text("utf-8"))
        names = _schema_paths(schema, schema.get("$defs", {}))
        for definition in schema.get("$defs", {}).values():
            names |= _schema_paths(definition, {})
        missing = sorted(n for n in names if not re.search(rf"(^|[.\s]){re.escape(n)}(\s|$)", page, re.M))
        assert not missing, f"the policy reference lacks {name} fields {missing}"
    assert "reconcile: clamp" in page, "the bundled default policy is the reference's example"


def test_the_cli_reference_documents_every_subcommand(site: Path) -> None:
    from webhook.cli import COMMANDS  # noqa: PLC0415

    page = _text((site / "reference" / "cli" / "index.html").read_text("utf-8"))
    for command in COMMANDS:
        assert f"csinode-guard {command}" in page, f"the CLI reference lacks {command}"
    assert "--state-key-file" in page and "--kubeconfig" in page


def test_the_moved_benchmark_tables_are_on_the_performance_page(site: Path) -> None:
    page = _text((site / "performance" / "index.html").read_text("utf-8"))
    for fact in ("Core", "Served", "Through the real apiserver", "One call instead of two", "Soak"):
        assert fact in page
