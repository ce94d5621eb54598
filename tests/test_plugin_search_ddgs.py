"""ddgs_search: at its function boundary (an injected search function), plus one smoke test of the real
ddgs library against a local page in DuckDuckGo's HTML layout."""

from __future__ import annotations

from urllib.parse import parse_qs

import pytest
from ddgs.engines.duckduckgo import Duckduckgo
from ddgs.exceptions import DDGSException, RatelimitException, TimeoutException

from tests.fakes.search import FakeDuckDuckGo
from tests.plugin_host import call_tool, isolate_env, plugin, plugin_runtime

NAME = "plugin_search_ddgs"


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    isolate_env(monkeypatch)


class Recorder:
    """A search function standing in for `DDGS().text`: returns `results` or raises `error`."""

    def __init__(self, results=None, error: Exception | None = None):
        self.results, self.error, self.calls = results or [], error, []

    def __call__(self, query: str, max_results: int):
        self.calls.append((query, max_results))
        if self.error is not None:
            raise self.error
        return self.results


async def test_results_are_numbered_with_url_and_short_snippet(tmp_path):
    stub = Recorder([{"title": "Python", "href": "https://python.org", "body": "The language.   Fast " * 30},
                     {"title": "", "href": "https://example.org/x", "body": ""}])
    async with plugin_runtime(tmp_path, {NAME: {"max_results": 4}}, {}) as rt:
        plugin(rt, NAME).search_fn = stub
        out = await call_tool(rt, "ddgs_search", query="python")
        await call_tool(rt, "ddgs_search", query="more", max_results=12)
        gate = rt.tools.entry("ddgs_search").gate
    snippet = " ".join(("The language.   Fast " * 30).split())[:199].rstrip() + "…"
    assert out == ("DuckDuckGo search results for: python\n\n"
                   f"1. Python\n   URL: https://python.org\n   {snippet}\n\n"
                   "2. (untitled)\n   URL: https://example.org/x")
    assert stub.calls == [("python", 4), ("more", 12)]
    assert gate == {"type": "search", "operation": "read"}


@pytest.mark.parametrize(("error", "expected"), [
    (DDGSException("No results found."), "DuckDuckGo search results for: q\n\n(no results)"),
    (RatelimitException("202 Ratelimit"), "ddgs_search error: DuckDuckGo is rate limiting this server; wait a minute"),
    (TimeoutException("timed out"), "ddgs_search error: no answer from DuckDuckGo within 10 s"),
    (DDGSException("ConnectError: dns error"), "ddgs_search error: DuckDuckGo search failed (ConnectError: dns error)"),
    (ValueError("bad html"), "ddgs_search error: ValueError: bad html"),
])
async def test_failures_become_tool_results(tmp_path, error, expected):
    async with plugin_runtime(tmp_path, {NAME: {}}, {}) as rt:
        plugin(rt, NAME).search_fn = Recorder(error=error)
        out = await call_tool(rt, "ddgs_search", query="q")
    assert out.startswith(expected)


async def test_smoke_real_ddgs_against_a_local_duckduckgo_page(tmp_path, monkeypatch):
    with FakeDuckDuckGo() as ddg:
        # ddgs has no base-URL setting; its engine's class attribute is the one redirect (test only).
        monkeypatch.setattr(Duckduckgo, "search_url", ddg.search_url)
        async with plugin_runtime(tmp_path, {NAME: {"region": "de-de"}}, {}) as rt:
            out = await call_tool(rt, "ddgs_search", query="example query", max_results=5)
            ddg.results = []
            empty = await call_tool(rt, "ddgs_search", query="nothing")
    assert out == ("DuckDuckGo search results for: example query\n\n"
                   "1. Example One\n   URL: https://example.org/one\n   First snippet text\n\n"
                   "2. Example Two\n   URL: https://example.org/two\n   Second snippet")
    form = parse_qs(ddg.calls[0].body.decode())
    assert ddg.calls[0].method == "POST" and form["q"] == ["example query"] and form["l"] == ["de-de"]
    assert empty == "DuckDuckGo search results for: nothing\n\n(no results)"
