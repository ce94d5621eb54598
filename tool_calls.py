"""The one tool-call pipeline: validate the arguments, run the checks (rate limit, gate), run the tool,
and hand back a `ToolOutcome` the model can read.

`ToolPipeline` is built once per instance (build.py); the agent loop (agents.py), the delegation tool
(tools.py) and the MCP server all call its `execute`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from langchain_core.tools import StructuredTool
from pydantic import ValidationError

import gate
import stores
import turns
from config import field_problems
from metrics import OFF as NO_METRICS
from metrics import Metrics
from registry import ToolError, ToolRegistry
from tracing import OFF as NO_TRACING
from tracing import Tracing

logger = logging.getLogger("agent_mcp.tool_calls")

def preview(text: str, limit: int) -> str:
    """`text` cut to `limit` characters (0: whole), marked when cut."""
    if limit <= 0 or len(text) <= limit:
        return text
    return text[:limit] + "\n…(truncated)"


def _short(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


@dataclass(frozen=True)
class ToolOutcome:
    """One tool call's result as a value: `text` is what the model reads; `status` is ok, error (the
    tool failed), refused (a check stopped it: see `refusal`) or invalid (unknown tool, bad arguments)."""

    text: str
    status: Literal["ok", "error", "refused", "invalid"]
    refusal: gate.Refusal | None = None
    #: For `invalid`: what is wrong, without the instructions to the model.
    problem: str = ""


@dataclass
class ToolPipeline:
    """The tool-call pipeline of one instance and exactly what it uses: the registry, the checks, the
    session's status stream, how a failure's text loses its locations, and the telemetry of each call."""

    tools: ToolRegistry
    #: A line for a session's status stream: (client id, text) (events.EventHub.status).
    status: Callable[[str, str], None]
    #: A failure's text without the locations in it (client_classes.without_locations with the config).
    hide: Callable[[str], str]
    #: Checks run in order on validated arguments before the executor (rate limit, then gate); see gate.ToolCheck.
    checks: list[gate.ToolCheck] = field(default_factory=list)
    metrics: Metrics = NO_METRICS
    tracing: Tracing = NO_TRACING

    async def execute(self, turn: turns.Turn, name: str, args: dict[str, Any]) -> ToolOutcome:
        """Run one tool call of `turn`: validate the arguments → the checks (rate limit, gate) → the executor.
        The one pipeline of the agent loop and the MCP server alike.

        Every failure is an outcome the model can read; only cancellation escapes.
        """
        entry = self.tools.entry(name)
        label = name if entry is not None else "other"  # a name a model made up is no metric label or span name
        with self.tracing.span(f"execute_tool {label}", {"gen_ai.operation.name": "execute_tool",
                                                          "gen_ai.tool.name": label}) as span:
            self.tracing.text(span, "gen_ai.tool.call.arguments", json.dumps(args, ensure_ascii=False, default=str))
            started = time.perf_counter()
            outcome = await _checked_tool(self.tools, self.checks, turn, name, args, self.status, self.hide)
            ran = None if outcome.status in ("refused", "invalid") else time.perf_counter() - started
            refusal = outcome.refusal.kind if outcome.refusal else None
            self.metrics.tool_call(label, outcome.status, refusal, ran, gate.gate_type(entry) if refusal else "")
            self.tracing.note(span, agent_mcp__tool__outcome=outcome.status, error__type=refusal)
            self.tracing.text(span, "gen_ai.tool.call.result", outcome.text)
            return outcome


async def _checked_tool(tools: ToolRegistry, checks: Sequence[gate.ToolCheck], turn: turns.Turn, name: str,
                        args: dict[str, Any], status: Callable[[str, str], None],
                        hide: Callable[[str], str]) -> ToolOutcome:
    entry = tools.entry(name)
    if entry is None:
        problem = f"unknown tool '{name}'"
        return ToolOutcome(f"ERROR: {problem}. Available tools: {', '.join(tools.names()) or 'none'}",
                           "invalid", problem=problem)
    try:
        parsed = entry.args_model.model_validate(args or {})
    except ValidationError as exc:
        problem = f"invalid arguments for {name}: {field_problems(exc, 'arguments')}"
        return ToolOutcome(f"ERROR: {problem}. Fix them and call again.", "invalid", problem=problem)
    args = parsed.model_dump()
    with turns.running(turn):
        turn.db_access = None  # what the gate decides for this call, and nothing an earlier call left
        for check in checks:
            refused = await check(turn, entry, args)
            if refused is not None:
                return ToolOutcome(refused.text, "refused", refused)
        return await _run_tool(turn, entry.tool, args, status, hide)


async def _run_tool(turn: turns.Turn, tool: StructuredTool, args: dict[str, Any],
                    status: Callable[[str, str], None], hide: Callable[[str], str]) -> ToolOutcome:
    """Run a tool whose arguments are validated and whose checks passed; a failure becomes an error outcome.
    `status` tells the session what runs and what came back; `hide` takes locations out of a failure's text."""
    name, client_id = tool.name, turn.client_id
    status(client_id, f"[{name} ▶] {_short(json.dumps(args, ensure_ascii=False), 200)}")
    failed = True
    try:
        run = tool.coroutine
        if run is None:  # registration refuses such a tool; one changed since fails here like any tool
            raise TypeError(f"tool {name} has no coroutine")
        result = await run(**args)
        failed = False
    except asyncio.CancelledError:
        raise
    except ToolError as exc:  # a failure the tool reports itself (STYLE 5)
        result = f"ERROR: {exc}"
    except Exception as exc:
        logger.exception("tool %s failed for %s", name, client_id)
        result = f"ERROR: tool {name} failed: {type(exc).__name__}: {exc}"
    text = result if isinstance(result, str) else json.dumps(result, ensure_ascii=False, default=str)
    if failed:
        # The model (and whoever reads its answers) learns what failed, never where: the log keeps it.
        hidden = hide(text)
        if hidden != text:
            logger.warning("tool %s for %s: %s", name, client_id, text)
        text = hidden
    limit = turn.session.tool_preview_length if turn.session else stores.DEFAULT_TOOL_PREVIEW
    status(client_id, f"[{name} ◀] {preview(text, limit)}")
    return ToolOutcome(text, "error" if failed else "ok")
