"""An MCP server's elicitation during a tool call (agent-mcp as MCP client), asked as a gate.

When a server agent-mcp uses sends `elicitation/create` (form mode) while one of its tools runs, the
question goes to the human of the turn that called the tool through the gate machinery
(`GateKeeper.ask`): the session's own gate (shell panel, API window, human MCP tokens) or, when
`approvals` routes the tool `<server>_<tool>` of that client class, its approvers (Slack buttons,
shell approver windows, the API admin key, MCP tokens). The gate event carries `elicitation`:
{server, message, fields}. The answer goes back to the server:

- allow with `content` (a JSON object; shell.py `/gate_response {"decision": "allow", "content": {…}}`)
  → accept with those values, checked against the server's form (`_mcp_forms.content_for`: JSON types
  without coercion, ranges, lengths, formats, choices, required fields);
- allow without content (a yes: a key, a button) → accept with the form's defaults (a single required
  yes/no field without a default counts as yes); a form whose required fields have no default then
  cannot be accepted: declined, and the session is told why;
- reject → decline; no answer in time → cancel;
- nobody to ask (a client class that cannot answer, no approvers; no turn of its own: the call came from
  several sessions at once on one connection) → decline at once.

Supported forms: flat objects of string, number, integer and boolean fields — what the MCP spec allows
(`_mcp_forms.py`). URL-mode elicitation is declined.
"""

from __future__ import annotations

import logging
from typing import Any

import mcp_types as types

import approvals
import decisions
import grants
import plugin_api
from audit_chain import AuditRecord
from plugins._mcp_forms import FormError, content_for, describe, fields_of

logger = logging.getLogger("agent_mcp.mcp_client")

MESSAGE_CHARS = 1000
#: What the elicitation gate reports as its operation (gate events carry one).
OPERATION = "elicitation"


def _status(rt: plugin_api.PluginContext, client_id: str, text: str, **more: Any) -> None:
    rt.hub.publish(client_id, "status", {"text": text, **more})


async def ask(rt: plugin_api.PluginContext, server: str, exposed: str, turn: plugin_api.Turn | None,
              params: types.ElicitRequestParams, max_wait: float) -> types.ElicitResult:
    """Ask the human of `turn` the server's question as a gate; the result to send back (never raises)."""
    if not isinstance(params, types.ElicitRequestFormParams):
        logger.info("MCP server %s asked for a URL elicitation: declined (not supported)", server)
        return types.ElicitResult(action="decline")
    what = f"MCP server '{server}'"
    if turn is None:
        logger.info("%s asked a question during %s, but no single turn called it: declined", what, exposed)
        return types.ElicitResult(action="decline")
    with plugin_api.running(turn):  # the callback may run outside the turn's task: its events carry the turn
        return await _ask(rt, server, exposed, turn, params, max_wait)


async def _ask(rt: plugin_api.PluginContext, server: str, exposed: str, turn: plugin_api.Turn,
               params: types.ElicitRequestFormParams, max_wait: float) -> types.ElicitResult:
    what, client_id = f"MCP server '{server}'", turn.client_id
    try:
        fields = fields_of(params.requested_schema)
    except FormError as exc:
        _status(rt, client_id, f"[ask ✗] {what} asked a question this client cannot show ({exc}) — declined")
        return types.ElicitResult(action="decline")
    keeper = rt.gate
    message = params.message[:MESSAGE_CHARS]
    wait = plugin_api.CLASSES[turn.kind].gate_wait
    route = keeper.desk.route(turn.kind, exposed, "tools", [exposed]) if keeper.desk is not None else None
    call = AuditRecord.call(client_id, exposed, OPERATION, args={"server": server, "message": message})
    if wait == plugin_api.NO_WAIT and route is None:
        label = plugin_api.CLIENT_LABELS[turn.kind]
        keeper.audit(call.decision(plugin_api.actor(turn), "declined (no one can answer)"))
        _status(rt, client_id, f"[ask ✗] {what} asked “{message[:120]}” during {exposed}, which {label} "
                               "cannot answer — declined")
        return types.ElicitResult(action="decline")
    timeout = route.timeout if route else keeper.timeout if wait == plugin_api.HUMAN_WAIT else keeper.api_timeout
    timeout = min(timeout, max_wait)
    asked = {"server": server, "message": message, "fields": fields, "summary": describe(fields),
             "schema": params.requested_schema}
    args = {"message": message, "fields": describe(fields)}
    payload = {"tool_name": exposed, "tool_args": {**args, "operation_type": OPERATION}, "tables": [],
               "timeout_seconds": timeout, "grants": [], "elicitation": asked}
    routed = None if route is None else approvals.RoutedGate(
        "", client_id, turn.kind, plugin_api.CLIENT_LABELS[turn.kind], exposed, OPERATION, [],
        f"{what} asks: {message[:approvals.ARG_CHARS]}", approvals.trimmed(args), [], 0.0, 0.0,
        [str(a) for a in route.approvers], route.who(), turn.id)
    if routed is not None:
        payload.update(approvers=routed.approvers, waiting_for=routed.who, headline=routed.headline())
    decision, gate_id = await rt.ask_gate(client_id, payload, timeout, routed)
    return await _answered(rt, keeper, client_id, exposed, fields, decision, gate_id, routed, call, timeout)


async def _answered(rt: plugin_api.PluginContext, keeper: plugin_api.PluginGate, client_id: str, exposed: str,
                    fields: list[dict[str, Any]], decision: grants.Decision, gate_id: str,
                    routed: approvals.RoutedGate | None, call: AuditRecord, limit: float) -> types.ElicitResult:
    """Close the question's gate (told to the session, audited) and say what goes back to the server."""
    closing = {"gate_id": gate_id, "decision": decision.word}
    if routed is not None and keeper.desk is not None:
        closed = (await keeper.desk.get(gate_id))[1]
        if closed is not None:
            closing.update(by=closed.by, channel=closed.channel)
            call = call.with_detail(approvals.audit_detail(routed, closed))
    if decision.word == "timeout":
        keeper.audit(call.decision("timeout", "elicitation cancelled (no answer)"))
        _status(rt, client_id, f"[ask ✗] {exposed}: no answer within {limit:g} s — cancelled", **closing)
        return types.ElicitResult(action="cancel")
    if decision.word == decisions.REJECT:
        keeper.audit(call.decision(decision.by, "elicitation declined"))
        _status(rt, client_id, f"[ask ✗] {exposed}: declined", **closing)
        return types.ElicitResult(action="decline")
    try:  # allow (a grant word counts as allow: nothing is granted for a question)
        content = content_for(fields, decision.content)
    except FormError as exc:
        keeper.audit(call.decision(decision.by, f"elicitation declined: {exc}"))
        _status(rt, client_id, f"[ask ✗] {exposed}: the answer did not fit the form ({exc}) — declined", **closing)
        return types.ElicitResult(action="decline")
    keeper.audit(call.decision(decision.by, "elicitation accepted"))
    _status(rt, client_id, f"[ask ✓] {exposed}: answered", **{**closing, "decision": "allow"})
    return types.ElicitResult(action="accept", content=content)
