"""Human approval gates, the per-session rate limiter and client classes.

Every tool call passes `check_rate_limit` and then `check_human_gate` (both installed in
`Runtime.tool_checks`, in that order) before its executor runs. A tool's gate comes from its
declaration (`get_gate_tools()` of its plugin, or the core tools' own): `{"type": <gate type>,
"operation": "read" | "write" | callable(args) -> "read" | "write"}`. The `db` type classifies
`args["sql"]` (`sql.classify_sql`: read, write or ddl, per table) and gates per table, with the
server's rule for the case of names (gate `case_sensitive`, see `case_rule`); every other type
gates per tool name. Whether a
call runs without asking is looked up in this session's overrides (set by `!autoAIdb`,
`!autogate`, `!autoAISysPrompt` and "allow for this session"), then in `gate-defaults.json`;
a specific entry beats `*`, and anything not found is gated.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import approvals
import grants
import guard
import sql
import state
from config import CODE_DIR, ConfigError, GateDefaults, GatePermission, RateLimit, ToolPermission, secret_values

if TYPE_CHECKING:  # annotations only: the registry imports langchain, which agentctl does not need
    from registry import RegisteredTool

logger = logging.getLogger("agent_mcp.gate")


READ, WRITE, DDL = sql.READ, sql.WRITE, sql.DDL
#: Operations of a tool's gate; database gates also have `ddl` (DB_OPERATIONS: CREATE, DROP, ALTER, …).
OPERATIONS = (READ, WRITE)
DB_OPERATIONS = sql.OPERATIONS
META, ANY_TABLE = sql.META, sql.ANY_TABLE
#: Gate (and rate-limit) type of a tool that declared none.
DEFAULT_TYPE = "system"
DEFAULT_GATE_TIMEOUT = 120.0
DEFAULT_API_GATE_TIMEOUT = 2.0


@dataclass(frozen=True)
class Refusal:
    """A tool call a check stopped, as a value: `kind` says why (rate_limited, reject, timeout, or
    denied: nobody could approve it), `text` is what the model reads instead of a result."""

    kind: str
    text: str


if TYPE_CHECKING:
    import shared
    #: A tool check: async (rt, turn, registered tool, validated args) → None to go on, or a Refusal.
    #: A check that refuses tells the user itself (a status event).
    ToolCheck = Callable[[state.Runtime, state.Turn, RegisteredTool, dict[str, Any]], Awaitable[Refusal | None]]

# ── Clients ─────────────────────────────────────────────────────────────────────────────────

SHELL, API, SWARM, PROXY, SLACK, MCP, UNKNOWN = "shell", "api", "swarm", "proxy", "slack", "mcp", "unknown"
#: How a gate of a client class is answered: a person waits for it ("human", GATE_TIMEOUT), a program
#: may answer within the API window ("window", API_GATE_TIMEOUT), or nobody can ("reject", at once).
HUMAN_WAIT, WINDOW_WAIT, NO_WAIT = "human", "window", "reject"


@dataclass(frozen=True)
class ClientClass:
    """What the clients of one class are; privileges come from the request (see `may_administer`)."""

    name: str
    label: str
    gate_wait: str = NO_WAIT


#: Every client class. Plugins declare which client-id namespace belongs to which class
#: (`BasePlugin.CLIENT_NAMESPACES`); an id no loaded plugin owns is UNKNOWN: the least privilege.
CLASSES = {c.name: c for c in (
    ClientClass(SHELL, "the shell", HUMAN_WAIT),
    ClientClass(API, "an API client", WINDOW_WAIT),
    ClientClass(SWARM, "another agent (swarm call)"),
    ClientClass(PROXY, "the chat proxy"),
    ClientClass(SLACK, "Slack"),
    ClientClass(MCP, "an MCP client", HUMAN_WAIT),  # answered by a person holding a human MCP token
    ClientClass(UNKNOWN, "a client no plugin vouches for"),
)}
CLIENT_LABELS = {name: c.label for name, c in CLASSES.items()}


def client_class(client_id: str | None, rt: state.Runtime | None = None) -> str:
    """The class of the loaded plugin's namespace that owns `client_id` (the longest prefix), else UNKNOWN."""
    rt = rt or state.installed()
    return _owner_class(rt.client_namespaces if rt else {}, client_id or "")


def _owner_class(namespaces: dict[str, tuple[str, str]], client_id: str) -> str:
    best, kind = -1, UNKNOWN
    for prefix, (declared, _plugin) in namespaces.items():
        if client_id.startswith(prefix) and len(prefix) > best:
            best, kind = len(prefix), declared
    return kind


def session_class(namespaces: dict[str, tuple[str, str]], session: state.Session) -> str:
    """The class a session is bounded and listed as: the class of the client that created it.

    Sessions stored before classes were recorded: their id's namespace, and bare ids are the
    shell's (the only client that created them). Never a source of privilege.
    """
    recorded = session.settings.get(state.CLIENT_CLASS)
    if recorded in CLASSES:
        return str(recorded)
    kind = _owner_class(namespaces, session.client_id)
    return SHELL if kind == UNKNOWN and state.CLIENT_CLASS not in session.settings else kind


