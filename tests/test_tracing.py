"""OpenTelemetry traces (issue 32): the span tree of a turn, GenAI attributes, gate waits, and one trace across
two instances through `agent_call` (W3C traceparent), collected with the SDK's in-memory exporter."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

import pytest
import uvicorn
from pydantic import BaseModel

import state
import tracing
from api_client import AgentClient
from tests.conftest import ConfigDir, free_port, openai_model
from tests.fakes.backend import text, tool_call
from tests.fakes.openai_backend import FakeOpenAI
from tests.runtime import ALL_OPEN, Recorder, add_plugin_tools, entry, runtime, turn

pytest.importorskip("opentelemetry.sdk")
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.fakes.otlp import FakeCollector

KEY_B = "tracing-test-key-of-b-0123456789"
SECRET_QUESTION = "What is the secret number 7431?"


def traced(name: str, content: bool = False) -> tuple[tracing.Tracing, InMemorySpanExporter]:
    """Spans for a runtime (`runtime(..., spans=…)`) from a tracer provider of their own, which land in the
    returned exporter."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return tracing.Tracing(provider, content=content), exporter


def by_name(spans: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def parent_of(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


@contextlib.asynccontextmanager
async def serving_api(rt: state.Runtime) -> AsyncIterator[str]:
    """rt's API plugin on a real port in this event loop, as agent-mcp.py serves it."""
    assert rt.plugins is not None
    plugin = next(p for p in rt.plugins.client_plugins() if p.PLUGIN_NAME == "plugin_client_api")
    cfg = plugin.get_config()
    sock = socket.socket()
    sock.bind(("127.0.0.1", cfg["port"]))
    sock.listen(16)  # connections wait in the backlog until the server accepts them
    config = uvicorn.Config(entry().build_app(rt, plugin, cfg), log_config=None, lifespan="off")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        yield f"http://127.0.0.1:{cfg['port']}"
    finally:
        server.should_exit = True
        await task
        sock.close()


async def test_one_trace_spans_two_instances_through_agent_call(tmp_path) -> None:
    with FakeOpenAI() as fake_a, FakeOpenAI() as fake_b:
        port_b = free_port()
        (tmp_path / "b").mkdir()
        (tmp_path / "a").mkdir()
        tracing_a, spans_a = traced("agent-a")
        tracing_b, spans_b = traced("agent-b")
        async with runtime(tmp_path / "b", {"gpt": openai_model(fake_b)}, env={"API_KEY": KEY_B},
                           spans=tracing_b) as rt_b:
            rt_b.config.enabled.enabled_plugins.append("plugin_client_api")
            rt_b.config.enabled.plugin_config["plugin_client_api"] = {"port": port_b}
            assert rt_b.plugins is not None
            assert (await rt_b.plugins.load("plugin_client_api")).status == "loaded"
            async with serving_api(rt_b) as url_b, runtime(
                    tmp_path / "a", {"gpt": openai_model(fake_a)}, env={"B_TOKEN": KEY_B}, gates=ALL_OPEN,
                    agents={"b": {"url": url_b, "token_env": "B_TOKEN"}}, spans=tracing_a) as rt_a:
                fake_a.script(tool_call("agent_call", {"agent_url": "b", "message": SECRET_QUESTION}),
                              text("B says ", "7431."))
                fake_b.script(text("The number ", "is 7431."))
                answer, _ = await turn(rt_a, SECRET_QUESTION)
                assert answer.endswith("B says 7431.")

    a, b = spans_a.get_finished_spans(), spans_b.get_finished_spans()
    [turn_a] = by_name(a, "invoke_agent agent-mcp")
    chats_a = by_name(a, "chat fake-gpt")
    [call] = by_name(a, "execute_tool agent_call")
    [turn_b] = by_name(b, "invoke_agent agent-mcp")
    [chat_b] = by_name(b, "chat fake-gpt")
    # A's tree: the turn, two model calls and the tool call under it.
    assert turn_a.parent is None
    assert len(chats_a) == 2 and all(parent_of(s) == turn_a.context.span_id for s in chats_a)
    assert parent_of(call) == turn_a.context.span_id
    # B's turn continues A's trace under the agent_call span (W3C traceparent), its model call under it.
    assert turn_b.context.trace_id == turn_a.context.trace_id
    assert parent_of(turn_b) == call.context.span_id and turn_b.parent is not None and turn_b.parent.is_remote
    assert parent_of(chat_b) == turn_b.context.span_id
    # GenAI semantic-convention attributes.
    assert turn_a.attributes["gen_ai.operation.name"] == "invoke_agent"
    assert turn_a.attributes["gen_ai.request.model"] == "fake-gpt"
    assert turn_a.attributes["agent_mcp.client_class"] == "shell"
    assert turn_b.attributes["agent_mcp.client_class"] == "swarm"
    first, second = sorted(chats_a, key=lambda s: s.start_time)
    assert first.attributes["gen_ai.operation.name"] == "chat"
    assert first.attributes["gen_ai.provider.name"] == "openai"
    assert first.attributes["gen_ai.response.finish_reasons"] == ("tool_calls",)
    assert second.attributes["gen_ai.response.finish_reasons"] == ("stop",)
    assert first.attributes["gen_ai.usage.output_tokens"] == 5 and second.attributes["gen_ai.usage.output_tokens"] == 2
    assert first.attributes["gen_ai.usage.input_tokens"] > 0
    assert call.attributes["gen_ai.operation.name"] == "execute_tool"
    assert call.attributes["gen_ai.tool.name"] == "agent_call"
    assert call.attributes["agent_mcp.tool.outcome"] == "ok"
    # No prompt, answer or tool text unless the operator turns content capture on.
    for span in (*a, *b):
        assert not any("7431" in str(v) for v in span.attributes.values()), (span.name, span.attributes)


class _Args(BaseModel):
    v: str


async def test_a_gate_wait_is_a_span_and_content_only_when_turned_on(tmp_path, fake_openai) -> None:
    recorder = Recorder()
    traces, spans = traced("agent", content=True)
    async with runtime(tmp_path, {"gpt": openai_model(fake_openai)}, gates={"db": {}, "tools": {}},
                       spans=traces) as rt:
        add_plugin_tools(rt, "plugin_rec", [recorder.tool("write_thing", _Args)],
                         {"write_thing": {"type": "thing", "operation": "write"}})
        fake_openai.script(tool_call("write_thing", {"v": "1"}), text("Done."),
                           tool_call("write_thing", {"v": "2"}), text("Not done."))
        await turn(rt, "write one", answer="allow")
        await turn(rt, "write two", answer="reject")
    finished = spans.get_finished_spans()
    gates = sorted(by_name(finished, "gate write_thing"), key=lambda s: s.start_time)
    tools = sorted(by_name(finished, "execute_tool write_thing"), key=lambda s: s.start_time)
    assert [g.attributes["agent_mcp.gate.decision"] for g in gates] == ["allow", "reject"]
    assert [parent_of(g) for g in gates] == [t.context.span_id for t in tools]
    assert [t.attributes["agent_mcp.tool.outcome"] for t in tools] == ["ok", "refused"]
    assert tools[1].attributes["error.type"] == "reject"
    turns = sorted(by_name(finished, "invoke_agent agent-mcp"), key=lambda s: s.start_time)
    assert turns[0].attributes["gen_ai.input.messages"] == "write one"
    assert turns[0].attributes["gen_ai.output.messages"] == "Done."
    assert tools[0].attributes["gen_ai.tool.call.arguments"] == '{"v": "1"}'


def test_tracing_is_off_without_an_endpoint_and_says_so_without_the_packages(monkeypatch, caplog) -> None:
    assert tracing.from_env({}, "x") is tracing.OFF
    assert not tracing.OFF.on and tracing.OFF.headers() == {}
    with tracing.OFF.span("x", {}) as span, tracing.OFF.continuing("00-" + "1" * 32 + "-" + "2" * 16 + "-01"):
        assert span is None
    on = tracing.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}, "x")
    assert on.on
    on.close()
    assert not tracing.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_SDK_DISABLED": "true"},
                                "x").on
    monkeypatch.setitem(__import__("sys").modules, "opentelemetry.exporter.otlp.proto.http.trace_exporter", None)
    with caplog.at_level("WARNING"):
        assert tracing.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}, "x") is tracing.OFF
    assert "pip install" in caplog.text


