"""Fakes of the search services, each speaking its real wire protocol (service-protocols.md §3–§6).

- `FakeTavily`: `POST /search`, `POST /extract` (tavily-python, `api_base_url=fake.url`).
- `FakeXAI`: `POST /v1/responses`, the Responses API with xAI's server-side search tools (openai SDK,
  `base_url=fake.base_url`).
- `FakeGeminiSearch`: `POST /{version}/models/{model}:generateContent` answering with `groundingMetadata`
  (google-genai, `HttpOptions(base_url=fake.url)`).
- `FakeDuckDuckGo`: `POST /html/`, DuckDuckGo's HTML results page (ddgs' `duckduckgo` engine).

Every fake records its requests in `calls`; `fail_next()` sends the service's error body instead.
"""

from __future__ import annotations

import html
from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import BaseRoute, Route

from tests.fakes.service import Call, ServiceFake


def tavily_error(message: str) -> dict[str, Any]:
    """Tavily's error body."""
    return {"detail": {"error": message}}


class FakeTavily(ServiceFake):
    """Tavily search and extract; answers come from `results`, `answer`, `pages` and `failed`."""

    def __init__(self, key: str = "tvly-test") -> None:
        super().__init__()
        self.key = key
        self.answer: str | None = "Paris is the capital of France."
        self.results: list[dict[str, Any]] = [
            {"title": "Paris - Wikipedia", "url": "https://en.wikipedia.org/wiki/Paris",
             "content": "Paris is the capital and largest city of France.", "score": 0.98, "raw_content": None},
            {"title": "France facts", "url": "https://example.org/france", "content": "Capital: Paris.",
             "score": 0.71, "raw_content": None},
        ]
        self.pages: dict[str, str] = {}  # url → markdown served by /extract
        self.failed: dict[str, str] = {}  # url → error reported in failed_results

    def routes(self) -> list[BaseRoute]:
        return [Route("/search", self.recorded(self._search), methods=["POST"]),
                Route("/extract", self.recorded(self._extract), methods=["POST"])]

    def _refused(self, call: Call) -> Response | None:
        if call.headers.get("authorization") != f"Bearer {self.key}":
            return JSONResponse(tavily_error("Unauthorized: missing or invalid API key."), status_code=401)
        return None

    async def _search(self, request: Request, call: Call) -> Response:
        if (refused := self._refused(call)) is not None:
            return refused
        body = call.json or {}
        results = self.results[: body.get("max_results", 5)]
        return JSONResponse({"query": body.get("query"), "follow_up_questions": None,
                             "answer": self.answer if body.get("include_answer") else None, "images": [],
                             "results": results, "response_time": 0.01, "request_id": "req-1"})

    async def _extract(self, request: Request, call: Call) -> Response:
        if (refused := self._refused(call)) is not None:
            return refused
        body = call.json or {}
        urls = body.get("urls") or []
        urls = [urls] if isinstance(urls, str) else urls
        ok = [{"url": u, "raw_content": self.pages[u], "images": []} for u in urls if u in self.pages]
        failed = [{"url": u, "error": self.failed.get(u, "Failed to fetch url")} for u in urls if u not in self.pages]
        return JSONResponse({"results": ok, "failed_results": failed, "response_time": 0.02, "request_id": "req-2"})


class FakeXAI(ServiceFake):
    """xAI's Responses endpoint: the answer in `answer`, sources as citations, annotations and search calls."""

    def __init__(self, key: str = "xai-test") -> None:
        super().__init__()
        self.key = key
        self.answer = "xAI released Grok 5 this week [[1]](https://x.ai/news)."
        self.annotated = ["https://x.ai/news"]
        self.searched = ["https://techsite.example/grok-5"]
        self.citations = ["https://x.ai/news", "https://x.com/xai/status/1"]

    @property
    def base_url(self) -> str:
        """What to give `openai.AsyncOpenAI(base_url=…)`."""
        return f"{self.url}/v1"

    def routes(self) -> list[BaseRoute]:
        return [Route("/v1/responses", self.recorded(self._responses), methods=["POST"])]

    async def _responses(self, request: Request, call: Call) -> Response:
        if call.headers.get("authorization") != f"Bearer {self.key}":
            return JSONResponse({"code": "Client specified an invalid argument", "error": "Incorrect API key provided"},
                                status_code=401)
        body = call.json or {}
        if "search_parameters" in body:
            return JSONResponse(
                {"code": "Gone", "error": "Live search is deprecated. Please switch to the Agent Tools API"},
                status_code=410,
            )
        annotations = [{"type": "url_citation", "url": u, "title": str(i), "start_index": 0, "end_index": 1}
                       for i, u in enumerate(self.annotated, 1)]
        tools = {t.get("type") for t in body.get("tools", [])}
        output: list[dict[str, Any]] = []
        if "web_search" in tools:
            output.append({"type": "web_search_call", "id": "ws_1", "status": "completed",
                           "action": {"type": "search", "query": "q", "sources": [{"type": "url", "url": u}
                                                                                  for u in self.searched]}})
        if "x_search" in tools:
            output.append({"type": "custom_tool_call", "id": "ctc_1", "call_id": "xs_1", "name": "x_keyword_search",
                           "input": '{"query": "q"}', "status": "completed"})
        output.append({"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                       "content": [{"type": "output_text", "text": self.answer, "annotations": annotations,
                                    "logprobs": []}]})
        return JSONResponse({"id": "resp_1", "object": "response", "created_at": 1_700_000_000,
                             "model": body.get("model"), "status": "completed", "output": output,
                             "parallel_tool_calls": True, "tool_choice": "auto", "tools": body.get("tools", []),
                             "citations": self.citations,
                             "usage": {"input_tokens": 10, "output_tokens": 20, "total_tokens": 30}})


