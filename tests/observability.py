"""A server with the metrics listener and a scripted mix of traffic, and a real Prometheus scraping it: shared by
tests/test_metrics.py, tests/test_prometheus.py and `make dashboard` (bench/dashboard.py)."""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai

from api_client import AgentClient, AgentClientError
from tests import needs
from tests.conftest import ROOT, AgentServer, ConfigDir, free_port, one_tool_plugin, openai_model
from tests.fakes.backend import error, text, tool_call
from tests.fakes.openai_backend import FakeOpenAI
from tests.waiting import until_sync

API_KEY = "metrics-test-api-key-0123456789"
GATED = {"type": "thing", "operation": "write"}
LOOKUP = {"type": "search", "operation": "read"}
DASHBOARD = ROOT / "deploy" / "grafana-agent-mcp.json"
SCRAPE_EXAMPLE = ROOT / "deploy" / "prometheus.yml"


@dataclass
class Urls:
    api: str
    proxy: str
    metrics: str


def metrics_server(cfg: ConfigDir, backend: FakeOpenAI, *, rate_limits: dict[str, Any] | None = None,
                   **env: str) -> tuple[AgentServer, Urls]:
    """A server (not started) with the API, the proxy and the metrics listener; tools `lookup` (allowed by
    gate-defaults, a `search` tool) and `write_thing` (gated); `instance` label test-a."""
    cfg.models = {"fake": openai_model(backend)}
    ports = {"api": free_port(), "proxy": free_port(), "metrics": free_port()}
    cfg.plugins += ["plugin_client_api", "plugin_proxy_llama", "plugin_client_metrics"]
    cfg.plugin_config.update({"plugin_client_api": {"port": ports["api"]},
                              "plugin_proxy_llama": {"port": ports["proxy"]},
                              "plugin_client_metrics": {"port": ports["metrics"]}})
    cfg.add_plugin("plugin_thing", one_tool_plugin("plugin_thing", "lookup", "q", "'found ' + q", LOOKUP, "Look up"))
    cfg.add_plugin("plugin_thing2", one_tool_plugin("plugin_thing2", "write_thing", "v", "'wrote ' + v", GATED,
                                                    "Write a thing"))
    cfg.gates = {"db": {}, "tools": {"lookup": {"read": True}}}
    cfg.env = {"API_KEY": API_KEY, "AGENT_INSTANCE": "test-a", **env}
    cfg.write()
    if rate_limits is not None:
        enabled = json.loads((cfg.path / "plugins-enabled.json").read_text())
        (cfg.path / "plugins-enabled.json").write_text(json.dumps({**enabled, "rate_limits": rate_limits}))
    server = AgentServer(cfg, {"SESSION_STORE": "memory"})
    return server, Urls(**{k: f"http://127.0.0.1:{p}" for k, p in ports.items()})


async def traffic(urls: Urls, backend: FakeOpenAI, rounds: int = 1) -> int:
    """`rounds` times: a tool call, a gate allowed, a gate rejected, a tool call refused by its rate limit (when
    one is configured), a model error, and two proxy requests of one conversation. Returns the turns run."""
    client = AgentClient(urls.api, "api-traffic", api_key=API_KEY, auto_approve_gates={"write_thing": True})
    rejecting = AgentClient(urls.api, "api-traffic", api_key=API_KEY, auto_approve_gates={"write_thing": False})
    proxy = openai.AsyncOpenAI(base_url=urls.proxy + "/v1", api_key="unused", max_retries=0, timeout=30)
    turns = 0
    try:
        for i in range(rounds):
            backend.script(tool_call("lookup", {"q": f"x{i}"}), text("Found ", "it."),
                           tool_call("write_thing", {"v": "1"}), text("Wrote it."),
                           tool_call("write_thing", {"v": "2"}), text("Not written."),
                           tool_call("lookup", {"q": "again"}), tool_call("lookup", {"q": "more"}), text("Enough."),
                           error(500, "backend broke"),
                           text("Hello ", "from ", "the proxy."), text("Again."))
            await client.send("find x")
            await client.send("write 1")
            await rejecting.send("write 2")
            await client.send("look twice")
            try:
                await client.send("fail now")
            except AgentClientError:
                pass
            first = await proxy.chat.completions.create(model="fake", messages=[{"role": "user", "content": f"hi {i}"}])
            await proxy.chat.completions.create(model="fake", messages=[
                {"role": "user", "content": f"hi {i}"},
                {"role": "assistant", "content": first.choices[0].message.content or ""},
                {"role": "user", "content": "more"}])
            turns += 7
    finally:
        await proxy.close()
    return turns


# ── Prometheus ─────────────────────────────────────────────────────────────────────────────────


class Prometheus:
    """Debian's `prometheus` scraping `target` every `interval` with deploy/prometheus.yml's job."""

    def __init__(self, workdir: Path, target: str, interval: str = "1s"):
        self.binary = needs.program("prometheus", "prometheus", "prometheus")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        example = SCRAPE_EXAMPLE.read_text()
        config = (example.replace('targets: ["127.0.0.1:9464"]', f'targets: ["{target}"]')
                  .replace("scrape_interval: 15s", f"scrape_interval: {interval}"))
        assert config != example, "deploy/prometheus.yml no longer has the target line this helper replaces"
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "prometheus.yml").write_text(config)
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None
        self.http = httpx.Client(timeout=30)

    def __enter__(self) -> Prometheus:
        self.log = (self.workdir / "prometheus.log").open("wb")
        self.proc = subprocess.Popen(
            [self.binary, f"--config.file={self.workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={self.workdir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT)
        until_sync(self._ready, "prometheus to be ready", 30)
        return self

    def _ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"prometheus exited: {(self.workdir / 'prometheus.log').read_text()[-2000:]}")
        try:
            return self.http.get(f"{self.url}/-/ready", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        self.http.close()

    def last_scrape(self, job: str = "agent-mcp") -> float:
        """When Prometheus last scraped `job` (0 before the first scrape)."""
        found = self.query(f'max(timestamp(up{{job="{job}"}}))')
        return float(found[0]["value"][1]) if found else 0.0

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """The result vector of an instant query (an error from Prometheus raises)."""
        params = {"query": expr, **({"time": str(at)} if at is not None else {})}
        body = self.http.get(f"{self.url}/api/v1/query", params=params).json()
        if body.get("status") != "success":
            raise RuntimeError(f"query {expr!r} failed: {body}")
        return body["data"]["result"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        params = {"query": expr, "start": str(start), "end": str(end), "step": str(step)}
        body = self.http.get(f"{self.url}/api/v1/query_range", params=params).json()
        if body.get("status") != "success":
            raise RuntimeError(f"query {expr!r} failed: {body}")
        return body["data"]["result"]


def dashboard_queries(rate_interval: str = "15s") -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of the Grafana dashboard, its variables filled in as Grafana
    would for "All" instances."""
    dashboard = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"].replace("$__rate_interval", rate_interval).replace("$instance", ".*")
            out.append((panel["title"], expr))
    return out