@pytest.mark.slow
async def test_two_server_processes_export_one_trace_over_otlp(tmp_path, start_server) -> None:
    """The operator's setup: OTEL_EXPORTER_OTLP_ENDPOINT on two real servers, a collector receiving OTLP/HTTP."""
    port_a, port_b = free_port(), free_port()
    with FakeOpenAI() as fake_a, FakeOpenAI() as fake_b, FakeCollector() as collector:
        dirs = {}
        for name, port, backend in (("a", port_a, fake_a), ("b", port_b, fake_b)):
            (tmp_path / name).mkdir()
            cfg = dirs[name] = ConfigDir(tmp_path / name)
            cfg.models = {"gpt": openai_model(backend)}
            cfg.plugins.append("plugin_client_api")
            cfg.plugin_config["plugin_client_api"] = {"port": port}
            cfg.env = {"API_KEY": f"key-of-{name}-0123456789", "B_TOKEN": "key-of-b-0123456789",
                       "AGENT_INSTANCE": f"agent-{name}", "OTEL_EXPORTER_OTLP_ENDPOINT": collector.url}
        dirs["a"].agents = {"b": {"url": f"http://127.0.0.1:{port_b}", "token_env": "B_TOKEN"}}
        dirs["a"].gates = ALL_OPEN
        b = start_server(dirs["b"])
        a = start_server(dirs["a"])
        fake_a.script(tool_call("agent_call", {"agent_url": "b", "message": SECRET_QUESTION}), text("B says 7431."))
        fake_b.script(text("It is 7431."))
        client = AgentClient(f"http://127.0.0.1:{port_a}", api_key="key-of-a-0123456789")
        assert (await client.send(SECRET_QUESTION)).endswith("B says 7431.")
        a.stop()  # a stopping server sends what it has buffered
        b.stop()
    spans = {(s.resource["service.instance.id"], s.name): s for s in collector.spans}
    turn_a, call = spans["agent-a", "invoke_agent agent-mcp"], spans["agent-a", "execute_tool agent_call"]
    turn_b, chat_b = spans["agent-b", "invoke_agent agent-mcp"], spans["agent-b", "chat fake-gpt"]
    assert turn_a.parent_id == "" and call.parent_id == turn_a.span_id
    assert turn_b.trace_id == turn_a.trace_id and turn_b.parent_id == call.span_id
    assert chat_b.parent_id == turn_b.span_id and chat_b.attributes["gen_ai.usage.output_tokens"] == 1
    assert turn_a.resource["service.name"] == "agent-mcp"
    assert turn_a.attributes["agent_mcp.client_class"] == "api"
    assert turn_b.attributes["agent_mcp.client_class"] == "swarm"
    assert not any("7431" in str(v) for s in collector.spans for v in s.attributes.values())
