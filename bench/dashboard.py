#!/usr/bin/env python3
"""`make dashboard`: every query of deploy/grafana-agent-mcp.json against a real Prometheus that scraped a run.

A server with the metrics listener (tests/observability.py: the API, the proxy, two tools, one gated)
gets a scripted mix of traffic for `--seconds` (tool calls, gates allowed and rejected, rate-limit
refusals, model errors, proxy conversations), in bursts of varying size; Debian's `prometheus`
scrapes it every second with deploy/prometheus.yml's job. Then every dashboard query runs (variables
filled in as Grafana does for all instances) and must return data; the main panels' range queries
are drawn into docs/dashboard.svg (matplotlib is not a dependency: the SVG is written here).

    python bench/dashboard.py [--seconds 90] [--out docs/dashboard.svg]
"""

from __future__ import annotations

import argparse
import asyncio
import html
import json
import math
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.conftest import ConfigDir  # noqa: E402
from tests.fakes.openai_backend import FakeOpenAI  # noqa: E402
from tests.observability import Prometheus, dashboard_queries, metrics_server, traffic  # noqa: E402

RATE = "20s"
#: The panels drawn: (title, unit, [(legend, PromQL)]).
PLOTTED = [
    ("Turns per second by outcome", "turns/s",
     [("ok", f'sum(rate(agent_mcp_turns_total{{outcome="ok"}}[{RATE}]))'),
      ("error", f'sum(rate(agent_mcp_turns_total{{outcome="error"}}[{RATE}]))')]),
    ("Turn duration", "ms",
     [("p50", f"1000 * histogram_quantile(0.5, sum by (le) (rate(agent_mcp_turn_duration_seconds_bucket[{RATE}])))"),
      ("p95", f"1000 * histogram_quantile(0.95, sum by (le) (rate(agent_mcp_turn_duration_seconds_bucket[{RATE}])))")]),
    ("Time to first token", "ms",
     [("p50", "1000 * histogram_quantile(0.5, sum by (le) "
              f"(rate(agent_mcp_time_to_first_token_seconds_bucket[{RATE}])))"),
      ("p95", "1000 * histogram_quantile(0.95, sum by (le) "
              f"(rate(agent_mcp_time_to_first_token_seconds_bucket[{RATE}])))")]),
    ("Tokens per second", "tokens/s",
     [("input", f'sum(rate(agent_mcp_tokens_total{{direction="input"}}[{RATE}]))'),
      ("output", f'sum(rate(agent_mcp_tokens_total{{direction="output"}}[{RATE}]))')]),
    ("Tool calls per second by outcome", "calls/s",
     [(o, f'sum(rate(agent_mcp_tool_calls_total{{outcome="{o}"}}[{RATE}]))') for o in ("ok", "refused")]),
    ("Gates and refusals per second", "per s",
     [("raised", f"sum(rate(agent_mcp_gates_raised_total[{RATE}]))"),
      ("rejected", f"sum(rate(agent_mcp_gates_rejected_total[{RATE}]))"),
      ("rate-limited", f"sum(rate(agent_mcp_rate_limit_refusals_total[{RATE}]))")]),
]
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e"]


