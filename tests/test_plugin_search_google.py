"""google_search (Gemini grounding) through the real google-genai client against the local Gemini fake."""

from __future__ import annotations

import pytest

from tests.conftest import free_port
from tests.fakes.search import FakeGeminiSearch, gemini_error
from tests.plugin_host import call_tool, isolate_env, plugin_runtime

NAME = "plugin_search_google"


@pytest.fixture
def gemini(monkeypatch):
    isolate_env(monkeypatch)
    with FakeGeminiSearch() as fake:
        yield fake


def _env(fake: FakeGeminiSearch, key: str = "gem-test") -> dict[str, str]:
    return {"GEMINI_API_KEY": key, "GOOGLE_GEMINI_BASE_URL": fake.url}


async def test_grounded_answer_with_queries_and_sources(tmp_path, gemini):
    async with plugin_runtime(tmp_path, {NAME: {}}, _env(gemini)) as rt:
        out = await call_tool(rt, "google_search", query="Who won Euro 2024?")
        gate = rt.tools.entry("google_search").gate
    assert out == (
        "[Search: 'Who won Euro 2024?']\n\n"
        "Spain won Euro 2024, beating England 2-1 in the final.\n\n"
        "Searched: who won euro 2024\n\n"
        "Sources:\n"
        "  - uefa.com: https://vertexaisearch.cloud.google.com/grounding-api-redirect/AAA\n"
        "  - wikipedia.org: https://vertexaisearch.cloud.google.com/grounding-api-redirect/BBB"
    )
    call = gemini.calls[0]
    assert call.path.endswith("/models/gemini-2.5-flash:generateContent")
    assert call.headers["x-goog-api-key"] == "gem-test"
    assert call.json["tools"] == [{"googleSearch": {}}]
    assert call.json["contents"] == [{"parts": [{"text": "Who won Euro 2024?"}], "role": "user"}]
    assert gate == {"type": "search", "operation": "read"}


async def test_answer_without_search_is_marked_unverified(tmp_path, gemini):
    gemini.grounded = False
    async with plugin_runtime(tmp_path, {NAME: {"model": "gemini-3-flash"}}, _env(gemini)) as rt:
        out = await call_tool(rt, "google_search", query="hello")
    assert "/models/gemini-3-flash:generateContent" in gemini.calls[0].path
    assert out.endswith("(Gemini answered without searching, so there are no sources; treat the answer as unverified.)")
    assert "Sources:" not in out


async def test_errors_become_tool_results(tmp_path, gemini):
    async with plugin_runtime(tmp_path, {NAME: {}}, _env(gemini, key="gem-wrong")) as rt:
        bad_key = await call_tool(rt, "google_search", query="q")
    gemini.fail_next(429, gemini_error(429, "Resource has been exhausted (e.g. check quota).", "RESOURCE_EXHAUSTED"))
    gemini.fail_next(503, gemini_error(503, "The model is overloaded.", "UNAVAILABLE"))
    async with plugin_runtime(tmp_path, {NAME: {}}, _env(gemini)) as rt:
        quota = await call_tool(rt, "google_search", query="q")
        busy = await call_tool(rt, "google_search", query="q")
        fine = await call_tool(rt, "google_search", query="q")
    assert bad_key.startswith("google_search error: Gemini rejected the API key (HTTP 400: API key not valid.")
    assert "GEMINI_API_KEY" in bad_key and "gem-wrong" not in bad_key
    assert quota.startswith("google_search error: Gemini quota or rate limit reached (HTTP 429: Resource has been")
    assert busy == "google_search error: Gemini answered HTTP 503: The model is overloaded; try again later"
    assert fine.startswith("[Search: 'q']")
    closed = f"http://127.0.0.1:{free_port()}"
    async with plugin_runtime(tmp_path, {NAME: {"base_url": closed}}, _env(gemini)) as rt:
        out = await call_tool(rt, "google_search", query="q")
    # (google-genai connects with aiohttp once it is installed, with httpx otherwise)
    assert out.startswith(f"google_search error: cannot reach Gemini at {closed} (")
    assert "ConnectError" in out or "ConnectionRefusedError: [Errno 111]" in out
