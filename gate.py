"""Human approval gates: the gate keeper decides, asks and records whether a tool call may run.

Every tool call passes the rate limiter (`rate_limits.RateLimiter.check`) and then the gate
(`GateKeeper.check`; both checks of the tool pipeline, `tool_calls.ToolPipeline.checks`, in that order)
before its executor runs. The keeper is also the only writer of gate policy (`set_policy`, `replace_policy`,
`override`).
Client classes live in `client_classes.py`, the gate `!commands` in `gate_commands.py`.

A tool's gate comes from its declaration (`get_gate_tools()` of its plugin, or the core tools'
own): `{"type": <gate type>, "operation": "read" | "write" | callable(args) -> "read" | "write"}`.
The `db` type classifies `args["sql"]` (`sql.classify_sql`: read, write or ddl, per table) and
gates per table, with the server's rule for the case of names (gate `case_sensitive`, see
`case_rule`); every other type gates per tool name. Whether a call runs without asking is looked
up in this session's overrides (set by `!autoAIdb`, `!autogate`, `!autoAISysPrompt` and "allow
for this session"), then in `gate-defaults.json`; a specific entry beats `*`, and anything not
found is gated.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import approvals
import decisions
import events
import gate_policy
import grants
import metrics
import sql
import sql_shape
import stores
import tracing
import turns
from audit_chain import AuditRecord
from client_classes import CLASSES, CLIENT_LABELS, HUMAN_WAIT, NO_WAIT, actor
from config import GATE_DEFAULTS_FILE, ConfigError, GateDefaults, GatePermission, ToolPermission, save_gate_defaults

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
#: The signal (state.Runtime.signals) that carries a change of the gate defaults to the other instances.
POLICY_SIGNAL = "gate-default"


@dataclass(frozen=True)
class Refusal:
    """A tool call a check stopped, as a value: `kind` says why (rate_limited, reject, timeout, or
    denied: nobody could approve it), `text` is what the model reads instead of a result."""

    kind: str
    text: str


if TYPE_CHECKING:
    import shared_gates
    import shared_link
    #: A tool check: async (turn, registered tool, validated args) → None to go on, or a Refusal.
    #: A check that refuses tells the user itself (a status event).
    ToolCheck = Callable[[turns.Turn, RegisteredTool, dict[str, Any]], Awaitable[Refusal | None]]

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


def _overrides(session: stores.Session | None, section: str) -> dict[str, dict[str, bool]]:
    if session is None:
        return {}
    overrides: dict[str, dict[str, bool]] = session.settings.get("gates", {}).get(section, {})
    return overrides


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

    def __init__(self, defaults: GateDefaults, hub: events.EventHub, *, config_dir: Path | None = None,
                 timeout: float = DEFAULT_GATE_TIMEOUT, api_timeout: float = DEFAULT_API_GATE_TIMEOUT):
        self.defaults = defaults
        #: Where the sessions hear of their gates (gate events, status lines).
        self.hub = hub
        #: Where `set_policy` saves gate-defaults.json; None: changes stay in memory (unit tests).
        self.config_dir = config_dir
        self.timeout = timeout
        self.api_timeout = api_timeout
        #: The runtime's metrics and tracing (set by build.build_runtime once they exist).
        self.metrics: Any = metrics.OFF
        self.tracing: Any = tracing.OFF
        #: With a shared store: tells the other instances of a change of the gate defaults.
        self.signals: shared_link.Signals | None = None
        #: Gates waiting for a human: gate id → (the session's client id, future of the decision).
        self.pending: dict[str, tuple[str, asyncio.Future[grants.Decision]]] = {}
        #: Grants and the audit log (opened by build.build_runtime; None: neither, as in unit tests).
        self.grants: grants.GrantStore | None = None
        #: With a shared store: gates of every instance (shared_gates.GateRelay), so any may answer them.
        self.relay: shared_gates.GateRelay | None = None
        #: Gates routed to approvers (plugins-enabled.json `approvals`); None: none are, as the spec says.
        self.desk: approvals.ApprovalDesk | None = None

    @classmethod
    def from_env(cls, defaults: GateDefaults, hub: events.EventHub, env: dict[str, str],
                 config_dir: Path | None = None) -> GateKeeper:
        """A keeper with `GATE_TIMEOUT` (interactive wait) and `API_GATE_TIMEOUT` (API window) from env."""
        return cls(defaults, hub, config_dir=config_dir,
                   timeout=_env_seconds(env, "GATE_TIMEOUT", DEFAULT_GATE_TIMEOUT),
                   api_timeout=_env_seconds(env, "API_GATE_TIMEOUT", DEFAULT_API_GATE_TIMEOUT))

    # ── lookups ──

    def _defaults(self, section: str) -> dict[str, Any]:
        return self.defaults.db if section == "db" else self.defaults.tools

    def explicit(self, session: stores.Session | None, section: str, key: str, op: str, *,
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

    def allowed(self, session: stores.Session | None, section: str, key: str, op: str, *,
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

    def keys(self, section: str, session: stores.Session | None) -> list[str]:
        """Every key with an entry in the defaults or this session's overrides, `*` first."""
        found = set(self._defaults(section)) | set(_overrides(session, section))
        return sorted(found, key=lambda k: (k != ANY_TABLE, k != META, k))

    # ── policy: the keeper is its only writer ──

    async def set_policy(self, change: gate_policy.PolicyChange) -> tuple[GatePermission | ToolPermission, str]:
        """Change one gate default for every session (MCP `set_gate_default`): applied here, saved in
        gate-defaults.json, audited, and sent to the other instances on one Redis. Returns the new entry and
        a note saying where it is in force and whether it was saved."""
        entry, note = self._change_default(change)
        if self.signals is not None:
            try:
                await self.signals.send(POLICY_SIGNAL, change.to_json())
                note += "; in force on every instance on this Redis"
            except stores.SessionError:
                note += "; NOT in force on the other instances (the session store is unreachable): set it again"
        return entry, note

    async def policy_changed_elsewhere(self, subject: str) -> None:
        """Another instance changed a gate default (`set_policy`): the same change here."""
        change = gate_policy.PolicyChange.from_json(subject)
        self._change_default(replace(change, by=f"{change.by} on another instance"))

    def _change_default(self, change: gate_policy.PolicyChange) -> tuple[GatePermission | ToolPermission, str]:
        entry = gate_policy.apply(self.defaults, change)
        note = (gate_policy.save(self.config_dir, self.defaults) if self.config_dir is not None
                else "in force, not saved (no config dir)")
        if "NOT saved" in note:
            logger.error("saving gate defaults failed: %s", note)
        logger.info("gate default %s.%s %s=%s set by %s", change.section, change.key, "+".join(change.ops),
                    change.allowed, change.by)
        self.audit(AuditRecord.policy(change.by, change.section, [change.key], change.ops, change.outcome(note)))
        return entry, note

    def replace_policy(self, new: GateDefaults, by: str) -> Path | None:
        """Replace the whole gate defaults (agentctl saving gate-defaults.json through the server): saved
        first (config.ConfigError or OSError: nothing changed), then in force for every session, each changed
        permission audited. Returns where it was saved."""
        path = save_gate_defaults(self.config_dir, new) if self.config_dir is not None else None
        old, self.defaults = self.defaults, new
        for section in gate_policy.SECTIONS:
            before, after = getattr(old, section), getattr(new, section)
            for key in sorted(set(before) | set(after)):
                for op in DB_OPERATIONS:  # ddl: database keys only (absent on tools: None both ways)
                    was = getattr(before[key], op, None) if key in before else None
                    now = getattr(after[key], op, None) if key in after else None
                    if was != now:
                        word = "removed" if now is None else "auto-allow" if now else "gated"
                        self.audit(AuditRecord.policy(by, section, [key], [op], f"{GATE_DEFAULTS_FILE}: {word}"))
        return path

    def override(self, session: stores.Session, section: str, keys: Iterable[str], ops: Iterable[str],
                 allowed: bool, by: str) -> None:
        """Change this session's own gates (the gate commands; persisted with the session, which the caller
        saves), audited as `by`."""
        keys, ops = list(keys), list(ops)
        for key in keys:
            for op in ops:
                self.set_override(session, section, key, op, allowed)
        self.audit(AuditRecord.policy(by, section, keys, ops, f"this session: {'auto-allow' if allowed else 'gated'}",
                                      session=session.client_id))

    @staticmethod
    def set_override(session: stores.Session, section: str, key: str, op: str, value: bool) -> None:
        """Record a per-session permission, not audited (tests; the gate commands go through `override`)."""
        gates = session.settings.setdefault("gates", {})
        gates.setdefault(section, {}).setdefault(key, {})[op] = bool(value)

    # ── the check ──

    def audit(self, record: AuditRecord) -> None:
        """Append to the audit log, when there is one (see grants.GrantStore.audit)."""
        if self.grants is not None:
            self.grants.audit(record)

    async def check(self, turn: turns.Turn, entry: RegisteredTool,
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
            self.metrics.gate_allowed("policy")
            _covers(turn, section, "policy", allows=functools.partial(self.allowed, session, "db", case_sensitive=case))
            return None

        @functools.cache
        def shaped() -> tuple[str, str]:  # (shape, its digest): parsed again only when needed
            shape = _call_shape(entry, args)
            return shape, grants.digest([tool_name, shape]) if shape else ""

        call = AuditRecord.call(client_id, tool_name, op, tables, args)
        if self.grants is not None:
            await self.grants.refresh(client_id)  # with several instances: granted or revoked on another one
        grant = self.grants.find(client_id, tool_name, section, keys, op, lambda: shaped()[1]) if self.grants else None
        if grant is not None:
            assert self.grants is not None
            self.grants.used(grant)
            self.metrics.gate_allowed("grant")
            self.audit(call.grant_used(actor(turn), grant.id))
            self.hub.status(client_id, f"[gate ✓] {tool_name}: allowed by grant {grant.id} ({grant.scope})")
            _covers(turn, section, "grant", grant.keys, grant.op)
            return None
        _covers(turn, section, "approval", keys, op)  # what a person approves below (or an @model turn)
        if turn.bypass_gates:
            self.metrics.gate_allowed("model_prefix")
            self.audit(call.decision(actor(turn), "allowed (@model turn)"))
            self.hub.status(client_id, f"[gate ✓] {tool_name}: allowed without asking (@model turn)")
            return None
        what = f"{op} on {', '.join(tables)}" if tables else op
        wait = CLASSES[turn.kind].gate_wait
        route = self.desk.route(turn.kind, tool_name, section, keys) if self.desk is not None else None
        if wait == NO_WAIT and route is None:
            label = CLIENT_LABELS[turn.kind]
            self.audit(call.decision(actor(turn), "denied (no one can approve)"))
            self.hub.status(client_id, f"[gate ✗] {tool_name} ({what}) needs approval, which {label} "
                                     "cannot give — rejected")
            return Refusal("denied", f"TOOL CALL REJECTED: {tool_name} ({what}) needs human approval, and this "
                                     f"client ({label}) cannot give it, so it was not run. Do not retry it; tell "
                                     "the user that an operator can allow it from the shell (!autogate / "
                                     "!autoAIdb) or in gate-defaults.json.")
        timeout = route.timeout if route else self.timeout if wait == HUMAN_WAIT else self.api_timeout
        shape, pattern = shaped()
        grantable = ANY_TABLE not in keys and self.grants is not None
        offers = [s for s in decisions.GRANT_SCOPES if grantable and (s != decisions.PATTERN or pattern)]
        payload = {"tool_name": tool_name, "tool_args": {**args, "operation_type": op}, "tables": tables,
                   "timeout_seconds": timeout, "grants": offers, **({"shape": shape} if pattern else {})}
        routed = None if route is None else approvals.RoutedGate(
            "", client_id, turn.kind, CLIENT_LABELS[turn.kind], tool_name, op, tables,
            shape or str(args.get("sql") or "")[:approvals.ARG_CHARS] if section == "db" else json.dumps(
                approvals.trimmed(args), ensure_ascii=False), approvals.trimmed(args), offers, 0.0, 0.0,
            [str(a) for a in route.approvers], route.who(), turn.id)
        if routed is not None:
            payload.update(approvers=routed.approvers, waiting_for=routed.who, headline=routed.headline())
        decision, gate_id = await self.ask(client_id, payload, timeout, routed)
        self.metrics.gate_answered(decision.word)
        resolved = {"gate_id": gate_id, "decision": decision.word}
        if routed is not None:  # who answered, through which channel, after how long: for the client and the audit
            closing = (await self.desk.get(gate_id))[1] if self.desk else None
            closing = closing or approvals.Closing(gate_id, decision.word, decision.by)
            resolved.update(by=closing.by, channel=closing.channel)
            call = call.with_detail(approvals.audit_detail(routed, closing))
        if decision.word in offers:
            assert self.grants is not None
            grant = grants.new_grant(client_id, decision, tool_name, section, keys, op, pattern, shape)
            # Its record first: the grant is bound to it (honoured only while that record is in the chain).
            grant.audit_seq = self.grants.audit(call.grant(decision.by, grant.describe(grant.created), grant.id))
            self.grants.add(grant)
            self.hub.publish(client_id, "status", {"text": f"[gate ✓] {tool_name}: {grant.describe(grant.created)}",
                                                 "grant": grant.id, **resolved})
            return None
        return self._answered(client_id, tool_name, what, timeout, decision, resolved, call)

    def _answered(self, client_id: str, tool_name: str, what: str, timeout: float,
                  decision: grants.Decision, resolved: dict[str, Any], call: AuditRecord) -> Refusal | None:
        """A gate answered without a grant (allow once, reject, no answer): told, audited, and the refusal if any."""
        if decision.word in decisions.GRANT_SCOPES:  # not offered for this call: it becomes a yes for this call only
            decision = grants.Decision("allow", decision.by)
            note = "allowed once (a statement that could not be analysed is never granted beyond this call)"
        else:
            note = {"allow": "allowed once", "reject": "rejected", "timeout": "no answer: rejected"}[decision.word]
        self.audit(call.decision(decision.by or "timeout", note))
        if decision.word == "allow":
            note += f" by {resolved['by']}" if resolved.get("by") else ""
            self.hub.publish(client_id, "status", {"text": f"[gate ✓] {tool_name}: {note}", **resolved})
            return None
        if decision.word == "timeout":
            self.hub.publish(client_id, "status", {
                "text": f"[gate ✗] {tool_name}: no answer within {timeout:g} s — rejected", **resolved})
            return Refusal("timeout", f"TOOL CALL REJECTED: nobody approved your {tool_name} request ({what}) "
                                      f"within {timeout:g} s, so it was not run. Do not retry it now; tell the user "
                                      "it is waiting for their approval.")
        whom = f"{resolved['by']} (an approver)" if resolved.get("by") else "the user"
        self.hub.publish(client_id, "status", {"text": f"[gate ✗] {tool_name}: rejected by {whom}", **resolved})
        return Refusal("reject", f"TOOL CALL REJECTED: the user rejected your {tool_name} request ({what}). Do not "
                                 "retry it; tell the user it was not run and ask how they want to proceed.")

    async def ask(self, client_id: str, payload: dict[str, Any], wait_seconds: float,
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
            async with relayed, self.tracing.waiting(f"gate {payload.get('tool_name')}") as span:
                self.metrics.gate_raised()
                if desk is not None and routed is not None:
                    self.metrics.gate_routed()
                    await approvals.opening(desk, self.hub, routed, gate_id, wait_seconds)
                self.hub.gate(client_id, {"gate_id": gate_id, **payload})
                try:
                    async with asyncio.timeout(wait_seconds):
                        decision = await future
                except TimeoutError:
                    decision = grants.Decision("timeout")
                    if desk is not None and routed is not None:  # an answer may have been claimed just before
                        decision = await approvals.timed_out(desk, routed) or decision
                self.tracing.note(span, agent_mcp__gate__decision=decision.word)
        finally:
            self.pending.pop(gate_id, None)
            if desk is not None and routed is not None:
                final = await approvals.closing(desk, routed)
                if final.decision == approvals.ABANDONED:  # the turn was cancelled while the gate waited
                    self.audit(AuditRecord.call(client_id, routed.tool, routed.op, routed.tables)
                               .with_detail(approvals.audit_detail(routed, final))
                               .decision("abandoned", "not run: the turn ended before an answer"))
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
            self.audit(AuditRecord.approval_refused(routed.session, str(answerer or by or "anonymous"), routed.tool,
                                                    routed.op, routed.tables,
                                                    json.dumps({"channel": channel, "asked": routed.approvers})))
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


def _covers(turn: turns.Turn, section: str, source: str, keys: Iterable[str] = (), op: str = "",
            allows: Callable[[str, str], bool] | None = None) -> None:
    """Record on the turn what a `db` call's decision covers, for the database to enforce (db_roles.py);
    a refusal after this leaves it unused, and the tool pipeline clears it before the next call."""
    if section == "db":
        turn.db_access = turns.DbAccess(source, frozenset((k, op) for k in keys), allows)


def _call_shape(entry: RegisteredTool, args: dict[str, Any]) -> str:
    """What a shape grant matches: a `db` statement with its values replaced by `?`; for other tools,
    the values of the arguments the tool declares as defining its effect (gate `defining`), else all."""
    if gate_type(entry) == "db":
        return sql_shape.sql_shape(args.get("sql"))
    defining = entry.gate.get("defining")
    chosen = {k: args.get(k) for k in defining} if isinstance(defining, list | tuple) else args
    return json.dumps(chosen, sort_keys=True, ensure_ascii=False, default=str)