def _svg(panels: list[tuple[str, str, list[tuple[str, list[tuple[float, float]]]]]], start: float) -> str:
    """Small multiples: one line chart per panel, 2 per row, time in seconds since `start` on x."""
    width, height, cols = 480, 230, 2
    rows = math.ceil(len(panels) / cols)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width * cols}" height="{height * rows + 30}" '
           'font-family="sans-serif" font-size="11">',
           '<rect width="100%" height="100%" fill="white"/><text x="10" y="18" font-size="14">agent-mcp dashboard, '
           'main panels (Prometheus range queries of one bench/dashboard.py run)</text>']
    for n, (title, unit, series) in enumerate(panels):
        ox, oy = (n % cols) * width, (n // cols) * height + 30
        left, top, pw, ph = ox + 55, oy + 25, width - 80, height - 65
        points = [p for _, pts in series for p in pts if math.isfinite(p[1])]
        ymax = max((p[1] for p in points), default=1.0) or 1.0
        xmax = max((p[0] for p in points), default=1.0) or 1.0
        out.append(f'<text x="{ox + 10}" y="{oy + 14}" font-size="12" font-weight="bold">{html.escape(title)}</text>')
        out.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>')
        for k in range(5):
            y = top + ph - ph * k / 4
            out.append(f'<line x1="{left}" x2="{left + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>'
                       f'<text x="{left - 4}" y="{y + 4:.1f}" text-anchor="end">{ymax * k / 4:.3g}</text>')
        out.append(f'<text x="{left + pw / 2}" y="{top + ph + 28}" text-anchor="middle">seconds since start '
                   f'({html.escape(unit)} on y)</text>')
        for k in range(5):
            x = left + pw * k / 4
            out.append(f'<text x="{x:.1f}" y="{top + ph + 14}" text-anchor="middle">{xmax * k / 4:.0f}</text>')
        for i, (legend, pts) in enumerate(series):
            color = COLORS[i % len(COLORS)]
            line = " ".join(f"{left + pw * x / xmax:.1f},{top + ph - ph * y / ymax:.1f}" for x, y in pts
                            if math.isfinite(y))
            if line:
                out.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{line}"/>')
            out.append(f'<text x="{left + pw - 5}" y="{top + 14 + 13 * i}" text-anchor="end" fill="{color}">'
                       f'{html.escape(legend)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


async def run(args: argparse.Namespace) -> tuple[int, str]:
    """Run the traffic and the queries; (queries that returned nothing, the plot's SVG)."""
    with FakeOpenAI() as backend, tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "cfg").mkdir()
        server, urls = metrics_server(ConfigDir(Path(tmp) / "cfg"), backend,
                                      rate_limits={"search": {"calls": 4, "window_seconds": 10, "auto_disable": False}})
        server.start()
        try:
            with Prometheus(Path(tmp) / "prometheus", urls.metrics.removeprefix("http://")) as prom:
                start = time.time()
                turns, burst = 0, 0
                while time.time() - start < args.seconds:
                    burst += 1
                    turns += await traffic(urls, backend, rounds=1 + burst % 4)  # bursts of 1 to 4 rounds
                    await asyncio.sleep(0.5 + (burst % 3))  # the load varies over the run
                end = time.time()
                await asyncio.sleep(3)  # two more scrapes
                print(f"{turns} turns in {end - start:.0f} s\n")
                print("| panel | query | series |\n|---|---|---|")
                empty = 0
                for title, expr in dashboard_queries(RATE):
                    found = prom.query(expr)
                    empty += not found
                    print(f"| {title} | `{expr}` | {len(found) or '**none**'} |")
                panels = []
                for title, unit, series in PLOTTED:
                    drawn = []
                    for legend, expr in series:
                        result = prom.query_range(expr, start, end + 2, 2)
                        values = [(float(t) - start, float(v)) for t, v in (result[0]["values"] if result else [])]
                        drawn.append((legend, values))
                    panels.append((title, unit, drawn))
        finally:
            server.stop()
    print(f"\n{'every query returned data' if not empty else f'{empty} queries returned nothing'}; "
          f"plot: {args.out}")
    print(json.dumps({"turns": turns, "seconds": round(end - start), "queries": len(dashboard_queries()),
                      "empty": empty}))
    return empty, _svg(panels, start)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=90)
    p.add_argument("--out", default=str(ROOT / "docs" / "dashboard.svg"))
    args = p.parse_args()
    empty, svg = asyncio.run(run(args))
    Path(args.out).write_text(svg)
    return 1 if empty else 0


if __name__ == "__main__":
    sys.exit(main())
