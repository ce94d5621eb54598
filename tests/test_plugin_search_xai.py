"""xai_search through the real openai SDK against the local fake of xAI's Responses endpoint."""

from __future__ import annotations

import pytest

from tests.conftest import free_port
from tests.fakes.search import FakeXAI
from tests.plugin_host import call_tool, isolate_env, plugin_runtime

NAME = "plugin_search_xai"


@pytest.fixture
def xai(monkeypatch):
    isolate_env(monkeypatch)
    with FakeXAI() as fake:
        yield fake


def _env(fake: FakeXAI, key: str = "xai-test") -> dict[str, str]:
    return {"XAI_API_KEY": key, "XAI_BASE_URL": fake.base_url}


async def test_answer_with_sources_from_every_place_xai_reports_them(tmp_path, xai):
    async with plugin_runtime(tmp_path, {NAME: {"max_retries": 0}}, _env(xai)) as rt:
        out = await call_tool(rt, "xai_search", query="What did xAI release this week?")
        gate = rt.tools.entry("xai_search").gate
    assert out == (
        "xAI search results for: What did xAI release this week?\n\n"
        "Answer: xAI released Grok 5 this week [[1]](https://x.ai/news).\n\n"
        "Sources:\n"
        "  [1] https://x.ai/news\n"  # annotation and citation: listed once
        "  [2] https://x.com/xai/status/1\n"
        "  [3] https://techsite.example/grok-5"
    )
    call = xai.calls[0]
    assert (call.method, call.path) == ("POST", "/v1/responses")
    assert call.headers["authorization"] == "Bearer xai-test"
    assert call.json["model"] == "grok-4-1-fast"
    assert call.json["tools"] == [{"type": "web_search"}, {"type": "x_search"}]
    assert call.json["input"] == [{"role": "user", "content": "What did xAI release this week?"}]
    assert "search_parameters" not in call.json  # Live Search is gone (HTTP 410)
    assert gate == {"type": "search", "operation": "read"}


async def test_sources_choice_and_model_setting(tmp_path, xai):
    xai.citations, xai.annotated = [], []
    async with plugin_runtime(tmp_path, {NAME: {"model": "grok-4.3", "max_retries": 0}}, _env(xai)) as rt:
        web = await call_tool(rt, "xai_search", query="q", sources="web")
        x = await call_tool(rt, "xai_search", query="q", sources="x")
    assert [c.json["tools"] for c in xai.calls] == [[{"type": "web_search"}], [{"type": "x_search"}]]
    assert {c.json["model"] for c in xai.calls} == {"grok-4.3"}
    assert web.endswith("Sources:\n  [1] https://techsite.example/grok-5")
    assert "Sources:" not in x  # X search reported no URLs this time


@pytest.mark.parametrize(("status", "expected"), [
    (429, "xAI rate limit or credit limit reached (HTTP 429: status 429); wait a while"),
    (410, "xAI answered HTTP 410: "),
    (404, "xAI does not know model 'grok-4-1-fast' or the endpoint (HTTP 404: status 404); set plugin_config"),
    (500, "xAI answered HTTP 500: "),
])
async def test_service_errors_become_tool_results(tmp_path, xai, status, expected):
    xai.fail_next(status, {"code": "error", "error": f"status {status}"})
    async with plugin_runtime(tmp_path, {NAME: {"max_retries": 0}}, _env(xai)) as rt:
        out = await call_tool(rt, "xai_search", query="q")
    assert out.startswith(f"xai_search error: {expected}")


async def test_wrong_key_and_unreachable_service(tmp_path, xai):
    async with plugin_runtime(tmp_path, {NAME: {"max_retries": 0}}, _env(xai, key="xai-wrong")) as rt:
        out = await call_tool(rt, "xai_search", query="q")
    assert out == ("xai_search error: xAI rejected the API key (HTTP 401: Incorrect API key provided); "
                   "check XAI_API_KEY in .env")
    closed = f"http://127.0.0.1:{free_port()}/v1"
    async with plugin_runtime(tmp_path, {NAME: {"base_url": closed, "max_retries": 0}}, _env(xai)) as rt:
        out = await call_tool(rt, "xai_search", query="q")
    assert out.startswith(f"xai_search error: cannot reach xAI at {closed} (")


async def test_retries_on_server_errors(tmp_path, xai):
    xai.fail_next(503, {"code": "unavailable", "error": "try again"})
    async with plugin_runtime(tmp_path, {NAME: {"max_retries": 1}}, _env(xai)) as rt:
        out = await call_tool(rt, "xai_search", query="q")
    assert len(xai.calls) == 2 and out.startswith("xAI search results for: q")
