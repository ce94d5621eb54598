"""The MCP SDK's side of plugin_client_mcp: the `MCPServer` with its resources, tools and per-token
checks, the subscriptions of both protocol eras, and the SDK's session manager.

Built at the first request to the plugin's port (`McpServerPlugin`), not at start: the SDK imports its
whole client and server (about 25 MiB of RSS), which a server whose MCP port nobody has used yet does
not hold (issue 31). The guard in front of the listener (Host, Origin, body size) applies from the
first request on; the bearer token is checked here, by the SDK, with `TokenTable`.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from mcp.server.auth.settings import AuthSettings
from mcp.server.context import ServerRequestContext
from mcp.server.mcpserver import MCPServer
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
from pydantic import AnyHttpUrl

from plugins._mcp_auth import TokenTable, forbidden, request_principal
from plugins._mcp_resources import add_resources, check_read, resources_for
from plugins._mcp_tokens import AGENT, HUMAN, SCHEME, Principal
from plugins._mcp_tools import add_tools

if TYPE_CHECKING:
    from plugins.plugin_client_mcp import McpServerPlugin

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


class McpApp:
    """The plugin's MCP server as the SDK serves it at /mcp; `app` is its ASGI app."""

    def __init__(self, plugin: McpServerPlugin, tokens: list[tuple[bytes, Principal]], resource: str):
        self.plugin = plugin
        self.bus = InMemorySubscriptionBus()
        #: (MCP session id, uri) → the ServerSession of a 2025-era subscriber and its principal.
        self.legacy: dict[tuple[str, str], tuple[Any, Principal]] = {}
        self.mcp = self._build(TokenTable(tokens, resource), resource)
        # Host and Origin are checked by the server's guard in front of every listener (guard.py), from
        # the plugin's allowed_hosts / allowed_origins: the SDK's own copy of those checks stays off.
        self.app = self.mcp.streamable_http_app(transport_security=_NO_SDK_CHECKS, host=plugin.cfg.host)

    async def run(self, ready: asyncio.Event, stop: asyncio.Event) -> None:
        """The SDK's session manager, until `stop` (uvicorn runs the app without lifespan)."""
        async with self.mcp.session_manager.run():
            ready.set()
            await stop.wait()

    async def publish(self, uri: str) -> None:
        """Tell this instance's subscribers of `uri`: 2026-07-28 listeners and 2025-11-25 subscribers."""
        await self.bus.publish(ResourceUpdated(uri=uri))
        for key, (session, _) in [(k, v) for k, v in self.legacy.items() if k[1] == uri]:
            try:
                await session.send_resource_updated(uri)
            except Exception:  # the connection is gone: forget it
                self.legacy.pop(key, None)

    def _build(self, verifier: TokenTable, resource: str) -> MCPServer:
        mcp = MCPServer(
            "agent-mcp",
            instructions=("agent-mcp sessions, pending approvals and gate policy as resources (agentmcp://…); "
                          "tools to talk to sessions and to answer gates."),
            token_verifier=verifier,
            auth=AuthSettings(issuer_url=AnyHttpUrl(resource), resource_server_url=AnyHttpUrl(resource),
                              validate_token_resource=True),
            subscriptions=self.bus,
            middleware=[self._middleware],
        )
        add_resources(self.plugin, mcp)
        add_tools(self.plugin, mcp)
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
                    raise forbidden(f"{name} needs a {' or '.join(TOOL_ROLES[name])} token; token '{who.name}' "
                                    f"has role {who.role}")
                return await call_next(ctx)
            if who.role == AGENT and self.plugin.ctx.tools.get(name) is not None:
                return await self._call_agent_tool(who, name, params.get("arguments") or {})
            raise MCPError(INVALID_PARAMS, f"unknown tool '{name[:80]}'; tools/list shows the tools of token "
                                           f"'{who.name}'")
        if method == "resources/list":
            return ListResourcesResult(resources=resources_for(self.plugin, who))
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
            for schema in self.plugin.ctx.tools.openai_schemas():
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
        mine = sum(1 for k in self.legacy if k[0] == session_id)
        if mine >= MAX_SUBSCRIPTIONS_PER_SESSION and (session_id, uri) not in self.legacy:
            raise MCPError(INVALID_PARAMS, f"this session has {mine} subscriptions: unsubscribe from some first")
        # A connection that closed is not reported to us; beyond the cap the oldest subscriptions go.
        while len(self.legacy) >= MAX_SUBSCRIPTIONS:
            self.legacy.pop(next(iter(self.legacy)))
        self.legacy[(session_id, uri)] = (ctx.session, who)
        return EmptyResult()

    async def _unsubscribe(self, ctx: ServerRequestContext[Any, Any], params: UnsubscribeRequestParams) -> EmptyResult:
        self.legacy.pop((self._mcp_session_id(ctx), str(params.uri)), None)
        return EmptyResult()

    @staticmethod
    def _mcp_session_id(ctx: ServerRequestContext[Any, Any]) -> str:
        headers = getattr(ctx.request, "headers", None)
        session_id = headers.get("mcp-session-id") if headers is not None else None
        if not session_id:
            raise MCPError(INVALID_PARAMS, "resources/subscribe needs a 2025-11-25 session (Mcp-Session-Id); "
                                           "2026-07-28 clients use subscriptions/listen")
        return str(session_id)

    async def _call_agent_tool(self, who: Principal, name: str, arguments: Any) -> Any:
        """An agent token calls one of the agent's tools: the model's pipeline (validation, rate limit,
        gate, executor); its outcome maps to the tool result, INVALID_PARAMS or -32950."""
        plugin = self.plugin
        rt = plugin.ctx
        assert who.session is not None
        client_id = who.session
        session = await rt.sessions.get_or_create(client_id, rt.config.default_model)
        if client_id not in plugin._known_sessions:
            plugin._known_sessions.add(client_id)
            await plugin.notify(f"{SCHEME}sessions")
        turn = rt.request(client_id).turn().holding(session)
        try:
            outcome = await rt.execute_tool(turn, name, arguments if isinstance(arguments, dict) else {})
        finally:
            if turn.id in plugin._gated_turns:
                plugin._gated_turns.discard(turn.id)
                await plugin._close_stale(client_id, "call cancelled")
        if outcome.status == "invalid":
            raise MCPError(INVALID_PARAMS, outcome.problem)
        if outcome.refusal is not None:
            refused = outcome.refusal
            raise MCPError(POLICY_DENIED, "policy_denied", {"type": "policy_denied", "decision": refused.kind,
                                                            "reason": refused.text, "tool": name, "token": who.name,
                                                            "session": client_id})
        await rt.sessions.save(session)
        return CallToolResult(content=[TextContent(type="text", text=outcome.text)], is_error=outcome.status == "error")
