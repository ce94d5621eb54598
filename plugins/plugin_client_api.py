"""The JSON/SSE API for programs and other agents (port 8767), spoken by `api_client.AgentClient`.

Endpoints (those of the reference `AgentClient`, so programs written for it keep working):
`POST /api/v1/submit`, `GET /api/v1/stream/{client_id}` (SSE with ids, `Last-Event-ID` replay,
`?turn_id=` for one turn's events only), `POST /api/v1/gate/{gate_id}`, `GET /api/v1/sessions`,
`GET /api/v1/health`, `DELETE /api/v1/session/{id}`, `POST /api/v1/stop`; with the admin key, the gates
routed to it as an approver (docs/approvals.md): `GET /api/v1/approvals`, `GET /api/v1/approvals/stream`.

Client ids live in the `api-` namespace: an id without that prefix gets it (`myapp` → `api-myapp`),
so an API caller can never reach an interactive shell session (whose gates it could otherwise
approve); ids starting with `api-swarm-` are swarm calls from other agents (gates auto-rejected,
no onward `agent_call`). Every request needs `Authorization: Bearer <key>` (checked by the guard
for the whole port): `API_KEY` when set, else the key generated into `<data dir>/api-key` (mode
0600) at the first start, exactly like the shell token, which `AgentClient` reads by itself. A
caller that also sends `X-Admin-Key: <API_ADMIN_KEY>` is an administrator: its messages may run
gate commands, and it sees every session, not only the `api-` ones. A gate event names the
permission it asks for in `tool_args.operation_type`: read, write, or for database tables ddl
(CREATE, DROP, ALTER, RENAME, TRUNCATE), which no write covers; a grant (`scope`
minutes/session/pattern) allows that permission only.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import approvals
import decisions
import guard
import plugin_api
from plugin_api import BasePlugin, PluginConfigError, PluginSettings, parse_settings
from plugins import _http

PREFIX = "api-"
logger = logging.getLogger("agent_mcp.api")
CLIENT_ID = re.compile(_http.CLIENT_ID_PATTERN)
DEFAULT_WAIT = 60.0
#: Turns submitted without `wait` whose stream may still be asked for by `turn_id`.
KEPT_TURNS = 4096
#: How long a turn id stays known to every instance of a shared store (a stream asked for on another one).
TURN_SECONDS = 86400


class ApiConfig(PluginSettings, guard.ListenerSettings):
    """`plugin_config.plugin_client_api` in plugins-enabled.json."""

    host: str = "127.0.0.1"
    port: int = Field(default=8767, ge=1, le=65535)
    #: Env var holding the bearer token every request must present (unset: `<data dir>/api-key`).
    token_env: str = "API_KEY"
    #: Env var holding the admin token (header `X-Admin-Key`); unset: nobody is an admin here.
    admin_token_env: str = "API_ADMIN_KEY"
    #: The longest `timeout` a `wait: true` submit may ask for, in seconds.
    max_wait_seconds: float = Field(default=600, gt=0)


class _Body(BaseModel):
    # Strict: "true" is not a boolean and "60" not a number. Unknown fields are ignored, so
    # newer clients keep working.
    model_config = ConfigDict(strict=True, extra="ignore")


class _SubmitBody(_Body):
    text: str = Field(max_length=_http.MAX_TEXT)
    client_id: str | None = Field(default=None, pattern=_http.CLIENT_ID_PATTERN)
    wait: bool = False
    timeout: float = Field(default=DEFAULT_WAIT, gt=0, allow_inf_nan=False)
    default_model: str | None = Field(default=None, max_length=128)


_ADMIN_APPROVER = f"{approvals.API}:{approvals.ADMIN}"
#: The gate decision of each `scope` of an approving answer.
_SCOPES = {name: word for word, name in decisions.SCOPE_NAMES.items()}
# A Literal built from the one vocabulary at run time, which a type checker cannot read (to it, a str).
if TYPE_CHECKING:
    ApiScope = str
else:
    ApiScope = Literal[tuple(_SCOPES)]


class _GateBody(_Body):
    approve: StrictBool
    #: How far a yes reaches (admin key only beyond `once`): this call, N `minutes` of this tool or these
    #: tables, the rest of the session, or calls of the same shape.
    scope: ApiScope = "once"
    minutes: StrictInt | None = None  # "15" or true is no number of minutes


class _StopBody(_Body):
    client_id: str = Field(pattern=_http.CLIENT_ID_PATTERN)


def api_client_id(raw: str) -> str:
    """The API-namespace id for a caller's id: unchanged when it starts with `api-`, else prefixed."""
    client_id = raw if raw.startswith(PREFIX) else PREFIX + raw
    if not CLIENT_ID.match(client_id):
        raise _http.BadRequest(400, f"invalid client_id '{raw[:140]}': use 1-124 letters, digits and . _ : @ -")
    return client_id


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def _session_row(s: plugin_api.Session) -> dict[str, Any]:
    return {"client_id": s.client_id, "shorthand_id": s.shorthand, "model": s.model, "history_length": len(s.history)}


