"""xai_search: Grok searches the web and X with xAI's server-side search tools and answers with sources.

Uses xAI's OpenAI-compatible Responses endpoint (`POST /v1/responses` with `tools: [{"type": "web_search"},
{"type": "x_search"}]`) through the openai SDK; the old Live Search (`search_parameters`) is gone (HTTP 410).
Needs `XAI_API_KEY`. `plugin_config.plugin_search_xai`: `base_url` (or env `XAI_BASE_URL`, default
https://api.x.ai/v1), `model` (default `grok-4-1-fast`), `timeout` (s, default 120: the model runs a whole
search loop per call), `max_retries` (default 1).
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import openai
from langchain_core.tools import StructuredTool
from pydantic import BaseModel, Field

from failures import Service, describe
from plugin_api import BasePlugin, PluginConfigError, PluginSettings, parse_settings

logger = logging.getLogger("agent_mcp.plugins.xai_search")

TOOL = "xai_search"
SOURCE_TOOLS = {"web": [{"type": "web_search"}], "x": [{"type": "x_search"}],
                "web_and_x": [{"type": "web_search"}, {"type": "x_search"}]}


class XaiSettings(PluginSettings):
    """`plugin_config.plugin_search_xai`."""

    base_url: str = Field(default="https://api.x.ai/v1", pattern=r"^https?://")
    model: str = Field(default="grok-4-1-fast", min_length=1)
    timeout: float = Field(default=120, gt=0)
    max_retries: int = Field(default=1, ge=0, le=5)


class _XaiSearchArgs(BaseModel):
    query: str = Field(min_length=1, description="The question to research")
    sources: Literal["web_and_x", "web", "x"] = Field(
        default="web_and_x", description="Search the web, X (Twitter) posts, or both"
    )


def _sources(resp: Any) -> list[tuple[str, str]]:
    """(title, url) of every source the response names, first mention first, each URL once.

    xAI reports sources in three places: `url_citation` annotations of the answer, the top-level
    `citations` list (an xAI extension) and the `sources` of each `web_search_call`.
    """
    found: dict[str, str] = {}
    for item in resp.output or []:
        if getattr(item, "type", None) == "message":
            for part in getattr(item, "content", None) or []:
                for ann in getattr(part, "annotations", None) or []:
                    if getattr(ann, "type", None) == "url_citation" and ann.url:
                        found.setdefault(ann.url, ann.title or "")
    for url in (resp.model_extra or {}).get("citations") or []:
        if isinstance(url, str):
            found.setdefault(url, "")
    for item in resp.output or []:
        if getattr(item, "type", None) == "web_search_call":
            action = getattr(item, "action", None)
            for src in getattr(action, "sources", None) or []:
                url = src.get("url") if isinstance(src, dict) else getattr(src, "url", None)
                if url:
                    found.setdefault(url, "")
    return [(title, url) for url, title in found.items()]


def format_response(query: str, resp: Any) -> str:
    """The answer, then numbered sources."""
    answer = (resp.output_text or "").strip() or "(the model returned no text)"
    lines = [f"xAI search results for: {query}", "", f"Answer: {answer}"]
    sources = _sources(resp)
    if sources:
        lines += ["", "Sources:"]
        # Numeric titles are just citation numbers; show the URL alone then.
        lines += [f"  [{i}] " + (f"{t} — {u}" if t and not t.isdigit() else u) for i, (t, u) in enumerate(sources, 1)]
    return "\n".join(lines)


def describe_error(exc: Exception, settings: XaiSettings) -> str:
    """What went wrong talking to xAI and what to do, in one line."""
    return describe(Service(
        "xAI", where=settings.base_url, key="XAI_API_KEY", timeout=settings.timeout,
        says={429: "xAI rate limit or credit limit reached",
              404: f"xAI does not know model '{settings.model}' or the endpoint"},
        advice={429: "wait a while or check the account's credits",
                404: "set plugin_config.plugin_search_xai.model to a current grok-4 model"}), exc)


async def run_xai_search(client: openai.AsyncOpenAI, settings: XaiSettings, query: str,
                         sources: str = "web_and_x") -> str:
    """One Responses call with the server-side search tools; failures come back as `xai_search error: …`."""
    try:
        resp = await client.responses.create(
            model=settings.model, input=[{"role": "user", "content": query}],
            tools=SOURCE_TOOLS[sources],  # type: ignore[arg-type]  # x_search is xAI's, not in openai's types
        )
    except Exception as exc:
        text = f"{TOOL} error: {describe_error(exc, settings)}"
        logger.info("%s", text)
        return text
    return format_response(query, resp)


class XaiSearchPlugin(BasePlugin):
    PLUGIN_NAME = "plugin_search_xai"
    PLUGIN_VERSION = "1.0.0"
    PLUGIN_TYPE = "data_tool"
    DESCRIPTION = "xai_search: xAI web and X search through the Responses API"
    DEPENDENCIES = ["openai"]
    ENV_VARS = ["XAI_API_KEY"]

    def __init__(self) -> None:
        super().__init__()
        self.settings = XaiSettings()
        self.client: openai.AsyncOpenAI | None = None

    def init(self, config: dict[str, Any]) -> bool:
        assert self.context is not None
        env = self.context.config.env
        self.settings = parse_settings(self.PLUGIN_NAME, XaiSettings, config, {"base_url": env.get("XAI_BASE_URL")})
        key = env.get("XAI_API_KEY")
        if not key:
            raise PluginConfigError("XAI_API_KEY is not set: add it to .env (get a key at https://console.x.ai)")
        self.client = openai.AsyncOpenAI(api_key=key, base_url=self.settings.base_url, timeout=self.settings.timeout,
                                         max_retries=self.settings.max_retries)
        return True

    async def shutdown(self) -> None:
        if self.client is not None:
            await self.client.close()
        self.client = None

    def get_tools(self) -> dict[str, Any]:
        async def xai_search(query: str, sources: str = "web_and_x") -> str:
            assert self.client is not None
            return await run_xai_search(self.client, self.settings, query, sources)

        return {"lc": [StructuredTool.from_function(
            coroutine=xai_search, name=TOOL, args_schema=_XaiSearchArgs,
            description="Ask Grok (xAI) to search the web and/or X posts; returns its answer with sources.",
        )]}

    def get_gate_tools(self) -> dict[str, Any]:
        return {TOOL: {"type": "search", "operation": "read"}}
