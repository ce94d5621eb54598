"""agent-mcp as an MCP server (port 8768): sessions, approvals, gate policy and tools at `/mcp`.

Streamable HTTP through the official `mcp` SDK (`MCPServer`), serving both protocol eras on one
endpoint: 2025-11-25 clients (`initialize`, `resources/subscribe`, `notifications/resources/updated`)
and 2026-07-28 clients (`subscriptions/listen`). Every request needs `Authorization: Bearer <token>`
with a token from the token file (`mcp-tokens.json` in the config dir, created with one human token
on first start): role `human` reaches every session, every approval and the gate policy; role
`agent` is bound to one `mcp-` session and may call the agent's own tools, each through the same
rate limiter and gate as the model's calls. A refused call is the JSON-RPC error -32950
`policy_denied` with `data` {type, decision, reason, tool}. Gates and their decisions (who, when)
are kept in SQLite (`<data dir>/mcp-approvals.sqlite3`).

Resources (JSON): `agentmcp://sessions`, `agentmcp://sessions/{id}/state`, `.../history`,
`.../approvals/pending`, `.../approvals/history`, `agentmcp://approvals/pending`,
`agentmcp://approvals/history`, `agentmcp://policy`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mcp.server.auth.settings import AuthSettings
from mcp.server.context import ServerRequestContext
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.subscriptions import InMemorySubscriptionBus, ResourceUpdated
from mcp.server.transport_security import TransportSecuritySettings
from mcp.shared.exceptions import MCPError
from mcp_types import (
    INVALID_PARAMS,
    CallToolResult,
    EmptyResult,
    ListResourcesResult,
    ListToolsResult,
    SubscribeRequestParams,
    TextContent,
    Tool,
    UnsubscribeRequestParams,
)
from pydantic import Field
from starlette.routing import Mount

import gate_policy
import guard
import plugin_api
from plugin_api import BasePlugin, PluginConfigError, PluginSettings, parse_settings
from plugins import _http
from plugins._mcp_approvals import HISTORY_LIMIT, KEPT_APPROVALS, ApprovalStore, SharedApprovals
from plugins._mcp_auth import (
    AGENT,
    HUMAN,
    PREFIX,
    Principal,
    TokenTable,
    create_token_file,
    forbidden,
    load_tokens,
    mcp_client_id,
    request_principal,
)
from plugins._mcp_resources import SCHEME, add_resources, check_read, resources_for, session_row
from plugins._mcp_tools import add_tools

logger = logging.getLogger("agent_mcp.mcp_server")

TOKENS_FILE = "mcp-tokens.json"
#: JSON-RPC error of a tool call the gate or the rate limiter refused (seed 002's code, kept for its clients).
POLICY_DENIED = -32950
#: Legacy (2025-11-25) subscriptions kept per MCP session and in all.
MAX_SUBSCRIPTIONS_PER_SESSION = 200
MAX_SUBSCRIPTIONS = 20_000
#: The SDK's Host/Origin checks, off: guard.Guard in front of the listener is the one place they live.
_NO_SDK_CHECKS = TransportSecuritySettings(enable_dns_rebinding_protection=False)
#: Management tools and the roles that may call them.
TOOL_ROLES: dict[str, tuple[str, ...]] = {
    "send_message": (HUMAN, AGENT),
    "list_pending_approvals": (HUMAN, AGENT),
    "create_session": (HUMAN,),
    "delete_session": (HUMAN,),
    "answer_approval": (HUMAN,),
    "get_gate_policy": (HUMAN,),
    "set_gate_default": (HUMAN,),
}
#: The signal to the other instances on one Redis (ctx.signals): notify your subscribers of these URIs.
NOTIFY_SIGNAL = "mcp-notify"


# ── The server ──────────────────────────────────────────────────────────────────────────────


class McpServerConfig(PluginSettings, guard.ListenerSettings):
    """`plugin_config.plugin_client_mcp` in plugins-enabled.json."""

    host: str = "127.0.0.1"
    port: int = Field(default=8768, ge=1, le=65535)
    #: Token file, relative to the config dir (created with one human token when missing).
    token_file: str = TOKENS_FILE
    #: The longest a `send_message` call waits for the answer, in seconds.
    max_wait_seconds: float = Field(default=600, gt=0)
    #: Decided approvals kept in mcp-approvals.sqlite3 (the newest); older ones are deleted.
    kept_approvals: int = Field(default=KEPT_APPROVALS, ge=HISTORY_LIMIT)


class McpServerPlugin(BasePlugin):
    """Serves agent-mcp to MCP clients: people approving gates and agents calling tools."""

    PLUGIN_NAME = "plugin_client_mcp"
    PLUGIN_VERSION = "1.0.0"
    PLUGIN_TYPE = "client_interface"
    CLIENT_NAMESPACES = {PREFIX: plugin_api.MCP}
    DESCRIPTION = "MCP server: sessions, approvals and the agent's tools over Streamable HTTP at /mcp"
    DEPENDENCIES = ["mcp", "aiosqlite"]

    def __init__(self) -> None:
        super().__init__()
        self._unobserve: Callable[[], None] = lambda: None
        self._unobserve_grants: Callable[[], None] = lambda: None
        self._unsignal: list[Callable[[], None]] = []
        self.cfg = McpServerConfig()
        self.store: ApprovalStore | None = None
        self.bus = InMemorySubscriptionBus()
        self.mcp: MCPServer | None = None
        self.app: Any = None
        self.token_path: Path | None = None
        #: (MCP session id, uri) → the ServerSession of a 2025-era subscriber and its principal.
        self._legacy: dict[tuple[str, str], tuple[Any, Principal]] = {}
        #: gate id → who answered it through this server (set just before resolving).
        self._deciders: dict[str, str] = {}
        self._known_sessions: set[str] = set()
        #: Turns of agent tool calls that opened a gate (a cancelled call's gates are closed after it).
        self._gated_turns: set[str] = set()
        #: Approval writes in order, each with the URIs to notify once it is stored (history).
        self._queue: asyncio.Queue[tuple[Any, tuple[str, ...]]] = asyncio.Queue()
        #: URIs to notify at once: what they show is in memory already (pending approvals).
        self._notes: asyncio.Queue[tuple[str, ...] | None] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._stop = asyncio.Event()

    # ── lifecycle ──

    async def init(self, config: dict[str, Any]) -> bool:
        self.cfg = parse_settings(self.PLUGIN_NAME, McpServerConfig, config)
        rt = self.ctx
        self.token_path = Path(rt.config.config_dir) / self.cfg.token_file
        if not self.token_path.exists():
            create_token_file(self.token_path)
            logger.warning("created %s with one human token ('owner'); read the token from that file "
                           "(it is never logged) and add agent tokens there", self.token_path)
        table = load_tokens(self.token_path)
        resource = f"http://{self._url_host()}:{self.cfg.port}/mcp"
        self.store = (SharedApprovals(rt.link, self.cfg.kept_approvals) if rt.link is not None  # several instances
                      else ApprovalStore(rt.config.data_dir() / "mcp-approvals.sqlite3", self.cfg.kept_approvals))
        await self.store.open()
        self.mcp = self._build_server(TokenTable(table, resource), resource)
        # Host and Origin are checked by the server's guard in front of every listener (guard.py), from
        # this plugin's allowed_hosts / allowed_origins: the SDK's own copy of those checks stays off.
        self.app = self.mcp.streamable_http_app(transport_security=_NO_SDK_CHECKS, host=self.cfg.host)
        self._known_sessions = {s.client_id for s in rt.sessions.all()}
        self._unobserve = rt.hub.observe(self._observe)
        if rt.signals is not None:  # several instances: their subscribers hear of changes made here, and ours of theirs
            self._unsignal = [rt.signals.on(NOTIFY_SIGNAL, self._notified)]
        if rt.gate.grants is not None:
            self._unobserve_grants = rt.gate.grants.observe(
                lambda client_id: self._notes.put_nowait(tuple(self._session_uris(client_id, "grants"))))
        # The SDK's session manager runs for as long as the plugin does (uvicorn runs our app without lifespan).
        ready = asyncio.Event()
        self._tasks = [asyncio.create_task(self._run_manager(ready), name="mcp-session-manager"),
                       asyncio.create_task(self._writer(), name="mcp-approval-writer"),
                       asyncio.create_task(self._notifier(), name="mcp-notifier")]
        waiting = asyncio.ensure_future(ready.wait())
        await asyncio.wait({waiting, self._tasks[0]}, return_when=asyncio.FIRST_COMPLETED)
        if not ready.is_set():
            waiting.cancel()
            await self.shutdown()
            raise PluginConfigError("the MCP session manager did not start (see the log above)")
        logger.info("MCP server: %d token(s) from %s", len(table), self.token_path)
        return True

    async def shutdown(self) -> None:
        self._unobserve()
        self._unobserve_grants()
        for stop in self._unsignal:
            stop()
        self._stop.set()
        self._queue.put_nowait((None, ()))  # the writer and the notifier finish what is queued, then stop
        self._notes.put_nowait(None)
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        self._legacy.clear()
        if self.store is not None:
            await self.store.close()

    async def _run_manager(self, ready: asyncio.Event) -> None:
        assert self.mcp is not None
        async with self.mcp.session_manager.run():
            ready.set()
            await self._stop.wait()

    def _url_host(self) -> str:
        return "127.0.0.1" if self.cfg.host in ("0.0.0.0", "::") else self.cfg.host

    def get_config(self) -> dict[str, Any]:
        return {"host": self.cfg.host, "port": self.cfg.port, "name": "MCP server", "token": None,
                "authenticates_requests": True, "allowed_hosts": self.cfg.allowed_hosts,
                "allowed_origins": self.cfg.allowed_origins}

    def get_routes(self) -> list[Any]:
        return [Mount("/", app=_http.WholeBody(self.app))]  # a body cut short: a 400, not the SDK's 500

    def get_help(self) -> str:
        return (f"MCP server on http://{self._url_host()}:{self.cfg.port}/mcp (bearer tokens from {self.token_path}; "
                "resources agentmcp://…, tools send_message, answer_approval, …)")

    # ── notifications ──

    async def notify(self, *uris: str) -> None:
        """Tell subscribers of each URI that it changed: 2026-07-28 listeners and 2025-11-25 subscribers,
        of this instance and (on one Redis) of the others."""
        unique = list(dict.fromkeys(uris))
        await self._notify_here(unique)
        if self.ctx.signals is not None and unique:
            try:
                await self.ctx.signals.send(NOTIFY_SIGNAL, json.dumps(unique))
            except plugin_api.SessionError:  # the store is unreachable (logged there): subscribers elsewhere miss it
                pass

    async def _notified(self, subject: str) -> None:
        await self._notify_here(json.loads(subject))

    async def _notify_here(self, uris: list[str]) -> None:
        for uri in uris:
            await self.bus.publish(ResourceUpdated(uri=uri))
            for key, (session, _) in [(k, v) for k, v in self._legacy.items() if k[1] == uri]:
                try:
                    await session.send_resource_updated(uri)
                except Exception:  # the connection is gone: forget it
                    self._legacy.pop(key, None)

    def _session_uris(self, client_id: str, *parts: str) -> list[str]:
        return [f"{SCHEME}sessions/{client_id}/{p}" for p in parts]

    def _observe(self, client_id: str, event: plugin_api.Event | None) -> None:
        """Event hub observer: gates opening and closing, turns ending, sessions appearing and going."""
        if event is None:  # session deleted
            self._known_sessions.discard(client_id)
            self._queue.put_nowait((self._close_stale(client_id, "session deleted"),
                                    (f"{SCHEME}sessions", *self._session_uris(client_id, "state", "history"))))
            return
        if event.name == "gate" and "gate_id" in event.data:
            row = {"gate_id": event.data["gate_id"], "session": client_id,
                   "tool_name": str(event.data.get("tool_name", "")), "opened_at": time.time(),
                   "request": {k: v for k, v in event.data.items() if k != "gate_id"}}
            assert self.store is not None
            self.store.pending[row["gate_id"]] = row
            if event.turn is not None:
                self._gated_turns.add(event.turn)
            self._queue.put_nowait((self.store.record_open(row), self._at_once(self._pending_uris(client_id))))
        elif event.name == "status" and "gate_id" in event.data and "decision" in event.data:
            self._close(client_id, str(event.data["gate_id"]), str(event.data["decision"]))
        elif plugin_api.ends_turn(event):
            uris = self._session_uris(client_id, "state", "history")
            if client_id not in self._known_sessions and self.ctx.sessions.get(client_id) is not None:
                self._known_sessions.add(client_id)
                uris.append(f"{SCHEME}sessions")
            self._queue.put_nowait((self._close_stale(client_id, "turn ended"), tuple(uris)))

    async def _notifier(self) -> None:
        while (uris := await self._notes.get()) is not None:
            try:
                await self.notify(*uris)
            except Exception:
                logger.exception("MCP server: notifying subscribers failed")

    def _pending_uris(self, client_id: str) -> tuple[str, ...]:
        return (f"{SCHEME}approvals/pending", *self._session_uris(client_id, "approvals/pending", "state"))

    def _close(self, client_id: str, gate_id: str, decision: str) -> None:
        assert self.store is not None
        row = self.store.pending.pop(gate_id, None)
        if row is None:
            return
        by = self._deciders.pop(gate_id, None)
        if by is None:
            kind = self.ctx.client_class(client_id)
            by = "timeout" if decision == "timeout" else (
                "gate closed" if decision == "cancelled" else f"{kind} client ({client_id})")
        self._queue.put_nowait((self.store.record_decision(gate_id, decision, by, time.time()),
                                (*self._at_once(self._pending_uris(client_id)), f"{SCHEME}approvals/history",
                                 *self._session_uris(client_id, "approvals/history"))))

    def _at_once(self, uris: tuple[str, ...]) -> tuple[str, ...]:
        """Pending approvals are read from memory on one instance: their subscribers are told at once (and
        nothing is left to tell after the write); on one Redis, readers anywhere read the store, so they are
        told after the write (the URIs are returned to go with it)."""
        if isinstance(self.store, SharedApprovals):
            return uris
        self._notes.put_nowait(uris)
        return ()

    async def _close_stale(self, client_id: str, why: str) -> None:
        """Record gates of a session that closed without a decision (turn cancelled, session deleted)."""
        assert self.store is not None
        for gate_id, row in list(self.store.pending.items()):
            if row["session"] == client_id and await self.ctx.gate.owner(gate_id) is None:
                self._deciders[gate_id] = why
                self._close(client_id, gate_id, "cancelled")

    async def _writer(self) -> None:
        """Apply approval writes in order, then tell subscribers (so a reader after a notice sees the row)."""
        while True:
            work, uris = await self._queue.get()
            if work is None:
                return
            try:
                await work
                await self.notify(*uris)
            except Exception:
                logger.exception("MCP server: recording an approval or notifying failed")

    # ── the MCP server ──

    def _build_server(self, verifier: TokenTable, resource: str) -> MCPServer:
        mcp = MCPServer(
            "agent-mcp",
            instructions=("agent-mcp sessions, pending approvals and gate policy as resources (agentmcp://…); "
                          "tools to talk to sessions and to answer gates."),
            token_verifier=verifier,
            auth=AuthSettings(issuer_url=resource, resource_server_url=resource, validate_token_resource=True),
            subscriptions=self.bus,
            middleware=[self._middleware],
        )
        add_resources(self, mcp)
        add_tools(self, mcp)
        low = mcp._lowlevel_server  # the SDK's documented way to serve resources/subscribe (no public API yet)
        low.add_request_handler("resources/subscribe", SubscribeRequestParams, self._subscribe)
        low.add_request_handler("resources/unsubscribe", UnsubscribeRequestParams, self._unsubscribe)
        return mcp

    async def _middleware(self, ctx: ServerRequestContext[Any, Any], call_next: Any) -> Any:
        """Per-token views and checks on top of MCPServer's handlers."""
        method = ctx.method
        if method in ("initialize", "notifications/initialized", "server/discover", "ping") or ctx.request_id is None:
            return await call_next(ctx)
        who = request_principal(ctx)
        params = dict(ctx.params or {})
        if method == "tools/list":
            return self._list_tools(who, await call_next(ctx))
        if method == "tools/call":
            name = str(params.get("name", ""))
            if name in TOOL_ROLES:
                if who.role not in TOOL_ROLES[name]:
                    raise forbidden(f"{name} needs a {' or '.join(TOOL_ROLES[name])} token; this one is {who.role}")
                return await call_next(ctx)
            if who.role == AGENT and self.ctx.tools.get(name) is not None:
                return await self._call_agent_tool(who, name, params.get("arguments") or {})
            raise MCPError(INVALID_PARAMS, f"unknown tool '{name[:80]}'; tools/list shows the tools of this token")
        if method == "resources/list":
            return ListResourcesResult(resources=resources_for(self, who))
        if method == "resources/read":
            check_read(who, str(params.get("uri", "")))
        if method == "subscriptions/listen":
            wanted = ((params.get("notifications") or {}).get("resourceSubscriptions")) or []
            for uri in wanted:
                check_read(who, str(uri))
        return await call_next(ctx)

    def _list_tools(self, who: Principal, result: Any) -> ListToolsResult:
        tools = result.tools if isinstance(result, ListToolsResult) else ListToolsResult.model_validate(result).tools
        mine = [t for t in tools if who.role in TOOL_ROLES.get(t.name, ())]
        if who.role == AGENT:
            for schema in self.ctx.tools.openai_schemas():
                fn = schema["function"]
                if fn["name"] not in TOOL_ROLES:
                    mine.append(Tool(name=fn["name"], description=fn.get("description") or "",
                                     input_schema=fn.get("parameters") or {"type": "object", "properties": {}}))
        return ListToolsResult(tools=mine)

    # ── 2025-11-25 subscriptions ──

    async def _subscribe(self, ctx: ServerRequestContext[Any, Any], params: SubscribeRequestParams) -> EmptyResult:
        who = request_principal(ctx)
        uri = str(params.uri)
        check_read(who, uri)
        session_id = self._mcp_session_id(ctx)
        mine = sum(1 for k in self._legacy if k[0] == session_id)
        if mine >= MAX_SUBSCRIPTIONS_PER_SESSION and (session_id, uri) not in self._legacy:
            raise MCPError(INVALID_PARAMS, f"this session has {mine} subscriptions: unsubscribe from some first")
        # A connection that closed is not reported to us; beyond the cap the oldest subscriptions go.
        while len(self._legacy) >= MAX_SUBSCRIPTIONS:
            self._legacy.pop(next(iter(self._legacy)))
        self._legacy[(session_id, uri)] = (ctx.session, who)
        return EmptyResult()

    async def _unsubscribe(self, ctx: ServerRequestContext[Any, Any], params: UnsubscribeRequestParams) -> EmptyResult:
        self._legacy.pop((self._mcp_session_id(ctx), str(params.uri)), None)
        return EmptyResult()

    @staticmethod
    def _mcp_session_id(ctx: ServerRequestContext[Any, Any]) -> str:
        headers = getattr(ctx.request, "headers", None)
        session_id = headers.get("mcp-session-id") if headers is not None else None
        if not session_id:
            raise MCPError(INVALID_PARAMS, "resources/subscribe needs a 2025-11-25 session (Mcp-Session-Id); "
                                           "2026-07-28 clients use subscriptions/listen")
        return str(session_id)

    async def _send(
        self, who: Principal, text: str, session: str, model: str, timeout_seconds: float,
        on_event: Callable[[plugin_api.Event], None] | None = None,
    ) -> dict[str, Any]:
        if who.role == AGENT:
            if session and mcp_client_id(session) != who.session:
                raise forbidden(f"token '{who.name}' may talk only to its own session {who.session}")
            assert who.session is not None
            client_id = who.session
        else:
            try:
                client_id = mcp_client_id(session or uuid.uuid4().hex[:8])
            except ValueError as exc:
                raise ToolError(str(exc)) from None
        if not text.strip():
            raise ToolError("text is empty: send a question or a !command")
        if len(text) > _http.MAX_TEXT:
            raise ToolError(f"text is {len(text)} characters; the limit is {_http.MAX_TEXT}")
        if model and model not in self.ctx.config.models:
            raise ToolError(f"unknown model '{model[:60]}'; available: {', '.join(self.ctx.config.models)}")
        request = self.ctx.request(client_id, text, admin=who.role == HUMAN, model=model or None,
                                   identity=f"mcp:{who.name}")
        seconds = min(max(timeout_seconds, 1.0), self.cfg.max_wait_seconds)
        return {"session": client_id, **await self.ctx.wait_turn(request, seconds, on_event=on_event)}

    def _create(self, name: str, model: str) -> dict[str, Any]:
        try:
            client_id = mcp_client_id(name or uuid.uuid4().hex[:8])
        except ValueError as exc:
            raise ToolError(str(exc)) from None
        if self.ctx.sessions.get(client_id) is not None:
            raise ToolError(f"session {client_id} already exists")
        if model and model not in self.ctx.config.models:
            raise ToolError(f"unknown model '{model[:60]}'; available: {', '.join(self.ctx.config.models)}")
        session, _ = self.ctx.sessions.get_or_add(client_id, model or self.ctx.config.default_model)
        self._known_sessions.add(client_id)
        self._queue.put_nowait((self.ctx.sessions.save(session), (f"{SCHEME}sessions",)))
        return session_row(self, session)

    async def _set_default(
        self, who: Principal, section: str, key: str, operation: str, allowed: bool
    ) -> dict[str, Any]:
        try:  # the keeper checks, applies, saves, audits and tells the other instances
            change = gate_policy.PolicyChange.parse(section, key, operation, allowed, f"mcp token '{who.name}'")
        except gate_policy.PolicyError as exc:
            raise ToolError(str(exc)) from None
        entry, note = await self.ctx.gate.set_policy(change)
        await self.notify(f"{SCHEME}policy")
        return {"section": section, "key": change.key, **entry.model_dump(), "note": note}

    async def _call_agent_tool(self, who: Principal, name: str, arguments: Any) -> Any:
        """An agent token calls one of the agent's tools: the model's pipeline (validation, rate limit,
        gate, executor); its outcome maps to the tool result, INVALID_PARAMS or -32950."""
        rt = self.ctx
        assert who.session is not None
        client_id = who.session
        session = await rt.sessions.get_or_create(client_id, rt.config.default_model)
        if client_id not in self._known_sessions:
            self._known_sessions.add(client_id)
            await self.notify(f"{SCHEME}sessions")
        turn = self.ctx.request(client_id).turn()
        turn.session = session
        try:
            outcome = await rt.execute_tool(turn, name, arguments if isinstance(arguments, dict) else {})
        finally:
            if turn.id in self._gated_turns:
                self._gated_turns.discard(turn.id)
                await self._close_stale(client_id, "call cancelled")
        if outcome.status == "invalid":
            raise MCPError(INVALID_PARAMS, outcome.problem)
        if outcome.refusal is not None:
            refused = outcome.refusal
            raise MCPError(POLICY_DENIED, "policy_denied", {"type": "policy_denied", "decision": refused.kind,
                                                            "reason": refused.text, "tool": name})
        await rt.sessions.save(session)
        return CallToolResult(content=[TextContent(type="text", text=outcome.text)], is_error=outcome.status == "error")
