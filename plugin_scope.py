"""What one plugin reaches of the sessions, their event streams and the signals between instances: its own.

A plugin's sessions are those whose client id starts with a namespace the loader registered for it
(its `CLIENT_NAMESPACES`), and the session of a turn it serves (its tool runs inside that turn). A
plugin the operator granted `all-sessions` in its plugin-manifest.json entry reaches every session:
the shell is the admin view, the API's admin key and the MCP server's human token manage any.
`PluginContext` hands out these views instead of the session manager, the event hub and the
signals; acting on a session outside the scope raises `ScopeError`. Scoping is the contract of the
plugin surface, not a sandbox: a plugin runs in the server's process.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from events import Event, EventHub, HubObserver
from sessions import SessionManager
from shared_link import Signals
from stores import Session
from turns import current_turn


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

    def _served(self) -> str | None:
        """The session of the turn the code runs for, while that turn runs (a tool the turn called): the turn
        holding the session, so a turn a plugin builds itself (`request(...).turn()`) does not count."""
        turn = current_turn()
        if turn is None or turn.session is None:
            return None
        held = self._sessions.get(turn.client_id) is turn.session and turn.session.running == turn.id
        return turn.client_id if held else None

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
            mine = ", ".join(f"'{p}'" for p in self._prefixes()) or "none"
            raise ScopeError(
                f"plugin {self.plugin} may not reach session '{client_id[:80]}': it is outside the plugin's client-id "
                f"namespaces ({mine}); a plugin that administers every session needs \"grants\": [\"all-sessions\"] "
                "in its plugin-manifest.json entry, which only an operator gives"
            )


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
                  report_gaps: bool = False) -> AsyncIterator[Event]:
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