def may_administer(turn: state.Turn | None) -> bool:
    """Whether `turn` may change gates or run privileged (★) commands such as `!db`.

    Accepted: a request the token-authenticated shell endpoint vouched for (payload
    `"interactive": True`), or one whose client plugin vouched for an administrator (payload
    `"admin": True`: the API plugin when the caller holds the admin token). Nothing else, whatever
    its client id; outside a request, nobody.
    """
    return turn is not None and turn.may_administer


def without_locations(rt: state.Runtime, text: str) -> str:
    """`text` with no secret, file path, hostname, address, URL (userinfo included) or DSN in it: the one
    redaction of every surface a non-admin reads (command output, errors, the model's tool results).
    Configured secrets become `***`, known directories their name, any other location `<hidden>`."""
    for secret in secret_values(rt.config.env, rt.config.enabled.plugin_config):
        text = text.replace(secret, "***")
    return guard.hide_locations(text, {"<config dir>": rt.config.config_dir, "<data dir>": rt.config.data_dir(),
                                       "<install dir>": CODE_DIR, "~": Path.home()})


def refusal(command: str, turn: state.Turn | None) -> str:
    """The message a client gets for a privileged command it may not run."""
    kind = turn.kind if turn is not None else UNKNOWN
    return (f"ERROR: {command} is accepted only from the interactive shell (shell.py) or an API client "
            f"holding the admin token; this request comes from {CLIENT_LABELS[kind]}.")


# ── Gate state ──────────────────────────────────────────────────────────────────────────────


def resolve_operation(spec: dict[str, Any], args: dict[str, Any]) -> str:
    """The operation a declared gate says this call performs; anything unclear counts as a write."""
    declared = spec.get("operation", READ)
    if callable(declared):
        try:
            declared = declared(dict(args))
        except Exception:
            logger.warning("gate operation of %s failed; treating the call as a write", spec, exc_info=True)
            return WRITE
    return declared if declared in OPERATIONS else WRITE


def case_rule(entry: RegisteredTool | None) -> bool | None:
    """How the database behind a `db` tool compares table names: its gate's `case_sensitive` (a bool, or a
    callable the plugin answers from the server's `lower_case_table_names`), None when not known."""
    value = (entry.gate if entry else {}).get("case_sensitive")
    if callable(value):
        try:
            value = value()
        except Exception:
            logger.warning("case_sensitive of %s failed; table names are matched both ways", entry, exc_info=True)
            return None
    return value if isinstance(value, bool) else None


def gate_type(entry: RegisteredTool | None) -> str:
    """A registered tool's gate type (also its rate-limit type)."""
    return str((entry.gate if entry else {}).get("type") or DEFAULT_TYPE)


def _overrides(session: state.Session | None, section: str) -> dict[str, dict[str, bool]]:
    if session is None:
        return {}
    return session.settings.get("gates", {}).get(section, {})


