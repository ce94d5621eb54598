"""Prometheus metrics at `GET /metrics` on a listener of its own (off by default).

Enable it in plugins-enabled.json (`"plugin_client_metrics": {"enabled": true}` and its name in
`enabled_plugins`): the server then collects the metrics of `metrics.py` and serves them on
127.0.0.1:9464. Like every listener it is behind the guard (Host, Origin); with a bearer token
(`AGENT_METRICS_TOKEN`, or the variable `token_env` names) every scrape must send it, and without one
it may only bind a loopback address. Prometheus reads it with `authorization: {credentials_file: …}`
(deploy/prometheus.yml). The page is in the text format Prometheus asks for (`Accept`), classic or
OpenMetrics.
"""

from __future__ import annotations

from typing import Any

from prometheus_client.exposition import choose_encoder
from pydantic import Field
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

import guard
from plugin_api import BasePlugin, PluginConfigError, PluginSettings, parse_settings


class MetricsConfig(PluginSettings, guard.ListenerSettings):
    """`plugin_config.plugin_client_metrics` in plugins-enabled.json."""

    host: str = "127.0.0.1"
    port: int = Field(default=9464, ge=1, le=65535)
    #: Env var holding the bearer token scrapes must send; unset or empty: no token (loopback only).
    token_env: str = "AGENT_METRICS_TOKEN"


class MetricsPlugin(BasePlugin):
    """Serves the runtime's Prometheus registry."""

    PLUGIN_NAME = "plugin_client_metrics"
    PLUGIN_VERSION = "1.0.0"
    PLUGIN_TYPE = "client_interface"
    DESCRIPTION = "Prometheus metrics at /metrics on a port of its own"
    DEPENDENCIES = ["prometheus-client"]

    def __init__(self) -> None:
        super().__init__()
        self.cfg = MetricsConfig()

    def init(self, config: dict[str, Any]) -> bool:
        self.cfg = parse_settings(self.PLUGIN_NAME, MetricsConfig, config)
        if not self.ctx.metrics.on:  # build_runtime collects metrics whenever this plugin is enabled
            raise PluginConfigError("metrics are not collected in this runtime; enable plugin_client_metrics in "
                                    "plugins-enabled.json before the server starts")
        return True

    def shutdown(self) -> None:
        pass

    def get_config(self) -> dict[str, Any]:
        token = self.ctx.config.env.get(self.cfg.token_env) or None
        return {"host": self.cfg.host, "port": self.cfg.port, "name": "Prometheus metrics", "token": token,
                "allowed_hosts": self.cfg.allowed_hosts, "allowed_origins": self.cfg.allowed_origins,
                "token_hint": f"the token is the server's {self.cfg.token_env} setting"}

    def get_routes(self) -> list[Route]:
        return [Route("/metrics", self.metrics, methods=["GET"])]

    async def metrics(self, request: Request) -> Response:
        encode, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(encode(self.ctx.metrics.registry), headers={"Content-Type": content_type})
