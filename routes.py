"""The request path: `process_request()` for every client, `!commands`, the `@model` prefix.

Every front door (shell.py, the API, the proxy, Slack, swarm calls) hands its text to
`submit()` / `process_request()`; commands are answered here, everything else becomes an LLM turn.
Each request ends with exactly one `done` event on the session's stream, except a request
cancelled by a newer one from the same client, which ends with a `[cancelled]` status line.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.requests import Request

import agents
import state
from config import AppConfig
from plugin_loader import PluginLoader
from prompt import PROMPT_DIR, PromptTree
from tools import ToolRegistry, make_core_tools

logger = logging.getLogger("agent_mcp.routes")

CANCEL_GRACE_SECONDS = 5


# ── Runtime assembly ────────────────────────────────────────────────────────────────────────


async def build_runtime(config: AppConfig, store: state.SessionStore | None = None) -> state.Runtime:
    """The object graph of one server instance, with sessions loaded and core tools registered."""
    sessions = state.SessionManager(store or state.open_store(config.env.get("SESSION_STORE"), config.data_dir()))
    await sessions.open()
    rt = state.Runtime(
        config=config,
        sessions=sessions,
        hub=state.EventHub(),
        tools=ToolRegistry(),
        prompt=PromptTree(config.path(PROMPT_DIR)).load(),
    )
    for tool in make_core_tools(rt):
        rt.tools.register(tool)
    rt.commands.update(CORE_COMMANDS)
    rt.plugins = PluginLoader(rt)
    return rt


async def close_runtime(rt: state.Runtime) -> None:
    """Stop running turns, shut plugins down (reverse order) and close the session store."""
    tasks = [t for group in rt.active_tasks.values() for t in group if not t.done()]
    for t in tasks:
        t.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=CANCEL_GRACE_SECONDS)
    if rt.plugins:
        await rt.plugins.shutdown_all()
    await rt.sessions.close()


# ── Submitting ──────────────────────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class Turn:
    """A submitted request: its id (carried by every event it produces) and its task."""

    id: str
    task: asyncio.Task[None]


async def cancel_active_task(rt: state.Runtime, client_id: str) -> None:
    """Cancel the client's running and waiting requests and wait until they have cleaned up."""
    tasks = [t for t in rt.active_tasks.get(client_id, ()) if not t.done() and t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=CANCEL_GRACE_SECONDS)


async def submit(
    rt: state.Runtime,
    client_id: str,
    text: str,
    payload: dict[str, Any] | None = None,
    *,
    cancel_running: bool = True,
) -> Turn:
    """Start a request as a task and return it.

    With `cancel_running` (what shell.py and the API do) the client's running request is
    cancelled first; without it the new request waits until the session is free, so several
    requests on one session are answered one after another, each with its own events.
    """
    if cancel_running:
        await cancel_active_task(rt, client_id)
    turn_id = uuid.uuid4().hex[:16]
    task = asyncio.create_task(
        process_request(client_id, text, payload, rt=rt, turn_id=turn_id), name=f"request:{client_id}:{turn_id}"
    )
    group = rt.active_tasks.setdefault(client_id, set())
    group.add(task)

    def _forget(t: asyncio.Task[None]) -> None:
        group.discard(t)
        if not group and rt.active_tasks.get(client_id) is group:
            del rt.active_tasks[client_id]

    task.add_done_callback(_forget)
    return Turn(turn_id, task)


async def run_turn(
    rt: state.Runtime,
    client_id: str,
    text: str,
    payload: dict[str, Any] | None = None,
    *,
    cancel_running: bool = False,
) -> AsyncIterator[state.Event]:
    """Submit `text` and yield the events of this request only, ending with its `done`.

    For client plugins that answer one request per HTTP call or message (proxy, Slack, API
    `wait`, MCP). If the caller stops iterating early (its client went away), the request is
    cancelled. A request cancelled by a newer one ends with a `status` event whose data has
    `"cancelled": true`.
    """
    events = rt.hub.subscribe(client_id, rt.hub.last_id(client_id))
    turn = await submit(rt, client_id, text, payload, cancel_running=cancel_running)
    finished = False
    try:
        async for ev in events:
            if ev.turn != turn.id:
                continue
            finished = ev.name == "done" or (ev.name == "status" and ev.data.get("cancelled") is True)
            yield ev
            if finished:
                return
    finally:
        await events.aclose()
        if not finished and not turn.task.done():
            turn.task.cancel()


