"""The server's own `!commands` (the gate commands live beside the gate keeper, in gate.py).

Each handler takes (ctx, turn, args) and returns the text the client is shown; the first line of
its docstring (`!name [args] — what it does`) is its line in `!help`. `ctx` (a `Context`) holds the
few pieces of the server the commands use, not the whole runtime.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import client_classes
import gate
import sessions
import stores
import turns
from config import AppConfig, ConfigError, save_model_fields
from decisions import DEFAULT_MINUTES
from gate_commands import parse_bool
from plugin_loader import PluginLoader
from prompt import PromptError, PromptTree
from registry import ToolRegistry
from tools import AGENT_CALL_STREAM


@dataclass(frozen=True)
class Context:
    """What the server's `!commands` use, assembled once by build.py: parts of the runtime, and the
    few actions of other modules they take, as functions."""

    config: AppConfig
    sessions: sessions.SessionManager
    prompt: PromptTree
    tools: ToolRegistry
    #: Every `!command`, and the plugins (their help and load reports): for `!help`.
    commands: dict[str, turns.Command]
    plugins: PluginLoader | None
    #: The gate keeper: its waiting times, for `!help`.
    gate: gate.GateKeeper
    #: routes.delete_session: the one way a session is deleted.
    delete_session: Callable[[str], Awaitable[stores.Session | None]]
    #: agents.context_report: the session model's window and the size of its next request (`!model`).
    context_report: Callable[[stores.Session], Awaitable[str]]
    #: models.close_models: drop the chat clients of these models (rebuilt at their next call).
    close_models: Callable[[list[str]], Awaitable[None]]
    #: The rate limiter's `reenable(client id, tool type)`.
    reenable: Callable[[str, str], Awaitable[bool]]


def _models_list(ctx: Context, current: str | None) -> str:
    rows = [
        f"  {key:<12} {m.model_id}{' (current)' if key == current else ''}"
        + (f"\n  {'':<12} {m.description}" if m.description else "")
        for key, m in ctx.config.models.items()
    ]
    return "Available models:\n" + "\n".join(rows)


async def cmd_help(ctx: Context, turn: turns.HeldTurn, args: str) -> str:
    """!help — this help"""
    lines = ["Commands:"]
    for name, cmd in sorted(ctx.commands.items()):
        if cmd.owner == "core":
            use, _, what = (cmd.usage or f"!{name}").partition(" — ")
            lines.append(f"  {use:<27} {what}".rstrip())
    lines += [
        "",
        "Prefix a message with @<model> to answer that one message with another model",
        "(in the shell, that turn's tool calls run without gates).",
        "In shell.py also: !session <ID> attach, !gate_preview_length [n], !exit",
        "",
        f"Gates: risky tool calls wait for a human. In the shell: a allow once, t allow for {DEFAULT_MINUTES} min,",
        "s allow for this session, p allow calls of this shape, r reject. No answer within",
        f"{ctx.gate.timeout:g} s rejects; API clients have {ctx.gate.api_timeout:g} s; the chat proxy, Slack and swarm",
        "calls are rejected. Types: db (per table: read/write/ddl; ddl = CREATE/DROP/ALTER/RENAME/TRUNCATE,",
        "never covered by write), search, extract, drive,",
        "system, llm_call and the plugins' own. Only the shell or an admin API client may change gates;",
        "changes apply to this session, gate-defaults.json to every session. true = auto-allow (gate OFF).",
        "!grants lists this session's grants (answers beyond one call); !grants revoke <id>|all ends them.",
    ]
    if ctx.plugins:
        for plugin in ctx.plugins.loaded:
            text = plugin.get_help()
            if text:
                lines += ["", text.rstrip()]
        idle = [r for r in ctx.plugins.reports.values() if r.status != "loaded"]
        if idle:
            lines += ["", "Plugins not loaded:"] + [f"  {r.line()}" for r in idle]
    lines += ["", "Tools:"]
    lines += [
        f"  {e.tool.name:<24} [{gate.gate_type(e)}] {e.tool.description.splitlines()[0] if e.tool.description else ''}"
        for e in ctx.tools.entries()
    ]
    return "\n".join(lines) + "\n"


async def cmd_model(ctx: Context, turn: turns.HeldTurn, args: str) -> str:
    """!model [key] — list models / switch this session's model"""
    session = turn.session
    if not args:
        return _models_list(ctx, session.model) + "\n\n" + await ctx.context_report(session)
    if args not in ctx.config.models:
        return (f"ERROR: Unknown model '{args}'\nAvailable models: {', '.join(ctx.config.models)}\n"
                "Use !model to list all models")
    session.model = args
    await ctx.sessions.save(session)
    return f"Model set to '{args}'."


