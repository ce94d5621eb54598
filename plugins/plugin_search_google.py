"""google_search: Gemini answers with Google Search grounding (google-genai, the `google_search` tool).

The model runs the Google searches itself and returns an answer grounded in them plus its sources
(Google's Custom Search JSON API is closed to new users and ends on 1 Jan 2027, so it is not used).
Needs `GEMINI_API_KEY`. `plugin_config.plugin_search_google`: `base_url` (or env `GOOGLE_GEMINI_BASE_URL`,
default Google's), `model` (default `gemini-2.5-flash`), `timeout` (s, default 30).
"""

from __future__ import annotations

import logging
from typing import Any

from google import genai
from google.genai import types
from langchain_core.tools import StructuredTool
from pydantic import BaseModel, Field

from failures import Service, describe, failure
from plugin_api import BasePlugin, PluginConfigError, PluginSettings, parse_settings

logger = logging.getLogger("agent_mcp.plugins.google_search")

TOOL = "google_search"
SEARCH_CONFIG = types.GenerateContentConfig(tools=[types.Tool(google_search=types.GoogleSearch())])


class GoogleSearchSettings(PluginSettings):
    """`plugin_config.plugin_search_google`."""

    base_url: str | None = Field(default=None, pattern=r"^https?://")
    model: str = Field(default="gemini-2.5-flash", min_length=1)
    timeout: float = Field(default=30, gt=0)


class _GoogleSearchArgs(BaseModel):
    query: str = Field(min_length=1, description="The question to answer from a Google search")


def format_response(query: str, resp: types.GenerateContentResponse) -> str:
    """The grounded answer, the searches the model ran and its sources (or a note that it did not search)."""
    candidate = resp.candidates[0] if resp.candidates else None
    answer = (resp.text or "").strip()
    if not answer:
        reason = getattr(candidate, "finish_reason", None) if candidate else None
        return f"{TOOL} error: Gemini returned no answer (finish reason: {reason or 'unknown'}); rephrase the query"
    lines = [f"[Search: '{query}']", "", answer]
    meta = candidate.grounding_metadata if candidate else None
    if meta is None or not meta.grounding_chunks:
        lines += ["", "(Gemini answered without searching, so there are no sources; treat the answer as unverified.)"]
        return "\n".join(lines)
    if meta.web_search_queries:
        lines += ["", "Searched: " + "; ".join(meta.web_search_queries)]
    lines += ["", "Sources:"]
    seen: set[str] = set()
    for chunk in meta.grounding_chunks:
        web = chunk.web
        if web is None or not web.uri or web.uri in seen:
            continue
        seen.add(web.uri)
        lines.append(f"  - {web.title or web.domain or 'source'}: {web.uri}")
    return "\n".join(lines)


def describe_error(exc: Exception, settings: GoogleSearchSettings) -> str:
    """What went wrong talking to Gemini and what to do, in one line."""
    service = Service("Gemini", where=settings.base_url or "Google", key="GEMINI_API_KEY", timeout=settings.timeout,
                      says={429: "Gemini quota or rate limit reached",
                            404: f"Gemini does not know model '{settings.model}'"},
                      advice={429: "wait a while or check the quota",
                              404: "set plugin_config.plugin_search_google.model to a current Gemini model"})
    found = failure(exc)
    # Gemini answers a bad key with 400 or 403 as often as with 401.
    rejected = found.status in (400, 401, 403) and "key" in found.message.lower()
    return describe(service, exc, key_rejected=rejected)


async def run_google_search(client: genai.Client, settings: GoogleSearchSettings, query: str) -> str:
    """One dedicated grounded `generate_content` call; failures come back as `google_search error: …`."""
    try:
        resp = await client.aio.models.generate_content(model=settings.model, contents=query, config=SEARCH_CONFIG)
    except Exception as exc:
        text = f"{TOOL} error: {describe_error(exc, settings)}"
        logger.info("%s", text)
        return text
    return format_response(query, resp)


class GoogleSearchPlugin(BasePlugin):
    PLUGIN_NAME = "plugin_search_google"
    PLUGIN_VERSION = "1.0.0"
    PLUGIN_TYPE = "data_tool"
    DESCRIPTION = "google_search: Gemini with Google Search grounding"
    DEPENDENCIES = ["google-genai"]
    ENV_VARS = ["GEMINI_API_KEY"]

    def __init__(self) -> None:
        super().__init__()
        self.settings = GoogleSearchSettings()
        self.client: genai.Client | None = None

    def init(self, config: dict[str, Any]) -> bool:
        assert self.context is not None
        env = self.context.config.env
        self.settings = parse_settings(self.PLUGIN_NAME, GoogleSearchSettings, config,
                                       {"base_url": env.get("GOOGLE_GEMINI_BASE_URL")})
        key = env.get("GEMINI_API_KEY")
        if not key:
            raise PluginConfigError("GEMINI_API_KEY is not set: add it to .env (get a key at https://aistudio.google.com)")
        options = types.HttpOptions(timeout=int(self.settings.timeout * 1000), base_url=self.settings.base_url)
        self.client = genai.Client(api_key=key, http_options=options)
        return True

    async def shutdown(self) -> None:
        if self.client is not None:
            await self.client.aio.aclose()
        self.client = None

    def get_tools(self) -> dict[str, Any]:
        async def google_search(query: str) -> str:
            assert self.client is not None
            return await run_google_search(self.client, self.settings, query)

        return {"lc": [StructuredTool.from_function(
            coroutine=google_search, name=TOOL, args_schema=_GoogleSearchArgs,
            description="Answer a question from a Google search (Gemini with Search grounding), with sources.",
        )]}

    def get_gate_tools(self) -> dict[str, Any]:
        return {TOOL: {"type": "search", "operation": "read"}}
