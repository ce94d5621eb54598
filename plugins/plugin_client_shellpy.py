"""The shell.py endpoint: submit, the session event stream, gate answers, sessions, health.

Wire contract (DESIGN.md): `POST /submit`, `GET /stream?client_id=X` (SSE with ids, replay after
`Last-Event-ID`), `POST /gate_response`, `GET /health`, `GET /sessions`, `DELETE /session/{id}`, and
`POST /admin` (agentctl's writes while the server runs: plugins/_shell_admin.py); for a window that is an
approver (`!approver on`, docs/approvals.md): `POST /approver`, `GET /approvals?window=W` (SSE feed).
Binds 127.0.0.1:8765 by default. Every endpoint needs a bearer token: `AGENT_SHELL_TOKEN` when set,
else the one generated into `<data dir>/shell-token` (mode 0600) at the first start, which shell.py
reads by itself.
"""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncGenerator
from typing import Any

from pydantic import BaseModel, Field, StrictInt
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

import approvals
import guard
import plugin_api
from plugin_api import BasePlugin, PluginConfigError, PluginSettings, parse_settings
from plugins import _http, _shell_admin

CLIENT_ID = re.compile(_http.CLIENT_ID_PATTERN)
logger = logging.getLogger("agent_mcp.shellpy")


class ShellConfig(PluginSettings, guard.ListenerSettings):
    """`plugin_config.plugin_client_shellpy` in plugins-enabled.json."""

    host: str = "127.0.0.1"
    port: int = Field(default=8765, ge=1, le=65535)
    #: Env var holding the bearer token; unset → the token file `<data dir>/shell-token`.
    token_env: str = "AGENT_SHELL_TOKEN"


class _SubmitBody(BaseModel):
    client_id: str = Field(pattern=_http.CLIENT_ID_PATTERN)
    text: str = Field(max_length=_http.MAX_TEXT)
    default_model: str | None = None


class _StopBody(BaseModel):
    client_id: str = Field(pattern=_http.CLIENT_ID_PATTERN)


class _GateBody(BaseModel):
    gate_id: str = Field(min_length=1, max_length=128)
    decision: str
    #: For allow_for: how long the grant lasts.
    minutes: StrictInt | None = None  # "15" or true is no number of minutes
    #: The answering window, when it answers a gate of another session as an approver (`!approver on`).
    approver: str | None = Field(default=None, pattern=_http.CLIENT_ID_PATTERN)
    #: The values filled in, for a question asking for some (an MCP server's elicitation: docs/approvals.md).
    content: dict[str, Any] | None = None


class _ApproverBody(BaseModel):
    window: str = Field(pattern=_http.CLIENT_ID_PATTERN)
    on: bool


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


async def _json_body(request: Request, model: type[BaseModel]) -> Any:
    """The request body validated by `model`, or a 4xx response that says what is wrong."""
    try:
        return await _http.read_json(request, model)
    except _http.BadRequest as exc:
        return _error(exc.status, str(exc))


def _session_row(rt: plugin_api.PluginContext, s: plugin_api.Session) -> dict[str, Any]:
    """A session for /sessions; `running`: a request of it runs or waits (a shell back online after a
    restart asks, to tell a turn that still runs from one the restart interrupted)."""
    return {"client_id": s.client_id, "shorthand_id": s.shorthand, "model": s.model, "history_length": len(s.history),
            "running": rt.busy(s.client_id)
                       or (rt.sessions.shared and s.running is not None)}  # a turn on another instance


async def _for_shells(desk: plugin_api.PluginDesk) -> AsyncGenerator[tuple[str, dict[str, Any]], None]:
    """The feed's gates that shell approvers may answer (and every closing: a window drops what it shows)."""
    async for name, data in desk.wire():
        if name == approvals.CLOSED or any(a.startswith(approvals.SHELL + ":") for a in data.get("approvers", ())):
            yield name, data


