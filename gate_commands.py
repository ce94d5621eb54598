"""The gate `!commands`: !autoAIdb, !autogate, !autoAISysPrompt (this session's gates), !ratelimit, !grants.

Reading them is open to every client; changing a gate, re-enabling a rate-limited type of another
caller or revoking another session's grant needs `client_classes.may_administer`. Every change of
a gate goes to the audit log as a "policy" record.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import stores
import turns
from client_classes import actor, may_administer, refusal
from gate import ANY_TABLE, DB_OPERATIONS, META, OPERATIONS, GateKeeper, gate_type
from rate_limits import RateLimiter, whom
from sessions import SessionManager

if TYPE_CHECKING:  # annotations only: the registry imports langchain
    from registry import ToolRegistry



@dataclass(frozen=True)
class Parts:
    """What the gate commands use of the server, given once by build.py instead of the whole runtime."""

    gate: GateKeeper
    rate_limiter: RateLimiter
    sessions: SessionManager
    tools: ToolRegistry


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def parse_bool(word: str) -> bool | None:
    """True / False for the words of a boolean setting (true, on, yes, 1 …), else None."""
    word = word.lower()
    return True if word in _TRUE else False if word in _FALSE else None


def _state_word(allowed: bool) -> str:
    return "auto-allow (gate OFF)" if allowed else "gated (gate ON)"


def _perm_line(keeper: GateKeeper, session: stores.Session, section: str, key: str) -> str:
    parts = []
    for op in DB_OPERATIONS if section == "db" else OPERATIONS:
        own = op in session.settings.get("gates", {}).get(section, {}).get(key, {})
        parts.append(f"{op}={'auto-allow' if keeper.allowed(session, section, key, op) else 'gated'}"
                     + (" (this session)" if own else ""))
    return ", ".join(parts)


_DB_LABELS = {ANY_TABLE: "* (every table without its own entry)",
              META: "__meta__ (statements on no table: SHOW, DESCRIBE, SELECT 1)"}
_AUTOAIDB_USAGE = (
    "Usage:\n  !autoAIdb status\n  !autoAIdb <table> <read|write|ddl> <true|false>\n"
    "  !autoAIdb <read|write|ddl> <true|false> (every table: * and __meta__)\n"
    "  !autoAIdb <table> <true|false>          (read and write; ddl only when named)\n"
    "ddl = CREATE, DROP, ALTER, RENAME, TRUNCATE: never covered by write. Table names keep their case\n"
    "(on a server with lower_case_table_names=0, Users and users are different tables).\n"
    "Examples: !autoAIdb users read true   !autoAIdb write false   !autoAIdb logs ddl true"
)


async def cmd_autoaidb(ctx: Parts, turn: turns.HeldTurn, args: str) -> str:
    """!autoAIdb [status | <table> [read|write|ddl] <bool> | <read|write|ddl> <bool>] — database gates"""
    session = turn.session
    words = args.split()
    # Operation words and booleans in any case; a table name as typed (the server may tell case apart).
    parts = [w if i == 0 and len(words) > 1 and w.lower() not in DB_OPERATIONS else w.lower()
             for i, w in enumerate(words)]
    if not parts or parts == ["status"]:
        rows = [f"  {_DB_LABELS.get(k, k)}: {_perm_line(ctx.gate, session, 'db', k)}"
                for k in ctx.gate.keys("db", session)]
        return ("Database gates of this session (gate-defaults.json, then this session's changes):\n"
                + "\n".join(rows or ["  (no entries: every table is gated)"]))
    if not may_administer(turn):
        return refusal("!autoAIdb", turn)
    value = parse_bool(parts[-1])
    if value is None or len(parts) > 3:
        return f"ERROR: Invalid arguments\n{_AUTOAIDB_USAGE}"
    if len(parts) == 2 and parts[0] in DB_OPERATIONS:
        keys, ops = [ANY_TABLE, META], [parts[0]]
    elif len(parts) == 3 and parts[1] in DB_OPERATIONS:
        keys, ops = [parts[0]], [parts[1]]
    elif len(parts) == 2:
        keys, ops = [parts[0]], list(OPERATIONS)
    else:
        return f"ERROR: Invalid arguments\n{_AUTOAIDB_USAGE}"
    ctx.gate.override(session, "db", keys, ops, value, actor(turn))
    await ctx.sessions.save(session)
    what = "every table (* and __meta__)" if len(keys) > 1 else keys[0]
    return f"autoAIdb {what} {'+'.join(ops)}: {_state_word(value)} for this session."


_AUTOGATE_USAGE = (
    "Usage:\n  !autogate [status]                       all tool gates of this session\n"
    "  !autogate <type|tool>                    one group or tool\n"
    "  !autogate <type|tool> [read|write] <true|false>\n"
    "  !autogate <read|write> <true|false>      the default (*) for tools without their own entry\n"
    "Examples: !autogate search true   !autogate drive write false   !autogate read true"
)


def _tool_groups(tools: ToolRegistry) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for entry in tools.entries():
        groups.setdefault(gate_type(entry), []).append(entry.tool.name)
    return groups


def _autogate_status(keeper: GateKeeper, session: stores.Session, groups: dict[str, list[str]]) -> str:
    lines = ["Tool gates of this session (gate-defaults.json, then this session's changes):",
             f"  DEFAULT (*): {_perm_line(keeper, session, 'tools', ANY_TABLE)}"]
    for kind in sorted(groups):
        lines.append(f"  {kind}:" + ("  (gated per table: see !autoAIdb)" if kind == "db" else ""))
        if kind != "db":
            lines += [f"    {name}: {_perm_line(keeper, session, 'tools', name)}" for name in sorted(groups[kind])]
    return "\n".join(lines)


async def cmd_autogate(ctx: Parts, turn: turns.HeldTurn, args: str) -> str:
    """!autogate [status | <type|tool> [[read|write] <bool>] | <read|write> <bool>] — tool gates"""
    session = turn.session
    parts = args.split()
    groups = _tool_groups(ctx.tools)
    if not parts or parts == ["status"]:
        return _autogate_status(ctx.gate, session, groups)
    name = parts[0]
    if len(parts) == 1:
        if name.lower() in groups:
            return _autogate_status(ctx.gate, session, {name.lower(): groups[name.lower()]})
        if name in ctx.tools.names():
            return f"{name}: {_perm_line(ctx.gate, session, 'tools', name)}"
    if not may_administer(turn):
        return refusal("!autogate", turn)
    value = parse_bool(parts[-1])
    if value is None or len(parts) not in (2, 3) or (len(parts) == 3 and parts[1].lower() not in OPERATIONS):
        return f"ERROR: Invalid arguments\n{_AUTOGATE_USAGE}"
    if len(parts) == 2 and name.lower() in OPERATIONS:
        names, ops, what = [ANY_TABLE], [name.lower()], "DEFAULT (*)"
    else:
        ops = [parts[1].lower()] if len(parts) == 3 else list(OPERATIONS)
        if name in ctx.tools.names():
            names, what = [name], name
        elif name.lower() in groups:
            names, what = groups[name.lower()], f"{name.lower()} ({', '.join(groups[name.lower()])})"
        else:
            return (f"ERROR: Unknown tool or gate type '{name}'\nGate types: {', '.join(sorted(groups))}\n"
                    f"Tools: {', '.join(ctx.tools.names())}")
        if gate_type(ctx.tools.entry(names[0])) == "db":
            return "ERROR: database tools are gated per table: use !autoAIdb"
    ctx.gate.override(session, "tools", names, ops, value, actor(turn))
    await ctx.sessions.save(session)
    return f"autogate {what} {'+'.join(ops)}: {_state_word(value)} for this session."


async def cmd_autoaisysprompt(ctx: Parts, turn: turns.HeldTurn, args: str) -> str:
    """!autoAISysPrompt [read|write] [bool] — gates of reading / editing the system prompt"""
    session = turn.session
    parts = args.lower().split()
    targets = {"read": "read_system_prompt", "write": "update_system_prompt"}
    if not parts:
        return "\n".join(
            f"autoAISysPrompt {op}:{' ' if op == 'read' else ''} "
            f"{'OFF (auto-allow)' if ctx.gate.allowed(session, 'tools', tool, op) else 'ON (human gates)'}"
            for op, tool in targets.items())
    if len(parts) == 1 and parts[0] in targets:
        return f"ERROR: Missing boolean value: !autoAISysPrompt {parts[0]} <true|false>"
    op = parts[0] if len(parts) == 2 else "write"  # a lone boolean sets write, as it always did
    value = parse_bool(parts[-1])
    if value is None or len(parts) > 2 or op not in targets:
        return "ERROR: Invalid arguments\nUsage: !autoAISysPrompt [read|write] <true|false>"
    if not may_administer(turn):
        return refusal("!autoAISysPrompt", turn)
    ctx.gate.override(session, "tools", [targets[op]], [op], value, actor(turn))
    await ctx.sessions.save(session)
    return f"autoAISysPrompt {op} ({targets[op]}): {_state_word(value)} for this session."


async def cmd_ratelimit(ctx: Parts, turn: turns.HeldTurn, args: str) -> str:
    """!ratelimit [enable <type>] — rate limits; re-enable a type disabled for you (★ enable)"""
    parts = args.lower().split()
    caller = whom(turn)
    if not parts:
        kinds = {gate_type(e) for e in ctx.tools.entries()}
        return (f"Rate limits (plugins-enabled.json rate_limits, per tool type, counted for {caller}):\n"
                + await ctx.rate_limiter.describe(turn.rate_key, kinds))
    if len(parts) in (2, 3) and parts[0] == "enable":
        if not may_administer(turn):  # else auto_disable would stop nobody: the caller lifts it itself
            return refusal("!ratelimit enable", turn)
        key = args.split()[2] if len(parts) == 3 else turn.rate_key  # another caller's, as its refusal names it
        caller = f"'{key}'" if len(parts) == 3 else caller
        if await ctx.rate_limiter.reenable(key, parts[1]):
            return f"{parts[1]} tools are enabled again for {caller}."
        return f"{parts[1]} tools are not disabled for {caller}."
    return "ERROR: Invalid arguments\nUsage: !ratelimit  |  !ratelimit enable <type> [<caller>]"


async def cmd_grants(ctx: Parts, turn: turns.HeldTurn, args: str) -> str:
    """!grants [revoke <id>|all] — this session's grants (who, scope, expiry, uses), or end them now

    The shell and admin API clients may revoke a grant of any session by its id (from another
    window while that session's turn runs: its next call asks again).
    """
    store = ctx.gate.grants
    if store is None:
        return "Grants are not kept by this server."
    parts = args.split()
    await store.refresh(turn.client_id)  # with several instances: as they are now
    await store.refresh(turn.client_id)  # with several instances: as they are on the shared store now
    if not parts:
        now = store.clock()
        rows = [f"  {g.describe(now)}" for g in store.active(turn.client_id)]
        return ("Grants of this session (answers to gates that reach beyond one call):\n" + "\n".join(rows)
                if rows else "No active grants in this session.")
    if len(parts) != 2 or parts[0].lower() != "revoke":
        return "ERROR: Invalid arguments\nUsage: !grants  |  !grants revoke <id>  |  !grants revoke all"
    which = parts[1] if parts[1].lower() != "all" else "all"
    owner = await store.find_owner(which) if which != "all" and may_administer(turn) else None
    ended = store.revoke(owner or turn.client_id, which, actor(turn))
    if not ended:
        return f"No active grant {parts[1]} in this session; !grants lists them."
    return f"Revoked {', '.join(g.id for g in ended)}: the next such call asks again."


#: The gate commands: name → handler (parts, turn, args).
COMMANDS: dict[str, Callable[[Parts, turns.HeldTurn, str], Awaitable[str]]] = {
    "autoaidb": cmd_autoaidb, "autogate": cmd_autogate, "autoaisysprompt": cmd_autoaisysprompt,
    "ratelimit": cmd_ratelimit, "grants": cmd_grants,
}
