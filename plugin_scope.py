"""What one plugin reaches of the sessions, their event streams, gates and the signals between instances: its own.

A plugin's sessions are those whose client id starts with a namespace the loader registered for it
(its `CLIENT_NAMESPACES`), and the session of a turn it serves (its tool runs inside that turn). A
plugin the operator granted `all-sessions` in its plugin-manifest.json entry reaches every session:
the shell is the admin view, the API's admin key and the MCP server's human token manage any.
`PluginContext` hands out these views instead of the session manager, the event hub, the signals, the
gate keeper and the tool registry; acting on a session outside the scope raises `ScopeError`. A gate
routed to approvers (approvals.py) also reaches the plugin that answers for them: the client plugin of
the class they are named after (Slack users and channels: the Slack plugin's). Writing gate policy,
reading every session's grants and vouching for more than a plugin's own client class need the grant.
Scoping is the contract of the plugin surface, not a sandbox: a plugin runs in the server's process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import approvals
import client_classes
import gate_policy
import grants
from audit_chain import AuditRecord
from config import GateDefaults, GatePermission, ModelConfig, ToolPermission
from events import Event, EventHub, HubObserver
from gate import GateKeeper
from registry import RegisteredTool, ToolRegistry
from sessions import SessionManager
from shared_link import Signals
from stores import Session
from turns import Turn, current_turn

#: The approvers (approvals.KINDS) a client plugin answers for: those named after a client class its
#: namespaces state (the Slack plugin's: Slack users and channels).
APPROVERS_OF = {client_classes.SLACK: (approvals.SLACK, approvals.SLACK_CHANNEL),
                client_classes.SHELL: (approvals.SHELL,), client_classes.MCP: (approvals.MCP,),
                client_classes.API: (approvals.API,)}
#: The longest gate id a refusal record names (ours are uuids).
GATE_ID_CHARS = 64
#: What ScopeError adds about the grant.
_GRANT = ("\"grants\": [\"all-sessions\"] in its plugin-manifest.json entry, which only an operator gives")


class ScopeError(PermissionError):
    """A plugin asked to act on a session outside its own; the message names both and the grant that would allow it."""


class Scope:
    """Which sessions one plugin reaches (`everything`: the operator granted it all-sessions)."""

    def __init__(self, plugin: str, namespaces: Mapping[str, tuple[str, str]], sessions: SessionManager,
                 everything: bool) -> None:
        self.plugin = plugin
        self.everything = everything
        self._namespaces = namespaces  # the runtime's: prefix → (class, plugin), filled as client plugins load
        self._sessions = sessions

    def _prefixes(self) -> tuple[str, ...]:
        return tuple(prefix for prefix, (_, owner) in self._namespaces.items() if owner == self.plugin)

    def owns(self, client_id: str) -> bool:
        """The session is in one of the plugin's namespaces (or the plugin may reach every session)."""
        return self.everything or client_id.startswith(self._prefixes())

    def approvers(self) -> frozenset[str]:
        """The approver kinds the plugin answers for (APPROVERS_OF the classes of its namespaces)."""
        classes = {kind for kind, owner in self._namespaces.values() if owner == self.plugin}
        return frozenset(a for kind in classes for a in APPROVERS_OF.get(kind, ()))

    def served_turn(self) -> Turn | None:
        """The turn the code runs for, while that turn runs (a tool the turn called): the turn holding its
        session, so a turn a plugin builds itself (`request(...).turn()`) does not count."""
        turn = current_turn()
        if turn is None or turn.session is None:
            return None
        held = self._sessions.get(turn.client_id) is turn.session and turn.session.running == turn.id
        return turn if held else None

    def _served(self) -> str | None:
        turn = self.served_turn()
        return turn.client_id if turn is not None else None

    def sees(self, client_id: str) -> bool:
        return self.owns(client_id) or self._served() == client_id

    def visible(self, sessions: list[Session]) -> list[Session]:
        """Those of `sessions` the plugin sees."""
        if self.everything:
            return sessions
        prefixes, served = self._prefixes(), self._served()
        return [s for s in sessions if s.client_id.startswith(prefixes) or s.client_id == served]

    def check(self, client_id: str) -> None:
        """Raise ScopeError unless the plugin may act on the session `client_id`."""
        if not self.sees(client_id):
            raise self.outside(f"reach session '{client_id[:80]}'")

    def outside(self, doing: str, also: str = "") -> ScopeError:
        """The refusal of `doing` to a session outside the plugin's namespaces (`also`: what else did not allow it)."""
        mine = ", ".join(f"'{p}'" for p in self._prefixes()) or "none"
        return ScopeError(f"plugin {self.plugin} may not {doing}: it is outside the plugin's client-id namespaces "
                          f"({mine}){also}; a plugin that administers every session needs {_GRANT}")

    def need_all(self, doing: str) -> None:
        """Raise ScopeError unless the operator granted the plugin every session: `doing` needs it."""
        if not self.everything:
            raise ScopeError(f"plugin {self.plugin} may not {doing}: that needs {_GRANT}")


