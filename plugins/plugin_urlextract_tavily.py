"""url_extract: one web page as markdown through Tavily extract, its links turned into numbered references.

Needs `TAVILY_API_KEY`. `plugin_config.plugin_urlextract_tavily`: `base_url` (or env `TAVILY_BASE_URL`),
`timeout` (s, default 30), `max_chars` (page text kept, default 20000).
"""

from __future__ import annotations

import logging
import re
from typing import Any, Literal
from urllib.parse import urljoin, urlsplit

from langchain_core.tools import StructuredTool
from pydantic import BaseModel, Field
from tavily import AsyncTavilyClient

from plugins import _tavily

logger = logging.getLogger("agent_mcp.plugins.url_extract")

TOOL = "url_extract"
_IMAGE = re.compile(r"!\[([^\]]*)\]\([^)]*\)")
_LINK = re.compile(r"\[([^\]]*)\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


class UrlExtractSettings(_tavily.TavilySettings):
    """`plugin_config.plugin_urlextract_tavily`."""

    max_chars: int = Field(default=20_000, ge=500)


class _UrlExtractArgs(BaseModel):
    url: str = Field(min_length=1, description="The http(s) URL of the page to read")
    query: str = Field(default="", description="Optional focus: return only the parts of the page relevant to this")
    extract_depth: Literal["basic", "advanced"] = Field(
        default="basic", description="advanced also reads tables and embedded content (slower)"
    )


def number_links(markdown: str, base_url: str) -> str:
    """Markdown with images reduced to their alt text and each link `[text](url)` turned into `text[n]`.

    Links are numbered by first appearance (the same URL keeps its number, relative URLs are resolved
    against `base_url`) and listed at the end as `[n]: url` under a `---` line.
    """
    refs: dict[str, int] = {}

    def link(m: re.Match[str]) -> str:
        url = urljoin(base_url, m[2])
        if urlsplit(url).scheme not in ("http", "https"):
            return m[1]  # mailto:, javascript:, fragments of nothing: keep the text only
        n = refs.setdefault(url, len(refs) + 1)
        return f"{m[1].strip()}[{n}]"

    text = _LINK.sub(link, _IMAGE.sub(lambda m: m[1], markdown))
    if refs:
        text = text.rstrip() + "\n\n---\n" + "\n".join(f"[{n}]: {url}" for url, n in refs.items())
    return text


def format_extract(url: str, query: str, response: dict[str, Any], max_chars: int) -> str:
    """Tavily's extract response as readable text (or why the page could not be read)."""
    results = response.get("results") or []
    if not results:
        failed = response.get("failed_results") or []
        detail = next((f.get("error") for f in failed if f.get("error")), None) or "the page returned no content"
        return f"Extraction failed for {url}.\nDetails: {detail}"
    parts = []
    for r in results:
        content = str(r.get("raw_content") or "")
        note = ""
        if len(content) > max_chars:
            note = f"\n\n…(truncated: {len(content) - max_chars} more characters not shown)"
            content = content[:max_chars]
        head = [f"Source: {r.get('url') or url}"] + ([f"Query: {query}"] if query else [])
        parts.append("\n".join(head) + "\n\n" + number_links(content, r.get("url") or url) + note)
    return "\n\n".join(parts)


async def run_url_extract(client: AsyncTavilyClient, settings: UrlExtractSettings, url: str, query: str = "",
                          extract_depth: str = "basic") -> str:
    """Extract and format; every failure comes back as a `url_extract error: …` line."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return f"{TOOL} error: '{url}' is not an http(s) URL; pass a full address such as https://example.org/page"
    focus = {"query": query, "chunks_per_source": 5} if query.strip() else {}
    try:
        response = await client.extract(url.strip(), format="markdown", extract_depth=extract_depth,
                                        timeout=settings.timeout, **focus)
    except Exception as exc:
        text = f"{TOOL} error: {_tavily.describe_error(exc, settings)}"
        logger.info("%s", text)
        return text
    return format_extract(url.strip(), query.strip(), response, settings.max_chars)


class UrlExtractPlugin(_tavily.TavilyPlugin):
    PLUGIN_NAME = "plugin_urlextract_tavily"
    PLUGIN_VERSION = "1.0.0"
    PLUGIN_TYPE = "data_tool"
    DESCRIPTION = "url_extract: a page as markdown with numbered link references (Tavily extract)"
    DEPENDENCIES = ["tavily-python"]
    ENV_VARS = ["TAVILY_API_KEY"]
    SETTINGS = UrlExtractSettings

    settings: UrlExtractSettings

    def get_tools(self) -> dict[str, Any]:
        async def url_extract(url: str, query: str = "", extract_depth: str = "basic") -> str:
            assert self.client is not None and self.settings is not None
            return await run_url_extract(self.client, self.settings, url, query, extract_depth)

        return {"lc": [StructuredTool.from_function(
            coroutine=url_extract, name=TOOL, args_schema=_UrlExtractArgs,
            description="Read one web page as markdown; links become numbered references listed at the end.",
        )]}

    def get_gate_tools(self) -> dict[str, Any]:
        return {TOOL: {"type": "extract", "operation": "read"}}
