"""The request path: `process_request()` for every client, `!commands`, the `@model` prefix.

Every front door (shell.py, the API, the proxy, Slack, swarm calls) hands its text to
`submit()` / `process_request()`; commands are answered here, everything else becomes an LLM turn.
Each request ends with exactly one `done` event on the session's stream, except a request
cancelled by a newer one from the same client, which ends with a `[cancelled]` status line.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
from pydantic import BaseModel, ValidationError
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.requests import Request

import agents
import gate
import state
from config import CORE_GATES, AppConfig, ConfigError, SessionsConfig, field_problems, save_model_fields
from plugin_loader import PluginLoader
from prompt import PROMPT_DIR, PromptError, PromptTree
from tools import AGENT_CALL_STREAM, ToolRegistry, make_core_tools

logger = logging.getLogger("agent_mcp.routes")

CANCEL_GRACE_SECONDS = 5


# ── Runtime assembly ────────────────────────────────────────────────────────────────────────


async def build_runtime(config: AppConfig, store: state.SessionStore | None = None) -> state.Runtime:
    """The object graph of one server instance, with sessions loaded and core tools registered."""
    namespaces: dict[str, tuple[str, str]] = {}  # filled by the plugin loader as client plugins load
    sessions = state.SessionManager(store or state.open_store(config.env.get("SESSION_STORE"), config.data_dir()),
                                    session_policy(config.enabled.sessions, namespaces))
    await sessions.open()
    rt = state.Runtime(
        config=config,
        sessions=sessions,
        client_namespaces=namespaces,
        hub=state.EventHub(),
        tools=ToolRegistry(),
        prompt=PromptTree(config.path(PROMPT_DIR)).load(),
    )
    for tool in make_core_tools(rt):
        rt.tools.register(tool, gate=CORE_GATES.get(tool.name))
    rt.gate = gate.GateKeeper.from_env(config.gates, config.env)
    rt.rate_limiter = gate.RateLimiter(config.enabled.rate_limits)
    # Whatever removes a session (delete, expiry, eviction) also drops its stream and rate-limit windows.
    sessions.forgotten += [rt.hub.drop, rt.rate_limiter.forget]
    sessions.is_busy = lambda client_id: bool(rt.active_tasks.get(client_id))
    sessions.start_sweeping()
    rt.tool_checks += [gate.check_rate_limit, gate.check_human_gate]  # rate limit first, then the human
    rt.commands.update(CORE_COMMANDS)
    rt.plugins = PluginLoader(rt)
    return rt


def session_policy(bounds: SessionsConfig, namespaces: dict[str, tuple[str, str]] | None = None
                   ) -> state.SessionPolicy:
    """The session bounds of plugins-enabled.json `sessions`, per client class (`gate.session_class`,
    with the client-id `namespaces` the runtime's plugins declare)."""
    unknown = sorted(set(bounds.classes) - set(gate.CLIENT_LABELS))
    if unknown:
        logger.warning("plugins-enabled.json: field 'sessions.classes': %s name no client class and apply to no "
                       "session; the classes are %s", ", ".join(unknown), ", ".join(gate.CLIENT_LABELS))

    def limits(kind: str) -> state.SessionLimits:
        limit = bounds.limit(kind, interactive=kind == gate.SHELL)
        idle = None if limit.idle_days is None else limit.idle_days * 86400
        return state.SessionLimits(idle_seconds=idle, max_sessions=limit.max_sessions)

    def classify(session: state.Session) -> str:
        return gate.session_class(namespaces or {}, session)

    return state.SessionPolicy(classify=classify, limits=limits, max_history=bounds.max_history_messages,
                               max_message_chars=bounds.max_message_chars, sweep_seconds=bounds.sweep_minutes * 60)


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


async def stop(rt: state.Runtime, client_id: str) -> bool:
    """Cancel the client's requests without starting another; each cancelled one also ends with a
    `done` (clients that wait for `done`, as the original API client does, stop waiting). Returns
    whether anything was running."""
    tasks = [t for t in rt.active_tasks.get(client_id, ()) if not t.done()]
    await cancel_active_task(rt, client_id)
    for task in tasks:
        kind, _, turn_id = task.get_name().rpartition(":")
        token = state.current_turn.set(turn_id if kind.startswith("request:") else None)
        try:
            rt.hub.done(client_id)
        finally:
            state.current_turn.reset(token)
    return bool(tasks)


def ends_turn(ev: state.Event) -> bool:
    """Whether `ev` is the last event of its request: its `done`, or the status of its cancellation."""
    return ev.name == "done" or (ev.name == "status" and ev.data.get("cancelled") is True)


async def delete_session(rt: state.Runtime, client_id: str) -> state.Session:
    """Cancel a session's requests and forget it: stored record, event channel, rate-limit windows."""
    await cancel_active_task(rt, client_id)
    return await rt.sessions.delete(client_id)  # its `forgotten` hooks drop the channel and the windows


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
            finished = ends_turn(ev)
            yield ev
            if finished:
                return
    finally:
        await events.aclose()
        if not finished and not turn.task.done():
            turn.task.cancel()


async def wait_turn(rt: state.Runtime, client_id: str, text: str, payload: dict[str, Any] | None, seconds: float,
                    *, cancel_running: bool = False) -> dict[str, Any]:
    """Run one request to its end (or for `seconds`, then cancel it): `{"status", "text"}` with status
    complete, error, timeout or cancelled, and `"error"` when the agent reported one."""
    parts: list[str] = []
    error: str | None = None
    status = "complete"
    async with contextlib.aclosing(run_turn(rt, client_id, text, payload, cancel_running=cancel_running)) as events:
        try:
            async with asyncio.timeout(seconds):
                async for ev in events:
                    if ev.name == "tok":
                        parts.append(str(ev.data.get("text", "")))
                    elif ev.name == "error":
                        error = error or str(ev.data.get("message", "error"))
                    elif ends_turn(ev) and ev.name != "done":
                        status = "cancelled"
        except TimeoutError:
            status = "timeout"  # leaving run_turn early cancelled the request
    answer: dict[str, Any] = {"status": "error" if error is not None and status == "complete" else status,
                              "text": "".join(parts)}
    if error is not None:
        answer["error"] = error
    return answer


_GONE = {"deleted": "with !session … delete or the API, maybe from another window",
         "expired": "idle longer than its client class keeps sessions",
         "evicted": "the least recently used over its client class's cap"}


async def process_request(
    client_id: str,
    text: str,
    payload: dict[str, Any] | None = None,
    *,
    rt: state.Runtime | None = None,
    turn_id: str | None = None,
) -> None:
    """Handle one message of a client: commands, a command batch, or an LLM turn; then `done`.

    Requests on one session run one at a time, in the order they were submitted. Payload keys:
    `default_model` (the model of a session created now), `model` (answer this request's LLM
    turn with that registry model; the session keeps its own model), `admin` (True only when the
    client plugin authenticated an administrator; see `gate.may_administer`), `interactive` (True
    only from the token-authenticated shell endpoint: ★ commands and the `@model` gate bypass).
    The request's client class is the shell's when vouched interactive, else that of the plugin
    namespace owning `client_id` (`gate.request_class`; an id no plugin owns gets the least
    privilege). A plugin may call this directly (the spec's path): the request is then tracked
    in `rt.active_tasks` like a submitted one, so a newer request or a delete cancels it.
    """
    rt = rt or state.current()
    payload = payload or {}
    wanted = payload.get("default_model")
    model = wanted if isinstance(wanted, str) and wanted in rt.config.models else rt.config.default_model
    turn_model = payload.get("model") or None
    turn_token = state.current_turn.set(turn_id or uuid.uuid4().hex[:16])
    token = state.current_client_id.set(client_id)
    kind = gate.request_class(rt, client_id, payload)
    admin_token = state.current_admin.set(payload.get("admin") is True)
    interactive_token = state.current_interactive.set(payload.get("interactive") is True)
    class_token = state.current_class.set(kind)
    untrack = _track(rt, client_id)
    session: state.Session | None = None
    cancelled = False
    try:
        # Added without awaiting, so requests take the session's lock in the order they arrived.
        session, created = rt.sessions.get_or_add(client_id, model, kind)
        async with session.lock:
            if created:
                await rt.sessions.save(session)
                why = rt.sessions.take_gone(client_id)
                if why is not None:
                    rt.hub.publish(client_id, "status", {"text": f"[session] this session was {why} ({_GONE[why]}); "
                                                                 "this message starts a new, empty one",
                                                         "session_gone": why})
            rt.hub.publish(client_id, "user", {"text": text})  # every window shows who said what, in order
            if turn_model is not None and turn_model not in rt.config.models:
                rt.hub.error(client_id, f"unknown model '{turn_model}'; available: {', '.join(rt.config.models)}")
            else:
                await _process(rt, session, text, turn_model)
    except asyncio.CancelledError:
        # No `done`: the request that replaced this one sends its own, and a client must not
        # mistake this turn's end for the end of the newer one.
        cancelled = True
        rt.hub.publish(client_id, "status", {"text": "[cancelled]", "cancelled": True})
        raise
    except Exception as exc:
        logger.exception("request of %s failed", client_id)
        detail = f": {type(exc).__name__}: {exc}" if gate.may_administer() else " (details are in the server log)"
        rt.hub.error(client_id, f"internal error{detail}")
    finally:
        untrack()
        state.current_client_id.reset(token)
        state.current_admin.reset(admin_token)
        state.current_interactive.reset(interactive_token)
        state.current_class.reset(class_token)
        if session is not None and rt.sessions.get(client_id) is session:
            await rt.sessions.save(session)
        if not cancelled:
            rt.hub.done(client_id)
        state.current_turn.reset(turn_token)


def _track(rt: state.Runtime, client_id: str) -> Any:
    """Put the running task among the client's requests unless `submit` did; returns the undo."""
    task = asyncio.current_task()
    if task is None or task in rt.active_tasks.get(client_id, ()):
        return lambda: None
    group = rt.active_tasks.setdefault(client_id, set())
    group.add(task)

    def untrack() -> None:
        group.discard(task)
        if not group and rt.active_tasks.get(client_id) is group:
            del rt.active_tasks[client_id]

    return untrack


async def _process(rt: state.Runtime, session: state.Session, text: str, model: str | None = None) -> None:
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
            await _llm_turn(rt, session, rest, model)
        return
    if stripped.startswith("!"):
        await run_command(rt, session, stripped)
        return
    if not stripped:
        rt.hub.error(session.client_id, "empty message: type a question or !help")
        return
    await _llm_turn(rt, session, stripped, model)


async def _llm_turn(rt: state.Runtime, session: state.Session, text: str, model: str | None = None) -> None:
    """An LLM turn on `model` (default: the session's), or on a leading `@model` for this turn only."""
    if not text.startswith("@"):
        await agents.dispatch_llm(rt, session, text, model)
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


def event_stream(rt: state.Runtime, client_id: str, after: int | None, turn: str | None = None) -> EventSourceResponse:
    """An SSE response with every event of a session: `id:` lines, JSON data, keepalive comments.

    With `turn`, only that request's events are sent and the response ends after its last one.
    """

    async def events() -> AsyncIterator[ServerSentEvent]:
        async with contextlib.aclosing(rt.hub.subscribe(client_id, after)) as subscription:
            async for ev in subscription:
                if turn is not None and ev.turn != turn:
                    continue
                yield ServerSentEvent(data=json.dumps(ev.data, ensure_ascii=False), event=ev.name, id=str(ev.id))
                if turn is not None and ends_turn(ev):
                    return

    if rt.stopping is None:
        rt.stopping = anyio.Event()
    return EventSourceResponse(
        events(),
        ping=SSE_PING_SECONDS,
        sep="\n",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        shutdown_event=rt.stopping,
    )


# ── HTTP helpers (shared by the client plugins) ─────────────────────────────────────────────

#: Client ids a client plugin accepts from callers (ids also appear in logs and file names).
CLIENT_ID_PATTERN = r"^[A-Za-z0-9._:@-]{1,128}$"
#: The longest message text a client plugin accepts, in characters.
MAX_TEXT = 200_000
#: The largest JSON request body read, in bytes (a MAX_TEXT message with every character escaped fits).
MAX_BODY = 8 * MAX_TEXT
#: The deepest nesting of arrays and objects a JSON request body may have (chat bodies need about 5).
#: Deeper values would later break json.dumps, repr and copies of the history with a RecursionError.
MAX_JSON_DEPTH = 64

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


class BadRequest(Exception):
    """A request a client plugin refuses; `status` is the HTTP status, the message says what to fix."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


_TOO_DEEP = (f"request body is nested too deeply: at most {MAX_JSON_DEPTH} levels of arrays and objects "
             "are accepted")


def _nested_deeper(value: Any, limit: int) -> bool:
    """Whether parsed JSON nests arrays/objects more than `limit` levels deep (iterative: no recursion)."""
    stack: list[tuple[Any, int]] = [(value, 1)] if isinstance(value, dict | list) else []
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return False


async def read_json(request: Request, model: type[M], max_bytes: int = MAX_BODY) -> M:
    """The request body as `model`; BadRequest (400, or 413 when over `max_bytes`) says what is wrong."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise BadRequest(413, f"request body is {declared} bytes; the limit is {max_bytes}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise BadRequest(413, f"request body is over {max_bytes} bytes; the limit is {max_bytes}")
        chunks.append(chunk)
    body = b"".join(chunks)
    try:
        raw = json.loads(body)
    except RecursionError:  # json.loads gives up (fast) at the interpreter's recursion limit
        raise BadRequest(400, _TOO_DEEP) from None
    except ValueError:
        raise BadRequest(400, "request body must be JSON") from None
    # Fewer brackets than the limit cannot nest deeper than it: most bodies skip the walk.
    if body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH and _nested_deeper(raw, MAX_JSON_DEPTH):
        raise BadRequest(400, _TOO_DEEP)
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        problems = field_problems(exc, "body")
        raise BadRequest(400, f"invalid request: {problems}") from None


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None when the HTTP client disconnects first (then `work` is cancelled)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    gone = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await task
    return task.result() if not task.cancelled() else None


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
    text = str(out) if out is not None else ""
    rt.hub.tok(session.client_id, text if gate.may_administer() else gate.without_locations(rt, text))


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
        "Prefix a message with @<model> to answer that one message with another model",
        "(in the shell, that turn's tool calls run without gates).",
        "In shell.py also: !session <ID> attach, !gate_preview_length [n], !exit",
        "",
        "Gates: risky tool calls wait for a human (shell: a allow once, s allow for this session, r reject;",
        f"no answer within {rt.gate.timeout:g} s rejects; API clients have {rt.gate.api_timeout:g} s; the chat proxy,",
        "Slack and swarm calls are rejected). Types: db (per table, read/write), search, extract, drive,",
        "system, llm_call and the plugins' own. Only the shell or an admin API client may change gates;",
        "changes apply to this session, gate-defaults.json to every session. true = auto-allow (gate OFF).",
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
    lines += [f"  {e.tool.name:<24} [{gate.gate_type(e)}] {e.tool.description.splitlines()[0] if e.tool.description else ''}"
              for e in rt.tools.entries()]
    return "\n".join(lines) + "\n"


async def cmd_model(rt: state.Runtime, session: state.Session, args: str) -> str:
    """!model [key] — list models, or switch this session to one."""
    if not args:
        return _models_list(rt, session.model) + "\n\n" + await agents.context_report(rt, session)
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
    """!session [<ID> [delete]] — list sessions, show one, or delete one (full or shorthand id).

    Other people's sessions are visible only to the shell and admin requests: a proxy, Slack or
    API user sees and deletes only their own.
    """
    parts = args.split()
    everyone = gate.may_administer()
    if not parts:
        rows = [
            f"  ID [{s.shorthand}] {s.client_id}: model={s.model}, history={len(s.history)} messages"
            f"{' (current)' if s is session else ''}"
            for s in rt.sessions.all() if everyone or s is session
        ]
        return "Active sessions:\n" + "\n".join(rows) if rows else "No active sessions."
    ident, action = parts[0], (parts[1].lower() if len(parts) > 1 else "")
    client_id = rt.sessions.resolve(ident)
    if client_id is None or (client_id != session.client_id and not everyone):
        return f"Session not found: {ident}\nUse !session to list sessions."
    if action == "delete":
        deleted = await delete_session(rt, client_id)  # never cancels this request itself
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


# ── Gate, prompt and delegation commands ────────────────────────────────────────────────────

_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _bool(word: str) -> bool | None:
    word = word.lower()
    return True if word in _TRUE else False if word in _FALSE else None


def _state_word(allowed: bool) -> str:
    return "auto-allow (gate OFF)" if allowed else "gated (gate ON)"


def _perm_line(rt: state.Runtime, session: state.Session, section: str, key: str) -> str:
    parts = []
    for op in gate.OPERATIONS:
        own = op in session.settings.get("gates", {}).get(section, {}).get(key, {})
        parts.append(f"{op}={'auto-allow' if rt.gate.allowed(session, section, key, op) else 'gated'}"
                     + (" (this session)" if own else ""))
    return ", ".join(parts)


_DB_LABELS = {gate.ANY_TABLE: "* (every table without its own entry)",
              gate.META: "__meta__ (statements on no table: SHOW, DESCRIBE, SELECT 1)"}
_AUTOAIDB_USAGE = (
    "Usage:\n  !autoAIdb status\n  !autoAIdb <table> <read|write> <true|false>\n"
    "  !autoAIdb <read|write> <true|false>     (every table: * and __meta__)\n"
    "  !autoAIdb <table> <true|false>          (read and write)\n"
    "Examples: !autoAIdb users read true   !autoAIdb write false   !autoAIdb __meta__ true"
)


async def cmd_autoaidb(rt: state.Runtime, session: state.Session, args: str) -> str:
    """!autoAIdb — show or change this session's database gates (per table, read/write)."""
    parts = args.lower().split()
    if not parts or parts == ["status"]:
        rows = [f"  {_DB_LABELS.get(k, k)}: {_perm_line(rt, session, 'db', k)}" for k in rt.gate.keys("db", session)]
        return ("Database gates of this session (gate-defaults.json, then this session's changes):\n"
                + "\n".join(rows or ["  (no entries: every table is gated)"]))
    if not gate.may_administer():
        return gate.refusal("!autoAIdb")
    value = _bool(parts[-1])
    if value is None or len(parts) > 3:
        return f"ERROR: Invalid arguments\n{_AUTOAIDB_USAGE}"
    if len(parts) == 2 and parts[0] in gate.OPERATIONS:
        keys, ops = [gate.ANY_TABLE, gate.META], [parts[0]]
    elif len(parts) == 3 and parts[1] in gate.OPERATIONS:
        keys, ops = [parts[0]], [parts[1]]
    elif len(parts) == 2:
        keys, ops = [parts[0]], list(gate.OPERATIONS)
    else:
        return f"ERROR: Invalid arguments\n{_AUTOAIDB_USAGE}"
    for key in keys:
        for op in ops:
            rt.gate.set_override(session, "db", key, op, value)
    await rt.sessions.save(session)
    what = "every table (* and __meta__)" if len(keys) > 1 else keys[0]
    return f"autoAIdb {what} {'+'.join(ops)}: {_state_word(value)} for this session."


_AUTOGATE_USAGE = (
    "Usage:\n  !autogate [status]                       all tool gates of this session\n"
    "  !autogate <type|tool>                    one group or tool\n"
    "  !autogate <type|tool> [read|write] <true|false>\n"
    "  !autogate <read|write> <true|false>      the default (*) for tools without their own entry\n"
    "Examples: !autogate search true   !autogate drive write false   !autogate read true"
)


def _tool_groups(rt: state.Runtime) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for entry in rt.tools.entries():
        groups.setdefault(gate.gate_type(entry), []).append(entry.tool.name)
    return groups


def _autogate_status(rt: state.Runtime, session: state.Session, groups: dict[str, list[str]]) -> str:
    lines = ["Tool gates of this session (gate-defaults.json, then this session's changes):",
             f"  DEFAULT (*): {_perm_line(rt, session, 'tools', gate.ANY_TABLE)}"]
    for kind in sorted(groups):
        lines.append(f"  {kind}:" + ("  (gated per table: see !autoAIdb)" if kind == "db" else ""))
        if kind != "db":
            lines += [f"    {name}: {_perm_line(rt, session, 'tools', name)}" for name in sorted(groups[kind])]
    return "\n".join(lines)


async def cmd_autogate(rt: state.Runtime, session: state.Session, args: str) -> str:
    """!autogate — show or change this session's tool gates (per tool or per gate type)."""
    parts = args.split()
    groups = _tool_groups(rt)
    if not parts or parts == ["status"]:
        return _autogate_status(rt, session, groups)
    name = parts[0]
    if len(parts) == 1:
        if name.lower() in groups:
            return _autogate_status(rt, session, {name.lower(): groups[name.lower()]})
        if name in rt.tools.names():
            return f"{name}: {_perm_line(rt, session, 'tools', name)}"
    if not gate.may_administer():
        return gate.refusal("!autogate")
    value = _bool(parts[-1])
    if value is None or len(parts) not in (2, 3) or (len(parts) == 3 and parts[1].lower() not in gate.OPERATIONS):
        return f"ERROR: Invalid arguments\n{_AUTOGATE_USAGE}"
    if len(parts) == 2 and name.lower() in gate.OPERATIONS:
        names, ops, what = [gate.ANY_TABLE], [name.lower()], "DEFAULT (*)"
    else:
        ops = [parts[1].lower()] if len(parts) == 3 else list(gate.OPERATIONS)
        if name in rt.tools.names():
            names, what = [name], name
        elif name.lower() in groups:
            names, what = groups[name.lower()], f"{name.lower()} ({', '.join(groups[name.lower()])})"
        else:
            return (f"ERROR: Unknown tool or gate type '{name}'\nGate types: {', '.join(sorted(groups))}\n"
                    f"Tools: {', '.join(rt.tools.names())}")
        if gate.gate_type(rt.tools.entry(names[0])) == "db":
            return "ERROR: database tools are gated per table: use !autoAIdb"
    for key in names:
        for op in ops:
            rt.gate.set_override(session, "tools", key, op, value)
    await rt.sessions.save(session)
    return f"autogate {what} {'+'.join(ops)}: {_state_word(value)} for this session."


async def cmd_autoaisysprompt(rt: state.Runtime, session: state.Session, args: str) -> str:
    """!autoAISysPrompt [read|write] [bool] — gates of reading / editing the system prompt by the model."""
    parts = args.lower().split()
    targets = {"read": "read_system_prompt", "write": "update_system_prompt"}
    if not parts:
        return "\n".join(
            f"autoAISysPrompt {op}:{' ' if op == 'read' else ''} "
            f"{'OFF (auto-allow)' if rt.gate.allowed(session, 'tools', tool, op) else 'ON (human gates)'}"
            for op, tool in targets.items())
    if len(parts) == 1 and parts[0] in targets:
        return f"ERROR: Missing boolean value: !autoAISysPrompt {parts[0]} <true|false>"
    op = parts[0] if len(parts) == 2 else "write"  # a lone boolean sets write, as it always did
    value = _bool(parts[-1])
    if value is None or len(parts) > 2 or op not in targets:
        return "ERROR: Invalid arguments\nUsage: !autoAISysPrompt [read|write] <true|false>"
    if not gate.may_administer():
        return gate.refusal("!autoAISysPrompt")
    rt.gate.set_override(session, "tools", targets[op], op, value)
    await rt.sessions.save(session)
    return f"autoAISysPrompt {op} ({targets[op]}): {_state_word(value)} for this session."


async def cmd_ratelimit(rt: state.Runtime, session: state.Session, args: str) -> str:
    """!ratelimit [enable <type>] — show the rate limits, or re-enable a tool type disabled for this session."""
    parts = args.lower().split()
    if not parts:
        kinds = {gate.gate_type(e) for e in rt.tools.entries()}
        return ("Rate limits (plugins-enabled.json rate_limits, per session and tool type):\n"
                + rt.rate_limiter.describe(session.client_id, kinds))
    if len(parts) == 2 and parts[0] == "enable":
        if rt.rate_limiter.enable(session.client_id, parts[1]):
            return f"{parts[1]} tools are enabled again for this session."
        return f"{parts[1]} tools are not disabled for this session."
    return "ERROR: Invalid arguments\nUsage: !ratelimit  |  !ratelimit enable <type>"


async def cmd_sysprompt(rt: state.Runtime, session: state.Session, args: str) -> str:
    """!sysprompt [reload] — show the assembled system prompt, or re-read it from disk."""
    if not args:
        return "--- Current system prompt ---\n" + rt.prompt.assemble()
    if args.lower() == "reload":
        text = rt.prompt.load().assemble()
        problems = "".join(f"\nWARNING: {p}" for p in rt.prompt.problems)
        return f"System prompt reloaded from disk ({len(text)} chars, {len(rt.prompt.sections)} sections).{problems}"
    return "ERROR: Invalid arguments\nUsage: !sysprompt  |  !sysprompt reload"


async def cmd_read_system_prompt(rt: state.Runtime, session: state.Session, args: str) -> str:
    """!read_system_prompt [index|name] — the cached prompt, or one section."""
    if not args:
        return "--- Cached system prompt ---\n" + rt.prompt.assemble()
    try:
        return f"--- Section: {args} ---\n" + rt.prompt.render(args)
    except PromptError:
        rows = [f"  [{i}] {s.name}: {s.description}" for i, s in enumerate(rt.prompt.sections)]
        return f"Section '{args}' not found.\n\nAvailable sections:\n" + "\n".join(rows)


async def _set_model_field(rt: state.Runtime, keys: list[str], field: str, value: Any) -> str:
    """Change a field of models in memory and in llm-models.json; returns the persistence note."""
    for key in keys:
        rt.config.models[key] = rt.config.models[key].model_copy(update={field: value})
        if field == "llm_call_timeout":
            rt.llms.pop(key, None)  # the chat model is rebuilt with the new timeout at its next call
    try:
        path = save_model_fields(rt.config.config_dir, {k: {field: value} for k in keys})
    except (ConfigError, OSError) as exc:
        return f"WARNING: Updated in memory but FAILED to persist to llm-models.json: {exc}"
    return f"Changes persisted to {path}."


def _positive_seconds(word: str) -> float | None:
    try:
        value = float(word)
    except ValueError:
        return None
    return value if 0 < value < float("inf") else None


async def _change_models(rt: state.Runtime, args: str, command: str, field: str, parse: Any, shown: Any,
                         usage: str) -> tuple[str, Any]:
    """`[model] value` of a model-setting command: (reply, the value set, or None when nothing changed)."""
    parts = args.split()
    if len(parts) == 2 and parts[0] not in rt.config.models:
        return f"ERROR: Unknown model '{parts[0]}'\nAvailable models: {', '.join(rt.config.models)}\nUsage: {usage}", None
    value = parse(parts[-1]) if len(parts) in (1, 2) else None
    if value is None:
        return f"ERROR: Invalid arguments\nUsage: {usage}", None
    if not gate.may_administer():
        return gate.refusal(command), None
    keys = list(rt.config.models) if len(parts) == 1 else [parts[0]]
    note = await _set_model_field(rt, keys, field, value)
    who = f"all models: {', '.join(keys)}" if len(parts) == 1 else keys[0]
    return f"{field}={shown(value)} set for {who}\n{note}", value


async def cmd_llm_call(rt: state.Runtime, session: state.Session, args: str) -> str:
    """!llm_call [model] [bool] — which models llm_clean_text / llm_clean_tool may delegate to."""
    if not args:
        return "LLM tool_call_available status:\n" + "\n".join(
            f"  {k:<14} tool_call={'YES' if m.tool_call_available else 'NO'}  timeout={m.llm_call_timeout:g}s  "
            f"{m.description}" for k, m in sorted(rt.config.models.items()))
    reply, value = await _change_models(rt, args, "!llm_call", "tool_call_available", _bool,
                                        lambda v: "enabled" if v else "disabled", "!llm_call [model] <true|false>")
    if value:
        rt.rate_limiter.enable(session.client_id, "llm_call")
    return reply


async def cmd_llm_timeout(rt: state.Runtime, session: state.Session, args: str) -> str:
    """!llm_timeout [model] [secs] — delegation timeouts (llm_call_timeout)."""
    if not args:
        return "LLM delegation timeouts:\n" + "\n".join(
            f"  {k:<14} timeout={m.llm_call_timeout:g}s  tool_call={'YES' if m.tool_call_available else 'NO'}"
            for k, m in sorted(rt.config.models.items()))
    reply, _ = await _change_models(rt, args, "!llm_timeout", "llm_call_timeout", _positive_seconds,
                                    lambda v: f"{v:g}s", "!llm_timeout [model] <seconds> (a positive number)")
    return reply


async def cmd_stream(rt: state.Runtime, session: state.Session, args: str) -> str:
    """!stream [on|off] — whether agent_call shows the other agent's answer live in this session."""
    if not args:
        on = session.settings.get(AGENT_CALL_STREAM, True) is not False
        return f"agent_call streaming: {'enabled' if on else 'disabled'}"
    value = _bool(args)
    if value is None:
        return "ERROR: Invalid arguments\nUsage: !stream [on|off]"
    session.settings[AGENT_CALL_STREAM] = value
    await rt.sessions.save(session)
    if value:
        return "agent_call streaming enabled — the other agent's answer and progress are relayed live."
    return "agent_call streaming disabled — only the final result of agent_call is shown (as a tool result)."


CORE_COMMANDS: dict[str, state.Command] = {
    "help": state.Command(cmd_help, usage="!help                       this help"),
    "model": state.Command(cmd_model, usage="!model [key]                list models / switch this session's model"),
    "reset": state.Command(cmd_reset, usage="!reset                      clear this session's history"),
    "session": state.Command(cmd_session, usage="!session [<ID> [delete]]    list sessions / show or delete one (full or shorthand id)"),
    "tool_preview_length": state.Command(
        cmd_tool_preview_length, usage="!tool_preview_length [n]    characters of tool results shown (0/off = all)"
    ),
    "autoaidb": state.Command(
        cmd_autoaidb, usage="!autoAIdb [status | <table> [read|write] <bool> | <read|write> <bool>]  database gates"
    ),
    "autogate": state.Command(
        cmd_autogate, usage="!autogate [status | <type|tool> [[read|write] <bool>] | <read|write> <bool>]  tool gates"
    ),
    "autoaisysprompt": state.Command(
        cmd_autoaisysprompt, usage="!autoAISysPrompt [read|write] [bool]  gates of reading / editing the system prompt"
    ),
    "ratelimit": state.Command(
        cmd_ratelimit, usage="!ratelimit [enable <type>]  rate limits; re-enable a type disabled for this session"
    ),
    "sysprompt": state.Command(cmd_sysprompt, usage="!sysprompt [reload]         show the system prompt / re-read it from disk"),
    "read_system_prompt": state.Command(
        cmd_read_system_prompt, usage="!read_system_prompt [section]  the cached prompt, or one section (name or index)"
    ),
    "llm_call": state.Command(
        cmd_llm_call, usage="!llm_call [model] [bool]    which models accept delegation (llm_clean_text/tool)"
    ),
    "llm_timeout": state.Command(
        cmd_llm_timeout, usage="!llm_timeout [model] [secs]  delegation timeouts (llm_call_timeout)"
    ),
    "stream": state.Command(cmd_stream, usage="!stream [on|off]            agent_call: relay the other agent's answer live"),
}
