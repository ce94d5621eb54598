"""tavily_search through the real tavily-python client against the local Tavily fake."""

from __future__ import annotations

import pytest

from tests.conftest import free_port
from tests.fakes.search import FakeTavily, tavily_error
from tests.plugin_host import call_tool, isolate_env, plugin_runtime, report

NAME = "plugin_search_tavily"


@pytest.fixture
def tavily(monkeypatch):
    isolate_env(monkeypatch)
    with FakeTavily() as fake:
        yield fake


def _env(fake: FakeTavily, key: str = "tvly-test") -> dict[str, str]:
    return {"TAVILY_API_KEY": key, "TAVILY_BASE_URL": fake.url}


async def test_search_returns_answer_and_numbered_sources(tmp_path, tavily):
    tavily.results[0]["content"] = "Paris is the capital. " * 40  # long snippets are cut
    async with plugin_runtime(tmp_path, {NAME: {}}, _env(tavily)) as rt:
        out = await call_tool(rt, "tavily_search", query="capital of France", search_depth="advanced")
        gate = rt.tools.entry("tavily_search").gate
    lines = out.splitlines()
    assert lines[0] == "Tavily search results for: capital of France"
    assert "Answer: Paris is the capital of France." in lines
    assert lines[lines.index("Sources:") + 1 :][:3] == [
        "1. Paris - Wikipedia", "   URL: https://en.wikipedia.org/wiki/Paris",
        "   " + ("Paris is the capital. " * 40)[:299].strip() + "…"]
    assert "2. France facts" in lines and "   URL: https://example.org/france" in lines
    call = tavily.calls[0]
    assert (call.method, call.path) == ("POST", "/search")
    assert call.headers["authorization"] == "Bearer tvly-test"
    assert call.json == {"query": "capital of France", "search_depth": "advanced", "max_results": 5,
                         "include_answer": "basic"}
    assert gate == {"type": "search", "operation": "read"}


async def test_max_results_setting_and_empty_result(tmp_path, tavily):
    async with plugin_runtime(tmp_path, {NAME: {"max_results": 1}}, _env(tavily)) as rt:
        one = await call_tool(rt, "tavily_search", query="q")
        tavily.results, tavily.answer = [], None
        none = await call_tool(rt, "tavily_search", query="nothing at all", max_results=3)
    assert tavily.calls[0].json["max_results"] == 1 and "2. " not in one and "1. Paris - Wikipedia" in one
    assert tavily.calls[1].json["max_results"] == 3
    assert none == "Tavily search results for: nothing at all\n\n(no results)"


@pytest.mark.parametrize(("status", "body", "expected"), [
    (429, tavily_error("usage limit exceeded"), "Tavily usage limit reached (HTTP 429: usage limit exceeded)"),
    (400, tavily_error("query is too long"), "Tavily rejected the request (HTTP 400: query is too long)"),
    (403, tavily_error("plan does not allow this"), "Tavily refused the request (HTTP 403: plan does not allow"),
    (502, {"detail": "bad gateway"}, "Tavily answered HTTP 502: Bad Gateway; try again later"),
])
async def test_service_errors_become_tool_results(tmp_path, tavily, status, body, expected):
    tavily.fail_next(status, body)
    async with plugin_runtime(tmp_path, {NAME: {}}, _env(tavily)) as rt:
        out = await call_tool(rt, "tavily_search", query="q")
        after = await call_tool(rt, "tavily_search", query="q")  # the next call works again
    assert out.startswith(f"tavily_search error: {expected}")
    assert after.startswith("Tavily search results for: q")


async def test_wrong_key_and_unreachable_service(tmp_path, tavily):
    async with plugin_runtime(tmp_path, {NAME: {}}, _env(tavily, key="tvly-wrong")) as rt:
        out = await call_tool(rt, "tavily_search", query="q")
    assert out.startswith("tavily_search error: Tavily rejected the API key (HTTP 401")
    assert "TAVILY_API_KEY" in out and "tvly-wrong" not in out
    closed = f"http://127.0.0.1:{free_port()}"
    async with plugin_runtime(tmp_path, {NAME: {"base_url": closed}}, _env(tavily)) as rt:
        out = await call_tool(rt, "tavily_search", query="q")
    assert out.startswith(f"tavily_search error: cannot reach Tavily at {closed} (ConnectError")


async def test_bad_settings_are_reported_with_the_field(tmp_path, tavily):
    async with plugin_runtime(tmp_path, {NAME: {"max_results": 0, "colour": "red"}}, _env(tavily)) as rt:
        r = report(rt, NAME)
        assert rt.tools.get("tavily_search") is None
    assert r.status == "failed"
    assert r.reasons[0].startswith("plugin_config.plugin_search_tavily in plugins-enabled.json: ")
    assert "max_results: Input should be greater than or equal to 1" in r.reasons[0]
    assert "colour: Extra inputs are not permitted" in r.reasons[0]