class ShellpyPlugin(BasePlugin):
    """Serves shell.py (and anything speaking its small JSON/SSE contract)."""

    PLUGIN_NAME = "plugin_client_shellpy"
    PLUGIN_VERSION = "1.0.0"
    PLUGIN_TYPE = "client_interface"
    DESCRIPTION = "SSE endpoint for the shell.py terminal client"
    DEPENDENCIES = ["sse-starlette"]

    def __init__(self) -> None:
        super().__init__()
        self.cfg = ShellConfig()
        self._token: str | None = None

    def init(self, config: dict[str, Any]) -> bool:
        self.cfg = parse_settings(self.PLUGIN_NAME, ShellConfig, config)
        rt = self.ctx
        self._token = rt.config.env.get(self.cfg.token_env) or None
        if self._token is None:
            path = rt.config.data_dir() / guard.SHELL_TOKEN_FILE
            new = not path.exists()
            try:
                self._token = guard.ensure_token_file(path)
            except guard.TokenFileError as exc:
                raise PluginConfigError(f"shell token: {exc}") from None
            if new:
                logger.info("wrote a new shell endpoint token to %s (readable by this user only); shell.py reads it "
                            "from there", path)
        return True

    def shutdown(self) -> None:
        self._token = None

    def get_config(self) -> dict[str, Any]:
        return {"host": self.cfg.host, "port": self.cfg.port, "name": "shell.py endpoint", "token": self._token,
                "allowed_hosts": self.cfg.allowed_hosts, "allowed_origins": self.cfg.allowed_origins,
                "token_hint": self._token_hint()}

    def _token_hint(self) -> str:
        """Where a 401's reader finds the token, without a path (the reader is nobody the server vouched for)."""
        if self.ctx.config.env.get(self.cfg.token_env):
            return f"the token is the server's {self.cfg.token_env} setting"
        name = guard.SHELL_TOKEN_FILE
        return (f"the token is in the file {name} of the server's data directory (data/{name} in its config dir "
                "unless AGENT_DATA_DIR says otherwise), readable only by the user who runs the server: "
                f"curl -H \"Authorization: Bearer $(cat data/{name})\" …")

    def get_routes(self) -> list[Route]:
        return [
            Route("/submit", self.submit, methods=["POST"]),
            Route("/stream", self.stream, methods=["GET"]),
            Route("/stop", self.stop, methods=["POST"]),
            Route("/gate_response", self.gate_response, methods=["POST"]),
            Route("/approver", self.approver, methods=["POST"]),
            Route("/approvals", self.approvals, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/sessions", self.sessions, methods=["GET"]),
            Route("/session/{sid}", self.delete_session, methods=["DELETE"]),
            Route("/admin", self.admin, methods=["POST"]),
        ]

    async def submit(self, request: Request) -> JSONResponse:
        body = await _json_body(request, _SubmitBody)
        if isinstance(body, JSONResponse):
            return body
        # Every request here carried the endpoint's token (the guard checked it): a person at shell.py.
        await self.ctx.submit(self.ctx.request(body.client_id, body.text, kind=plugin_api.SHELL, interactive=True,
                                                default_model=body.default_model, identity="shell"))
        return JSONResponse({"status": "OK"})

    async def stop(self, request: Request) -> JSONResponse:
        """Ctrl-C in shell.py: cancel the session's running turn, which says `[stopped]` and ends with `done`."""
        body = await _json_body(request, _StopBody)
        if isinstance(body, JSONResponse):
            return body
        return JSONResponse({"status": "OK", "cancelled": await self.ctx.stop(body.client_id)})

    async def stream(self, request: Request) -> Any:
        client_id = request.query_params.get("client_id", "")
        if not CLIENT_ID.match(client_id):
            return _error(400, "missing or invalid client_id query parameter")
        return _http.event_stream(self.ctx, client_id, _http.last_event_id(request))

    async def gate_response(self, request: Request) -> JSONResponse:
        body = await _json_body(request, _GateBody)
        if isinstance(body, JSONResponse):
            return body
        window = approvals.Approver(approvals.SHELL, body.approver) if body.approver else None
        try:  # the shell's user is the human the gates ask: they may grant
            result = await self.ctx.gate.answer(body.gate_id, body.decision, by="shell", minutes=body.minutes,
                                               answerer=window, channel="shell", content=body.content)
        except ValueError as exc:
            return _error(400, str(exc))
        if result.outcome == approvals.UNKNOWN:
            return _error(404, f"unknown or already answered gate '{body.gate_id}' (it may have timed out)")
        if not result.answered:  # a routed gate: not an approver (409, not 403: the token is fine), or too late
            first = result.first.to_dict() if result.first else None
            return JSONResponse({"error": approvals.explain(result), "outcome": result.outcome, "first": first},
                                status_code=409)
        return JSONResponse({"status": "OK"})

    async def approver(self, request: Request) -> JSONResponse:
        """`!approver on|off` of a shell window: it is shown the gates routed to shell approvers, and may answer."""
        body = await _json_body(request, _ApproverBody)
        if isinstance(body, JSONResponse):
            return body
        if self.ctx.gate.desk is None:
            return _error(409, "no gates are routed to approvers: add an 'approvals' section to "
                               "plugins-enabled.json (docs/approvals.md)")
        await self.ctx.gate.desk.set_window(body.window, body.on)
        shells = any(a.startswith("shell:") for g in await self.ctx.gate.desk.pending() for a in g.approvers)
        return JSONResponse({"status": "OK", "on": body.on, "window": body.window,
                             "shell_approvers": self._shells_configured(), "pending_for_shells": shells})

    def _shells_configured(self) -> bool:
        cfg = self.ctx.config.enabled.approvals
        return any(e.shell or any(t.shell for t in (*e.tools.values(), *e.tables.values()))
                   for e in cfg.classes.values())

    async def approvals(self, request: Request) -> Any:
        """The approver feed (SSE `approval` / `approval_closed` events) for a window that opted in."""
        window = request.query_params.get("window", "")
        desk = self.ctx.gate.desk
        if not CLIENT_ID.match(window):
            return _error(400, "missing or invalid window query parameter")
        if desk is None or not await desk.is_window(window):
            return _error(409, "this window is not an approver: !approver on")
        return _http.feed_stream(self.ctx, _for_shells(desk))

    async def admin(self, request: Request) -> JSONResponse:
        """agentctl's writes to what this server owns (plugins/_shell_admin.py), done and audited here."""
        body = await _json_body(request, _shell_admin.AdminBody)
        if isinstance(body, JSONResponse):
            return body
        try:
            return JSONResponse(await _shell_admin.handle(self.ctx, body))
        except _shell_admin.AdminError as exc:
            return _error(400, str(exc))

    async def health(self, request: Request) -> JSONResponse:
        rt = self.ctx
        await rt.sessions.refresh()
        return JSONResponse({
            "status": "healthy",
            "models": list(rt.config.models),
            "default_model": rt.config.default_model,
            "sessions": rt.sessions.count(),
            "instances": await rt.sessions.instances(),  # several on one Redis: how many are alive
            "plugins": rt.plugin_reports(),
        })

    async def sessions(self, request: Request) -> JSONResponse:
        wanted = request.query_params.get("client_id")
        await self.ctx.sessions.refresh()
        if wanted is None:
            return JSONResponse({"sessions": [_session_row(self.ctx, s) for s in self.ctx.sessions.all()]})
        client_id = self.ctx.sessions.resolve(wanted)
        session = self.ctx.sessions.get(client_id) if client_id else None
        return JSONResponse({"sessions": [_session_row(self.ctx, session)] if session else []})

    async def delete_session(self, request: Request) -> JSONResponse:
        rt = self.ctx
        await rt.sessions.refresh()
        client_id = rt.sessions.resolve(request.path_params["sid"])
        if client_id is None:
            return _error(404, f"session '{request.path_params['sid']}' not found")
        await rt.delete_session(client_id)
        return JSONResponse({"status": "OK", "deleted": client_id})
