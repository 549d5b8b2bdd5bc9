"""A picture of the dashboard: the panels' queries of :data:`dashboard.panels.ROWS` over a time range of a
Prometheus, drawn with matplotlib into one PNG (no Grafana needed).

    python -m dashboard.picture --prometheus http://127.0.0.1:9090 --namespace csinode-guard \\
        --minutes 30 --out docs/dashboard.png

The repository's picture (docs/dashboard.png) comes from the suite's rollout scenario:
``CSINODE_GUARD_DASHBOARD_PNG=docs/dashboard.png python -m pytest -n 0 tests/k8s/test_monitoring_dashboard.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from dashboard.panels import ROWS, Panel, expand

QueryRange = Callable[[str, float, float, float], list[dict[str, Any]]]
"""``(expr, start, end, step) -> [{"metric": {...}, "values": [[ts, "v"], ...]}]`` (Prometheus' query_range)."""

COLUMNS = 3
UNIT_LABELS = {"reqps": "per second", "s": "seconds", "d": "days", "short": "", "percentunit": "share"}


def legend(template: str, labels: Mapping[str, str]) -> str:
    """Grafana's legend template (``{{label}}``) filled from a series' labels."""
    text = template
    for key, value in labels.items():
        text = text.replace("{{" + key + "}}", value)
    while "{{" in text and "}}" in text:  # labels the series does not carry
        start, end = text.index("{{"), text.index("}}") + 2
        text = text[:start] + text[end:]
    return " ".join(text.split()) or "value"


def _draw(ax: Any, panel: Panel, query_range: QueryRange, namespace: str, start: float, end: float,
          step: float) -> None:
    lines = 0
    for query in panel.queries:
        for series in query_range(expand(query.expr, namespace), start, end, step):
            times = [datetime.fromtimestamp(float(t), UTC) for t, _ in series["values"]]
            values = [float(v) for _, v in series["values"]]
            ax.plot(times, values, linewidth=1.4, label=legend(query.legend, series["metric"]))
            lines += 1
    if panel.red is not None:
        ax.axhline(panel.red, color="#d62728", linestyle="--", linewidth=1, label=f"red from {panel.red:g}")
    ax.set_title(panel.title, fontsize=10, loc="left")
    ax.set_ylabel(UNIT_LABELS.get(panel.unit, panel.unit), fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    if lines:
        ax.legend(fontsize=6.5, loc="upper left", framealpha=0.8)
    else:
        ax.text(0.5, 0.5, "no data", transform=ax.transAxes,
                ha="center", va="center", fontsize=9, color="#777777")
    import matplotlib.dates as mdates  # noqa: PLC0415

    ax.set_xlim(datetime.fromtimestamp(start, UTC), datetime.fromtimestamp(end, UTC))
    formatter = mdates.DateFormatter("%H:%M:%S" if end - start < 900 else "%H:%M")  # type: ignore[no-untyped-call]
    ax.xaxis.set_major_formatter(formatter)


def render(query_range: QueryRange, out: Path, namespace: str, start: float, end: float) -> Path:
    """Draw every row (its title on the left) and panel over [``start``, ``end``] (Unix seconds) into ``out``
    (PNG). Returns ``out``."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    step = max(1.0, (end - start) / 240)
    figure = plt.figure(figsize=(18, 2.7 * len(ROWS)), layout="constrained")
    first, last = datetime.fromtimestamp(start, UTC), datetime.fromtimestamp(end, UTC)
    figure.suptitle(f"csinode-guard rollout signals (namespace {namespace}, {first:%Y-%m-%d %H:%M}–{last:%H:%M} UTC)",
                    fontsize=13)
    rows = list(figure.subfigures(len(ROWS), 1, squeeze=False)[:, 0])
    for row, subfigure in zip(ROWS, rows, strict=True):
        subfigure.suptitle(row.title, x=0.005, ha="left", fontsize=11, fontweight="bold")
        axes = subfigure.subplots(1, COLUMNS)
        for index, ax in enumerate(axes):
            if index < len(row.panels):
                panel = row.panels[index]
                _draw(ax, panel, query_range, namespace, start, end, step)
            else:
                ax.axis("off")
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=72)
    plt.close(figure)
    return out


def http_query_range(url: str) -> QueryRange:
    """A :data:`QueryRange` over the HTTP API of the Prometheus at ``url``."""

    def query_range(expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        params = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
        with urllib.request.urlopen(f"{url.rstrip('/')}/api/v1/query_range?{params}", timeout=30) as answer:
            body = json.loads(answer.read())
        if body.get("status") != "success":
            raise RuntimeError(f"{expr}: {body}")
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    return query_range


def main(argv: list[str] | None = None) -> int:
    """The command line of the module docstring."""
    parser = argparse.ArgumentParser(prog="python -m dashboard.picture", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prometheus", required=True, help="base URL of the Prometheus to query")
    parser.add_argument("--namespace", default="csinode-guard", help="the installation's namespace label")
    parser.add_argument("--minutes", type=float, default=30, help="time range ending now")
    parser.add_argument("--out", type=Path, default=Path("dashboard.png"))
    args = parser.parse_args(argv)
    end = time.time()
    print(render(http_query_range(args.prometheus), args.out, args.namespace, end - 60 * args.minutes, end))
    return 0


if __name__ == "__main__":
    sys.exit(main())
