"""tavily_search: web search through Tavily (tavily-python's async client), with a short answer and sources.

Needs `TAVILY_API_KEY`. `plugin_config.plugin_search_tavily`: `base_url` (or env `TAVILY_BASE_URL`,
default https://api.tavily.com), `timeout` (s, default 30), `max_results` (default 5).
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from langchain_core.tools import StructuredTool
from pydantic import BaseModel, Field
from tavily import AsyncTavilyClient

from plugins import _tavily

logger = logging.getLogger("agent_mcp.plugins.tavily_search")

TOOL = "tavily_search"
SNIPPET_CHARS = 300


class TavilySearchSettings(_tavily.TavilySettings):
    """`plugin_config.plugin_search_tavily`."""

    max_results: int = Field(default=5, ge=1, le=20)


class _TavilySearchArgs(BaseModel):
    query: str = Field(min_length=1, description="What to search the web for")
    search_depth: Literal["basic", "advanced"] = Field(
        default="basic", description="basic: fast; advanced: slower, more thorough (costs more credits)"
    )
    max_results: int | None = Field(default=None, ge=1, le=20, description="How many sources (default 5)")


def format_results(query: str, response: dict[str, Any]) -> str:
    """Tavily's search response as readable text: the answer, then numbered sources with snippets."""
    lines = [f"Tavily search results for: {query}"]
    if response.get("answer"):
        lines += ["", f"Answer: {response['answer']}"]
    results = response.get("results") or []
    if not results:
        lines += ["", "(no results)"]
        return "\n".join(lines)
    lines += ["", "Sources:"]
    for i, r in enumerate(results, 1):
        snippet = " ".join(str(r.get("content") or "").split())
        if len(snippet) > SNIPPET_CHARS:
            snippet = snippet[: SNIPPET_CHARS - 1].rstrip() + "…"
        lines.append(f"{i}. {r.get('title') or '(untitled)'}")
        lines.append(f"   URL: {r.get('url', '')}")
        if snippet:
            lines.append(f"   {snippet}")
    return "\n".join(lines)


async def run_tavily_search(client: AsyncTavilyClient, settings: TavilySearchSettings, query: str,
                            search_depth: str = "basic", max_results: int | None = None) -> str:
    """Search and format; every failure comes back as a `tavily_search error: …` line."""
    try:
        response = await client.search(
            query, search_depth=search_depth, max_results=max_results or settings.max_results,
            include_answer="basic", timeout=settings.timeout,
        )
    except Exception as exc:
        text = f"{TOOL} error: {_tavily.describe_error(exc, settings)}"
        logger.info("%s", text)
        return text
    return format_results(query, response)


class TavilySearchPlugin(_tavily.TavilyPlugin):
    PLUGIN_NAME = "plugin_search_tavily"
    PLUGIN_VERSION = "1.0.0"
    PLUGIN_TYPE = "data_tool"
    DESCRIPTION = "tavily_search: Tavily web search"
    DEPENDENCIES = ["tavily-python"]
    ENV_VARS = ["TAVILY_API_KEY"]
    SETTINGS = TavilySearchSettings

    settings: TavilySearchSettings

    def get_tools(self) -> dict[str, Any]:
        async def tavily_search(query: str, search_depth: str = "basic", max_results: int | None = None) -> str:
            assert self.client is not None and self.settings is not None
            return await run_tavily_search(self.client, self.settings, query, search_depth, max_results)

        return {"lc": [StructuredTool.from_function(
            coroutine=tavily_search, name=TOOL, args_schema=_TavilySearchArgs,
            description="Search the web with Tavily. Returns a short answer and sources (title, URL, snippet).",
        )]}

    def get_gate_tools(self) -> dict[str, Any]:
        return {TOOL: {"type": "search", "operation": "read"}}
