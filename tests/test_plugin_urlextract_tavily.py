"""url_extract through the real tavily-python client against the local Tavily fake."""

from __future__ import annotations

import pytest

from tests.fakes.search import FakeTavily
from tests.plugin_host import call_tool, isolate_env, plugin_runtime, report

NAME = "plugin_urlextract_tavily"
URL = "https://example.org/docs/guide"
PAGE = (
    "# Guide\n\n"
    "Read the [install notes](https://example.org/install) first, then the [API](../api \"API docs\").\n"
    "![logo](https://example.org/logo.png) Mail [us](mailto:team@example.org).\n"
    "Again: [install](https://example.org/install). [![badge](https://img.example/b.svg)](https://ci.example/run)\n"
)


@pytest.fixture
def tavily(monkeypatch):
    isolate_env(monkeypatch)
    with FakeTavily() as fake:
        fake.pages[URL] = PAGE
        yield fake


def _env(fake: FakeTavily) -> dict[str, str]:
    return {"TAVILY_API_KEY": "tvly-test", "TAVILY_BASE_URL": fake.url}


async def test_page_as_markdown_with_numbered_references(tmp_path, tavily):
    async with plugin_runtime(tmp_path, {NAME: {}}, _env(tavily)) as rt:
        out = await call_tool(rt, "url_extract", url=URL)
        gate = rt.tools.entry("url_extract").gate
    assert out == (
        f"Source: {URL}\n\n"
        "# Guide\n\n"
        "Read the install notes[1] first, then the API[2].\n"
        "logo Mail us.\n"
        "Again: install[1]. badge[3]\n\n"
        "---\n"
        "[1]: https://example.org/install\n"
        "[2]: https://example.org/api\n"
        "[3]: https://ci.example/run"
    )
    body = tavily.calls[0].json
    assert tavily.calls[0].path == "/extract"
    assert body == {"urls": URL, "format": "markdown", "extract_depth": "basic", "timeout": 30}
    assert gate == {"type": "extract", "operation": "read"}


async def test_query_focus_and_truncation(tmp_path, tavily):
    tavily.pages[URL] = "x" * 1200 + " [tail link](https://example.org/tail)"
    async with plugin_runtime(tmp_path, {NAME: {"max_chars": 1000}}, _env(tavily)) as rt:
        out = await call_tool(rt, "url_extract", url=URL, query="installation steps", extract_depth="advanced")
    assert tavily.calls[0].json["query"] == "installation steps"
    assert tavily.calls[0].json["chunks_per_source"] == 5
    assert tavily.calls[0].json["extract_depth"] == "advanced"
    assert out.startswith(f"Source: {URL}\nQuery: installation steps\n\n" + "x" * 1000)
    assert out.endswith("…(truncated: 238 more characters not shown)") and "[1]" not in out


async def test_failed_page_and_bad_url(tmp_path, tavily):
    tavily.failed["https://example.org/gone"] = "HTTP 404 from the site"
    async with plugin_runtime(tmp_path, {NAME: {}}, _env(tavily)) as rt:
        failed = await call_tool(rt, "url_extract", url="https://example.org/gone")
        bad = await call_tool(rt, "url_extract", url="file:///etc/passwd")
        relative = await call_tool(rt, "url_extract", url="example.org/page")
    assert failed == "Extraction failed for https://example.org/gone.\nDetails: HTTP 404 from the site"
    assert bad.startswith("url_extract error: 'file:///etc/passwd' is not an http(s) URL")
    assert relative.startswith("url_extract error: 'example.org/page' is not an http(s) URL")
    assert len(tavily.calls) == 1  # the bad URLs never left the server


async def test_service_errors_and_missing_key(tmp_path, tavily):
    tavily.fail_next(401, {"detail": {"error": "Unauthorized: missing or invalid API key."}})
    async with plugin_runtime(tmp_path, {NAME: {}}, _env(tavily)) as rt:
        out = await call_tool(rt, "url_extract", url=URL)
    assert out.startswith("url_extract error: Tavily rejected the API key (HTTP 401: Unauthorized")
    async with plugin_runtime(tmp_path, {NAME: {}}, {"TAVILY_BASE_URL": tavily.url}) as rt:
        r = report(rt, NAME)
    assert r.status == "invalid" and "TAVILY_API_KEY" in r.reasons[0]
