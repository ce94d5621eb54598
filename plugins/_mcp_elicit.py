"""Gates of an MCP client's turn asked as MCP elicitation forms (agent-mcp as MCP server).

A `send_message` call whose MCP session declared the `elicitation` capability (protocol 2025-06-18 and
later, on a connection that can carry server-to-client requests) gets every gate its turn raises as an
`elicitation/create` form on that call's own stream: the tool, what it will do, and a `decision` enum
of the scopes the gate offers (allow once / for N minutes / for the session / for this statement shape
/ reject) with `minutes`. Accept → that decision, once every value fits the form (`_mcp_forms`: no
coercion, ranges, choices; an answer that does not fit is asked again saying why, and after ATTEMPTS
misfits the gate is rejected); decline or cancel → reject. The answer goes through `GateKeeper.answer`
as `Approver(MCP, token name)` through channel `mcp-elicitation`, so a gate routed to approvers takes it
only when the token is one of them; a gate answered elsewhere first closes the form. Without the
capability, or for an agent token (which may never approve its own gates), nothing changes: the gate
waits for `answer_approval` as before.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import approvals
import decisions
import plugin_api
from plugins._mcp_forms import FormError, content_for, fields_of
from plugins._mcp_tokens import HUMAN, Principal

logger = logging.getLogger("agent_mcp.mcp_server")

CHANNEL = "mcp-elicitation"
#: The form's choices: (decision word sent back, agent-mcp decision, title shown), in the order shown.
CHOICES = (
    ("allow_once", decisions.ALLOW, "Allow once"),
    (decisions.TIMED, decisions.TIMED, "Allow for a time (minutes below)"),
    (decisions.SESSION, decisions.SESSION, "Allow for the rest of this session"),
    (decisions.PATTERN, decisions.PATTERN, "Allow calls of this exact shape"),
    (decisions.REJECT, decisions.REJECT, "Reject"),
)
MESSAGE_ARGS = 600
#: Answers that do not fit the form before the gate is rejected (each misfit asks again, saying why).
ATTEMPTS = 3


def can_elicit(session: Any) -> bool:
    """Whether the MCP session of a request can be sent an elicitation form now."""
    try:
        caps = session.client_capabilities
        return bool(caps is not None and caps.elicitation is not None and session.can_send_request)
    except Exception:  # a context without a connection (never for a tools/call): no forms
        return False


def form(data: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The message and requested schema of one gate event's form."""
    offered = set(data.get("grants") or ())
    choices = [c for c in CHOICES if c[1] in (decisions.ALLOW, decisions.REJECT) or c[1] in offered]
    what = data.get("headline") or data.get("tool_name", "?")
    args = {k: v for k, v in (data.get("tool_args") or {}).items() if k != "operation_type"}
    shown = json.dumps(args, ensure_ascii=False, default=str)
    if len(shown) > MESSAGE_ARGS:
        shown = shown[:MESSAGE_ARGS] + "…"
    op = (data.get("tool_args") or {}).get("operation_type", "")
    tables = ", ".join(data.get("tables") or ())
    lines = [f"agent-mcp asks for approval: {what}",
             f"operation: {op}" + (f" on {tables}" if tables else ""),
             f"arguments: {shown}"]
    if data.get("shape"):
        lines.append(f"statement shape: {data['shape']}")
    if data.get("waiting_for"):
        lines.append(f"approvers: {data['waiting_for']}")
    lines.append(f"No answer within {float(data.get('timeout_seconds') or 0):g} s rejects it.")
    props: dict[str, Any] = {"decision": {
        "type": "string", "title": "Decision",
        "oneOf": [{"const": word, "title": title} for word, _, title in choices]}}
    if "allow_for" in offered:
        props["minutes"] = {"type": "integer", "title": "Minutes (for 'allow for a time')", "minimum": 1,
                            "maximum": decisions.MAX_MINUTES, "default": decisions.DEFAULT_MINUTES}
    return "\n".join(lines), {"type": "object", "properties": props, "required": ["decision"]}


def decision_of(content: dict[str, Any], offered: list[str]) -> tuple[str, int | None]:
    """The agent-mcp decision (and minutes) of a gate form's content, once it fits the form (`_mcp_forms`):
    anything the gate did not offer rejects (fail closed)."""
    word = {w: d for w, d, _ in CHOICES}.get(str(content.get("decision", "")))
    if word is None or (word not in (decisions.ALLOW, decisions.REJECT) and word not in offered):
        return decisions.REJECT, None
    minutes = content.get("minutes")
    return (word, minutes) if word == decisions.TIMED and isinstance(minutes, int) else (word, None)


def again(message: str, problem: str, left: int) -> str:
    """A form asked again after an answer that did not fit it: why, first."""
    return (f"Your answer was not taken: {problem}. Answer again ({left} more "
            f"{'try' if left == 1 else 'tries'}, then the gate is rejected).\n\n{message}")


