"""Prometheus metrics (issue 32): a real server with the metrics listener, scraped after a scripted set of
turns and read with prometheus_client's own parser; bounded labels; the listener's guard."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import build
import metrics
from api_client import AgentClient
from tests.conftest import AgentServer, ConfigDir, free_port, openai_model
from tests.fakes.backend import error, text, tool_call
from tests.fakes.openai_backend import FakeOpenAI, _usage
from tests.observability import API_KEY, metrics_server


def scrape(url: str, headers: dict[str, str] | None = None) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a /metrics page, parsed by prometheus_client: (name, sorted labels) → value."""
    response = httpx.get(f"{url}/metrics", headers=headers or {}, timeout=5)
    assert response.status_code == 200, response.text
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


#: The counters a server exports before anything happened: each series of a fixed set of label values, at 0.
ZEROS = {
    **{("agent_mcp_gates_allowed_total", (("scope", s),)): 0
       for s in ("policy", "grant", "model_prefix", "once", "minutes", "session", "pattern")},
    **{("agent_mcp_gates_rejected_total", (("reason", r),)): 0 for r in ("user", "timeout", "no_approver")},
    **{("agent_mcp_proxy_conversations_total", (("result", r),)): 0 for r in ("matched", "new", "header", "address")},
    **{("agent_mcp_db_queries_total", (("outcome", o),)): 0 for o in ("ok", "error")},
    **{(f"agent_mcp_{name}_total", ()): 0 for name in ("gates_raised", "gates_routed", "redis_round_trips",
                                                        "redis_failures")},
}


def value(samples: dict[Any, float], name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted({"instance": "test-a", **labels}.items()))))