class PluginSessions:
    """The sessions a plugin reaches (`ctx.sessions`): the session manager's methods plugins use, on its own."""

    def __init__(self, manager: SessionManager, scope: Scope) -> None:
        self._manager = manager
        self._scope = scope

    @property
    def shared(self) -> bool:
        """Several instances share the sessions (a Redis store)."""
        return self._manager.store.shared

    async def instances(self) -> int:
        """How many instances use the session store now."""
        return await self._manager.store.instances()

    def get(self, client_id: str) -> Session | None:
        """The session, or None (also when it is not the plugin's)."""
        return self._manager.get(client_id) if self._scope.sees(client_id) else None

    def all(self) -> list[Session]:
        """The plugin's sessions this instance knows, by shorthand id."""
        return self._scope.visible(self._manager.all())

    def count(self) -> int:
        return self._manager.count() if self._scope.everything else len(self.all())

    async def exists(self, client_id: str) -> bool:
        """Whether the plugin's session exists (with a shared store: on any instance, now)."""
        return self._scope.sees(client_id) and await self._manager.exists(client_id)

    async def refresh(self) -> None:
        """With a shared store: read the sessions again (another instance may have changed any)."""
        await self._manager.refresh()

    def resolve(self, ident: str) -> str | None:
        """The full client id of one of the plugin's sessions, from a full or a shorthand id ("101"), or None."""
        client_id = self._manager.resolve(ident)
        return client_id if client_id is not None and self._scope.sees(client_id) else None

    def get_or_add(self, client_id: str, model: str, client_class: str | None = None) -> tuple[Session, bool]:
        """The session, added in memory if new (then True); the caller saves it."""
        self._scope.check(client_id)
        return self._manager.get_or_add(client_id, model, client_class)

    async def get_or_create(self, client_id: str, model: str) -> Session:
        """The session, created and saved if new."""
        self._scope.check(client_id)
        return await self._manager.get_or_create(client_id, model)

    async def save(self, session: Session) -> None:
        self._scope.check(session.client_id)
        await self._manager.save(session)

    def on_forgotten(self, hook: Callable[[str], None]) -> Callable[[], None]:
        """Call `hook(client_id)` when one of the plugin's sessions is removed (deleted, expired, evicted);
        returns the function that stops it."""
        def forgotten(client_id: str) -> None:
            if self._scope.owns(client_id):
                hook(client_id)

        self._manager.forgotten.append(forgotten)

        def stop() -> None:
            if forgotten in self._manager.forgotten:
                self._manager.forgotten.remove(forgotten)

        return stop


