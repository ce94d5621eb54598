"""The MCP server's management tools: talk to sessions, answer gates, read and set the gate policy.

`_mcp_app.py` builds the server and calls `add_tools`; the plugin (plugin_client_mcp.py) keeps the
approval records and tells subscribers what changed.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import uuid
from typing import TYPE_CHECKING, Annotated, Any, Literal

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import Field

import approvals
import decisions
import gate_policy
import plugin_api
from audit_chain import AuditRecord
from plugins import _http
from plugins._mcp_auth import forbidden, request_principal
from plugins._mcp_elicit import GateForms
from plugins._mcp_forms import FormError, content_for
from plugins._mcp_resources import pending, policy_of, read_session, session_row
from plugins._mcp_tokens import AGENT, HUMAN, SCHEME, Principal, mcp_client_id

if TYPE_CHECKING:
    from plugins.plugin_client_mcp import McpServerPlugin

logger = logging.getLogger("agent_mcp.mcp_server")

#: The words `answer_approval` takes (decisions.MCP_WORDS), as its schema lists them: a Literal built from the one
#: vocabulary at run time, which a type checker cannot read (to it, a str).
if TYPE_CHECKING:
    McpDecision = str
else:
    McpDecision = Literal[tuple(decisions.MCP_WORDS)]
#: `answer_approval`'s minutes: a JSON integer in range ("15" and true are refused, not read as 15 or 1).
Minutes = Annotated[int, Field(strict=True, ge=1, le=decisions.MAX_MINUTES)]



def add_tools(plugin: McpServerPlugin, mcp: MCPServer) -> None:
    """Serve the management tools (TOOL_ROLES says which token may call which) on `mcp`."""
    @mcp.tool()
    async def send_message(text: str, session: str = "", model: str = "", timeout_seconds: float = 300,
                           ctx: Context | None = None) -> dict[str, Any]:
        """Send a message (or a !command) to a session and return the answer.

        Human tokens name the session (created if new, in the mcp- namespace); agent tokens always
        talk to their own session. `model` answers this turn with another registry model. A client
        that declared the elicitation capability is asked each gate of the turn as a form.
        """
        who = request_principal()
        forms = GateForms.for_request(plugin.ctx, ctx, who, plugin._deciders)
        try:
            return await _send(plugin, who, text, session, model, timeout_seconds, _Follow(forms))
        finally:
            if forms is not None:
                await forms.close()

    @mcp.tool()
    async def create_session(name: str = "", model: str = "") -> dict[str, Any]:
        """Create an MCP session (id mcp-<name>, a random name when empty) on `model` (default model if empty)."""
        return _create(plugin, name, model)

    @mcp.tool()
    async def delete_session(session: str) -> dict[str, Any]:
        """Delete a session (full id or shorthand id): its history, running turns and event stream."""
        await plugin.ctx.sessions.refresh()
        client_id = plugin.ctx.sessions.resolve(session)
        if client_id is None:
            raise ToolError(f"no session '{session[:140]}'; read agentmcp://sessions for the list")
        await plugin.ctx.delete_session(client_id)
        return {"status": "deleted", "session": client_id}

    @mcp.tool()
    async def list_pending_approvals(session: str = "") -> list[dict[str, Any]]:
        """Gates waiting for a decision (all the token may see, or one session's)."""
        who = request_principal()
        if session:
            return await pending(plugin, (await read_session(plugin, who, session)).client_id)
        return [r for r in await pending(plugin) if who.may_read(r["session"])]

    @mcp.tool()
    async def answer_approval(
        gate_id: str,
        decision: McpDecision,
        minutes: Minutes = decisions.DEFAULT_MINUTES,
        content: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Answer a pending gate: allow_once; allow_for (this tool, or these tables with this permission,
        for `minutes`); allow_session (the same for the rest of the session); allow_pattern (calls of
        the same shape: the request's `shape`); or reject. The gate's `grants` lists what it offers.
        A question of an MCP server agent-mcp uses (the request has `elicitation`): allow_once with
        `content`, the values its `fields` ask for (without: the form's defaults); reject declines."""
        who = request_principal()
        owner = await plugin.ctx.gate.owner(gate_id)
        if owner is None:
            raise ToolError(f"no pending gate '{gate_id[:64]}': it was answered, timed out or never existed; "
                            "read agentmcp://approvals/pending")
        if content is not None:
            await _check_content(plugin, gate_id, content)
        plugin._deciders[gate_id] = who.label
        try:  # a gate routed to approvers (approvals.py) takes the answer only of a token it names
            result = await plugin.ctx.gate.answer(gate_id, decisions.MCP_WORDS[decision], by=f"mcp token '{who.name}'",
                                                 answerer=approvals.Approver(approvals.MCP, who.name),
                                                 channel="mcp", minutes=minutes, content=content)
        except ValueError as exc:
            plugin._deciders.pop(gate_id, None)
            raise ToolError(str(exc)) from None
        if not result.answered:
            plugin._deciders.pop(gate_id, None)
            if result.outcome == approvals.NOT_APPROVER:
                raise ToolError(f"gate '{gate_id[:64]}' is answered by its approvers "
                                f"({', '.join(result.approvers)}), and token '{who.name}' is not one of them; "
                                "nothing was changed")
            first = f" ({result.first.describe()})" if result.first else ""
            raise ToolError(f"gate '{gate_id[:64]}' was answered meanwhile{first}")
        return {"status": "answered", "gate_id": gate_id, "session": owner, "decision": decision,
                "decided_by": who.label}

    @mcp.tool()
    async def get_gate_policy(session: str = "") -> dict[str, Any]:
        """The gate defaults (gate-defaults.json) and, with `session`, that session's own overrides."""
        out: dict[str, Any] = {"defaults": policy_of(plugin)}
        if session:
            s = await read_session(plugin, request_principal(), session)
            out["session"] = {"session": s.client_id, "overrides": s.settings.get("gates", {})}
        return out

    @mcp.tool()
    async def set_gate_default(section: Literal["tools", "db"], key: str,
                               operation: Literal["read", "write", "ddl", "both"],
                               allowed: bool) -> dict[str, Any]:
        """Change a gate default for every session (saved in gate-defaults.json): `key` is a tool name
        (section tools) or a table (section db), `*` for everything without its own entry; allowed=true
        means the call runs without asking. `both` is read and write; `ddl` (CREATE, DROP, ALTER,
        RENAME, TRUNCATE; section db only) is never covered by write and must be named."""
        return await _set_default(plugin, request_principal(), section, key, operation, allowed)


class _Follow:
    """The events of one `send_message` call's turn: the gates it has open (what a client that goes away
    leaves waiting), passed on to the call's forms while its client is there."""

    def __init__(self, forms: GateForms | None = None):
        self.forms = forms
        #: gate id → its gate event's data, while the gate waits.
        self.open: dict[str, dict[str, Any]] = {}
        self.gone = False

    def __call__(self, ev: plugin_api.Event) -> None:
        gate_id = str(ev.data.get("gate_id", ""))
        if gate_id and ev.name == "gate":
            self.open[gate_id] = ev.data
        elif gate_id and ev.name == "status" and "decision" in ev.data:
            self.open.pop(gate_id, None)
        if self.forms is not None and not self.gone:
            self.forms.on_event(ev)


async def _check_content(plugin: McpServerPlugin, gate_id: str, content: dict[str, Any]) -> None:
    """ToolError (nothing changed) unless `content` fits the form of the MCP server whose question the gate is."""
    row = next((r for r in await pending(plugin) if r["gate_id"] == gate_id), None)
    asked = (row or {}).get("request", {}).get("elicitation")
    if row is not None and not isinstance(asked, dict):
        raise ToolError(f"gate '{gate_id[:64]}' is not a question of an MCP server: it takes no content; "
                        "answer without it")
    if asked is None:  # not listed here yet: checked where the question waits
        return
    try:
        content_for(asked.get("fields") or [], content)
    except FormError as exc:
        raise ToolError(f"the answer does not fit the form of MCP server '{asked.get('server')}': {exc}; nothing "
                        "was changed, the gate still waits") from None


def _left(plugin: McpServerPlugin, who: Principal, client_id: str, follow: _Follow,
          call: asyncio.Task[dict[str, Any]]) -> None:
    """The client of a call went away while a gate of its turn waits: the turn goes on without it (its
    message and what it does are kept), the gate stays open for its approvers or until its timeout, and
    each open gate's record says the client left."""
    follow.gone = True
    plugin._left.add(call)
    call.add_done_callback(functools.partial(_ended, plugin, who, client_id))
    for gate_id, data in follow.open.items():
        args = given if isinstance(given := data.get("tool_args"), dict) else {}
        asked = follow.forms is not None and follow.forms.asked(gate_id)
        detail = {"gate_id": gate_id, "token": who.name, "form_shown": asked,
                  "waiting_for": data.get("waiting_for") or "the session's approvers",
                  "timeout_s": data.get("timeout_seconds")}
        plugin.ctx.gate.audit(
            AuditRecord.call(client_id, str(data.get("tool_name", "")), str(args.get("operation_type", "")),
                             [str(t) for t in data.get("tables") or ()]).with_detail(json.dumps(detail)).client_gone(
                str(approvals.Approver(approvals.MCP, who.name)),
                "the MCP client went away " + ("mid-form" if asked else "while the gate waited")
                + "; the gate stays open for its approvers or until its timeout"))
        logger.info("MCP client of token '%s' went away while gate %s of %s waits%s: the turn goes on until the "
                    "gate is answered or expires", who.name, gate_id[:8], client_id, " (form shown)" if asked else "")


def _ended(plugin: McpServerPlugin, who: Principal, client_id: str, call: asyncio.Task[dict[str, Any]]) -> None:
    plugin._left.discard(call)
    if call.cancelled():
        return
    if (exc := call.exception()) is not None:
        logger.warning("the turn of %s, left by its MCP client (token '%s'), failed: %s: %s", client_id, who.name,
                       type(exc).__name__, exc)
        return
    logger.info("the turn of %s, left by its MCP client (token '%s'), ended: %s", client_id, who.name,
                call.result().get("status"))


async def _send(
    plugin: McpServerPlugin, who: Principal, text: str, session: str, model: str, timeout_seconds: float,
    follow: _Follow | None = None,
) -> dict[str, Any]:
    ctx = plugin.ctx
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
    if model and model not in ctx.config.models:
        raise ToolError(f"unknown model '{model[:60]}'; available: {', '.join(ctx.config.models)}")
    request = ctx.request(client_id, text, admin=who.role == HUMAN, model=model or None, identity=f"mcp:{who.name}")
    seconds = min(max(timeout_seconds, 1.0), plugin.cfg.max_wait_seconds)
    follow = follow or _Follow()
    call = asyncio.ensure_future(ctx.wait_turn(request, seconds, on_event=follow))
    try:  # shielded: a client that goes away while a gate waits leaves the turn running (`_left`)
        answer = await asyncio.shield(call)
    except asyncio.CancelledError:
        if follow.open and not call.done():
            _left(plugin, who, client_id, follow, call)
        else:
            call.cancel()  # as leaving wait_turn does: the turn is cancelled
        raise
    return {"session": client_id, **answer}


def _create(plugin: McpServerPlugin, name: str, model: str) -> dict[str, Any]:
    ctx = plugin.ctx
    try:
        client_id = mcp_client_id(name or uuid.uuid4().hex[:8])
    except ValueError as exc:
        raise ToolError(str(exc)) from None
    if ctx.sessions.get(client_id) is not None:
        raise ToolError(f"session {client_id} already exists")
    if model and model not in ctx.config.models:
        raise ToolError(f"unknown model '{model[:60]}'; available: {', '.join(ctx.config.models)}")
    session, _ = ctx.sessions.get_or_add(client_id, model or ctx.config.default_model)
    plugin._known_sessions.add(client_id)
    plugin._queue.put_nowait((ctx.sessions.save(session), (f"{SCHEME}sessions",)))
    return session_row(plugin, session)


async def _set_default(
    plugin: McpServerPlugin, who: Principal, section: str, key: str, operation: str, allowed: bool
) -> dict[str, Any]:
    try:  # the keeper checks, applies, saves, audits and tells the other instances
        change = gate_policy.PolicyChange.parse(section, key, operation, allowed, f"mcp token '{who.name}'")
    except gate_policy.PolicyError as exc:
        raise ToolError(str(exc)) from None
    entry, note = await plugin.ctx.gate.set_policy(change)
    await plugin.notify(f"{SCHEME}policy")
    return {"section": section, "key": change.key, **entry.model_dump(), "note": note}