async def process_request(
    client_id: str,
    text: str,
    payload: dict[str, Any] | None = None,
    *,
    rt: state.Runtime | None = None,
    turn_id: str | None = None,
) -> None:
    """Handle one message of a client: commands, a command batch, or an LLM turn; then `done`.

    Requests on one session run one at a time, in the order they were submitted.
    """
    rt = rt or state.current()
    payload = payload or {}
    wanted = payload.get("default_model")
    model = wanted if isinstance(wanted, str) and wanted in rt.config.models else rt.config.default_model
    turn_token = state.current_turn.set(turn_id or uuid.uuid4().hex[:16])
    token = state.current_client_id.set(client_id)
    session: state.Session | None = None
    cancelled = False
    try:
        session = await rt.sessions.get_or_create(client_id, model)
        async with session.lock:
            await _process(rt, session, text)
    except asyncio.CancelledError:
        # No `done`: the request that replaced this one sends its own, and a client must not
        # mistake this turn's end for the end of the newer one.
        cancelled = True
        rt.hub.publish(client_id, "status", {"text": "[cancelled]", "cancelled": True})
        raise
    except Exception as exc:
        logger.exception("request of %s failed", client_id)
        rt.hub.error(client_id, f"internal error: {type(exc).__name__}: {exc}")
    finally:
        state.current_client_id.reset(token)
        if session is not None and rt.sessions.get(client_id) is session:
            await rt.sessions.save(session)
        if not cancelled:
            rt.hub.done(client_id)
        state.current_turn.reset(turn_token)


async def _process(rt: state.Runtime, session: state.Session, text: str) -> None:
    stripped = text.strip()
    lines = text.split("\n")
    command_lines = [line.strip() for line in lines if line.lstrip().startswith("!")]
    if len(command_lines) > 1:
        # A batch: every `!` line runs in order, the remaining lines (if any) go to the model.
        for line in command_lines:
            await run_command(rt, session, line)
            rt.hub.tok(session.client_id, "\n")
        rest = "\n".join(line for line in lines if not line.lstrip().startswith("!")).strip()
        if rest:
            await _llm_turn(rt, session, rest)
        return
    if stripped.startswith("!"):
        await run_command(rt, session, stripped)
        return
    if not stripped:
        rt.hub.error(session.client_id, "empty message: type a question or !help")
        return
    await _llm_turn(rt, session, stripped)


async def _llm_turn(rt: state.Runtime, session: state.Session, text: str) -> None:
    """An LLM turn, honouring a leading `@model` (that model for this turn only)."""
    if not text.startswith("@"):
        await agents.dispatch_llm(rt, session, text)
        return
    first, _, rest = text.partition(" ")
    key = first[1:]
    if key not in rt.config.models:
        rt.hub.tok(session.client_id, f"ERROR: Unknown model '@{key}'\nAvailable models: {', '.join(rt.config.models)}")
        return
    original = session.model
    session.model, session.temp_model_active = key, True
    try:
        await agents.dispatch_llm(rt, session, rest.strip())
    finally:
        session.model, session.temp_model_active = original, False


# ── Event streams (shared by the client plugins) ─────────────────────────────────────────────

SSE_PING_SECONDS = 15


def last_event_id(request: Request) -> int | None:
    """The `Last-Event-ID` header (or `last_event_id` query parameter) as an int, if valid."""
    raw = request.headers.get("last-event-id") or request.query_params.get("last_event_id")
    try:
        return int(raw) if raw else None
    except ValueError:
        return None


def event_stream(rt: state.Runtime, client_id: str, after: int | None) -> EventSourceResponse:
    """An SSE response with every event of a session: `id:` lines, JSON data, keepalive comments."""

    async def events() -> AsyncIterator[ServerSentEvent]:
        async for ev in rt.hub.subscribe(client_id, after):
            yield ServerSentEvent(data=json.dumps(ev.data, ensure_ascii=False), event=ev.name, id=str(ev.id))

    if rt.stopping is None:
        rt.stopping = anyio.Event()
    return EventSourceResponse(
        events(),
        ping=SSE_PING_SECONDS,
        sep="\n",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        shutdown_event=rt.stopping,
    )


# ── Commands ────────────────────────────────────────────────────────────────────────────────


async def run_command(rt: state.Runtime, session: state.Session, line: str) -> None:
    """Run one `!command` line and send its output; unknown commands never reach the model."""
    name, _, args = line.lstrip("!").partition(" ")
    name = name.strip().lower()
    command = rt.commands.get(name)
    if command is None:
        rt.hub.tok(session.client_id, f"Unknown command: !{name}\nUse !help to see available commands.\n")
        return
    try:
        if command.owner == "core":
            out = await command.handler(rt, session, args.strip())
        else:
            out = await command.handler(args.strip())
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        logger.exception("command !%s failed", name)
        out = f"ERROR: !{name} failed: {type(exc).__name__}: {exc}"
    rt.hub.tok(session.client_id, str(out) if out is not None else "")


