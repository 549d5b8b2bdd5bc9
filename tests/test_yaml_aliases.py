"""YAML alias expansion ("billion laughs") is refused in every file the guard reads: policy, policy test and
cluster facts, through the CLI and through a hot reload on the real server (the last good policy keeps serving).

A policy of a few KB whose metadata (free-form in the schema) nests aliases nine wide expands to half a million
nodes at six levels, to hundreds of millions at nine: the schema validation and the policy hash walk every one.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO
from tests.test_hot_reload import Load, readyz
from webhook.admission.policy import PolicyError, load_policy
from webhook.admission.safe_yaml import MAX_ALIASES, load_yaml


def laughs(levels: int, indent: str = "    ") -> str:
    """Nested aliases, nine per level: ``l0`` is nine strings, ``l<n>`` nine aliases of ``l<n-1>``."""
    lines = [f"{indent}l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n"]
    lines += [f"{indent}l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]\n" for i in range(1, levels)]
    return "".join(lines)


def laughing_policy(levels: int) -> str:
    """The default policy, without its comment lines, with ``metadata.laughs`` holding :func:`laughs`
    (schema-valid: metadata is free-form): a file of a few KB, whatever the default policy's comments say."""
    lines = (REPO / "policies" / "default.yaml").read_text().splitlines(keepends=True)
    text = "".join(line for line in lines if not line.lstrip().startswith("#"))
    head = "metadata:\n  name: default\n"
    assert head in text
    return text.replace(head, "metadata:\n  name: laughs\n  laughs:\n" + laughs(levels))


MEMORY_LIMIT = 512 * 1024 * 1024
"""Address space (bytes) the CLI gets in :func:`cli`: ample for reading any real policy (the default one is
validated in under 300 MB), far below what expanding the aliases takes (1.35 GB at nine levels, measured)."""


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """The CLI as a subprocess with at most :data:`MEMORY_LIMIT` of memory: a refusal that came only after the
    expansion would have run out of it first (a MemoryError, not the refusal), whatever the machine's load."""
    return subprocess.run([sys.executable, "-m", "webhook", *args], check=False, capture_output=True, text=True,
                          timeout=120, cwd=REPO, preexec_fn=_limit_memory)


@pytest.mark.parametrize("levels", [pytest.param(6, id="half a million nodes"),
                                    pytest.param(9, id="387 million nodes")])
def test_policy_validate_refuses_nested_aliases_at_once_with_a_clear_error(tmp_path: Path, levels: int) -> None:
    path = tmp_path / "laughs.yaml"
    path.write_text(laughing_policy(levels))
    assert len(path.read_bytes()) < 5000
    result = cli("policy", "validate", str(path))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "alias expansion" in result.stdout + result.stderr
    assert "MemoryError" not in result.stderr


def test_a_few_aliases_are_still_read() -> None:
    doc = load_yaml("base: &b {max: 27}\none: *b\ntwo: *b\n")
    assert doc == {"base": {"max": 27}, "one": {"max": 27}, "two": {"max": 27}}


def test_too_many_aliases_and_an_alias_inside_itself_are_refused() -> None:
    many = "a: &a x\nb: [" + ", ".join(["*a"] * (MAX_ALIASES + 1)) + "]\n"
    with pytest.raises(yaml.YAMLError, match="aliases"):
        load_yaml(many)
    with pytest.raises(yaml.YAMLError, match="contains itself"):
        load_yaml("a: &a [1, *a]\n")


def test_load_policy_raises_policy_error(tmp_path: Path) -> None:
    path = tmp_path / "laughs.yaml"
    path.write_text(laughing_policy(6))
    with pytest.raises(PolicyError, match="alias expansion"):
        load_policy(path)


def test_a_policy_test_file_and_a_facts_file_with_nested_aliases_are_refused(tmp_path: Path) -> None:
    test_file = tmp_path / "laughs-test.yaml"
    test_file.write_text("apiVersion: csinode-guard.io/v1alpha1\nkind: PolicyTest\nlaughs:\n" + laughs(7, "  "))
    result = cli("policy", "test", str(test_file))
    assert result.returncode != 0 and "alias expansion" in result.stdout + result.stderr, result.stdout
    facts = tmp_path / "facts.yaml"
    facts.write_text("nodes: {}\nlaughs:\n" + laughs(7, "  "))
    review = tmp_path / "review.json"
    review.write_bytes((REPO / "tests" / "data" / "review-eni-25-to-23.json").read_bytes())
    result = cli("evaluate", "--review", str(review), "--cluster-facts", str(facts))
    assert result.returncode != 0 and "alias expansion" in result.stdout + result.stderr, result.stdout


@pytest.mark.slow
def test_a_hot_reload_of_nested_aliases_is_refused_and_the_last_good_policy_keeps_serving(
    server_factory: Any, tmp_path: Path
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text((REPO / "policies" / "default.yaml").read_text())
    server = server_factory("--policy", str(policy), "--policy-reload-interval", "0.5")
    good = readyz(server)["policy"]
    with Load(server) as load:
        time.sleep(0.5)
        staged = tmp_path / "staged.yaml"
        staged.write_text(laughing_policy(9))
        os.replace(staged, policy)
        deadline = time.monotonic() + 30
        while "alias expansion" not in server.stderr_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)
    assert "alias expansion" in server.stderr_path.read_text()
    assert not load.failures, load.failures[:5]
    assert load.sent > 20
    for _ in range(6):  # fresh connections: both workers
        assert readyz(server)["policy"] == good
    answer = server.post("/mutate", json.loads((REPO / "tests" / "data" / "review-eni-25-to-23.json").read_text()))
    assert answer.status == 200
