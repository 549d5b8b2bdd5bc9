"""Build the Grafana dashboard JSON from :data:`dashboard.panels.ROWS` with grafana-foundation-sdk.

    python -m dashboard.build            write deploy/overlays/monitoring/dashboards/csinode-guard.json
    python -m dashboard.build --check    exit 1 (and say so) when the committed JSON is not what the code builds

Grafana picks the dashboard up from the overlay's ConfigMap (label ``grafana_dashboard: "1"``, as the Grafana
sidecar of kube-prometheus-stack selects). Two variables: the Prometheus data source and the installation's
namespace(s).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import common as common_builder
from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import prometheus, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models.dashboard import (
    DataSourceRef,
    Threshold,
    ThresholdsMode,
    VariableOption,
    VariableRefresh,
)

from dashboard.panels import ROWS, Panel

REPO = Path(__file__).resolve().parents[1]
OUTPUT = REPO / "deploy" / "overlays" / "monitoring" / "dashboards" / "csinode-guard.json"
UID = "csinode-guard"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")


def build_panel(panel: Panel, panel_id: int) -> timeseries.Panel:
    """Time series panel ``panel_id``: its queries (refId A, B, ...), unit, description and the red threshold."""
    builder = (
        timeseries.Panel()
        .id(panel_id)
        .title(panel.title)
        .description(panel.description)
        .unit(panel.unit)
        .datasource(DATASOURCE)
        .height(8)
        .span(12)
        .line_width(1)
        .fill_opacity(10)
        .legend(common_builder.VizLegendOptions().show_legend(True).display_mode(common.LegendDisplayMode.LIST)
                .placement(common.LegendPlacement.BOTTOM))
    )
    for number, query in enumerate(panel.queries):
        builder = builder.with_target(
            prometheus.Dataquery().expr(query.expr).legend_format(query.legend).ref_id(chr(ord("A") + number))
        )
    steps = [Threshold(value=None, color="green")]
    if panel.red is not None:
        steps.append(Threshold(value=panel.red, color="red"))
        builder = builder.thresholds_style(
            common_builder.GraphThresholdsStyleConfig().mode(common.GraphTresholdsStyleMode.DASHED))
    return builder.thresholds(dash.ThresholdsConfig().mode(ThresholdsMode.ABSOLUTE).steps(steps))


def build_dashboard() -> dash.Dashboard:
    """The whole dashboard: one row per signal of :data:`dashboard.panels.ROWS`, two panels across."""
    board = (
        dash.Dashboard("csinode-guard: mutable CSINode allocatable counts")
        .uid(UID)
        .description("The rollout signals of csinode-guard (docs/operations.md, 'Dashboard').")
        .tags(["csinode-guard", "storage", "kubernetes"])
        .refresh("30s")
        .time("now-6h", "now")
        .timezone("utc")
        .readonly()
        .with_variable(dash.DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(
            dash.QueryVariable("namespace")
            .label("Installation namespace")
            .datasource(DATASOURCE)
            .query("label_values(csinode_guard_requests_total, namespace)")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .multi(True)
            .include_all(True)
            .current(VariableOption(selected=True, text="All", value="$__all"))
        )
    )
    panel_id = 0
    for row in ROWS:
        panel_id += 1
        board = board.with_row(dash.Row(row.title).id(panel_id))
        for panel in row.panels:
            panel_id += 1
            board = board.with_panel(build_panel(panel, panel_id))
    return board


def render() -> str:
    """The dashboard's JSON text (sorted keys, two-space indent, final newline)."""
    return JSONEncoder(sort_keys=True, indent=2).encode(build_dashboard().build()) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write (or with ``--check`` compare) :data:`OUTPUT`; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m dashboard.build", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed file instead of writing")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not args.output.exists() or args.output.read_text("utf-8") != text:
            print(f"{args.output} is not up to date: run python -m dashboard.build", file=sys.stderr)
            return 1
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text, "utf-8")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
