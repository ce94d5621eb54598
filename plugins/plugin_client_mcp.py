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
import contextvars
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field
from starlette.responses import JSONResponse
from starlette.routing import Mount, Route
from starlette.types import Receive, Scope, Send

import guard
import plugin_api
from plugin_api import BasePlugin, PluginSettings, parse_settings
from plugins import _http
from plugins._mcp_approvals import HISTORY_LIMIT, KEPT_APPROVALS, ApprovalStore, SharedApprovals
from plugins._mcp_tokens import PREFIX, SCHEME, Principal, create_token_file, load_tokens

if TYPE_CHECKING:
    from plugins._mcp_app import McpApp

logger = logging.getLogger("agent_mcp.mcp_server")

TOKENS_FILE = "mcp-tokens.json"
#: The signal to the other instances on one Redis (ctx.signals): notify your subscribers of these URIs.
NOTIFY_SIGNAL = "mcp-notify"
#: What the SDK's app serves (`_mcp_app.McpApp.app`): path → methods (None: any). Listed before it is built.
SDK_ROUTES: dict[str, list[str] | None] = {"/mcp": None,
                                           "/.well-known/oauth-protected-resource/mcp": ["GET", "OPTIONS"]}


class _SdkEntry:
    """The MCP port's ASGI app, before and after the SDK's is built (`serve`); `routes` lists what the
    SDK's app serves (SDK_ROUTES) for whatever reads a plugin's routes before the first request."""

    def __init__(self, serve: Callable[[Scope, Receive, Send], Any]):
        self.serve = serve
        self.routes = [Route(path, self, methods=methods) for path, methods in SDK_ROUTES.items()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.serve(scope, receive, send)


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
        self.token_path: Path | None = None
        self._tokens: list[tuple[bytes, Principal]] = []
        #: The SDK's side (`_mcp_app.McpApp`), built at the first request to the port (`_sdk_app`).
        self.server: McpApp | None = None
        self._building = asyncio.Lock()
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
        #: send_message calls whose client went away while a gate of their turn waits: they run to its end.
        self._left: set[asyncio.Task[Any]] = set()
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
        self._tokens = load_tokens(self.token_path)
        self.store = (SharedApprovals(rt.link, self.cfg.kept_approvals) if rt.link is not None  # several instances
                      else ApprovalStore(rt.config.data_dir() / "mcp-approvals.sqlite3", self.cfg.kept_approvals))
        await self.store.open()
        self._known_sessions = {s.client_id for s in rt.sessions.all()}
        self._unobserve = rt.hub.observe(self._observe)
        if rt.signals is not None:  # several instances: their subscribers hear of changes made here, and ours of theirs
            self._unsignal = [rt.signals.on(NOTIFY_SIGNAL, self._notified)]
        if rt.gate.grants is not None:
            self._unobserve_grants = rt.gate.grants.observe(
                lambda client_id: self._notes.put_nowait(tuple(self._session_uris(client_id, "grants"))))
        self._tasks = [asyncio.create_task(self._writer(), name="mcp-approval-writer"),
                       asyncio.create_task(self._notifier(), name="mcp-notifier")]
        logger.info("MCP server: %d token(s) from %s", len(self._tokens), self.token_path)
        return True

    async def shutdown(self) -> None:
        for call in list(self._left):
            call.cancel()
        await asyncio.gather(*self._left, return_exceptions=True)
        self._unobserve()
        self._unobserve_grants()
        for stop in self._unsignal:
            stop()
        self._stop.set()
        self._queue.put_nowait((None, ()))  # the writer and the notifier finish what is queued, then stop
        self._notes.put_nowait(None)
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self.server is not None:
            self.server.legacy.clear()
        if self.store is not None:
            await self.store.close()

    async def _sdk_app(self) -> Any:
        """The SDK's app, built once, at the first request: the SDK imported in a worker thread (about
        0.3 s of imports the event loop does not wait for), then its session manager started, which
        runs for as long as the plugin does (uvicorn runs the app without lifespan)."""
        async with self._building:
            if self.server is None:
                server = await asyncio.to_thread(self._build_sdk_app)
                ready = asyncio.Event()
                # A task of the plugin's, not of the request that happened to be first (its context stays out).
                manager = asyncio.get_running_loop().create_task(
                    server.run(ready, self._stop), name="mcp-session-manager", context=contextvars.Context())
                waiting = asyncio.ensure_future(ready.wait())
                await asyncio.wait({waiting, manager}, return_when=asyncio.FIRST_COMPLETED)
                if not ready.is_set():
                    waiting.cancel()
                    manager.result()  # its exception
                self._tasks.append(manager)
                self.server = server
        return self.server.app

    def _build_sdk_app(self) -> McpApp:
        from plugins._mcp_app import McpApp

        return McpApp(self, self._tokens, f"http://{self._url_host()}:{self.cfg.port}/mcp")

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            app = await self._sdk_app()
        except Exception:
            logger.exception("MCP server: the MCP SDK's app could not be built")
            await JSONResponse({"error": "the MCP server could not start (see the agent-mcp log); the next "
                                         "request tries again"}, status_code=503)(scope, receive, send)
            return
        await app(scope, receive, send)

    def _url_host(self) -> str:
        return "127.0.0.1" if self.cfg.host in ("0.0.0.0", "::") else self.cfg.host

    def get_config(self) -> dict[str, Any]:
        return {"host": self.cfg.host, "port": self.cfg.port, "name": "MCP server", "token": None,
                "authenticates_requests": True, "allowed_hosts": self.cfg.allowed_hosts,
                "allowed_origins": self.cfg.allowed_origins}

    def get_routes(self) -> list[Any]:
        return [Mount("/", app=_http.WholeBody(_SdkEntry(self._serve)))]  # a body cut short: a 400, not the SDK's 500

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
        if self.server is None:  # no MCP request yet: nobody has subscribed
            return
        for uri in uris:
            await self.server.publish(uri)

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