def counters(samples: dict[Any, float]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The counter samples (name ends in _total), without the instance label."""
    return {(name, tuple(kv for kv in labels if kv[0] != "instance")): v for (name, labels), v in samples.items()
            if name.endswith("_total")}


def _server(tmp_path: Any, backend: FakeOpenAI, servers: list[AgentServer], **env: str) -> tuple[AgentServer, dict]:
    """A started metrics_server (stopped by the `servers` fixture after the test)."""
    server, urls = metrics_server(ConfigDir(tmp_path), backend, **env)
    servers.append(server)
    return server.start(), {"api": urls.api, "proxy": urls.proxy, "metrics": urls.metrics}


async def test_every_counter_after_a_scripted_set_of_turns(tmp_path, fake_openai, servers) -> None:
    _, urls = _server(tmp_path, fake_openai, servers)
    before = scrape(urls["metrics"])
    # Nothing counted yet: every series of a fixed set of label values exists at 0; the others (models, tools,
    # error kinds) have no sample until their first use.
    assert counters(before) == ZEROS
    fake_openai.script(
        tool_call("lookup", {"q": "x"}), text("Found ", "it."),             # a tool call allowed by policy
        tool_call("nope", {"a": 1}), text("No such tool."),                 # a tool the model made up
        tool_call("write_thing", {"v": "1"}), text("Wrote it."),            # a gate allowed
        tool_call("write_thing", {"v": "2"}), text("Not written."),         # a gate rejected
        error(500, "backend broke"),                                        # a model error
        text("Hello ", "from ", "the proxy."), text("Again."),              # two proxy requests
    )
    client = AgentClient(urls["api"], "api-m1", api_key=API_KEY, auto_approve_gates={"write_thing": True})
    assert "it." in await client.send("find x")
    assert "No such tool." in await client.send("call nope")
    assert "Wrote it." in await client.send("write 1")
    rejecting = AgentClient(urls["api"], "api-m1", api_key=API_KEY, auto_approve_gates={"write_thing": False})
    assert "Not written." in await rejecting.send("write 2")
    with pytest.raises(Exception, match="HTTP 500"):
        await client.send("fail now")
    proxy = openai.AsyncOpenAI(base_url=urls["proxy"] + "/v1", api_key="unused", max_retries=0, timeout=30)
    first = await proxy.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}])
    await proxy.chat.completions.create(model="fake", messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "more"}])
    await proxy.close()

    samples = scrape(urls["metrics"])
    answered = [r for r in fake_openai.requests if r.json and r.json.get("stream")]
    assert len(answered) == 11
    completion = [5, 2, 5, 1, 5, 1, 5, 1, 3, 1]  # what the fake reports per reply that answered, in order
    ok_requests = [r for i, r in enumerate(answered) if i != 8]
    tokens_in = sum(_usage(r, 0)["prompt_tokens"] for r in ok_requests)
    expected = {
        ("agent_mcp_turns_total", (("client_class", "api"), ("model", "fake"), ("outcome", "ok"))): 4,
        ("agent_mcp_turns_total", (("client_class", "api"), ("model", "fake"), ("outcome", "error"))): 1,
        ("agent_mcp_turns_total", (("client_class", "proxy"), ("model", "fake"), ("outcome", "ok"))): 2,
        ("agent_mcp_model_calls_total", (("model", "fake"), ("outcome", "ok"))): 10,
        ("agent_mcp_model_calls_total", (("model", "fake"), ("outcome", "error"))): 1,
        ("agent_mcp_model_errors_total", (("kind", "http_500"), ("model", "fake"))): 1,
        ("agent_mcp_tokens_total", (("direction", "input"), ("model", "fake"))): tokens_in,
        ("agent_mcp_tokens_total", (("direction", "output"), ("model", "fake"))): sum(completion),
        ("agent_mcp_tool_calls_total", (("outcome", "ok"), ("tool", "lookup"))): 1,
        ("agent_mcp_tool_calls_total", (("outcome", "invalid"), ("tool", "other"))): 1,
        ("agent_mcp_tool_calls_total", (("outcome", "ok"), ("tool", "write_thing"))): 1,
        ("agent_mcp_tool_calls_total", (("outcome", "refused"), ("tool", "write_thing"))): 1,
        ("agent_mcp_gates_raised_total", ()): 2,
        ("agent_mcp_gates_allowed_total", (("scope", "policy"),)): 1,
        ("agent_mcp_gates_allowed_total", (("scope", "once"),)): 1,
        ("agent_mcp_gates_rejected_total", (("reason", "user"),)): 1,
        ("agent_mcp_proxy_conversations_total", (("result", "new"),)): 1,
        ("agent_mcp_proxy_conversations_total", (("result", "matched"),)): 1,
    }
    expected = {**ZEROS, **expected}
    assert counters(samples) == expected
    # Histograms: one observation per turn, per model call that answered, per tool call that ran.
    assert value(samples, "agent_mcp_turn_duration_seconds_count", model="fake") == 7
    assert value(samples, "agent_mcp_time_to_first_token_seconds_count", model="fake") == 6
    assert value(samples, "agent_mcp_model_call_duration_seconds_count", model="fake") == 10
    assert value(samples, "agent_mcp_tool_call_duration_seconds_count", tool="lookup") == 1
    # Levels, read at the scrape: the api session and the proxy conversation (its second request continued it).
    assert value(samples, "agent_mcp_sessions_stored") == 2
    assert value(samples, "agent_mcp_sessions_running") == 0
    assert value(samples, "agent_mcp_gates_pending") == 0
    assert value(samples, "agent_mcp_grants_active") == 0
    assert all(dict(labels)["instance"] == "test-a" for _, labels in samples)


async def test_label_values_stay_bounded_after_1000_sessions(tmp_path, fake_openai, servers) -> None:
    _, urls = _server(tmp_path, fake_openai, servers)
    proxy = openai.AsyncOpenAI(base_url=urls["proxy"] + "/v1", api_key="unused", max_retries=0, timeout=30)
    fake_openai.script(*(tool_call(f"made_up_{i}", {}) if i % 2 else text(f"answer {i}") for i in range(40)))

    async def one(i: int) -> None:
        await proxy.chat.completions.create(model="fake", messages=[{"role": "user", "content": f"user {i} says hi"}])

    for start in range(0, 1000, 50):
        await asyncio.gather(*(one(i) for i in range(start, start + 50)))
    await proxy.close()
    samples = scrape(urls["metrics"])
    turns = {labels: v for (name, labels), v in samples.items() if name == "agent_mcp_turns_total"}
    assert sum(turns.values()) == 1000
    assert len(samples) < 150, len(samples)  # a few per metric, not one per session or per made-up tool
    values = {v for _, labels in samples for k, v in labels if k != "le"}
    assert not any("made_up" in v or "user " in v or v.startswith("llama-") for v in values), values
    tools = {dict(labels).get("tool") for (name, labels) in samples if name == "agent_mcp_tool_calls_total"}
    assert tools == {"other"}


def test_the_listener_has_the_guard_and_a_token_when_configured(tmp_path, fake_openai, servers) -> None:
    _, urls = _server(tmp_path, fake_openai, servers, AGENT_METRICS_TOKEN="scrape-token-0123456789")
    assert httpx.get(f"{urls['metrics']}/metrics", timeout=5).status_code == 401
    ok = httpx.get(f"{urls['metrics']}/metrics", headers={"Authorization": "Bearer scrape-token-0123456789"}, timeout=5)
    assert ok.status_code == 200 and "agent_mcp_turns" in ok.text
    assert httpx.get(f"{urls['metrics']}/metrics", headers={"Host": "evil.example"}, timeout=5).status_code == 421
    openmetrics = httpx.get(f"{urls['metrics']}/metrics", timeout=5, headers={
        "Authorization": "Bearer scrape-token-0123456789", "Accept": "application/openmetrics-text; version=1.0.0"})
    assert openmetrics.headers["content-type"].startswith("application/openmetrics-text")
    assert openmetrics.text.rstrip().endswith("# EOF")


def test_metrics_are_off_by_default_and_cost_nothing(tmp_path, fake_openai) -> None:
    cfg = ConfigDir(tmp_path)
    cfg.models = {"fake": openai_model(fake_openai)}
    from config import load_config

    config = load_config(cfg.write().path)
    rt_metrics, spans = build.observability(config)
    assert rt_metrics is metrics.OFF and not spans.on


def test_a_listener_beyond_loopback_needs_a_token(tmp_path, fake_openai) -> None:
    cfg = ConfigDir(tmp_path)
    cfg.models = {"fake": openai_model(fake_openai)}
    cfg.plugins.append("plugin_client_metrics")
    cfg.plugin_config["plugin_client_metrics"] = {"host": "0.0.0.0", "port": free_port()}
    server = AgentServer(cfg.write(), {"SESSION_STORE": "memory"})
    server.start(wait=False)
    assert server.proc is not None
    server.proc.wait(timeout=30)
    out = server.stop()
    assert "plugin plugin_client_metrics would listen on 0.0.0.0" in out and "without a token" in out


async def test_redis_round_trips_are_counted_with_several_instances(tmp_path, fake_openai, servers,
                                                                     redis_store) -> None:
    server, urls = metrics_server(ConfigDir(tmp_path), fake_openai)
    server.env["SESSION_STORE"] = redis_store
    servers.append(server.start())
    before = value(scrape(urls.metrics), "agent_mcp_redis_round_trips_total")
    assert before is not None and before > 0  # loading sessions, the instance's heartbeat
    fake_openai.script(text("Hi."))
    assert await AgentClient(urls.api, "api-r1", api_key=API_KEY).send("hello") == "Hi."
    after = scrape(urls.metrics)
    # A turn takes its lease, saves the session twice and writes its events: at least a few round trips.
    assert value(after, "agent_mcp_redis_round_trips_total") >= before + 4
    assert value(after, "agent_mcp_redis_failures_total") == 0
    assert value(after, "agent_mcp_turns_total", client_class="api", model="fake", outcome="ok") == 1