class PluginHub:
    """The event streams of a plugin's sessions (`ctx.hub`)."""

    def __init__(self, hub: EventHub, scope: Scope) -> None:
        self._hub = hub
        self._scope = scope

    def publish(self, client_id: str, name: str, data: dict[str, Any] | None = None) -> Event:
        self._scope.check(client_id)
        return self._hub.publish(client_id, name, data)

    def subscribe(self, client_id: str, last_event_id: int | None = None,
                  report_gaps: bool = False) -> AsyncGenerator[Event, None]:
        """The session's events after `last_event_id` (without one: those no subscriber has seen yet), then live."""
        self._scope.check(client_id)
        return self._hub.subscribe(client_id, last_event_id, report_gaps)

    def last_id(self, client_id: str) -> int:
        self._scope.check(client_id)
        return self._hub.last_id(client_id)

    def observe(self, observer: HubObserver) -> Callable[[], None]:
        """Call `observer(client_id, event)` with every event of the plugin's sessions published from now on;
        returns the function that stops it."""
        if self._scope.everything:
            return self._hub.observe(observer)
        return self._hub.observe(lambda client_id, event: observer(client_id, event)
                                 if self._scope.owns(client_id) else None)


class PluginSignals:
    """Signals between one plugin's halves on several instances (`ctx.signals`): its signal names are its
    own, so it neither hears nor sends another plugin's or the core's (`cancel`, `stop`)."""

    def __init__(self, signals: Signals, plugin: str) -> None:
        self._signals = signals
        self._plugin = plugin

    async def send(self, what: str, subject: str) -> None:
        """Tell the plugin on every other instance `what` about `subject`."""
        await self._signals.send(f"{self._plugin}:{what}", subject)

    def on(self, what: str, handler: Callable[[str], Awaitable[Any]]) -> Callable[[], None]:
        """Call `handler(subject)` for every `what` the plugin on another instance sends; returns the function
        that stops it."""
        return self._signals.on(f"{self._plugin}:{what}", handler)


class PluginDesk:
    """The routed gates a plugin sees (`ctx.gate.desk`): those of its sessions and those routed to the
    approvers it answers for."""

    def __init__(self, desk: approvals.ApprovalDesk, scope: Scope) -> None:
        self._desk = desk
        self._scope = scope

    def shows(self, gate: approvals.RoutedGate) -> bool:
        """The gate is of one of the plugin's sessions, or routed to approvers it answers for."""
        mine = self._scope.approvers()
        return self._scope.sees(gate.session) or any(a.partition(":")[0] in mine for a in gate.approvers)

    def route(self, kind: str, tool: str, section: str, keys: Iterable[str]) -> approvals.Route | None:
        """Who answers a gate of client class `kind` on `tool` (`keys`: its tables), or None (approvals.py)."""
        return self._desk.route(kind, tool, section, keys)

    async def get(self, gate_id: str) -> tuple[approvals.RoutedGate | None, approvals.Closing | None]:
        """(the gate, its closing) if the plugin sees it; (None, None) otherwise, as for a gate not routed."""
        gate, closing = await self._desk.get(gate_id)
        if self._scope.everything or (gate is not None and self.shows(gate)):
            return gate, closing
        if gate is None and closing is not None and self._scope.sees(closing.session):
            return None, closing
        return None, None

    async def pending(self) -> list[approvals.RoutedGate]:
        """The open routed gates the plugin sees, soonest deadline first."""
        return [g for g in await self._desk.pending() if self._scope.everything or self.shows(g)]

    def watch(self) -> AsyncGenerator[approvals.FeedEvent, None]:
        """The approver feed from this call on (`ApprovalDesk.watch`): the gates the plugin sees, and their
        closings."""
        return self._seen(self._desk.watch())

    async def _seen(self, feed: AsyncGenerator[approvals.FeedEvent, None]
                    ) -> AsyncGenerator[approvals.FeedEvent, None]:
        told: set[str] = set()
        async with contextlib.aclosing(feed):
            async for ev in feed:
                if ev.gate is not None and (self._scope.everything or self.shows(ev.gate)):
                    told.add(ev.gate.gate_id)
                    yield ev
                elif ev.closing is not None and (ev.closing.gate_id in told or self._scope.sees(ev.closing.session)):
                    told.discard(ev.closing.gate_id)
                    yield ev

    def wire(self) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """`watch()` as (event name, JSON data) pairs, for an SSE response."""
        return approvals.on_the_wire(self.watch())

    async def set_window(self, window: str, on: bool) -> None:
        """A shell window opts in or out as an approver: only the plugin answering for shell approvers."""
        if not self._scope.everything and approvals.SHELL not in self._scope.approvers():
            raise ScopeError(f"plugin {self._scope.plugin} may not open shell approver windows: it states no "
                             f"'shell' client class; that needs {_GRANT}")
        await self._desk.set_window(window, on)

    async def is_window(self, window: str) -> bool:
        return await self._desk.is_window(window)