class GateForms:
    """The elicitation forms of one `send_message` call: one per gate its turn raises, each closed when
    the gate is decided (here or elsewhere) or the call ends."""

    def __init__(self, rt: plugin_api.PluginContext, session: Any, request_id: Any, who: Principal,
                 deciders: dict[str, str], notify: Callable[[str, float], None] | None = None):
        self.ctx, self.session, self.request_id, self.who = rt, session, request_id, who
        self._deciders = deciders
        self._tasks: dict[str, asyncio.Task[None]] = {}
        #: Called with (gate id, seconds from the gate event to the form being sent) — for the bench.
        self._notify = notify

    @classmethod
    def for_request(cls, rt: plugin_api.PluginContext, ctx: Any, who: Principal,
                    deciders: dict[str, str]) -> GateForms | None:
        """Forms for this request, or None when its client cannot be asked (no capability) or may not
        approve (an agent token)."""
        if who.role != HUMAN or ctx is None:
            return None
        rc = ctx.request_context
        return cls(rt, rc.session, rc.request_id, who, deciders) if can_elicit(rc.session) else None

    def on_event(self, ev: plugin_api.Event) -> None:
        """Follow the turn's events (routes.wait_turn's `on_event`)."""
        data = ev.data
        gate_id = str(data.get("gate_id", ""))
        if not gate_id:
            return
        if ev.name == "gate" and gate_id not in self._tasks:
            asked = data.get("approvers")
            if asked is not None and str(approvals.Approver(approvals.MCP, self.who.name)) not in asked:
                return  # routed to others: this token's answer would be refused, so it is not asked
            self._tasks[gate_id] = asyncio.create_task(self._ask(gate_id, data, time.time()),
                                                       name=f"mcp-elicit:{gate_id[:8]}")
        elif ev.name == "status" and "decision" in data:
            task = self._tasks.get(gate_id)
            if task is not None and not task.done() and data.get("channel") != CHANNEL:
                task.cancel()  # decided elsewhere (or timed out): the form is withdrawn

    def asked(self, gate_id: str) -> bool:
        """Whether the gate was sent as a form on this call."""
        return gate_id in self._tasks

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        self._tasks.clear()

    async def _ask(self, gate_id: str, data: dict[str, Any], seen: float) -> None:
        asked = data.get("elicitation") if isinstance(data.get("elicitation"), dict) else None
        if asked is not None:  # an MCP server agent-mcp uses asks (plugins/_mcp_asks.py): its own form, passed on
            message = (f"MCP server '{asked.get('server')}' asks (during {data.get('tool_name')}): "
                       f"{asked.get('message', '')}")
            schema = asked.get("schema") or {"type": "object", "properties": {}}
        else:
            message, schema = form(data)
        offered = list(data.get("grants") or ())
        try:
            fields = fields_of(schema)
        except FormError:  # a server's form _mcp_asks took already, and ours, always fit: never here
            fields = []
        if self._notify is not None:
            self._notify(gate_id, time.time() - seen)
        shown, problem, content, action = message, "", None, "cancel"
        for attempt in range(1, ATTEMPTS + 1):
            try:
                result = await self.session.elicit_form(shown, schema, related_request_id=self.request_id)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the client failed, refused the form or went away: the gate waits as before
                logger.info("MCP elicitation of gate %s not answered by the client (%s: %s); it waits for "
                            "answer_approval", gate_id[:8], type(exc).__name__, exc)
                return
            action = result.action
            if action != "accept":
                problem = ""
                break
            try:  # every value checked against the form before it means anything
                content = content_for(fields, result.content)
            except FormError as exc:
                problem = str(exc)
                logger.info("MCP elicitation answer %d for gate %s from token '%s' did not fit its form: %s",
                            attempt, gate_id[:8], self.who.name, problem)
                shown = again(message, problem, ATTEMPTS - attempt)
                continue
            problem = ""
            break
        if problem:  # every answer misfit: rejected (fail closed), and said why
            word, minutes, content = decisions.REJECT, None, None
            how = f"answers did not fit the form: {problem}"
        elif action != "accept" or content is None:
            word, minutes, content, how = decisions.REJECT, None, None, action
        elif asked is not None:  # a server's form: allow with the values (checked against it again there)
            word, minutes, how = decisions.ALLOW, None, "accept"
        else:
            (word, minutes), content, how = decision_of(content, offered), None, "accept"
        self._deciders[gate_id] = f"{self.who.label} (elicitation: {how})"
        try:
            answered = await self.ctx.gate.answer(
                gate_id, word, answerer=approvals.Approver(approvals.MCP, self.who.name), channel=CHANNEL,
                by=f"mcp token '{self.who.name}'", minutes=minutes, content=content)
        except ValueError as exc:  # e.g. minutes out of range: fail closed
            logger.info("MCP elicitation answer for gate %s refused (%s): rejecting", gate_id[:8], exc)
            answered = await self.ctx.gate.answer(
                gate_id, decisions.REJECT, answerer=approvals.Approver(approvals.MCP, self.who.name), channel=CHANNEL,
                by=f"mcp token '{self.who.name}'")
        if not answered.answered:
            self._deciders.pop(gate_id, None)
            logger.info("MCP elicitation answer for gate %s not taken: %s", gate_id[:8], approvals.explain(answered))
