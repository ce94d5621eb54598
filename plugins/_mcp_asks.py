"""An MCP server's elicitation during a tool call (agent-mcp as MCP client), asked as a gate.

When a server agent-mcp uses sends `elicitation/create` (form mode) while one of its tools runs, the
question goes to the human of the turn that called the tool through the gate machinery
(`GateKeeper.ask`): the session's own gate (shell panel, API window, human MCP tokens) or, when
`approvals` routes the tool `<server>_<tool>` of that client class, its approvers (Slack buttons,
shell approver windows, the API admin key, MCP tokens). The gate event carries `elicitation`:
{server, message, fields}. The answer goes back to the server:

- allow with `content` (a JSON object; shell.py `/gate_response {"decision": "allow", "content": {…}}`)
  → accept with those values (checked against the form: types, enums, required fields);
- allow without content (a yes: a key, a button) → accept with the form's defaults (a single required
  yes/no field without a default counts as yes); a form whose required fields have no default then
  cannot be accepted: declined, and the session is told why;
- reject → decline; no answer in time → cancel;
- nobody to ask (a client class that cannot answer, no approvers; no turn of its own: the call came from
  several sessions at once on one connection) → decline at once.

Supported forms: flat objects of string (with `enum` / `oneOf` const choices, `format` shown only),
number, integer and boolean fields — what the MCP spec allows. URL-mode elicitation is declined.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import mcp_types as types

import approvals
import decisions
import grants
import plugin_api
from audit_chain import AuditRecord

logger = logging.getLogger("agent_mcp.mcp_client")

TYPES = ("string", "number", "integer", "boolean")
MESSAGE_CHARS = 1000
VALUE_CHARS = 2000
#: What the elicitation gate reports as its operation (gate events carry one).
OPERATION = "elicitation"


class FormError(ValueError):
    """A form this client does not support, or content that does not fit the form; the text says why."""


def fields_of(schema: Any) -> list[dict[str, Any]]:
    """The fields of a requested schema, each {name, type, title, description, required, default, choices};
    FormError for anything beyond the flat primitive forms the spec allows."""
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        raise FormError("the requested schema is not an object")
    props = schema.get("properties") or {}
    if not isinstance(props, dict):
        raise FormError("the requested schema's properties are not an object")
    required = set(schema.get("required") or ())
    out = []
    for name, spec in props.items():
        if not isinstance(spec, dict) or spec.get("type") not in TYPES:
            raise FormError(f"field '{name}' is not a string, number, integer or boolean")
        choices: list[str] | None = None
        if isinstance(spec.get("enum"), list):
            choices = [str(c) for c in spec["enum"]]
        elif isinstance(spec.get("oneOf"), list):
            choices = [str(c.get("const")) for c in spec["oneOf"] if isinstance(c, dict) and "const" in c]
        out.append({"name": str(name), "type": spec["type"], "title": str(spec.get("title") or name),
                    "description": str(spec.get("description") or ""), "required": name in required,
                    **({"default": spec["default"]} if "default" in spec else {}),
                    **({"choices": choices} if choices else {})})
    return out


def _value(field: dict[str, Any], value: Any) -> Any:
    kind, name = field["type"], field["name"]
    if kind == "boolean":
        if isinstance(value, str) and value.strip().lower() in ("yes", "y", "true", "1", "no", "n", "false", "0"):
            value = value.strip().lower() in ("yes", "y", "true", "1")
        if not isinstance(value, bool):
            raise FormError(f"field '{name}' takes true or false")
    elif kind in ("number", "integer"):
        if isinstance(value, str):
            try:
                value = int(value) if kind == "integer" else float(value)
            except ValueError:
                raise FormError(f"field '{name}' takes a{'n integer' if kind == 'integer' else ' number'}") from None
        if isinstance(value, bool) or not isinstance(value, int | float) or (kind == "integer" and
                                                                              not float(value).is_integer()):
            raise FormError(f"field '{name}' takes a{'n integer' if kind == 'integer' else ' number'}")
        value = int(value) if kind == "integer" else value
    else:
        if not isinstance(value, str):
            raise FormError(f"field '{name}' takes text")
        if len(value) > VALUE_CHARS:
            raise FormError(f"field '{name}' is longer than {VALUE_CHARS} characters")
    if field.get("choices") and str(value) not in field["choices"]:
        raise FormError(f"field '{name}' takes one of: {', '.join(field['choices'])}")
    return value


def content_for(fields: list[dict[str, Any]], given: dict[str, Any] | None) -> dict[str, Any]:
    """The content to accept with: the human's values (checked) over the form's defaults."""
    known = {f["name"]: f for f in fields}
    if given:
        extra = sorted(set(given) - set(known))
        if extra:
            raise FormError(f"the form has no field {', '.join(extra)} (its fields: {', '.join(known) or 'none'})")
    out: dict[str, Any] = {}
    for f in fields:
        if given and f["name"] in given:
            out[f["name"]] = _value(f, given[f["name"]])
        elif "default" in f:
            out[f["name"]] = f["default"]
    missing = [f["name"] for f in fields if f["required"] and f["name"] not in out]
    if missing and not given and len(fields) == 1 and fields[0]["type"] == "boolean":
        return {fields[0]["name"]: True}  # a yes to a single yes/no question
    if missing:
        raise FormError(f"the form needs a value for {', '.join(missing)}: answer with a JSON object "
                        f"(content) such as {json.dumps({m: '…' for m in missing})}")
    return out


def _describe(fields: list[dict[str, Any]]) -> str:
    parts = []
    for f in fields:
        kind = "|".join(f["choices"]) if f.get("choices") else f["type"]
        parts.append(f"{f['name']} ({kind}{', required' if f['required'] else ''}"
                     f"{', default ' + json.dumps(f['default']) if 'default' in f else ''})")
    return "; ".join(parts) or "no fields (a yes or no)"


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
    asked = {"server": server, "message": message, "fields": fields, "summary": _describe(fields),
             "schema": params.requested_schema}
    args = {"message": message, "fields": _describe(fields)}
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