async def cmd_reset(ctx: Context, turn: turns.HeldTurn, args: str) -> str:
    """!reset — clear this session's history"""
    session = turn.session
    count = len(session.history)
    session.history.clear()
    await ctx.sessions.save(session)
    return f"Conversation history cleared ({count} messages removed)."


async def cmd_session(ctx: Context, turn: turns.HeldTurn, args: str) -> str:
    """!session [<ID> [delete]] — list sessions / show or delete one (full or shorthand id)

    Other people's sessions are visible only to the shell and admin requests: a proxy, Slack or
    API user sees and deletes only their own.
    """
    session = turn.session
    parts = args.split()
    everyone = client_classes.may_administer(turn)
    await ctx.sessions.refresh()  # with several instances: theirs too, as they are now
    if not parts:
        rows = [
            f"  ID [{s.shorthand}] {s.client_id}: model={s.model}, history={len(s.history)} messages"
            f"{' (current)' if s is session else ''}"
            for s in ctx.sessions.all() if everyone or s is session
        ]
        return "Active sessions:\n" + "\n".join(rows) if rows else "No active sessions."
    ident, action = parts[0], (parts[1].lower() if len(parts) > 1 else "")
    client_id = ctx.sessions.resolve(ident)
    if client_id is None or (client_id != session.client_id and not everyone):
        return f"Session not found: {ident}\nUse !session to list sessions."
    if action == "delete":
        if client_id == turn.client_id:  # its own: deleted once this answer has reached the client
            turn.ends_session = True
            return f"Deleted session ID [{session.shorthand}]: {client_id} (the next message starts a new one)"
        deleted = await ctx.delete_session(client_id)  # never cancels this request itself
        if deleted is None:  # deleted elsewhere since it was resolved above
            return f"Session not found: {ident}\nUse !session to list sessions."
        return f"Deleted session ID [{deleted.shorthand}]: {client_id}"
    if action == "attach":
        return "!session <ID> attach is a shell.py command: it switches the terminal to that session."
    if action:
        return f"Unknown action: {action}\nUse: !session <ID> attach|delete"
    s = ctx.sessions.get(client_id)
    assert s is not None
    return (f"Session ID [{s.shorthand}]: {s.client_id}\n  model: {s.model}\n  history: {len(s.history)} messages\n"
            f"  tool_preview_length: {s.tool_preview_length or 'unlimited'}")


async def cmd_tool_preview_length(ctx: Context, turn: turns.HeldTurn, args: str) -> str:
    """!tool_preview_length [n] — characters of tool results shown (0/off = all)"""
    session = turn.session
    def show(n: int) -> str:
        return f"{n} chars" if n else "unlimited"

    if not args:
        return f"Tool preview length: {show(session.tool_preview_length)}"
    value = 0 if args.lower() in ("0", "off", "unlimited") else int(args) if args.isdigit() else None
    if value is None:
        return "ERROR: use !tool_preview_length <n> (characters), or 0 / off / unlimited to show whole results."
    session.tool_preview_length = value
    await ctx.sessions.save(session)
    return f"Tool preview length set to {show(value)}."


async def cmd_sysprompt(ctx: Context, turn: turns.HeldTurn, args: str) -> str:
    """!sysprompt [reload] — show the system prompt / re-read it from disk"""
    if not args:
        return "--- Current system prompt ---\n" + ctx.prompt.assemble()
    if args.lower() == "reload":
        text = ctx.prompt.load().assemble()
        problems = "".join(f"\nWARNING: {p}" for p in ctx.prompt.problems)
        return f"System prompt reloaded from disk ({len(text)} chars, {len(ctx.prompt.sections)} sections).{problems}"
    return "ERROR: Invalid arguments\nUsage: !sysprompt  |  !sysprompt reload"


async def cmd_read_system_prompt(ctx: Context, turn: turns.HeldTurn, args: str) -> str:
    """!read_system_prompt [section] — the cached prompt, or one section (name or index)"""
    if not args:
        return "--- Cached system prompt ---\n" + ctx.prompt.assemble()
    try:
        return f"--- Section: {args} ---\n" + ctx.prompt.render(args)
    except PromptError:
        rows = [f"  [{i}] {s.name}: {s.description}" for i, s in enumerate(ctx.prompt.sections)]
        return f"Section '{args}' not found.\n\nAvailable sections:\n" + "\n".join(rows)


