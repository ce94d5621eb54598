"""A new client plugin, as a newcomer writes it: one file (and its manifest entry).

POST /ask {"name", "text"} runs one request of client `echo-<name>` and answers {"status", "text"}.
It imports nothing of the server but `plugin_api`; its requests state the class its namespace
declares (`ctx.request`).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from plugin_api import API, BasePlugin, PluginSettings, parse_settings


class EchoSettings(PluginSettings):
    """`plugin_config.plugin_client_echo` in plugins-enabled.json."""

    port: int = 8799
    #: The longest a request is waited for, in seconds.
    wait_seconds: float = 30


class _Ask(BaseModel):
    name: str
    text: str


class EchoPlugin(BasePlugin):
    PLUGIN_NAME = "plugin_client_echo"
    PLUGIN_TYPE = "client_interface"
    CLIENT_NAMESPACES = {"echo-": API}

    def init(self, config: dict[str, Any]) -> bool:
        self.settings = parse_settings(self.PLUGIN_NAME, EchoSettings, config)
        return True

    def shutdown(self) -> None:
        pass

    def get_config(self) -> dict[str, Any]:
        return {"host": "127.0.0.1", "port": self.settings.port, "name": "echo", "token": None}

    def get_routes(self) -> list[Any]:
        return [Route("/ask", self.ask, methods=["POST"])]

    async def ask(self, request: Request) -> JSONResponse:
        body = _Ask.model_validate(await request.json())
        asked = self.ctx.request(f"echo-{body.name}", body.text, identity=f"echo:{body.name}")
        return JSONResponse(await self.ctx.wait_turn(asked, self.settings.wait_seconds))
