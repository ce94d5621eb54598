"""A real Prometheus (Debian's package; skipped unless installed, required in CI) scrapes a running server:
the turn count comes back from a query, and every query of deploy/grafana-agent-mcp.json returns data."""

from __future__ import annotations

import pytest

from tests.conftest import ConfigDir
from tests.observability import Prometheus, dashboard_queries, metrics_server, traffic
from tests.waiting import until


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_prometheus_scrapes_the_server_and_every_dashboard_query_returns_data(tmp_path, fake_openai,
                                                                                      servers) -> None:
    (tmp_path / "cfg").mkdir()
    server, urls = metrics_server(ConfigDir(tmp_path / "cfg"), fake_openai,
                                  rate_limits={"search": {"calls": 2, "window_seconds": 3600, "auto_disable": False}})
    servers.append(server.start())
    with Prometheus(tmp_path / "prometheus", urls.metrics.removeprefix("http://")) as prom:
        turns = await traffic(urls, fake_openai, rounds=2)

        def counted() -> bool:
            found = prom.query('sum(agent_mcp_turns_total{job="agent-mcp", instance="test-a"})')
            return bool(found) and float(found[0]["value"][1]) == turns

        await until(counted, f"prometheus to scrape the count of {turns} turns")
        # Rates need two scrapes after the traffic: wait for one more, then every panel's query has data.
        scraped = prom.last_scrape()

        def scraped_again() -> bool:
            return prom.last_scrape() > scraped

        await until(scraped_again, "another scrape")
        empty = [(title, expr) for title, expr in dashboard_queries("30s") if not prom.query(expr)]
        assert empty == [], empty
        assert prom.query('up{job="agent-mcp"}')[0]["value"][1] == "1"
        by_outcome = {r["metric"]["outcome"]: float(r["value"][1]) for r in
                      prom.query('sum by (outcome) (agent_mcp_turns_total)')}
        assert by_outcome == {"ok": turns - 2, "error": 2}
        refused = prom.query('sum(agent_mcp_rate_limit_refusals_total{tool_type="search"})')
        assert float(refused[0]["value"][1]) == 4  # 6 lookups: 2 allowed in the window, the other 4 refused