async def _set_model_field(ctx: Context, keys: list[str], field: str, value: Any) -> str:
    """Change a field of models in memory and in llm-models.json; returns the persistence note."""
    for key in keys:
        ctx.config.models[key] = ctx.config.models[key].model_copy(update={field: value})
    if field == "llm_call_timeout":
        await ctx.close_models(keys)  # rebuilt with the new timeout at its next call
    try:
        path = save_model_fields(ctx.config.config_dir, {k: {field: value} for k in keys})
    except (ConfigError, OSError) as exc:
        return f"WARNING: Updated in memory but FAILED to persist to llm-models.json: {exc}"
    return f"Changes persisted to {path}."


def _positive_seconds(word: str) -> float | None:
    try:
        value = float(word)
    except ValueError:
        return None
    return value if 0 < value < float("inf") else None


async def _change_models(
    ctx: Context, turn: turns.HeldTurn, args: str, command: str, field: str, parse: Any, shown: Any, usage: str
) -> tuple[str, Any]:
    """`[model] value` of a model-setting command: (reply, the value set, or None when nothing changed)."""
    parts = args.split()
    if len(parts) == 2 and parts[0] not in ctx.config.models:
        return (
            f"ERROR: Unknown model '{parts[0]}'\nAvailable models: {', '.join(ctx.config.models)}\nUsage: {usage}",
            None,
        )
    value = parse(parts[-1]) if len(parts) in (1, 2) else None
    if value is None:
        return f"ERROR: Invalid arguments\nUsage: {usage}", None
    if not client_classes.may_administer(turn):
        return client_classes.refusal(command, turn), None
    keys = list(ctx.config.models) if len(parts) == 1 else [parts[0]]
    note = await _set_model_field(ctx, keys, field, value)
    who = f"all models: {', '.join(keys)}" if len(parts) == 1 else keys[0]
    return f"{field}={shown(value)} set for {who}\n{note}", value


async def cmd_llm_call(ctx: Context, turn: turns.HeldTurn, args: str) -> str:
    """!llm_call [model] [bool] — which models accept delegation (llm_clean_text/tool)"""
    session = turn.session
    if not args:
        return "LLM tool_call_available status:\n" + "\n".join(
            f"  {k:<14} tool_call={'YES' if m.tool_call_available else 'NO'}  timeout={m.llm_call_timeout:g}s  "
            f"{m.description}" for k, m in sorted(ctx.config.models.items()))
    reply, value = await _change_models(ctx, turn, args, "!llm_call", "tool_call_available", parse_bool,
                                        lambda v: "enabled" if v else "disabled", "!llm_call [model] <true|false>")
    if value:
        await ctx.reenable(session.client_id, "llm_call")
    return reply


async def cmd_llm_timeout(ctx: Context, turn: turns.HeldTurn, args: str) -> str:
    """!llm_timeout [model] [secs] — delegation timeouts (llm_call_timeout)"""
    if not args:
        return "LLM delegation timeouts:\n" + "\n".join(
            f"  {k:<14} timeout={m.llm_call_timeout:g}s  tool_call={'YES' if m.tool_call_available else 'NO'}"
            for k, m in sorted(ctx.config.models.items()))
    reply, _ = await _change_models(ctx, turn, args, "!llm_timeout", "llm_call_timeout", _positive_seconds,
                                    lambda v: f"{v:g}s", "!llm_timeout [model] <seconds> (a positive number)")
    return reply


async def cmd_stream(ctx: Context, turn: turns.HeldTurn, args: str) -> str:
    """!stream [on|off] — agent_call: relay the other agent's answer live"""
    session = turn.session
    if not args:
        on = session.settings.get(AGENT_CALL_STREAM, True) is not False
        return f"agent_call streaming: {'enabled' if on else 'disabled'}"
    value = parse_bool(args)
    if value is None:
        return "ERROR: Invalid arguments\nUsage: !stream [on|off]"
    session.settings[AGENT_CALL_STREAM] = value
    await ctx.sessions.save(session)
    if value:
        return "agent_call streaming enabled — the other agent's answer and progress are relayed live."
    return "agent_call streaming disabled — only the final result of agent_call is shown (as a tool result)."


#: The server's own `!commands` besides the gate commands (gate_commands.COMMANDS): name → handler (ctx, turn, args).
COMMANDS: dict[str, Callable[[Context, turns.HeldTurn, str], Awaitable[str]]] = {
    "help": cmd_help, "model": cmd_model, "reset": cmd_reset, "session": cmd_session,
    "tool_preview_length": cmd_tool_preview_length, "sysprompt": cmd_sysprompt,
    "read_system_prompt": cmd_read_system_prompt, "llm_call": cmd_llm_call, "llm_timeout": cmd_llm_timeout,
    "stream": cmd_stream,
}
