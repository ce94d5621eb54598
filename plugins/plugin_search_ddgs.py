"""ddgs_search: web search through DuckDuckGo (the `ddgs` library, `duckduckgo` backend). No key needed.

`plugin_config.plugin_search_ddgs`: `region` (default `us-en`), `safesearch` (`on`/`moderate`/`off`),
`timeout` (s, default 10), `max_results` (default 10), `proxy` (http/https/socks5 URL; env `DDGS_PROXY`
also works). ddgs scrapes DuckDuckGo's HTML page with a blocking client, so searches run in a thread.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from langchain_core.tools import StructuredTool
from pydantic import BaseModel, Field

from plugin_api import BasePlugin, PluginSettings, parse_settings

if TYPE_CHECKING:
    from ddgs import DDGS

logger = logging.getLogger("agent_mcp.plugins.ddgs_search")

TOOL = "ddgs_search"
SNIPPET_CHARS = 200
NO_RESULTS = "No results found."  # what ddgs raises instead of returning an empty list

SearchFn = Callable[[str, int], list[dict[str, Any]]]
"""`(query, max_results) -> [{"title", "href", "body"}, ...]`; blocking; raises ddgs exceptions."""


class DdgsSettings(PluginSettings):
    """`plugin_config.plugin_search_ddgs`."""

    region: str = "us-en"
    safesearch: Literal["on", "moderate", "off"] = "moderate"
    timeout: int = Field(default=10, ge=1, le=60)
    max_results: int = Field(default=10, ge=1, le=30)
    proxy: str | None = None


class _DdgsSearchArgs(BaseModel):
    query: str = Field(min_length=1, description="What to search the web for")
    max_results: int | None = Field(default=None, ge=1, le=30, description="How many results (default 10)")


def format_results(query: str, results: list[dict[str, Any]]) -> str:
    """Results as numbered entries: title, URL, a short snippet."""
    lines = [f"DuckDuckGo search results for: {query}"]
    if not results:
        return "\n".join([*lines, "", "(no results)"])
    for i, r in enumerate(results, 1):
        snippet = " ".join(str(r.get("body") or "").split())
        if len(snippet) > SNIPPET_CHARS:
            snippet = snippet[: SNIPPET_CHARS - 1].rstrip() + "…"
        lines += ["", f"{i}. {r.get('title') or '(untitled)'}", f"   URL: {r.get('href', '')}"]
        if snippet:
            lines.append(f"   {snippet}")
    return "\n".join(lines)


async def run_ddgs_search(
    search_fn: SearchFn, settings: DdgsSettings, query: str, max_results: int | None = None
) -> str:
    """Run the blocking search in a thread and format it; every failure becomes a `ddgs_search error: …` line."""
    from ddgs.exceptions import DDGSException, RatelimitException, TimeoutException  # ddgs: see init

    max_results = max_results or settings.max_results
    try:
        results = await asyncio.to_thread(search_fn, query, max_results)
    except RatelimitException:
        return f"{TOOL} error: DuckDuckGo is rate limiting this server; wait a minute or use another search tool"
    except TimeoutException:
        return (
            f"{TOOL} error: no answer from DuckDuckGo within {settings.timeout} s; try again or use another search tool"
        )
    except DDGSException as exc:
        if str(exc) == NO_RESULTS:
            return format_results(query, [])
        logger.info("ddgs_search failed: %s", exc)
        return f"{TOOL} error: DuckDuckGo search failed ({exc}); check the network or use another search tool"
    except Exception as exc:
        logger.warning("ddgs_search failed", exc_info=True)
        return f"{TOOL} error: {type(exc).__name__}: {exc}"
    return format_results(query, results[:max_results])


class DdgsSearchPlugin(BasePlugin):
    PLUGIN_NAME = "plugin_search_ddgs"
    PLUGIN_VERSION = "1.0.0"
    PLUGIN_TYPE = "data_tool"
    DESCRIPTION = "ddgs_search: DuckDuckGo web search (no key)"
    DEPENDENCIES = ["ddgs"]
    ENV_VARS = []

    def __init__(self) -> None:
        super().__init__()
        self.settings = DdgsSettings()
        self.search_fn: SearchFn | None = None  # tests may replace it before calling the tool

    def init(self, config: dict[str, Any]) -> bool:
        self.settings = parse_settings(self.PLUGIN_NAME, DdgsSettings, config)
        settings = self.settings
        clients: list[DDGS] = []

        def search(query: str, max_results: int) -> list[dict[str, Any]]:
            if not clients:
                # ddgs (with its HTTP client primp and lxml, about 13 MiB) is imported at the first search,
                # not at start: a server may never search.
                from ddgs import DDGS
                clients.append(DDGS(proxy=settings.proxy, timeout=settings.timeout))
            return clients[0].text(query, backend="duckduckgo", region=settings.region,
                                   safesearch=settings.safesearch, max_results=max_results)

        self.search_fn = search
        return True

    def shutdown(self) -> None:
        self.search_fn = None

    def get_tools(self) -> dict[str, Any]:
        async def ddgs_search(query: str, max_results: int | None = None) -> str:
            assert self.search_fn is not None
            return await run_ddgs_search(self.search_fn, self.settings, query, max_results)

        return {"lc": [StructuredTool.from_function(
            coroutine=ddgs_search, name=TOOL, args_schema=_DdgsSearchArgs,
            description="Search the web with DuckDuckGo. Returns titles, URLs and snippets.",
        )]}

    def get_gate_tools(self) -> dict[str, Any]:
        return {TOOL: {"type": "search", "operation": "read"}}
