"""The monitoring overlay's Grafana dashboard: built from dashboard/panels.py (the committed JSON is what the code
builds), shipped in a ConfigMap Grafana's sidecar loads, on metric names the guard exports or the recording rules
define, and every panel explained in the runbook. tests/k8s/test_monitoring_dashboard.py runs the queries."""

from __future__ import annotations

import json
import re

from deploy_helpers import DEPLOY, Objects, find, load_yaml_documents

from dashboard import build
from dashboard.panels import NAMESPACE, ROWS

OPERATIONS = DEPLOY.parent / "docs" / "operations.md"


def _exported() -> set[str]:
    """Every csinode_guard_ metric name the package defines (as exported: counters with _total)."""
    names = set()
    for path in (DEPLOY.parent / "webhook").rglob("*.py"):
        text = path.read_text("utf-8")
        for kind, name in re.findall(r'\b(Counter|Gauge|Histogram|GaugeMetricFamily|CounterMetricFamily)\(\s*'
                                     r'"(csinode_guard_[a-z0-9_]+)"', text):
            names.add(f"{name}_total" if kind.startswith("Counter") else name)
    return names


def _recorded() -> set[str]:
    rule = find(load_yaml_documents(DEPLOY / "overlays" / "monitoring" / "prometheusrule.yaml"), "PrometheusRule")
    return {r["record"] for g in rule["spec"]["groups"] for r in g["rules"] if "record" in r}


def test_the_committed_dashboard_is_what_the_code_builds() -> None:
    assert build.main(["--check"]) == 0, "run: python -m dashboard.build"


def test_the_dashboard_ships_in_a_configmap_grafana_loads(rendered: dict[str, Objects]) -> None:
    config_map = find(rendered["overlays/monitoring"], "ConfigMap", "csinode-guard-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["namespace"] == "csinode-guard"
    assert json.loads(config_map["data"]["csinode-guard.json"]) == json.loads(build.OUTPUT.read_text())


def test_every_query_reads_existing_metrics_of_the_selected_installation() -> None:
    exported, recorded = _exported(), _recorded()
    for row in ROWS:
        for panel in row.panels:
            for query in panel.queries:
                assert f'namespace=~"{NAMESPACE}"' in query.expr, (panel.title, query.expr)
                names = set(re.findall(r"\b(csinode_guard(?::[a-z0-9_]+)+|csinode_guard_[a-z0-9_]+)", query.expr))
                names = {re.sub(r"_(bucket|sum|count)$", "", n) if n not in exported else n for n in names}
                unknown = names - exported - recorded
                assert not unknown, (panel.title, unknown)


def test_every_panel_is_explained_in_the_runbook() -> None:
    text = OPERATIONS.read_text("utf-8")
    section = text[text.index("### Dashboard"):]
    for row in ROWS:
        for panel in row.panels:
            assert panel.title in section, f"docs/operations.md 'Dashboard' does not explain {panel.title!r}"