class PluginGate:
    """The gate keeper as one plugin reaches it (`ctx.gate`): the gates of its sessions and those routed to the
    approvers it answers for; writing gate policy and every session's grants need the all-sessions grant. The
    keeper's own checks still decide who may answer a routed gate."""

    def __init__(self, keeper: GateKeeper, scope: Scope) -> None:
        self._keeper = keeper
        self._scope = scope

    @property
    def desk(self) -> PluginDesk | None:
        """The routed gates the plugin sees (None: plugins-enabled.json routes no gate to approvers)."""
        return PluginDesk(self._keeper.desk, self._scope) if self._keeper.desk is not None else None

    @property
    def timeout(self) -> float:
        """How long a gate waits for a person (GATE_TIMEOUT)."""
        return self._keeper.timeout

    @property
    def api_timeout(self) -> float:
        """How long a gate of an API client waits (API_GATE_TIMEOUT)."""
        return self._keeper.api_timeout

    @property
    def defaults(self) -> GateDefaults:
        """A copy of the gate defaults in force (gate-defaults.json): changing it changes nothing."""
        return self._keeper.defaults.model_copy(deep=True)

    async def owner(self, gate_id: str) -> str | None:
        """The session of a pending gate, or None if it is not pending or not one of the plugin's sessions."""
        owner = await self._keeper.owner(gate_id)
        return owner if owner is None or self._scope.sees(owner) else None

    async def answer(self, gate_id: str, decision: str, *, answerer: approvals.Approver | None = None,
                     channel: str = "", by: str = "", minutes: Any = None, may_grant: bool = True,
                     content: dict[str, Any] | None = None) -> approvals.AnswerResult:
        """`GateKeeper.answer` of a gate of the plugin's sessions, or routed to approvers it answers for (as one
        of them: `answerer`); a gate it cannot see is UNKNOWN or, when it is another's, ScopeError."""
        if not self._scope.everything:
            owner = await self._keeper.owner(gate_id)
            gate, closing = await self._keeper.desk.get(gate_id) if self._keeper.desk else (None, None)
            session = owner or (gate.session if gate else "") or (closing.session if closing else "")
            if not session:
                return approvals.AnswerResult(approvals.UNKNOWN, gate_id)
            mine = self._scope.approvers()
            # As an approver it answers for: of an open gate routed to them (of one closed already, the
            # keeper only says who answered first).
            routed_here = (any(a.partition(":")[0] in mine for a in gate.approvers) if gate is not None
                           else closing is not None)
            as_approver = answerer is not None and answerer.kind in mine and routed_here
            if not (self._scope.sees(session) or as_approver):
                self._refusal(gate_id, session, gate, str(answerer or by or "anonymous"), channel,
                              "refused: the gate is of another session and not routed to this channel's approvers")
                kinds = ", ".join(sorted(mine)) or "none"
                raise self._scope.outside(f"answer gate '{gate_id[:64]}' of session '{session[:80]}'",
                                          f", and the gate is not routed to the approvers it answers for ({kinds})")
        return await self._keeper.answer(gate_id, decision, answerer=answerer, channel=channel, by=by,
                                         minutes=minutes, may_grant=may_grant, content=content)

    async def refused(self, gate_id: str, actor: str, channel: str, why: str) -> None:
        """Audit an answer the plugin took in and refused itself (a malformed, stale or unknown one): an
        `approval_refused` record about the gate it named, of whatever session, with `why` as its outcome."""
        named = gate_id[:GATE_ID_CHARS]
        gate = closing = None
        owner = await self._keeper.owner(named) if named else None
        if named and self._keeper.desk is not None:
            gate, closing = await self._keeper.desk.get(named)
        session = owner or (gate.session if gate else "") or (closing.session if closing else "")
        self._refusal(named, session, gate, actor, channel, why)

    def _refusal(self, gate_id: str, session: str, gate: approvals.RoutedGate | None, actor: str, channel: str,
                 why: str) -> None:
        detail = {"channel": channel, "gate_id": gate_id[:GATE_ID_CHARS], "plugin": self._scope.plugin,
                  **({"asked": gate.approvers} if gate is not None else {})}
        self._keeper.audit(AuditRecord.approval_refused(session, actor[:200], gate.tool if gate else "",
                                                        gate.op if gate else "", gate.tables if gate else (),
                                                        json.dumps(detail), why))

    async def resolve(self, gate_id: str, decision: str, *, by: str = "", minutes: Any = None,
                      may_grant: bool = True) -> bool:
        """`answer` without an approver identity, of a gate of the plugin's sessions: True when it decided it."""
        owner = await self._keeper.owner(gate_id)
        if owner is None:
            return False
        self._scope.check(owner)
        return await self._keeper.resolve(gate_id, decision, by=by, minutes=minutes, may_grant=may_grant)

    async def active_grants(self, client_id: str) -> list[grants.Grant]:
        """The active grants of one of the plugin's sessions (given on any instance)."""
        self._scope.check(client_id)
        store = self._keeper.grants
        if store is None:
            return []
        await store.refresh(client_id)
        return store.active(client_id)

    @property
    def grants(self) -> grants.GrantStore | None:
        """The grants of every session and their audit log: only with the all-sessions grant."""
        self._scope.need_all("read or revoke every session's grants")
        return self._keeper.grants

    def audit(self, record: AuditRecord) -> None:
        """Append to the audit log a record about one of the plugin's sessions (any record: with the grant)."""
        if record.session:
            self._scope.check(record.session)
        else:
            self._scope.need_all(f"write a {record.event or 'session-less'} record to the audit log")
        self._keeper.audit(record)

    async def set_policy(self, change: gate_policy.PolicyChange) -> tuple[GatePermission | ToolPermission, str]:
        """Change one gate default for every session (`GateKeeper.set_policy`): only with the grant."""
        self._scope.need_all("change the gate policy of every session")
        return await self._keeper.set_policy(change)

    def replace_policy(self, new: GateDefaults, by: str) -> Path | None:
        """Replace the whole gate defaults (`GateKeeper.replace_policy`): only with the grant."""
        self._scope.need_all("change the gate policy of every session")
        return self._keeper.replace_policy(new, by)


