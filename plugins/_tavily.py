"""Shared by the two Tavily plugins (`tavily_search`, `url_extract`): settings, the client, error messages.

Not a plugin itself (no manifest entry); the plugins import it as `plugins._tavily`.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import Field
from tavily import AsyncTavilyClient
from tavily import errors as tavily_errors

from failures import Service, describe
from plugin_api import BasePlugin, PluginConfigError, PluginSettings, parse_settings

DEFAULT_BASE_URL = "https://api.tavily.com"


class TavilySettings(PluginSettings):
    """Settings both Tavily plugins understand (`plugin_config.<plugin>`)."""

    base_url: str = Field(default=DEFAULT_BASE_URL, pattern=r"^https?://", description="TAVILY_BASE_URL")
    timeout: float = Field(default=30, gt=0, le=120)


S = TypeVar("S", bound=TavilySettings)


def load_settings(plugin_name: str, model: type[S], config: dict[str, Any], env: dict[str, str]) -> S:
    """The plugin's settings, `base_url` defaulting to `TAVILY_BASE_URL`."""
    return parse_settings(plugin_name, model, config, {"base_url": env.get("TAVILY_BASE_URL")})


def make_client(settings: TavilySettings, env: dict[str, str]) -> AsyncTavilyClient:
    """One async client (one connection pool) for the plugin's lifetime."""
    key = env.get("TAVILY_API_KEY")
    if not key:
        # Without a key the library silently switches to its limited keyless mode; say what to set instead.
        raise PluginConfigError("TAVILY_API_KEY is not set: add it to .env (get a key at https://app.tavily.com)")
    return AsyncTavilyClient(api_key=key, api_base_url=settings.base_url.rstrip("/"))


class TavilyPlugin(BasePlugin):
    """What both Tavily plugins do the same way: settings and one client from `init()` to `shutdown()`."""

    SETTINGS: type[TavilySettings] = TavilySettings

    def __init__(self) -> None:
        super().__init__()
        self.settings: Any = None
        self.client: AsyncTavilyClient | None = None

    def init(self, config: dict[str, Any]) -> bool:
        assert self.context is not None
        env = self.context.config.env
        self.settings = load_settings(self.PLUGIN_NAME, self.SETTINGS, config, env)
        self.client = make_client(self.settings, env)
        return True

    async def shutdown(self) -> None:
        if self.client is not None:
            await self.client.close()
        self.client = None


#: Tavily's client raises one class per status without carrying it.
_STATUSES = {tavily_errors.InvalidAPIKeyError: 401, tavily_errors.UsageLimitExceededError: 429,
             tavily_errors.ForbiddenError: 403, tavily_errors.BadRequestError: 400}


def describe_error(exc: Exception, settings: TavilySettings) -> str:
    """What went wrong talking to Tavily and what to do, in one line."""
    service = Service("Tavily", where=settings.base_url, key="TAVILY_API_KEY", timeout=settings.timeout,
                      says={429: "Tavily usage limit reached", 403: "Tavily refused the request",
                            400: "Tavily rejected the request"},
                      advice={429: "wait a while or raise the plan's limit", 400: "change the arguments"})
    status = next((code for cls, code in _STATUSES.items() if isinstance(exc, cls)), None)
    return describe(service, exc, status=status, message=(str(exc).strip() or "no details") if status else None)