Handler = Callable[[Request], Awaitable[Response]]


def _endpoint(handler: Handler) -> Handler:
    """A route handler whose BadRequest becomes the JSON error response it describes."""

    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request)
        except _http.BadRequest as exc:
            return _error(exc.status, str(exc))

    return endpoint


class ApiPlugin(BasePlugin):
    """Serves programs (`AgentClient`) and other agent-mcp instances (`agent_call`)."""

    PLUGIN_NAME = "plugin_client_api"
    PLUGIN_VERSION = "1.0.0"
    PLUGIN_TYPE = "client_interface"
    CLIENT_NAMESPACES = {PREFIX: plugin_api.API, "api-swarm-": plugin_api.SWARM}
    DESCRIPTION = "JSON/SSE API for programs and swarm calls between agents"
    DEPENDENCIES = ["sse-starlette"]

    def __init__(self) -> None:
        super().__init__()
        self.cfg = ApiConfig()
        self._turns: OrderedDict[str, tuple[str, int]] = OrderedDict()
        self._routes: list[Route] = []
        self._key: str | None = None

    def init(self, config: dict[str, Any]) -> bool:
        self.cfg = parse_settings(self.PLUGIN_NAME, ApiConfig, config)
        self._key = self._env(self.cfg.token_env)
        if self._key is None:  # no anonymous API: a key of its own, kept the way the shell token is
            path = self.ctx.config.data_dir() / guard.API_KEY_FILE
            new = not path.exists()
            try:
                self._key = guard.ensure_token_file(path, self.cfg.token_env)
            except guard.TokenFileError as exc:
                raise PluginConfigError(f"API key: {exc}") from None
            if new:
                logger.info("wrote a new API key to %s (readable by this user only); api_client.AgentClient reads "
                            "it from there", path)
        admin = self._admin_token()
        if admin is not None and admin == self._token():
            raise PluginConfigError(f"{self.cfg.admin_token_env} must differ from {self.cfg.token_env}: with one key "
                                    "every API caller would be an administrator")
        return True

    def shutdown(self) -> None:
        self._turns.clear()
        self._key = None

    def _env(self, name: str) -> str | None:
        return (self.context.config.env.get(name) if self.context else None) or None

    def _token(self) -> str | None:
        return self._key

    def _admin_token(self) -> str | None:
        return self._env(self.cfg.admin_token_env)

    def get_config(self) -> dict[str, Any]:
        # admin_token is not used to serve; agent_call reads it to never send it anywhere.
        hint = f"the key is {self.cfg.token_env}, or else the file <data dir>/{guard.API_KEY_FILE} of the server"
        return {"host": self.cfg.host, "port": self.cfg.port, "name": "JSON/SSE API", "token": self._token(),
                "token_hint": f"{hint} (AGENT_DATA_DIR, default ./data), which AgentClient reads by itself",
                "admin_token": self._admin_token(), "allowed_hosts": self.cfg.allowed_hosts,
                "allowed_origins": self.cfg.allowed_origins}

    def get_help(self) -> str:
        return (f"JSON/SSE API on http://{self.cfg.host}:{self.cfg.port}/api/v1 "
                "(bearer key required; api_client.AgentClient speaks it)")

    def get_routes(self) -> list[Route]:
        self._routes = [
            Route("/api/v1/submit", _endpoint(self.submit), methods=["POST"]),
            Route("/api/v1/stream/{client_id}", _endpoint(self.stream), methods=["GET"]),
            Route("/api/v1/gate/{gate_id}", _endpoint(self.gate_answer), methods=["POST"]),
            Route("/api/v1/approvals", _endpoint(self.approvals), methods=["GET"]),
            Route("/api/v1/approvals/stream", _endpoint(self.approvals_stream), methods=["GET"]),
            Route("/api/v1/stop", _endpoint(self.stop), methods=["POST"]),
            Route("/api/v1/sessions", _endpoint(self.sessions), methods=["GET"]),
            Route("/api/v1/health", _endpoint(self.health), methods=["GET"]),
            Route("/api/v1/session/{sid}", _endpoint(self.delete_session), methods=["DELETE"]),
        ]
        return [*self._routes, Route("/{path:path}", self.not_found,
                                     methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"])]

    # ── who is asking ──

    def _is_admin(self, request: Request) -> bool:
        """Whether the request carries the admin token (constant-time compare)."""
        admin = self._admin_token()
        given = dict(request.scope["headers"]).get(b"x-admin-key")
        return admin is not None and given is not None and hmac.compare_digest(given, admin.encode())

    def _visible(self, client_id: str, admin: bool) -> bool:
        """API callers see this plugin's namespaces (their sessions and swarm sessions); an admin sees all."""
        return admin or self.client_class(client_id) != plugin_api.UNKNOWN

    async def _remember(self, turn_id: str, client_id: str, after: int) -> None:
        self._turns[turn_id] = (client_id, after)
        while len(self._turns) > KEPT_TURNS:
            self._turns.popitem(last=False)
        if self.ctx.values is not None:  # several instances: the stream may be asked for on another one
            await self.ctx.values.put(f"api-turn:{turn_id}", json.dumps([client_id, after]), TURN_SECONDS)

    async def _recall(self, turn_id: str) -> tuple[str, int] | None:
        known = self._turns.get(turn_id)
        if known is None and self.ctx.values is not None:
            stored = await self.ctx.values.get(f"api-turn:{turn_id}")
            known = tuple(json.loads(stored)) if stored else None
        return known

    # ── endpoints ──

    async def submit(self, request: Request) -> Response:
        body = await _http.read_json(request, _SubmitBody)
        if not body.text.strip():
            raise _http.BadRequest(400, "text is empty: send {\"text\": \"<your message>\"}")
        clamped = body.timeout > self.cfg.max_wait_seconds  # the original accepted any timeout: clamp, and say so
        timeout = min(body.timeout, self.cfg.max_wait_seconds)
        client_id = api_client_id(body.client_id) if body.client_id else f"{PREFIX}{uuid.uuid4().hex[:8]}"
        admin = self._is_admin(request)
        # Rate limits follow the key, not the client id a caller picks.
        asked = self.ctx.request(client_id, body.text, default_model=body.default_model, admin=admin,
                                 identity="api:admin" if admin else "api:key")
        # A caller's W3C trace context (another agent's agent_call): this turn's spans join its trace.
        traced = self.ctx.tracing.continuing(request.headers.get("traceparent"))
        if body.wait:
            with traced:
                answer = await _http.unless_disconnected(
                    request, self.ctx.wait_turn(asked, timeout, cancel_running=True))
            if answer is None:
                return Response(status_code=499)
            if answer["status"] == "error":  # the message in `text` too, as the original API answers
                answer = {**answer, "partial": answer["text"], "text": answer["error"]}
            if clamped:
                answer["note"] = (f"timeout {body.timeout:g} s is above this server's limit; waited at most "
                                  f"{timeout:g} s (plugin_config.plugin_client_api.max_wait_seconds)")
            return JSONResponse({"client_id": client_id, **answer})
        after = self.ctx.hub.last_id(client_id)
        with traced:
            turn = await self.ctx.submit(asked)
        await self._remember(turn.id, client_id, after)
        return JSONResponse({"client_id": client_id, "status": "accepted", "turn_id": turn.id, "after": after})

    async def stream(self, request: Request) -> Response:
        client_id = api_client_id(request.path_params["client_id"])
        after = _http.last_event_id(request)
        turn_id = request.query_params.get("turn_id")
        if turn_id is not None:
            known = await self._recall(turn_id)
            if known is None or known[0] != client_id:
                raise _http.BadRequest(404, f"unknown turn_id '{turn_id[:40]}' for client {client_id}: use the "
                                             "turn_id that POST /api/v1/submit returned")
            after = known[1] if after is None else after
        return _http.event_stream(self.ctx, client_id, after, turn_id)

    async def gate_answer(self, request: Request) -> Response:
        gate_id = request.path_params["gate_id"]
        body = await _http.read_json(request, _GateBody)
        owner = await self.ctx.gate.owner(gate_id)
        admin = self._is_admin(request)
        decision = _SCOPES[body.scope] if body.approve else decisions.REJECT
        if self.ctx.gate.desk is not None and (await self.ctx.gate.desk.get(gate_id)) != (None, None):
            return await self._answer_routed(gate_id, decision, body, admin)
        try:
            # Only gates of API sessions: a shell user's gate is never answered from here.
            answered = owner is not None and self.client_class(owner) == plugin_api.API and await self.ctx.gate.resolve(
                gate_id, decision, by=f"api ({'admin key' if admin else owner})", minutes=body.minutes,
                may_grant=admin)
        except ValueError as exc:
            return _error(400, str(exc))
        if not answered:
            return _error(404, f"unknown gate '{gate_id[:64]}': it was answered, timed out "
                               f"(after {self.ctx.gate.api_timeout:g} s) or never existed")
        return JSONResponse({"status": "ok"})

    async def _answer_routed(self, gate_id: str, decision: str, body: _GateBody, admin: bool) -> Response:
        """A gate routed to approvers (approvals.py): the admin key answers when the operator named it."""
        try:
            result = await self.ctx.gate.answer(
                gate_id, decision, answerer=approvals.Approver(approvals.API, approvals.ADMIN) if admin else None,
                channel="api", by="api (key)", minutes=body.minutes, may_grant=admin)
        except ValueError as exc:
            return _error(400, str(exc))
        if result.answered:
            return JSONResponse({"status": "ok"})
        # 409, not 403: the key is valid (403 is the guard's); the gate is someone else's to answer, or answered.
        status = 409 if result.outcome in (approvals.NOT_APPROVER, approvals.DECIDED) else 404
        return JSONResponse({"error": approvals.explain(result), "outcome": result.outcome,
                             "first": result.first.to_dict() if result.first else None}, status_code=status)

    def _admin_desk(self, request: Request) -> plugin_api.PluginDesk:
        if not self._is_admin(request):
            raise _http.BadRequest(404, "no approvals for this key: they are answered with the admin key "
                                        "(send X-Admin-Key)")
        if self.ctx.gate.desk is None:
            raise _http.BadRequest(404, "no gates are routed to approvers: add an 'approvals' section to "
                                        "plugins-enabled.json (docs/approvals.md)")
        return self.ctx.gate.desk

    async def approvals(self, request: Request) -> Response:
        """The open gates routed to the admin key (approvals.RoutedGate each), soonest deadline first."""
        desk = self._admin_desk(request)
        mine = [g.to_dict() for g in await desk.pending() if _ADMIN_APPROVER in g.approvers]
        return JSONResponse({"approvals": mine})

    async def approvals_stream(self, request: Request) -> Response:
        """The approver feed (SSE `approval` / `approval_closed`) of the gates routed to the admin key."""
        desk = self._admin_desk(request)

        async def mine() -> AsyncGenerator[tuple[str, dict[str, Any]], None]:
            async for name, data in desk.wire():
                if name == approvals.CLOSED or _ADMIN_APPROVER in data.get("approvers", ()):
                    yield name, data

        return _http.feed_stream(self.ctx, mine())

    async def stop(self, request: Request) -> Response:
        """Cancel a client's running request without starting another: `{"status": "OK", "cancelled"}`."""
        body = await _http.read_json(request, _StopBody)
        client_id = api_client_id(body.client_id)
        if not self._visible(client_id, self._is_admin(request)):
            return _error(404, f"no session '{client_id}' you may stop")
        return JSONResponse({"status": "OK", "cancelled": await self.ctx.stop(client_id),
                             "client_id": client_id})

    async def sessions(self, request: Request) -> Response:
        admin = self._is_admin(request)
        await self.ctx.sessions.refresh()
        rows = [_session_row(s) for s in self.ctx.sessions.all() if self._visible(s.client_id, admin)]
        return JSONResponse({"sessions": rows})

    async def health(self, request: Request) -> Response:
        admin = self._is_admin(request)
        await self.ctx.sessions.refresh()
        count = sum(1 for s in self.ctx.sessions.all() if self._visible(s.client_id, admin))
        return JSONResponse({"status": "ok", "sessions": count, "models": list(self.ctx.config.models)})

    async def delete_session(self, request: Request) -> Response:
        sid = request.path_params["sid"]
        await self.ctx.sessions.refresh()
        client_id = self.ctx.sessions.resolve(sid)
        if client_id is None and CLIENT_ID.match(PREFIX + sid) and not sid.isdigit():
            client_id = self.ctx.sessions.resolve(PREFIX + sid)
        if client_id is None or not self._visible(client_id, self._is_admin(request)):
            return _error(404, f"Session '{sid[:140]}' not found")
        await self.ctx.delete_session(client_id)
        return JSONResponse({"status": "deleted", "client_id": client_id})

    async def not_found(self, request: Request) -> Response:
        path = request.url.path
        allowed = sorted({m for r in self._routes if r.path_regex.match(path) for m in r.methods or ()})
        if allowed:
            response = _error(405, f"{request.method} is not supported on {path}; use {' or '.join(allowed)}")
            response.headers["Allow"] = ", ".join(allowed)
            return response
        return _error(404, f"no endpoint {request.method} {path}; the API lives under /api/v1 (submit, stream, "
                           "gate, sessions, health, session)")