def gemini_error(status: int, message: str, name: str) -> dict[str, Any]:
    """The Gemini API's error body."""
    return {"error": {"code": status, "message": message, "status": name}}


class FakeGeminiSearch(ServiceFake):
    """Gemini `generateContent` with Google Search grounding; `grounded = False` answers without searching."""

    def __init__(self, key: str = "gem-test") -> None:
        super().__init__()
        self.key = key
        self.answer = "Spain won Euro 2024, beating England 2-1 in the final."
        self.grounded = True
        self.chunks = [("uefa.com", "https://vertexaisearch.cloud.google.com/grounding-api-redirect/AAA"),
                       ("wikipedia.org", "https://vertexaisearch.cloud.google.com/grounding-api-redirect/BBB")]

    def routes(self) -> list[BaseRoute]:
        return [Route("/{version}/models/{rest:path}", self.recorded(self._generate), methods=["POST"])]

    async def _generate(self, request: Request, call: Call) -> Response:
        if call.headers.get("x-goog-api-key") != self.key:
            return JSONResponse(
                gemini_error(400, "API key not valid. Please pass a valid API key.", "INVALID_ARGUMENT"),
                status_code=400,
            )
        if not request.path_params["rest"].endswith(":generateContent"):
            return JSONResponse(gemini_error(404, "method not found", "NOT_FOUND"), status_code=404)
        body = call.json or {}
        if not any("googleSearch" in t or "google_search" in t for t in body.get("tools", [])):
            return JSONResponse(gemini_error(400, "this fake only answers grounded requests", "INVALID_ARGUMENT"),
                                status_code=400)
        candidate: dict[str, Any] = {"content": {"role": "model", "parts": [{"text": self.answer}]},
                                     "finishReason": "STOP", "index": 0}
        if self.grounded:
            candidate["groundingMetadata"] = {
                "webSearchQueries": ["who won euro 2024"],
                "searchEntryPoint": {"renderedContent": "<style>.x{}</style><div>Google Search</div>"},
                "groundingChunks": [{"web": {"uri": uri, "title": title}} for title, uri in self.chunks],
                "groundingSupports": [
                    {
                        "segment": {"startIndex": 0, "endIndex": len(self.answer), "text": self.answer},
                        "groundingChunkIndices": list(range(len(self.chunks))),
                    }
                ],
            }
        return JSONResponse(
            {
                "candidates": [candidate],
                "usageMetadata": {"promptTokenCount": 5, "candidatesTokenCount": 12, "totalTokenCount": 17},
                "modelVersion": request.path_params["rest"].split(":")[0],
            }
        )


class FakeDuckDuckGo(ServiceFake):
    """DuckDuckGo's HTML endpoint: a results page from `results` (`title`, `href`, `body`), plus one ad."""

    def __init__(self) -> None:
        super().__init__()
        self.results: list[dict[str, str]] = [
            {"title": "Example One", "href": "https://example.org/one", "body": "First <b>snippet</b> text"},
            {"title": "Example Two", "href": "https://example.org/two", "body": "Second snippet"},
        ]

    @property
    def search_url(self) -> str:
        """The value for ddgs' `Duckduckgo.search_url`."""
        return f"{self.url}/html/"

    def routes(self) -> list[BaseRoute]:
        return [Route("/html/", self.recorded(self._html), methods=["POST"])]

    @staticmethod
    def _item(title: str, href: str, body: str) -> str:
        return (
            f'<div class="result results_links web-result"><div class="links_main result__body">'
            f'<h2 class="result__title"><a class="result__a" href="{html.escape(href)}">{html.escape(title)}</a></h2>'
            f'<a class="result__snippet" href="{html.escape(href)}">{body}</a></div></div>'
        )

    async def _html(self, request: Request, call: Call) -> Response:
        items = "".join(self._item(r["title"], r["href"], r["body"]) for r in self.results)
        if self.results:  # DuckDuckGo mixes ads in; ddgs must drop them
            items = self._item("Buy now", "https://duckduckgo.com/y.js?ad_provider=x", "an ad") + items
        return HTMLResponse(f"<html><body><div id='links' class='results'>{items}</div></body></html>")
