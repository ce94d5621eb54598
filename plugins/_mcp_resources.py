"""The MCP server's resources (agentmcp://…): who may read which, and what each one says.

`_mcp_app.py` builds the server and calls `add_resources`; the notifications that tell subscribers
a resource changed stay with the plugin (plugin_client_mcp.py).
"""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any

from mcp.server.mcpserver import MCPServer
from mcp.shared.exceptions import MCPError
from mcp_types import INVALID_PARAMS, Resource

import plugin_api
from plugins._mcp_auth import forbidden, request_principal
from plugins._mcp_tokens import HUMAN, SCHEME, Principal

if TYPE_CHECKING:
    from plugins.plugin_client_mcp import McpServerPlugin


def json_text(data: Any) -> str:
    return json.dumps(data, ensure_ascii=False, indent=1, default=str)



def check_read(who: Principal, uri: str) -> str | None:
    """The session a URI belongs to (None for server-wide ones); MCPError when `who` may not read it."""
    rest = uri.removeprefix(SCHEME) if uri.startswith(SCHEME) else None
    if rest is None:
        raise MCPError(INVALID_PARAMS, f"unknown resource {uri[:120]}: agent-mcp resources start with {SCHEME}")
    if rest == "sessions":
        return None
    if rest.startswith("sessions/"):
        client_id = rest.removeprefix("sessions/").split("/", 1)[0]
        if not who.may_read(client_id):
            raise forbidden(f"token '{who.name}' ({who.role}) may read only its own session {who.session}")
        return client_id
    if who.role != HUMAN:
        raise forbidden(f"{uri[:120]} needs a human token; token '{who.name}' has role {who.role}")
    return None

def resources_for(plugin: McpServerPlugin, who: Principal) -> list[Resource]:
    def res(uri: str, name: str, description: str) -> Resource:
        return Resource(uri=uri, name=name, description=description, mime_type="application/json")

    out = [res(f"{SCHEME}sessions", "sessions", "The sessions this token may see")]
    if who.role == HUMAN:
        out += [
            res(f"{SCHEME}approvals/pending", "pending approvals", "Gates waiting for a decision, all sessions"),
            res(f"{SCHEME}approvals/history", "approval history", "Decided gates: decision, who, when"),
            res(f"{SCHEME}policy", "gate policy", "gate-defaults.json as in force"),
        ]
    for s in plugin.ctx.sessions.all():
        if who.may_read(s.client_id):
            for part, label in (
                ("state", "state"),
                ("history", "history"),
                ("approvals/pending", "pending approvals"),
                ("approvals/history", "approval history"),
                ("grants", "grants"),
            ):
                out.append(res(f"{SCHEME}sessions/{s.client_id}/{part}", f"{s.client_id} {label}",
                               f"Session {s.client_id} (#{s.shorthand}): {label}"))
    return out



async def read_session(plugin: McpServerPlugin, who: Principal, ident: str) -> plugin_api.Session:
    await plugin.ctx.sessions.refresh()  # with several instances: as it is now
    client_id = plugin.ctx.sessions.resolve(ident)
    session = plugin.ctx.sessions.get(client_id) if client_id else None
    if session is None or not who.may_read(session.client_id):
        # Another session's existence is not confirmed to an agent token.
        raise MCPError(INVALID_PARAMS, f"no session '{ident[:140]}' readable with token '{who.name}'")
    return session

async def pending(plugin: McpServerPlugin, client_id: str | None = None) -> list[dict[str, Any]]:
    assert plugin.store is not None
    rows = [r for r in await plugin.store.open_rows() if client_id is None or r["session"] == client_id]
    return sorted(rows, key=lambda r: r["opened_at"])

def session_row(plugin: McpServerPlugin, s: plugin_api.Session) -> dict[str, Any]:
    return {"session": s.client_id, "shorthand_id": s.shorthand, "model": s.model, "created": s.created,
            "client": plugin.ctx.client_class(s.client_id)}

def policy_of(plugin: McpServerPlugin) -> dict[str, Any]:
    return plugin.ctx.gate.defaults.model_dump(mode="json")

def add_resources(plugin: McpServerPlugin, mcp: MCPServer) -> None:
    """Serve the agentmcp:// resources on `mcp`."""
    @mcp.resource(f"{SCHEME}sessions", name="sessions", mime_type="application/json")
    async def sessions() -> str:
        who = request_principal()
        await plugin.ctx.sessions.refresh()
        return json_text([session_row(plugin, s) for s in plugin.ctx.sessions.all() if who.may_read(s.client_id)])

    @mcp.resource(f"{SCHEME}approvals/pending", name="pending approvals", mime_type="application/json")
    async def pending_all() -> str:
        check_read(request_principal(), f"{SCHEME}approvals/pending")
        return json_text(await pending(plugin))

    @mcp.resource(f"{SCHEME}approvals/history", name="approval history", mime_type="application/json")
    async def history_all() -> str:
        check_read(request_principal(), f"{SCHEME}approvals/history")
        assert plugin.store is not None
        return json_text(await plugin.store.history())

    @mcp.resource(f"{SCHEME}policy", name="gate policy", mime_type="application/json")
    async def policy() -> str:
        check_read(request_principal(), f"{SCHEME}policy")
        return json_text(policy_of(plugin))

    @mcp.resource(SCHEME + "sessions/{sid}/state", name="session state", mime_type="application/json")
    async def session_state(sid: str) -> str:
        s = await read_session(plugin, request_principal(), sid)
        return json_text({**session_row(plugin, s), "history_length": len(s.history),
                      "busy": plugin.ctx.busy(s.client_id),
                      "pending_approvals": len(await pending(plugin, s.client_id)),
                      "gate_overrides": s.settings.get("gates", {})})

    @mcp.resource(SCHEME + "sessions/{sid}/history", name="session history", mime_type="application/json")
    async def session_history(sid: str) -> str:
        s = await read_session(plugin, request_principal(), sid)
        return json_text(s.history)

    @mcp.resource(SCHEME + "sessions/{sid}/approvals/pending", name="session pending approvals",
                  mime_type="application/json")
    async def session_pending(sid: str) -> str:
        s = await read_session(plugin, request_principal(), sid)
        return json_text(await pending(plugin, s.client_id))

    @mcp.resource(SCHEME + "sessions/{sid}/approvals/history", name="session approval history",
                  mime_type="application/json")
    async def session_approvals(sid: str) -> str:
        s = await read_session(plugin, request_principal(), sid)
        assert plugin.store is not None
        return json_text(await plugin.store.history(s.client_id))

    @mcp.resource(SCHEME + "sessions/{sid}/grants", name="session grants", mime_type="application/json")
    async def session_grants(sid: str) -> str:
        """The session's active grants: scope, tool, tables, permission, expiry, who granted, uses."""
        s = await read_session(plugin, request_principal(), sid)
        return json_text([dataclasses.asdict(g) for g in await plugin.ctx.gate.active_grants(s.client_id)])