def _models_list(rt: state.Runtime, current: str | None) -> str:
    rows = [
        f"  {key:<12} {m.model_id}{' (current)' if key == current else ''}" + (f"\n  {'':<12} {m.description}" if m.description else "")
        for key, m in rt.config.models.items()
    ]
    return "Available models:\n" + "\n".join(rows)


async def cmd_help(rt: state.Runtime, session: state.Session, args: str) -> str:
    """!help — this text."""
    lines = ["Commands:"]
    for name, cmd in sorted(rt.commands.items()):
        if cmd.owner == "core":
            lines.append(f"  {cmd.usage or '!' + name}")
    lines += [
        "",
        "Prefix a message with @<model> to answer that one message with another model.",
        "In shell.py also: !session <ID> attach, !gate_preview_length [n], !exit",
    ]
    if rt.plugins:
        for plugin in rt.plugins.loaded:
            text = plugin.get_help()
            if text:
                lines += ["", text.rstrip()]
        idle = [r for r in rt.plugins.reports.values() if r.status != "loaded"]
        if idle:
            lines += ["", "Plugins not loaded:"] + [f"  {r.line()}" for r in idle]
    lines += ["", "Tools:"]
    lines += [f"  {e.tool.name:<24} {e.tool.description.splitlines()[0] if e.tool.description else ''}"
              for e in rt.tools.entries()]
    return "\n".join(lines) + "\n"


async def cmd_model(rt: state.Runtime, session: state.Session, args: str) -> str:
    """!model [key] — list models, or switch this session to one."""
    if not args:
        return _models_list(rt, session.model)
    if args not in rt.config.models:
        return (f"ERROR: Unknown model '{args}'\nAvailable models: {', '.join(rt.config.models)}\n"
                "Use !model to list all models")
    session.model = args
    await rt.sessions.save(session)
    return f"Model set to '{args}'."


async def cmd_reset(rt: state.Runtime, session: state.Session, args: str) -> str:
    """!reset — clear this session's history."""
    count = len(session.history)
    session.history.clear()
    await rt.sessions.save(session)
    return f"Conversation history cleared ({count} messages removed)."


async def cmd_session(rt: state.Runtime, session: state.Session, args: str) -> str:
    """!session [<ID> [delete]] — list sessions, show one, or delete one (full or shorthand id)."""
    parts = args.split()
    if not parts:
        rows = [
            f"  ID [{s.shorthand}] {s.client_id}: model={s.model}, history={len(s.history)} messages"
            f"{' (current)' if s is session else ''}"
            for s in rt.sessions.all()
        ]
        return "Active sessions:\n" + "\n".join(rows) if rows else "No active sessions."
    ident, action = parts[0], (parts[1].lower() if len(parts) > 1 else "")
    client_id = rt.sessions.resolve(ident)
    if client_id is None:
        return f"Session not found: {ident}\nUse !session to list sessions."
    if action == "delete":
        if client_id != session.client_id:
            await cancel_active_task(rt, client_id)
            rt.hub.drop(client_id)
        deleted = await rt.sessions.delete(client_id)
        return f"Deleted session ID [{deleted.shorthand}]: {client_id}"
    if action == "attach":
        return "!session <ID> attach is a shell.py command: it switches the terminal to that session."
    if action:
        return f"Unknown action: {action}\nUse: !session <ID> attach|delete"
    s = rt.sessions.get(client_id)
    assert s is not None
    return (f"Session ID [{s.shorthand}]: {s.client_id}\n  model: {s.model}\n  history: {len(s.history)} messages\n"
            f"  tool_preview_length: {s.tool_preview_length or 'unlimited'}")


async def cmd_tool_preview_length(rt: state.Runtime, session: state.Session, args: str) -> str:
    """!tool_preview_length [n|0|off] — characters of each tool result shown (0 = all)."""
    def show(n: int) -> str:
        return f"{n} chars" if n else "unlimited"

    if not args:
        return f"Tool preview length: {show(session.tool_preview_length)}"
    value = 0 if args.lower() in ("0", "off", "unlimited") else int(args) if args.isdigit() else None
    if value is None:
        return "ERROR: use !tool_preview_length <n> (characters), or 0 / off / unlimited to show whole results."
    session.tool_preview_length = value
    await rt.sessions.save(session)
    return f"Tool preview length set to {show(value)}."


CORE_COMMANDS: dict[str, state.Command] = {
    "help": state.Command(cmd_help, usage="!help                       this help"),
    "model": state.Command(cmd_model, usage="!model [key]                list models / switch this session's model"),
    "reset": state.Command(cmd_reset, usage="!reset                      clear this session's history"),
    "session": state.Command(cmd_session, usage="!session [<ID> [delete]]    list sessions / show or delete one (full or shorthand id)"),
    "tool_preview_length": state.Command(
        cmd_tool_preview_length, usage="!tool_preview_length [n]    characters of tool results shown (0/off = all)"
    ),
}