class PluginTools:
    """The tool registry, read only (`ctx.tools`): the loader registers a plugin's tools from `get_tools()`;
    `reload` registers the plugin's own again when they changed while it runs (an MCP server's tool list)."""

    def __init__(self, registry: ToolRegistry, plugin: str,
                 own: Callable[[], tuple[dict[str, Any], dict[str, Any]]] | None) -> None:
        self._registry = registry
        self._plugin = plugin
        self._own = own  # a data tool's (get_tools(), get_gate_tools()); None for a client plugin

    def get(self, name: str) -> Any:
        """A copy of the registered tool (a StructuredTool), or None."""
        tool = self._registry.get(name)
        return tool.model_copy() if tool is not None else None

    def entry(self, name: str) -> RegisteredTool | None:
        """A copy of the tool's registration (owner, gate): changing it changes nothing registered."""
        entry = self._registry.entry(name)
        if entry is None:
            return None
        return dataclasses.replace(entry, tool=entry.tool.model_copy(), gate=dict(entry.gate))

    def names(self) -> list[str]:
        return self._registry.names()

    def openai_schemas(self, model: ModelConfig | None = None) -> list[dict[str, Any]]:
        """The tools' OpenAI function schemas (of `model`'s llm_tools, else all)."""
        return self._registry.openai_schemas(model)

    def reload(self) -> list[str]:
        """Register the plugin's tools again from its `get_tools()` and `get_gate_tools()`, all or nothing (on a
        problem its old ones stay and registry.ToolRegistrationError says why); their names."""
        if self._own is None:
            raise ScopeError(f"plugin {self._plugin}: only a data_tool plugin registers tools")
        tools, gates = self._own()
        return self._registry.replace_plugin_tools(self._plugin, tools, gates)
