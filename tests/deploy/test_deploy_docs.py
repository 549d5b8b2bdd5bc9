"""docs/operations.md: the runbook every alert points to, its internal links, and the facts it must carry."""

from __future__ import annotations

import re

import pytest
from deploy_helpers import DEPLOY, REPO, find, load_yaml_documents

RUNBOOK = REPO / "docs" / "operations.md"


def _anchor(heading: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors() -> set[str]:
    text = RUNBOOK.read_text("utf-8")
    in_code = False
    anchors = set()
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            anchors.add(_anchor(line.lstrip("#")))
    return anchors


def _alert_runbooks() -> dict[str, str]:
    rule = find(load_yaml_documents(DEPLOY / "overlays" / "monitoring" / "prometheusrule.yaml"), "PrometheusRule")
    return {r["alert"]: r["annotations"]["runbook"] for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r}


@pytest.mark.parametrize(("alert", "runbook"), sorted(_alert_runbooks().items()))
def test_every_alert_runbook_link_resolves(alert: str, runbook: str) -> None:
    path, _, anchor = runbook.partition("#")
    assert REPO / path == RUNBOOK
    assert anchor in _anchors(), f"{alert}: no heading for #{anchor}"


def test_internal_links_resolve() -> None:
    links = set(re.findall(r"\]\(#([^)]+)\)", RUNBOOK.read_text("utf-8")))
    assert links
    assert links <= _anchors(), links - _anchors()


def test_paths_named_in_the_runbook_exist() -> None:
    paths = set(re.findall(r"`((?:deploy|policies|webhook)/[\w./-]+)`", RUNBOOK.read_text("utf-8")))
    assert paths
    for path in paths:
        assert (REPO / path).exists(), path


@pytest.mark.parametrize(
    "fact",
    [
        "MutableCSINodeAllocatableCount",
        "| 1.33 | alpha, off by default |",
        "| 1.34 | beta, off by default |",
        "| 1.35 | beta, on by default |",
        "| 1.36 | GA |",
        "kube-apiserver",
        "kubelet",
        "kube-scheduler",
        "CSI driver",
        "csinode-guard unregister",
        "csinode-guard restore ip-10-0-1-23.ec2.internal --driver ebs.csi.aws.com",
        "enforcementScope",
        "enforcementAction: dryrun",
    ],
)
def test_the_runbook_states(fact: str) -> None:
    assert fact in RUNBOOK.read_text("utf-8")


def _sections() -> list[str]:
    """The runbook's ``## `` headings, outside code blocks."""
    in_code = False
    sections = []
    for line in RUNBOOK.read_text("utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("## "):
            sections.append(line[3:])
    return sections


def test_the_runbook_is_final_and_its_contents_list_every_section() -> None:
    text = RUNBOOK.read_text("utf-8")
    title = text.splitlines()[0]
    assert "draft" not in title.lower(), title
    contents = text[text.index("Contents:"):text.index("\n\n", text.index("Contents:"))]
    linked = set(re.findall(r"\]\(#([\w-]+)\)", contents))
    missing = [s for s in _sections() if _anchor(s) not in linked]
    assert not missing, f"not in the contents: {missing}"
    assert "rolling-back" in linked


def test_the_runbook_documents_the_out_of_cluster_setup() -> None:
    text = RUNBOOK.read_text("utf-8")
    section = text[text.index("## Running the guard outside the cluster"):]
    section = section[:section.index("\n## ", 1)]
    commands = re.search(r"```sh\n(.*?)```", section, re.S)
    assert commands is not None
    block = commands.group(1).replace("\\\n", " ")
    assert re.search(r"csinode-guard serve .*--kubeconfig", block)
    assert re.search(r"csinode-guard register --url https://", block)