def _env_seconds(env: dict[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1
    if value <= 0:
        raise ConfigError(f"environment variable {name}={raw!r}: must be a positive number of seconds")
    return value


class GateKeeper:
    """Decides, asks and records approvals of tool calls for one server instance."""

    def __init__(self, defaults: GateDefaults, *, timeout: float = DEFAULT_GATE_TIMEOUT,
                 api_timeout: float = DEFAULT_API_GATE_TIMEOUT):
        self.defaults = defaults
        self.timeout = timeout
        self.api_timeout = api_timeout
        #: Gates waiting for a human: gate id → (the session's client id, future of the decision).
        self.pending: dict[str, tuple[str, asyncio.Future[grants.Decision]]] = {}
        #: Grants and the audit log (opened by build.build_runtime; None: neither, as in unit tests).
        self.grants: grants.GrantStore | None = None
        #: With a shared store: gates of every instance (shared.GateRelay), so any may answer them.
        self.relay: shared.GateRelay | None = None
        #: Gates routed to approvers (plugins-enabled.json `approvals`); None: none are, as the spec says.
        self.desk: approvals.ApprovalDesk | None = None

    @classmethod
    def from_env(cls, defaults: GateDefaults, env: dict[str, str]) -> GateKeeper:
        """A keeper with `GATE_TIMEOUT` (interactive wait) and `API_GATE_TIMEOUT` (API window) from env."""
        return cls(defaults, timeout=_env_seconds(env, "GATE_TIMEOUT", DEFAULT_GATE_TIMEOUT),
                   api_timeout=_env_seconds(env, "API_GATE_TIMEOUT", DEFAULT_API_GATE_TIMEOUT))

    # ── lookups ──

    def _defaults(self, section: str) -> dict[str, Any]:
        return self.defaults.db if section == "db" else self.defaults.tools

    def explicit(self, session: state.Session | None, section: str, key: str, op: str, *,
                 case_sensitive: bool = True) -> bool | None:
        """The permission set for `key` (session first, then defaults), or None. Database keys on a server
        that ignores the case of names (`case_sensitive=False`) match entries in any case, and then one
        entry that says no wins over others that say yes."""
        caseless = section == "db" and not case_sensitive

        def matching(entries: dict[str, Any]) -> list[Any]:
            if not caseless:
                return [entries[key]] if key in entries else []
            return [v for k, v in entries.items() if k.lower() == key.lower()]

        own = [bool(v[op]) for v in matching(_overrides(session, section)) if op in v]
        if own:
            return all(own)
        found = [bool(getattr(v, op, False)) for v in matching(self._defaults(section))]
        return all(found) if found else None

    def allowed(self, session: state.Session | None, section: str, key: str, op: str, *,
                case_sensitive: bool | None = True) -> bool:
        """True when `op` on `key` ("db": a table, `__meta__` or `*`; "tools": a tool) runs unasked.

        `case_sensitive` is how the database server compares table names (see `case_rule`): entries
        match a key exactly when it does, in any case when it does not; None (not known): only what
        both rules allow.
        """
        if case_sensitive is None:
            return (self.allowed(session, section, key, op, case_sensitive=True)
                    and self.allowed(session, section, key, op, case_sensitive=False))
        wildcard = self.explicit(session, section, ANY_TABLE, op) is True
        if section == "db" and key == ANY_TABLE:
            # Unknown tables: only if every table could be written, the explicitly gated ones too.
            named = set(_overrides(session, "db")) | set(self.defaults.db)
            return wildcard and all(self.explicit(session, "db", t, op) is not False
                                    for t in named - {ANY_TABLE, META})
        own = self.explicit(session, section, key, op, case_sensitive=case_sensitive)
        if section == "db" and sql.is_system_key(key):
            return own is True  # the server's own schemas (accounts, grants): never through `*`
        return own if own is not None else wildcard

    def keys(self, section: str, session: state.Session | None) -> list[str]:
        """Every key with an entry in the defaults or this session's overrides, `*` first."""
        found = set(self._defaults(section)) | set(_overrides(session, section))
        return sorted(found, key=lambda k: (k != ANY_TABLE, k != META, k))

    def set_default(self, section: str, key: str, ops: Iterable[str], allowed: bool) -> ToolPermission:
        """Change `gate-defaults.json`'s entry for `key` in memory (every session); returns the new entry.
        The caller saves `self.defaults` (config.save_gate_defaults) and says whether that worked."""
        entries = self.defaults.db if section == "db" else self.defaults.tools
        blank = GatePermission() if section == "db" else ToolPermission()
        entries[key] = (entries.get(key) or blank).model_copy(update=dict.fromkeys(ops, allowed))
        return entries[key]

    @staticmethod
    def set_override(session: state.Session, section: str, key: str, op: str, value: bool) -> None:
        """Record a per-session permission (persisted with the session)."""
        gates = session.settings.setdefault("gates", {})
        gates.setdefault(section, {}).setdefault(key, {})[op] = bool(value)

    # ── the check ──

    def audit(self, event: str, **fields: Any) -> None:
        """Append to the audit log, when there is one (see grants.GrantStore.audit)."""
        if self.grants is not None:
            self.grants.audit(event, **fields)

    async def check(self, rt: state.Runtime, turn: state.Turn, entry: RegisteredTool,
                    args: dict[str, Any]) -> Refusal | None:
        """The gate of one tool call: None to run it, or the refusal the model receives.

        Allowed without asking when gate-defaults or this session's gate commands say so, or when an
        active grant of the session covers it; otherwise a human is asked (or, for a client class that
        cannot ask one, it is refused). Every decision, and every use of a grant, goes to the audit log.
        """
        client_id, tool_name, session = turn.client_id, entry.tool.name, turn.session
        case = case_rule(entry)
        if gate_type(entry) == "db":
            op, found = sql.classify_sql(args.get("sql"), case_sensitive=case is not False)
            section, keys, tables = "db", sorted(found), sorted(found)
        else:
            op, section, keys, tables = resolve_operation(entry.gate, args), "tools", [tool_name], []
        if all(self.allowed(session, section, k, op, case_sensitive=case) for k in keys):
            rt.metrics.gate_allowed("policy")
            _covers(turn, section, "policy", allows=functools.partial(self.allowed, session, "db", case_sensitive=case))
            return None

        @functools.cache
        def shaped() -> tuple[str, str]:  # (shape, its digest): parsed again only when needed
            shape = _call_shape(entry, args)
            return shape, grants.digest([tool_name, shape]) if shape else ""

        audit = {"session": client_id, "tool": tool_name, "op": op, "tables": tables, "args": args}
        if self.grants is not None:
            await self.grants.refresh(client_id)  # with several instances: granted or revoked on another one
        grant = self.grants.find(client_id, tool_name, section, keys, op, lambda: shaped()[1]) if self.grants else None
        if grant is not None:
            assert self.grants is not None
            self.grants.used(grant)
            rt.metrics.gate_allowed("grant")
            self.audit("grant_used", actor=_actor(turn), outcome="allowed", grant_id=grant.id, **audit)
            rt.hub.status(client_id, f"[gate ✓] {tool_name}: allowed by grant {grant.id} ({grant.scope})")
            _covers(turn, section, "grant", grant.keys, grant.op)
            return None
        _covers(turn, section, "approval", keys, op)  # what a person approves below (or an @model turn)
        if turn.bypass_gates:
            rt.metrics.gate_allowed("model_prefix")
            self.audit("decision", actor=_actor(turn), outcome="allowed (@model turn)", **audit)
            rt.hub.status(client_id, f"[gate ✓] {tool_name}: allowed without asking (@model turn)")
            return None
        what = f"{op} on {', '.join(tables)}" if tables else op
        wait = CLASSES[turn.kind].gate_wait
        route = self.desk.route(turn.kind, tool_name, section, keys) if self.desk is not None else None
        if wait == NO_WAIT and route is None:
            label = CLIENT_LABELS[turn.kind]
            self.audit("decision", actor=_actor(turn), outcome="denied (no one can approve)", **audit)
            rt.hub.status(client_id, f"[gate ✗] {tool_name} ({what}) needs approval, which {label} "
                                     "cannot give — rejected")
            return Refusal("denied", f"TOOL CALL REJECTED: {tool_name} ({what}) needs human approval, and this "
                                     f"client ({label}) cannot give it, so it was not run. Do not retry it; tell "
                                     "the user that an operator can allow it from the shell (!autogate / "
                                     "!autoAIdb) or in gate-defaults.json.")
        timeout = route.timeout if route else self.timeout if wait == HUMAN_WAIT else self.api_timeout
        shape, pattern = shaped()
        grantable = ANY_TABLE not in keys and self.grants is not None
        offers = [s for s in grants.GRANT_SCOPES if grantable and (s != grants.PATTERN or pattern)]
        payload = {"tool_name": tool_name, "tool_args": {**args, "operation_type": op}, "tables": tables,
                   "timeout_seconds": timeout, "grants": offers, **({"shape": shape} if pattern else {})}
        routed = None if route is None else approvals.RoutedGate(
            "", client_id, turn.kind, CLIENT_LABELS[turn.kind], tool_name, op, tables,
            shape or str(args.get("sql") or "")[:approvals.ARG_CHARS] if section == "db" else json.dumps(
                approvals.trimmed(args), ensure_ascii=False), approvals.trimmed(args), offers, 0.0, 0.0,
            [str(a) for a in route.approvers], route.who(), turn.id)
        if routed is not None:
            payload.update(approvers=routed.approvers, waiting_for=routed.who, headline=routed.headline())
        decision, gate_id = await self.ask(rt, client_id, payload, timeout, routed)
        rt.metrics.gate_answered(decision.word)
        resolved = {"gate_id": gate_id, "decision": decision.word}
        if routed is not None:  # who answered, through which channel, after how long: for the client and the audit
            closing = (await self.desk.get(gate_id))[1] if self.desk else None
            closing = closing or approvals.Closing(gate_id, decision.word, decision.by)
            resolved.update(by=closing.by, channel=closing.channel)
            audit["detail"] = approvals.audit_detail(routed, closing)
        if decision.word in offers:
            assert self.grants is not None
            grant = grants.new_grant(client_id, decision, tool_name, section, keys, op, pattern, shape)
            # Its record first: the grant is bound to it (honoured only while that record is in the chain).
            grant.audit_seq = self.grants.audit("grant", actor=decision.by, outcome=grant.describe(grant.created),
                                                grant_id=grant.id, **audit)
            self.grants.add(grant)
            rt.hub.publish(client_id, "status", {"text": f"[gate ✓] {tool_name}: {grant.describe(grant.created)}",
                                                 "grant": grant.id, **resolved})
            return None
        return self._answered(rt, client_id, tool_name, what, timeout, decision, resolved, audit)

    def _answered(self, rt: state.Runtime, client_id: str, tool_name: str, what: str, timeout: float,
                  decision: grants.Decision, resolved: dict[str, Any], audit: dict[str, Any]) -> Refusal | None:
        """A gate answered without a grant (allow once, reject, no answer): told, audited, and the refusal if any."""
        if decision.word in grants.GRANT_SCOPES:  # not offered for this call: it becomes a yes for this call only
            decision = grants.Decision("allow", decision.by)
            note = "allowed once (a statement that could not be analysed is never granted beyond this call)"
        else:
            note = {"allow": "allowed once", "reject": "rejected", "timeout": "no answer: rejected"}[decision.word]
        self.audit("decision", actor=decision.by or "timeout", outcome=note, **audit)
        if decision.word == "allow":
            note += f" by {resolved['by']}" if resolved.get("by") else ""
            rt.hub.publish(client_id, "status", {"text": f"[gate ✓] {tool_name}: {note}", **resolved})
            return None
        if decision.word == "timeout":
            rt.hub.publish(client_id, "status", {
                "text": f"[gate ✗] {tool_name}: no answer within {timeout:g} s — rejected", **resolved})
            return Refusal("timeout", f"TOOL CALL REJECTED: nobody approved your {tool_name} request ({what}) "
                                      f"within {timeout:g} s, so it was not run. Do not retry it now; tell the user "
                                      "it is waiting for their approval.")
        whom = f"{resolved['by']} (an approver)" if resolved.get("by") else "the user"
        rt.hub.publish(client_id, "status", {"text": f"[gate ✗] {tool_name}: rejected by {whom}", **resolved})
        return Refusal("reject", f"TOOL CALL REJECTED: the user rejected your {tool_name} request ({what}). Do not "
                                 "retry it; tell the user it was not run and ask how they want to proceed.")

    async def ask(self, rt: state.Runtime, client_id: str, payload: dict[str, Any], wait_seconds: float,
                  routed: approvals.RoutedGate | None = None) -> tuple[grants.Decision, str]:
        """Send a gate event and wait for its decision (word `timeout` when none came), with the gate id.

        A `routed` gate is also put on the approver feed, its requester is told who it waits for, and the
        first answer (or the timeout) is claimed once (`approvals.ApprovalDesk.claim`). The pending entry is
        always removed: on a decision, on timeout, and when the turn is cancelled.
        """
        gate_id = str(uuid.uuid4())
        future: asyncio.Future[grants.Decision] = asyncio.get_running_loop().create_future()
        self.pending[gate_id] = (client_id, future)
        # With a shared store the gate is listed, and answerable, on every instance.
        relayed = (self.relay.listening(gate_id, client_id, wait_seconds, future, grants.Decision)
                   if self.relay is not None else contextlib.nullcontext())
        desk = self.desk if routed is not None else None
        try:
            async with relayed, rt.tracing.waiting(f"gate {payload.get('tool_name')}") as span:
                rt.metrics.gate_raised()
                if desk is not None and routed is not None:
                    rt.metrics.gate_routed()
                    await approvals.opening(desk, rt.hub, routed, gate_id, wait_seconds)
                rt.hub.gate(client_id, {"gate_id": gate_id, **payload})
                try:
                    async with asyncio.timeout(wait_seconds):
                        decision = await future
                except TimeoutError:
                    decision = grants.Decision("timeout")
                    if desk is not None and routed is not None:  # an answer may have been claimed just before
                        decision = await approvals.timed_out(desk, routed) or decision
                rt.tracing.note(span, agent_mcp__gate__decision=decision.word)
        finally:
            self.pending.pop(gate_id, None)
            if desk is not None and routed is not None:
                final = await approvals.closing(desk, routed)
                if final.decision == approvals.ABANDONED:  # the turn was cancelled while the gate waited
                    self.audit("decision", session=client_id, actor="abandoned", tool=routed.tool, op=routed.op,
                               tables=routed.tables, outcome="not run: the turn ended before an answer",
                               detail=approvals.audit_detail(routed, final))
        return decision, gate_id

    async def answer(self, gate_id: str, decision: str, *, answerer: approvals.Approver | None = None,
                     channel: str = "", by: str = "", minutes: Any = None, may_grant: bool = True,
                     content: dict[str, Any] | None = None) -> approvals.AnswerResult:
        """Answer a pending gate as `answerer` through `channel` (see approvals.AnswerResult for the outcomes).

        A gate routed to approvers takes only an answer of one of them (else NOT_APPROVER, and nothing
        changes), and only the first (later ones get DECIDED with who answered). Any other gate is answered
        as `resolve` does. grants.GrantError (a ValueError) for an answer that is not allowed.
        """
        routed, first = await self.desk.get(gate_id) if self.desk is not None else (None, None)
        if routed is None and first is None:
            done = await self.resolve_plain(gate_id, decision, by=by or str(answerer or ""), minutes=minutes,
                                            may_grant=may_grant, content=content)
            return approvals.AnswerResult(approvals.ANSWERED if done else approvals.UNKNOWN, gate_id)
        assert self.desk is not None
        if first is not None or routed is None:
            return approvals.AnswerResult(approvals.DECIDED, gate_id, first)
        if not await self.desk.admits(routed, answerer, channel):
            self.audit("approval_refused", session=routed.session, actor=str(answerer or by or "anonymous"),
                       tool=routed.tool, op=routed.op, tables=routed.tables, outcome="not an approver of this gate",
                       detail=json.dumps({"channel": channel, "asked": routed.approvers}))
            return approvals.AnswerResult(approvals.NOT_APPROVER, gate_id, approvers=tuple(routed.approvers))
        checked = replace(grants.Decision.parse(decision, str(answerer), minutes, may_grant=may_grant),
                                      content=content)
        won, first = await self.desk.claim(approvals.answered(routed, checked.word, checked.by, channel,
                                                              checked.minutes))
        if not won:
            return approvals.AnswerResult(approvals.DECIDED if first else approvals.UNKNOWN, gate_id, first)
        waiting = self.pending.get(gate_id)
        if waiting is not None:
            if not waiting[1].done():
                waiting[1].set_result(checked)
        elif self.relay is not None:
            await self.relay.answer(gate_id, {"word": checked.word, "by": checked.by, "minutes": checked.minutes,
                                              "content": checked.content})
        return approvals.AnswerResult(approvals.ANSWERED, gate_id)

    async def owner(self, gate_id: str) -> str | None:
        """The client id of the session a pending gate belongs to (on any instance), or None if it is not pending."""
        waiting = self.pending.get(gate_id)
        if waiting is not None:
            return waiting[0]
        return await self.relay.owner(gate_id) if self.relay is not None else None

    async def resolve(self, gate_id: str, decision: str, *, by: str = "", minutes: Any = None,
                      may_grant: bool = True) -> bool:
        """`answer` without an approver identity: True when it decided the gate (never a routed one)."""
        return (await self.answer(gate_id, decision, by=by, minutes=minutes, may_grant=may_grant)).answered

    async def resolve_plain(self, gate_id: str, decision: str, *, by: str = "", minutes: Any = None,
                            may_grant: bool = True, content: dict[str, Any] | None = None) -> bool:
        """Answer a pending gate: allow (once), allow_for (`minutes`), allow_session, allow_pattern or reject;
        `by` names who answered (for the audit log). False if the gate is unknown or already answered;
        grants.GrantError (a ValueError) for an answer that is not allowed. With a shared store the gate
        may belong to a turn on another instance: the answer goes there through Redis."""
        checked = replace(grants.Decision.parse(decision, by, minutes, may_grant=may_grant), content=content)
        waiting = self.pending.get(gate_id)
        if waiting is None:
            return self.relay is not None and await self.relay.answer(
                gate_id, {"word": checked.word, "by": checked.by, "minutes": checked.minutes, "content": content})
        if waiting[1].done():
            return False
        waiting[1].set_result(checked)
        return True


def _covers(turn: state.Turn, section: str, source: str, keys: Iterable[str] = (), op: str = "",
            allows: Callable[[str, str], bool] | None = None) -> None:
    """Record on the turn what a `db` call's decision covers, for the database to enforce (db_roles.py);
    a refusal after this leaves it unused, and execute_tool clears it before the next call."""
    if section == "db":
        turn.db_access = state.DbAccess(source, frozenset((k, op) for k in keys), allows)


def _actor(turn: state.Turn) -> str:
    """Who a request is, for the audit log: its client class and id."""
    return f"{turn.kind}:{turn.client_id}"


def _call_shape(entry: RegisteredTool, args: dict[str, Any]) -> str:
    """What a shape grant matches: a `db` statement with its values replaced by `?`; for other tools,
    the values of the arguments the tool declares as defining its effect (gate `defining`), else all."""
    if gate_type(entry) == "db":
        return sql.sql_shape(args.get("sql"))
    defining = entry.gate.get("defining")
    chosen = {k: args.get(k) for k in defining} if isinstance(defining, list | tuple) else args
    return json.dumps(chosen, sort_keys=True, ensure_ascii=False, default=str)


async def check_rate_limit(rt: state.Runtime, turn: state.Turn, entry: RegisteredTool,
                           args: dict[str, Any]) -> Refusal | None:
    """The rate-limit tool check (see `RateLimiter.check`) of the runtime's current rate limiter."""
    return await rt.rate_limiter.check(rt, turn, entry, args)


async def check_human_gate(rt: state.Runtime, turn: state.Turn, entry: RegisteredTool,
                           args: dict[str, Any]) -> Refusal | None:
    """The gate tool check (see `GateKeeper.check`) of the runtime's current gate keeper."""
    return await rt.gate.check(rt, turn, entry, args)


# ── Gate commands ───────────────────────────────────────────────────────────────────────────

_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def parse_bool(word: str) -> bool | None:
    """True / False for the words of a boolean setting (true, on, yes, 1 …), else None."""
    word = word.lower()
    return True if word in _TRUE else False if word in _FALSE else None


def _state_word(allowed: bool) -> str:
    return "auto-allow (gate OFF)" if allowed else "gated (gate ON)"


def _perm_line(rt: state.Runtime, session: state.Session, section: str, key: str) -> str:
    parts = []
    for op in DB_OPERATIONS if section == "db" else OPERATIONS:
        own = op in session.settings.get("gates", {}).get(section, {}).get(key, {})
        parts.append(f"{op}={'auto-allow' if rt.gate.allowed(session, section, key, op) else 'gated'}"
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


async def cmd_autoaidb(rt: state.Runtime, turn: state.Turn, args: str) -> str:
    """!autoAIdb [status | <table> [read|write|ddl] <bool> | <read|write|ddl> <bool>] — database gates"""
    session = turn.session
    words = args.split()
    # Operation words and booleans in any case; a table name as typed (the server may tell case apart).
    parts = [w if i == 0 and len(words) > 1 and w.lower() not in DB_OPERATIONS else w.lower()
             for i, w in enumerate(words)]
    if not parts or parts == ["status"]:
        rows = [f"  {_DB_LABELS.get(k, k)}: {_perm_line(rt, session, 'db', k)}" for k in rt.gate.keys("db", session)]
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
    for key in keys:
        for op in ops:
            rt.gate.set_override(session, "db", key, op, value)
    await rt.sessions.save(session)
    _audit_policy(rt, turn, "db", keys, ops, value)
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
        groups.setdefault(gate_type(entry), []).append(entry.tool.name)
    return groups


def _autogate_status(rt: state.Runtime, session: state.Session, groups: dict[str, list[str]]) -> str:
    lines = ["Tool gates of this session (gate-defaults.json, then this session's changes):",
             f"  DEFAULT (*): {_perm_line(rt, session, 'tools', ANY_TABLE)}"]
    for kind in sorted(groups):
        lines.append(f"  {kind}:" + ("  (gated per table: see !autoAIdb)" if kind == "db" else ""))
        if kind != "db":
            lines += [f"    {name}: {_perm_line(rt, session, 'tools', name)}" for name in sorted(groups[kind])]
    return "\n".join(lines)


async def cmd_autogate(rt: state.Runtime, turn: state.Turn, args: str) -> str:
    """!autogate [status | <type|tool> [[read|write] <bool>] | <read|write> <bool>] — tool gates"""
    session = turn.session
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
    if not may_administer(turn):
        return refusal("!autogate", turn)
    value = parse_bool(parts[-1])
    if value is None or len(parts) not in (2, 3) or (len(parts) == 3 and parts[1].lower() not in OPERATIONS):
        return f"ERROR: Invalid arguments\n{_AUTOGATE_USAGE}"
    if len(parts) == 2 and name.lower() in OPERATIONS:
        names, ops, what = [ANY_TABLE], [name.lower()], "DEFAULT (*)"
    else:
        ops = [parts[1].lower()] if len(parts) == 3 else list(OPERATIONS)
        if name in rt.tools.names():
            names, what = [name], name
        elif name.lower() in groups:
            names, what = groups[name.lower()], f"{name.lower()} ({', '.join(groups[name.lower()])})"
        else:
            return (f"ERROR: Unknown tool or gate type '{name}'\nGate types: {', '.join(sorted(groups))}\n"
                    f"Tools: {', '.join(rt.tools.names())}")
        if gate_type(rt.tools.entry(names[0])) == "db":
            return "ERROR: database tools are gated per table: use !autoAIdb"
    for key in names:
        for op in ops:
            rt.gate.set_override(session, "tools", key, op, value)
    await rt.sessions.save(session)
    _audit_policy(rt, turn, "tools", names, ops, value)
    return f"autogate {what} {'+'.join(ops)}: {_state_word(value)} for this session."


async def cmd_autoaisysprompt(rt: state.Runtime, turn: state.Turn, args: str) -> str:
    """!autoAISysPrompt [read|write] [bool] — gates of reading / editing the system prompt"""
    session = turn.session
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
    value = parse_bool(parts[-1])
    if value is None or len(parts) > 2 or op not in targets:
        return "ERROR: Invalid arguments\nUsage: !autoAISysPrompt [read|write] <true|false>"
    if not may_administer(turn):
        return refusal("!autoAISysPrompt", turn)
    rt.gate.set_override(session, "tools", targets[op], op, value)
    await rt.sessions.save(session)
    _audit_policy(rt, turn, "tools", [targets[op]], [op], value)
    return f"autoAISysPrompt {op} ({targets[op]}): {_state_word(value)} for this session."


async def cmd_ratelimit(rt: state.Runtime, turn: state.Turn, args: str) -> str:
    """!ratelimit [enable <type>] — rate limits; re-enable a type disabled for you (★ enable)"""
    parts = args.lower().split()
    whom = _whom(turn)
    if not parts:
        kinds = {gate_type(e) for e in rt.tools.entries()}
        return (f"Rate limits (plugins-enabled.json rate_limits, per tool type, counted for {whom}):\n"
                + await rt.rate_limiter.describe(turn.rate_key, kinds))
    if len(parts) in (2, 3) and parts[0] == "enable":
        if not may_administer(turn):  # else auto_disable would stop nobody: the caller lifts it itself
            return refusal("!ratelimit enable", turn)
        key = args.split()[2] if len(parts) == 3 else turn.rate_key  # another caller's, as its refusal names it
        whom = f"'{key}'" if len(parts) == 3 else whom
        if await rt.rate_limiter.reenable(key, parts[1]):
            return f"{parts[1]} tools are enabled again for {whom}."
        return f"{parts[1]} tools are not disabled for {whom}."
    return "ERROR: Invalid arguments\nUsage: !ratelimit  |  !ratelimit enable <type> [<caller>]"


#: The gate commands: name → handler (rt, turn, args).
def _audit_policy(rt: state.Runtime, turn: state.Turn, section: str, keys: Iterable[str], ops: Iterable[str],
                        allowed: bool) -> None:
    rt.gate.audit("policy", session=turn.client_id, actor=_actor(turn), op="+".join(ops),
                        tables=keys if section == "db" else (), tool="" if section == "db" else ",".join(keys),
                        outcome=f"this session: {'auto-allow' if allowed else 'gated'}")


async def cmd_grants(rt: state.Runtime, turn: state.Turn, args: str) -> str:
    """!grants [revoke <id>|all] — this session's grants (who, scope, expiry, uses), or end them now

    The shell and admin API clients may revoke a grant of any session by its id (from another
    window while that session's turn runs: its next call asks again).
    """
    store = rt.gate.grants
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
    ended = store.revoke(owner or turn.client_id, which, _actor(turn))
    if not ended:
        return f"No active grant {parts[1]} in this session; !grants lists them."
    return f"Revoked {', '.join(g.id for g in ended)}: the next such call asks again."


COMMANDS: dict[str, Callable[[state.Runtime, state.Turn, str], Awaitable[str]]] = {
    "autoaidb": cmd_autoaidb, "autogate": cmd_autogate, "autoaisysprompt": cmd_autoaisysprompt,
    "ratelimit": cmd_ratelimit, "grants": cmd_grants,
}


# ── Rate limiter ────────────────────────────────────────────────────────────────────────────

SWEEP_EVERY = 256


def _whom(turn: state.Turn) -> str:
    """Who a rate limit counts for, as the model and the user are told."""
    return "this caller (all its sessions)" if turn.identity else "this session"


class RateLimiter:
    """Sliding windows per (identity, tool type) from `plugins-enabled.json` `rate_limits`.

    The key is a turn's `rate_key`: the proven identity within its client class (one shell token,
    API key, proxy user, MCP token, Slack user), so a caller that makes new session ids still
    shares one window; a session id only when the client plugin proved nothing. A call over the
    limit is refused (and not counted). With `auto_disable` the whole tool type is then disabled
    for that key until `!ratelimit enable <type>`. Deleting a session leaves an identity's windows
    alone. Empty windows are dropped every `SWEEP_EVERY` checks, so memory stays bounded by the
    recently active callers.
    """

    def __init__(self, limits: dict[str, RateLimit], clock: Callable[[], float] = time.monotonic):
        self.limits = limits
        self.clock = clock
        self.windows: dict[tuple[str, str], deque[float]] = {}
        self.disabled: dict[str, set[str]] = {}
        self._checks = 0
        #: With a shared store: the windows and disabled types live in Redis for every instance.
        self.shared: shared.SharedLimits | None = None

    def hit(self, client_id: str, tool_type: str) -> str | None:
        """Count one call; None if allowed, else why not ("limit" or "disabled") as a short reason."""
        if tool_type in self.disabled.get(client_id, ()):
            return "disabled"
        limit = self.limits.get(tool_type)
        if limit is None or limit.calls == 0 or limit.window_seconds == 0:
            return None
        now = self.clock()
        self._checks += 1
        if self._checks % SWEEP_EVERY == 0:
            self.sweep(now)
        window = self.windows.setdefault((client_id, tool_type), deque())
        while window and window[0] <= now - limit.window_seconds:
            window.popleft()
        if len(window) >= limit.calls:
            if limit.auto_disable:
                self.disabled.setdefault(client_id, set()).add(tool_type)
            return "limit"
        window.append(now)
        return None

    def sweep(self, now: float | None = None) -> None:
        """Drop windows whose calls have all expired."""
        now = self.clock() if now is None else now
        for key in list(self.windows):
            limit = self.limits.get(key[1])
            window = self.windows[key]
            if limit is None or not window or window[-1] <= now - limit.window_seconds:
                del self.windows[key]

    async def count(self, client_id: str, tool_type: str) -> str | None:
        """`hit`, in Redis when the store is shared."""
        if self.shared is None:
            return self.hit(client_id, tool_type)
        return await self.shared.hit(client_id, tool_type, self.limits.get(tool_type))

    async def reenable(self, client_id: str, tool_type: str) -> bool:
        """`enable`, in Redis when the store is shared."""
        return await self.shared.enable(client_id, tool_type) if self.shared else self.enable(client_id, tool_type)

    def enable(self, client_id: str, tool_type: str) -> bool:
        """Re-enable a tool type for a session; False if it was not disabled."""
        types = self.disabled.get(client_id, set())
        if tool_type not in types:
            return False
        types.discard(tool_type)
        if not types:
            self.disabled.pop(client_id, None)
        return True

    def forget(self, client_id: str) -> None:
        """Drop everything kept for a deleted session."""
        if self.shared is not None:
            asyncio.get_running_loop().create_task(self.shared.forget(client_id))
        self.disabled.pop(client_id, None)
        for key in [k for k in self.windows if k[0] == client_id]:
            del self.windows[key]

    async def check(self, rt: state.Runtime, turn: state.Turn, entry: RegisteredTool,
                    args: dict[str, Any]) -> Refusal | None:
        """The rate-limit check of one tool call: None to go on, or the refusal the model receives."""
        client_id, tool_name, tool_type = turn.client_id, entry.tool.name, gate_type(entry)
        why = await self.count(turn.rate_key, tool_type)
        if why is None:
            return None
        again = f"the operator can re-enable them with !ratelimit enable {tool_type}"
        if why == "disabled":
            rt.hub.status(client_id, f"[RATE LIMITED] {tool_name}: {tool_type} tools are disabled for {_whom(turn)}")
            return Refusal("rate_limited", f"TOOL DISABLED: {tool_type} tools were disabled for {_whom(turn)} after "
                                           f"the rate limit was exceeded; {again}. Do not call them again.")
        logger.info("rate limit: %s (%s) refused for %s (%s)", tool_name, tool_type, turn.rate_key, why)
        limit = self.limits[tool_type]
        rule = f"limit is {limit.calls} calls in {limit.window_seconds:g} s for {_whom(turn)}"
        rt.hub.status(client_id, f"[RATE LIMITED] {tool_name} ({tool_type}): {rule}")
        message = f"RATE LIMIT EXCEEDED: {tool_name} ({tool_type}) — {rule}."
        if limit.auto_disable:
            return Refusal("rate_limited", f"{message} All {tool_type} tools are now disabled for {_whom(turn)}; "
                                           f"{again}.")
        return Refusal("rate_limited", f"{message} Wait before calling it again.")

    async def describe(self, client_id: str, types: Iterable[str]) -> str:
        """The limits and this session's state, one line per tool type."""
        rows = []
        windows = {k: v.window_seconds for k, v in self.limits.items()}
        if self.shared is not None:
            used_by, off_types = await self.shared.usage(client_id, windows)
        else:
            now = self.clock()
            used_by = {k: sum(1 for t in self.windows.get((client_id, k), ()) if t > now - seconds)
                       for k, seconds in windows.items()}
            off_types = self.disabled.get(client_id, set())
        for tool_type in sorted(set(types) | set(self.limits)):
            limit = self.limits.get(tool_type)
            rule = (
                f"{limit.calls} calls / {limit.window_seconds:g} s" + (", auto_disable" if limit.auto_disable else "")
                if limit and limit.calls and limit.window_seconds
                else "unlimited"
            )
            used = used_by.get(tool_type, 0)
            off = " — DISABLED for this session" if tool_type in off_types else ""
            rows.append(f"  {tool_type:<12} {rule}" + (f" (used {used})" if used else "") + off)
        return "\n".join(rows)
