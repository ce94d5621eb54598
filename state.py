"""Server state: sessions (persisted in a SessionStore), the per-session event hub, the runtime.

One `Runtime` per server instance owns every mutable object; it is built once (see
`build.build_runtime`) and passed in. The module-level functions the plugin contract names
(`push_tok`, `push_done`, ...) are thin facades over the runtime that `set_current()` installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import itertools
import logging
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: importing these (langchain, sqlglot) would slow every CLI start
    from config import AppConfig
    from gate import GateKeeper, ToolCheck
    from plugin_loader import PluginLoader
    from prompt import PromptTree
    from rate_limits import RateLimiter
    from registry import ToolRegistry
    from stores import SessionStore

logger = logging.getLogger("agent_mcp.state")

FIRST_SHORTHAND = 101
DEFAULT_TOOL_PREVIEW = 500
#: Defaults of the session bounds (plugins-enabled.json `sessions`; see SessionPolicy).
DEFAULT_MAX_SESSIONS = 1000
DEFAULT_MAX_HISTORY = 1000
DEFAULT_MAX_MESSAGE_CHARS = 200_000
TRUNCATED = "\n…(truncated: longer than the stored message limit)"
EVENT_BUFFER = 2000
#: The name of the marker `EventHub.subscribe(..., report_gaps=True)` yields where a subscriber lost
#: events (it fell more than EVENT_BUFFER events behind); `data["missed"]` says how many, if known.
LOST = "lost"
#: Channels without subscribers kept for replay; beyond this the least recently used go.
MAX_IDLE_CHANNELS = 1000
#: Seconds between two looks for turns whose instance died (shared stores; see SessionManager.recover).
RECOVER_SECONDS = 1.0
#: Removed sessions whose reason is remembered for a client that comes back (SessionManager.take_gone).
MAX_GONE = 4096


class SessionError(Exception):
    """A session cannot be found or changed; the message says which and why."""


class Stopping(SessionError):
    """This server is stopping and starts no more turns (HTTP: 503, so the request is sent again)."""


# ── Turns ───────────────────────────────────────────────────────────────────────────────────


@dataclass
class Turn:
    """One request as it runs: who sent it, on which session, and what it may do.

    Built once where a request enters (`routes.process_request`, the MCP server's tool calls)
    and passed down explicitly; tools, which the model calls with their own arguments only,
    reach it through `current_turn()`. Privileges come from here, never from the client id.
    """

    client_id: str
    #: Every event published while this turn runs carries this id.
    id: str
    #: The client class (client_classes.CLASSES) the request is treated as.
    kind: str
    #: The client plugin authenticated an administrator (the API's admin token).
    admin: bool = False
    #: The token-authenticated shell endpoint vouched for the request.
    interactive: bool = False
    #: The model of this turn's LLM call; None: the session's own.
    model: str | None = None
    #: Tool calls of this turn skip the human gate (an `@model` turn from the interactive shell).
    bypass_gates: bool = False
    #: The session, once the turn holds it.
    session: Session | None = None
    #: The request deletes its own session (`!session <own id> delete`): done once it has answered.
    ends_session: bool = False
    #: What the gate decision of the tool call running now covers (a `db` tool's; see DbAccess), set
    #: by the gate and cleared before each call's checks, so it never outlives its call.
    db_access: DbAccess | None = None
    #: Who the client plugin proved the caller to be (its token, key or user: `shell`, `api:key`,
    #: `proxy:alice`, `mcp:worker`, `slack:U123`); None: nothing proven beyond the session.
    identity: str | None = None

    @property
    def rate_key(self) -> str:
        """What rate limits count by: the proven identity within its client class, so new session ids
        under one token share its windows; the session id only when nothing is proven."""
        return f"{self.kind}|{self.identity}" if self.identity else self.client_id

    @property
    def may_administer(self) -> bool:
        """Whether this request may change gates and run privileged (★) commands."""
        return self.interactive or self.admin


@dataclass(frozen=True)
class DbAccess:
    """What the gate decision of one `db` tool call covers, for the database to enforce (db_roles.py).

    `source`: "policy" (ran unasked: `allows(key, op)` says what this session's gates open),
    "grant" (a grant's keys × operation) or "approval" (exactly what a person approved for this
    call, or an `@model` turn's classified keys); `pairs` are the (gate key, operation) covered.
    """

    source: str
    pairs: frozenset[tuple[str, str]] = frozenset()
    allows: Callable[[str, str], bool] | None = field(default=None, compare=False)


_turn: contextvars.ContextVar[Turn | None] = contextvars.ContextVar("agent_mcp_turn", default=None)


def current_turn() -> Turn | None:
    """The turn whose code is running (for tools, which get only their own arguments), or None."""
    return _turn.get()


@contextlib.contextmanager
def running(turn: Turn | None) -> Iterator[Turn | None]:
    """Make `turn` the current one inside the block (events published meanwhile carry its id)."""
    token = _turn.set(turn)
    try:
        yield turn
    finally:
        _turn.reset(token)


# ── Sessions ────────────────────────────────────────────────────────────────────────────────


@dataclass
class Session:
    """One conversation, keyed by client id. `history` holds OpenAI-style message dicts."""

    client_id: str
    shorthand: int
    model: str
    history: list[dict[str, Any]] = field(default_factory=list)
    tool_preview_length: int = DEFAULT_TOOL_PREVIEW
    settings: dict[str, Any] = field(default_factory=dict)
    created: float = field(default_factory=time.time)
    #: Last activity (a request or a saved change), by the manager's clock; expiry and LRU go by it.
    updated: float = field(default_factory=time.time)
    #: The id of the request holding the session, stored while it runs: a session found with one that no
    #: live process holds lost its turn with that process (SessionManager.recover ends it).
    running: str | None = None
    # Held by the request running on this session; later requests wait their turn.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False, compare=False)

    def to_record(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "history": self.history,
            "tool_preview_length": self.tool_preview_length,
            "settings": self.settings,
            "created": self.created,
            **({"running": self.running} if self.running else {}),
        }

    @classmethod
    def from_record(cls, client_id: str, shorthand: int, record: dict[str, Any], updated: float) -> Session:
        return cls(
            client_id=client_id,
            shorthand=shorthand,
            model=record["model"],
            history=list(record.get("history", [])),
            tool_preview_length=int(record.get("tool_preview_length", DEFAULT_TOOL_PREVIEW)),
            settings=dict(record.get("settings", {})),
            created=float(record.get("created", time.time())),
            updated=float(updated),
            running=record.get("running") or None,
        )

    def take_from(self, other: Session) -> None:
        """Become `other` (a fresher copy read from a shared store), keeping this object and its lock."""
        for name in ("shorthand", "model", "history", "tool_preview_length", "settings", "created", "updated",
                     "running"):
            setattr(self, name, getattr(other, name))


def _starts_turn(msg: dict[str, Any]) -> bool:
    # Results of text tool calls are user messages too, but they belong to the turn before them.
    return msg.get("role") == "user" and not msg.get("tool_results")


def trim_history(history: list[dict[str, Any]], max_messages: int) -> list[dict[str, Any]]:
    """The last `max_messages` messages, starting at a user message so no tool result loses its call.

    Older turns go whole (a turn: a user message and everything up to the next one); a single
    turn longer than the limit is kept whole from its user message.
    """
    if len(history) <= max_messages:
        return history
    kept = history[-max_messages:]
    for i, msg in enumerate(kept):
        if _starts_turn(msg):
            return kept[i:]
    for i in range(len(history) - 1, -1, -1):
        if _starts_turn(history[i]):
            return history[i:]
    return []


#: What a turn's task is cancelled with when its instance lost the session's turn lease (shared stores).
LEASE_LOST = "the session's turn lease was lost"


@dataclass(frozen=True)
class SessionLimits:
    """Bounds of one client class: idle seconds before a session expires (None: never) and how many are kept."""

    idle_seconds: float | None = None
    max_sessions: int = DEFAULT_MAX_SESSIONS


@dataclass(frozen=True)
class SessionPolicy:
    """How long sessions live, how many are kept and how much history each stores.

    `classify` names a session's client class; `limits` gives that class's bounds. Both are injected
    (build.build_runtime wires the gate's client classes), so this module knows no client kinds.
    """

    classify: Callable[[Session], str] = lambda session: "default"
    limits: Callable[[str], SessionLimits] = lambda kind: SessionLimits()
    max_history: int = DEFAULT_MAX_HISTORY
    max_message_chars: int = DEFAULT_MAX_MESSAGE_CHARS
    #: Seconds between two sweeps of the running server (expiry, then caps).
    sweep_seconds: float = 3600.0


#: Session setting: the class of the client that created the session (bounds and listings, never privileges).
CLIENT_CLASS = "client_class"

#: Called with the client id of every session the manager forgets (deleted, expired or evicted).
ForgetHook = Callable[[str], None]


class SessionManager:
    """The live sessions, their shorthand ids, write-through persistence, and their bounds.

    Every session removed (by `delete`, expiry or eviction) passes through `_forget`, which runs
    the `forgotten` hooks (the runtime drops the event channel and the rate-limit windows there).
    A session is never expired or evicted while `busy`: its lock is held or `is_busy(client_id)`.
    """

    def __init__(self, store: SessionStore, policy: SessionPolicy | None = None,
                 clock: Callable[[], float] = time.time, is_busy: Callable[[str], bool] | None = None):
        self.store = store
        self.policy = policy or SessionPolicy()
        self.clock = clock
        self.is_busy = is_busy
        self.forgotten: list[ForgetHook] = []
        #: Called with (client id, request id) for a request found to have died with its process.
        self.interrupted: Callable[[str, str], None] | None = None
        self._sessions: dict[str, Session] = {}
        self._by_short: dict[int, str] = {}
        self._last_short = FIRST_SHORTHAND - 1
        self._unsaved: set[str] = set()  # added, never saved: their class's cap is checked at the first save
        #: Per client class, its sessions from the least to the most recently active (eviction order).
        self._lru: dict[str, OrderedDict[str, Session]] = {}
        self._kind: dict[str, str] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self._recoverer: asyncio.Task[None] | None = None
        #: Why recently removed sessions went (client id → "deleted", …), so a client that comes back
        #: is told instead of silently getting an empty session (bounded: MAX_GONE, oldest dropped).
        self._gone: OrderedDict[str, str] = OrderedDict()

    async def open(self) -> None:
        """Load the stored sessions (the first sweep, at `start_sweeping`, applies the bounds to them).

        A shared store is only opened: its sessions are read when they are used (`refresh`, `hold`).
        """
        await self.store.open()
        if self.store.shared:
            return
        sessions, last = await self.store.load()
        for s in sessions:
            self._add(s)
        self._last_short = max(last, FIRST_SHORTHAND - 1)

    async def close(self) -> None:
        for task in (self._sweeper, self._recoverer):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._sweeper = self._recoverer = None
        await self.store.close()

    def start_sweeping(self) -> None:
        """Sweep now, then every `policy.sweep_seconds` until `close()`.

        Call it once every client class is known (classes declared by plugins: after they load).
        """
        if self._sweeper is None:
            self._sweeper = asyncio.create_task(self._sweep_forever(), name="session-sweeper")

    async def _sweep_forever(self) -> None:
        if self.store.shared:
            self._recoverer = asyncio.create_task(self._recover_forever(), name="turn-recovery")
        while True:
            try:
                await self.sweep()
            except Exception:  # a failing store must not end the sweeping; the next round retries
                logger.exception("session sweep failed")
            await asyncio.sleep(self.policy.sweep_seconds)

    async def _recover_forever(self) -> None:
        """With a shared store: end, within seconds, the turns of instances that died (see `recover`)."""
        while True:
            await asyncio.sleep(RECOVER_SECONDS)
            try:
                await self.recover()
            except SessionError:
                pass  # the store is unreachable: said elsewhere; the next round tries again
            except Exception:
                logger.exception("looking for interrupted turns failed")

    def get(self, client_id: str) -> Session | None:
        return self._sessions.get(client_id)

    def all(self) -> list[Session]:
        return sorted(self._sessions.values(), key=lambda s: s.shorthand)

    def count(self) -> int:
        """How many sessions this instance knows (what `len(all())` says, without sorting them all)."""
        return len(self._sessions)

    def get_or_add(self, client_id: str, model: str, client_class: str | None = None) -> tuple[Session, bool]:
        """The client's session, added in memory if new (then True), marked active now; the caller saves it.

        A new session records `client_class`, the class of the client that created it (for its bounds).
        """
        session = self._sessions.get(client_id)
        if session is not None:
            self._touch(session)
            return session, False
        # A shared store hands the id out when the session is first saved (0 until then).
        shorthand = 0 if self.store.shared else self._last_short + 1
        self._last_short = max(self._last_short, shorthand)
        now = self.clock()
        settings = {CLIENT_CLASS: client_class} if client_class else {}
        session = Session(client_id=client_id, shorthand=shorthand, model=model, created=now, updated=now,
                          settings=settings)
        self._add(session)
        self._unsaved.add(client_id)
        return session, True

    def _add(self, session: Session) -> None:
        self._sessions[session.client_id] = session
        if session.shorthand:
            self._by_short[session.shorthand] = session.client_id
        self._place(session)

    def _drop(self, client_id: str) -> Session:
        """Remove a session from this instance's memory only."""
        session = self._sessions.pop(client_id)
        if self._by_short.get(session.shorthand) == client_id:
            del self._by_short[session.shorthand]
        self._unsaved.discard(client_id)
        del self._lru[self._kind.pop(client_id)][client_id]
        return session

    def _take(self, session: Session, fresh: Session) -> None:
        """Update a remembered session from a fresher stored copy (another instance changed it)."""
        if self._by_short.get(session.shorthand) == session.client_id:
            del self._by_short[session.shorthand]
        session.take_from(fresh)
        self._by_short[session.shorthand] = session.client_id

    async def exists(self, client_id: str) -> bool:
        """Whether the session exists (with a shared store: on any instance, now)."""
        if self.store.shared:
            return await self.store.fetch(client_id) is not None
        return client_id in self._sessions

    async def refresh(self) -> None:
        """With a shared store: read every session again, since another instance may have added, changed
        or removed any (listings and sweeps call this first). Sessions held by a request here are the
        request's own copy and stay as they are."""
        if not self.store.shared:
            return
        stored = {s.client_id: s for s in await self.store.fetch_all()}
        for client_id, mine in list(self._sessions.items()):
            if client_id not in stored and not mine.lock.locked() and client_id not in self._unsaved:
                self._drop(client_id)
        for client_id, fresh in stored.items():
            mine = self._sessions.get(client_id)
            if mine is None:
                self._add(fresh)
            elif not mine.lock.locked():
                self._take(mine, fresh)

    async def _reload(self, session: Session) -> bool:
        """Read a held session again from a shared store; True when the store has none (a new session)."""
        fresh = await self.store.fetch(session.client_id)
        if fresh is not None:
            self._unsaved.discard(session.client_id)
            self._take(session, fresh)
            return False
        if session.client_id not in self._unsaved:  # removed by another instance since we saw it
            kind = session.settings.get(CLIENT_CLASS)
            session.history, session.settings, session.running = [], ({CLIENT_CLASS: kind} if kind else {}), None
            if self._by_short.get(session.shorthand) == session.client_id:
                del self._by_short[session.shorthand]
            session.shorthand = 0
            self._unsaved.add(session.client_id)
        return True

    @contextlib.asynccontextmanager
    async def hold(self, session: Session, turn_id: str,
                   ended: Callable[[], None] | None = None) -> AsyncIterator[bool]:
        """Hold `session` for one request; yields whether the session is new.

        Requests on a session run one at a time, in the order they asked (on every instance of a
        shared store: the store's lease, and the session is read again once held). While held, the
        session is stored marked `running`, so a request that dies with its process is found and
        ended (`recover`); on leaving it is saved, unless it was removed meanwhile. `ended` runs
        after that save and before the session is let go, when the request finished without an
        exception: its `done` then comes before anything the next request (on any instance) says.
        """
        async with session.lock, self.store.lease(session.client_id, turn_id):
            created = await self._reload(session) if self.store.shared else session.client_id in self._unsaved
            if session.running and self.interrupted is not None:
                self.interrupted(session.client_id, session.running)  # its process died; say so first
            session.running = turn_id
            finished = False
            try:
                await self.save(session)
                yield created
                finished = True
            finally:
                session.running = None
                if self._sessions.get(session.client_id) is session:
                    await self.save(session)
                if finished and ended is not None:
                    ended()

    async def recover(self) -> list[str]:
        """End the requests whose process died while they ran (see `hold`): `interrupted` tells their
        clients, and the sessions are marked free. Returns their client ids.

        With a shared store these are the running sessions whose lease expired; otherwise (at start)
        every session stored as running."""
        if self.store.shared:
            candidates = await self.store.orphans()
        else:
            candidates = [s.client_id for s in self._sessions.values() if s.running and not s.lock.locked()]
        ended = []
        for client_id in candidates:
            session, _ = self.get_or_add(client_id, "")
            async with session.lock, self.store.lease(client_id, "recover"):
                if self.store.shared and await self._reload(session):
                    self._drop(client_id)  # gone meanwhile
                    continue
                if session.running:
                    if self.interrupted is not None:
                        self.interrupted(client_id, session.running)
                    session.running = None
                    await self.save(session)
                    ended.append(client_id)
        if ended:
            logger.warning("ended %d turn(s) interrupted by a stopped server: %s", len(ended), ", ".join(ended))
        return ended

    def _place(self, session: Session) -> None:
        """Put the session last (most recently active) in its class's eviction order."""
        kind = self._kind[session.client_id] = self.policy.classify(session)
        self._lru.setdefault(kind, OrderedDict())[session.client_id] = session

    def _reclassify(self) -> None:
        """Sort every session into its class again (classes may have been declared since it was added)."""
        self._lru.clear()
        for s in sorted(self._sessions.values(), key=lambda s: (s.updated, s.shorthand)):
            self._place(s)

    def _touch(self, session: Session) -> None:
        session.updated = self.clock()
        self._lru[self._kind[session.client_id]].move_to_end(session.client_id)

    async def get_or_create(self, client_id: str, model: str) -> Session:
        """The client's session, created and saved if new."""
        session, created = self.get_or_add(client_id, model)
        if created:
            await self.save(session)
        return session

    def resolve(self, ident: str) -> str | None:
        """A full client id for a full id or a shorthand id ("101"), or None."""
        ident = ident.strip()
        if ident in self._sessions:
            return ident
        if ident.isdigit():
            return self._by_short.get(int(ident))
        return None

    async def save(self, session: Session) -> None:
        """Store the session (its history bounded first) as active now; a new one may evict its class's LRU."""
        if self._sessions.get(session.client_id) is not session:
            return
        if not session.shorthand:
            session.shorthand = await self.store.allocate_shorthand()
            self._by_short[session.shorthand] = session.client_id
        self._bound_history(session)
        self._touch(session)
        if await self.store.save(session, self._last_short, create=session.client_id in self._unsaved) is False:
            self._drop(session.client_id)  # removed on another instance meanwhile: not brought back
            return
        if session.client_id in self._unsaved:
            self._unsaved.discard(session.client_id)
            kind = self._kind[session.client_id]
            await self._evict(kind, self.policy.limits(kind).max_sessions, keep=session.client_id)

    def _bound_history(self, session: Session) -> None:
        """Drop the oldest whole turns beyond `max_history` messages; cut texts over `max_message_chars`."""
        history, policy = session.history, self.policy
        if len(history) > policy.max_history:
            history[:] = trim_history(history, policy.max_history)
        for msg in history:
            content = msg.get("content")
            if isinstance(content, str) and len(content) > policy.max_message_chars:
                msg["content"] = content[: policy.max_message_chars] + TRUNCATED

    async def delete(self, ident: str, remember: bool = True) -> Session:
        """Forget a session; with `remember`, a client that comes back is told it was deleted
        (`take_gone`). Throwaway sessions (the proxy's background tasks) are not remembered."""
        client_id = self.resolve(ident)
        if client_id is None:
            raise SessionError(f"no session '{ident}'; use !session to list sessions")
        return await self._forget(client_id, "deleted" if remember else None)

    async def take_gone(self, client_id: str) -> str | None:
        """Why `client_id`'s session was removed ("deleted", "expired", "evicted"), once, or None."""
        if self.store.shared:
            return await self.store.take_gone(client_id)
        return self._gone.pop(client_id, None)

    async def _forget(self, client_id: str, why: str | None) -> Session:
        if why is not None and self.store.shared:
            await self.store.mark_gone(client_id, why)
        elif why is not None:
            self._gone[client_id] = why
            self._gone.move_to_end(client_id)
            if len(self._gone) > MAX_GONE:
                self._gone.popitem(last=False)
        session = self._drop(client_id)
        await self.store.delete(client_id)
        for hook in list(self.forgotten):
            try:
                hook(client_id)
            except Exception:
                logger.exception("session hook %r failed for %s", hook, client_id)
        return session

    def busy(self, session: Session) -> bool:
        """Whether a request runs on (or waits for) the session: then it is never expired or evicted."""
        return (session.lock.locked() or (self.is_busy is not None and self.is_busy(session.client_id))
                or (self.store.shared and session.running is not None))  # a turn on another instance

    async def sweep(self) -> list[str]:
        """Expire sessions idle longer than their class allows, then evict each class down to its cap.

        Returns the client ids removed. Busy sessions are skipped (a later sweep takes them).
        """
        await self.refresh()
        self._reclassify()
        now = self.clock()
        removed = []
        for kind, members in list(self._lru.items()):
            idle = self.policy.limits(kind).idle_seconds
            if idle is not None:
                removed += [s.client_id for s in list(members.values())
                            if now - s.updated > idle and await self._remove_idle(s, "expired")]
        if removed:
            logger.info("expired %d idle session(s)", len(removed))
        for kind in list(self._lru):
            removed += await self._evict(kind, self.policy.limits(kind).max_sessions)
        return removed

    async def _evict(self, kind: str, cap: int, keep: str | None = None) -> list[str]:
        """Forget the least recently active idle sessions of class `kind` beyond `cap` (never `keep`)."""
        members = self._lru.get(kind, {})
        excess = len(members) - cap
        if excess <= 0:
            return []
        idle = (s for s in members.values() if s.client_id != keep and not self.busy(s))
        victims = list(itertools.islice(idle, excess))  # the least recently active first
        evicted = [s.client_id for s in victims if await self._remove_idle(s, "evicted")]
        if evicted:
            logger.info("evicted %d least recently used %s session(s) over the cap of %d", len(evicted), kind, cap)
        return evicted

    async def _remove_idle(self, session: Session, why: str) -> bool:
        """Forget `session` unless it is busy or already gone (another task may have run meanwhile)."""
        if self._sessions.get(session.client_id) is not session or self.busy(session):
            return False
        await self._forget(session.client_id, why)
        return True


# ── Events ──────────────────────────────────────────────────────────────────────────────────


@dataclass(frozen=True, slots=True)
class Event:
    """One output event of a session: `tok`, `status`, `gate`, `done` or `error`.

    `turn` is the id of the request that produced it (None outside a request).
    """

    id: int
    name: str
    data: dict[str, Any]
    turn: str | None = None


class _Channel:
    """A bounded, replayable event sequence of one session with broadcast wake-ups."""

    __slots__ = ("_wake", "events", "last_id", "seen", "start", "subscribers", "touched")

    def __init__(self, buffer: int = EVENT_BUFFER) -> None:
        self.subscribers = 0
        self.touched = time.monotonic()
        # Ids start at the current time in microseconds so that they keep increasing across
        # restarts: a client that reconnects with an old Last-Event-ID gets everything new.
        self.last_id = time.time_ns() // 1000
        self.start = self.last_id  # below its first event
        self.seen = self.last_id  # highest id handed to any subscriber
        self.events: deque[Event] = deque(maxlen=buffer)
        self._wake = asyncio.Event()

    def publish(self, name: str, data: dict[str, Any]) -> Event:
        self.touched = time.monotonic()
        self.last_id += 1
        turn = _turn.get()
        event = Event(self.last_id, name, data, turn.id if turn is not None else None)
        self.events.append(event)
        wake, self._wake = self._wake, asyncio.Event()
        wake.set()
        return event

    def after(self, cursor: int) -> Event | None:
        """The first buffered event with an id above `cursor` (skipping what fell out of the buffer)."""
        if cursor >= self.last_id or not self.events:
            return None
        index = max(0, cursor + 1 - self.events[0].id)
        return self.events[index]


#: Called with (client id, event) on every publish, and with (client id, None) when a session's
#: channel is dropped (the session was deleted). Runs synchronously in the publisher's task.
HubObserver = Callable[[str, Event | None], None]


class EventHub:
    """Per-session output events. Every subscriber sees every event; reconnects replay by id.

    Observers (`observe()`) see every event of every session as it is published (the MCP server
    uses this to learn when gates open and close and when turns end); an observer that raises is
    logged and never disturbs the publisher.
    """

    def __init__(self, max_idle_channels: int = MAX_IDLE_CHANNELS, buffer: int = EVENT_BUFFER) -> None:
        self._channels: dict[str, _Channel] = {}
        #: Events kept per session for readers that fall behind or reconnect (AGENT_EVENT_BUFFER).
        self.buffer = buffer
        self.max_idle_channels = max_idle_channels
        self._observers: list[HubObserver] = []
        self.closed = False

    def observe(self, observer: HubObserver) -> Callable[[], None]:
        """Call `observer` with every event published from now on; returns the function that stops it."""
        self._observers.append(observer)

        def stop() -> None:
            with contextlib.suppress(ValueError):
                self._observers.remove(observer)

        return stop

    def _notify(self, client_id: str, event: Event | None) -> None:
        for observer in list(self._observers):
            try:
                observer(client_id, event)
            except Exception:
                logger.exception("event hub observer %r failed", observer)

    def _channel(self, client_id: str) -> _Channel:
        ch = self._channels.get(client_id)
        if ch is None:
            ch = self._channels[client_id] = _Channel(self.buffer)
            if len(self._channels) > self.max_idle_channels:
                self._evict_idle()
        return ch

    def _evict_idle(self) -> None:
        """Forget the least recently used channels nobody follows, so streams of unknown ids cannot grow memory."""
        idle = sorted((ch.touched, cid) for cid, ch in self._channels.items() if ch.subscribers == 0)
        for _, cid in idle[: len(idle) - self.max_idle_channels]:
            del self._channels[cid]

    def publish(self, client_id: str, name: str, data: dict[str, Any] | None = None) -> Event:
        event = self._channel(client_id).publish(name, data or {})
        if self._observers:
            self._notify(client_id, event)
        return event

    def last_id(self, client_id: str) -> int:
        return self._channel(client_id).last_id

    async def aclose(self) -> None:
        """Release what the hub holds (a shared hub: its writer, after sending what is queued)."""

    def close(self) -> None:
        """The server stops: every subscription ends after the events it has not yet received."""
        self.closed = True
        for ch in self._channels.values():
            ch._wake.set()

    def drop(self, client_id: str) -> None:
        ch = self._channels.pop(client_id, None)
        if ch is not None:
            ch._wake.set()  # wake its subscribers so they move to the session's next channel
        if self._observers:
            self._notify(client_id, None)

    async def subscribe(self, client_id: str, last_event_id: int | None = None, report_gaps: bool = False
                        ) -> AsyncIterator[Event]:
        """Events after `last_event_id`; without one, every event no subscriber has seen yet, then live.

        A subscriber that falls more than `buffer` events behind misses the oldest; with
        `report_gaps` a `LOST` marker event (turn None) comes where they are missing, so a reader that
        must not present a gapped answer as whole (run_turn) can tell.
        """
        ch = self._channel(client_id)
        cursor = ch.seen if last_event_id is None else last_event_id
        ch.subscribers += 1
        try:
            while True:
                event = ch.after(cursor)
                if event is None and self._channels.get(client_id) is not ch:
                    # Session deleted: what it had sent was delivered; go on with the id's new channel, all of
                    # it (another subscriber that moved first may have seen its first events already).
                    ch.subscribers -= 1
                    ch = self._channel(client_id)
                    ch.subscribers += 1
                    cursor = ch.start
                    continue
                if event is None:
                    if self.closed:
                        return
                    await ch._wake.wait()
                    continue
                if report_gaps and event.id > cursor + 1:  # ids of one channel are consecutive
                    yield Event(event.id - 1, LOST, {"missed": event.id - cursor - 1})
                cursor = event.id
                if cursor > ch.seen:
                    ch.seen = cursor
                yield event
        finally:
            ch.subscribers -= 1
            ch.touched = time.monotonic()

    # Typed helpers, one per event kind of the wire contract.
    def tok(self, client_id: str, text: str) -> None:
        if text:
            self.publish(client_id, "tok", {"text": text})

    def status(self, client_id: str, text: str) -> None:
        self.publish(client_id, "status", {"text": text})

    def gate(self, client_id: str, payload: dict[str, Any]) -> None:
        self.publish(client_id, "gate", payload)

    def done(self, client_id: str) -> None:
        self.publish(client_id, "done", {})

    def error(self, client_id: str, message: str, kind: str | None = None) -> None:
        """An `error` event; `kind` ("timeout": the model did not answer in time, "backend": the model
        call failed) lets a plugin answer in its protocol's terms (the proxy: 504 / 502)."""
        self.publish(client_id, "error", {"message": message, **({"kind": kind} if kind else {})})


#: A `!command` handler: async (turn, args) → the text the client is shown.
CommandHandler = Callable[[Turn, str], Awaitable[Any]]


@dataclass
class Command:
    """A `!command`: its handler, who provided it ("core": the server), and its line in `!help`."""

    handler: CommandHandler
    owner: str = "core"
    #: `!name [args] — what it does`: the first line of the handler's docstring (see usage_of).
    usage: str = ""


def usage_of(handler: Callable[..., Any]) -> str:
    """The first line of a command handler's docstring: its `!help` line."""
    return (inspect.getdoc(handler) or "").partition("\n")[0].strip()


# ── Runtime ─────────────────────────────────────────────────────────────────────────────────


#: client id → its requests running or waiting for the session: each task with its turn id, carried as data
#: (a stopped request's `done` carries its id).
Requests = dict[str, dict[asyncio.Task[None], str]]


@dataclass
class Runtime:
    """Everything one server instance owns. Built once, passed to every module that needs it."""

    config: AppConfig
    sessions: SessionManager
    hub: EventHub
    tools: ToolRegistry
    prompt: PromptTree
    plugins: PluginLoader | None = None
    #: `!command` name (lower case, no `!`) → Command.
    commands: dict[str, Command] = field(default_factory=dict)
    #: model key → LangChain chat model, built once and reused.
    llms: dict[str, Any] = field(default_factory=dict)
    #: client id → its requests that are running or waiting for the session (routes.py keeps it).
    active_tasks: Requests = field(default_factory=dict)
    #: Checks run by tool_calls.execute_tool, in order, on validated arguments before the executor
    #: (rate limit, then gate); see gate.ToolCheck.
    tool_checks: list[ToolCheck] = field(default_factory=list)
    started: float = field(default_factory=time.time)
    #: model key → (context window in tokens, where that number comes from), found at first use.
    windows: dict[str, tuple[int, str]] = field(default_factory=dict)
    #: Client-id namespaces declared by the loaded client plugins: prefix → (client class, plugin).
    client_namespaces: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: The gate keeper (pending gates included) and the rate limiter, set by build_runtime.
    gate: GateKeeper = None  # type: ignore[assignment]
    rate_limiter: RateLimiter = None  # type: ignore[assignment]
    #: Set when the server stops, so endless event streams end (an anyio.Event).
    stopping: Any = None
    #: Event-stream responses not yet complete, and the event a stopping server waits on until none is left.
    open_streams: int = 0
    streams_done: asyncio.Event | None = None
    #: Set when the server starts to stop (routes.end_all): requests cancelled from then on end as
    #: interrupted (error + done, the user's message kept), not as replaced by a newer one.
    closing: bool = False
    #: With a shared store (several instances on one Redis): the connection (shared.Link), and the
    #: small values plugins share through it (shared.SharedValues); None on one instance.
    link: Any = None
    values: Any = None
    #: With a shared store: requests to the other instances (shared.Signals: cancel, stop).
    signals: Any = None
    #: Prometheus metrics (metrics.Metrics, metrics.OFF without a metrics listener) and OpenTelemetry spans
    #: (tracing.Tracing), set by build_runtime.
    metrics: Any = None
    tracing: Any = None

    def unavailable(self) -> str | None:
        """Why this instance cannot serve requests now (its shared store is unreachable), or None."""
        return self.link.unavailable_message() if self.link is not None else None


_current: Runtime | None = None


def set_current(rt: Runtime | None) -> None:
    """Install the runtime the facade functions below act on."""
    global _current
    _current = rt


def current() -> Runtime:
    if _current is None:
        raise RuntimeError("no agent-mcp runtime is running")
    return _current


def installed() -> Runtime | None:
    """The runtime `set_current()` installed, or None."""
    return _current


def push_tok(client_id: str, text: str) -> None:
    """Send answer text to every subscriber of the session."""
    current().hub.tok(client_id, text)


def push_status(client_id: str, text: str) -> None:
    current().hub.status(client_id, text)


def push_done(client_id: str) -> None:
    current().hub.done(client_id)


def push_error(client_id: str, message: str) -> None:
    """Report a failed turn; a `done` follows so clients give the prompt back."""
    hub = current().hub
    hub.error(client_id, message)
    hub.done(client_id)


def push_gate(client_id: str, payload: dict[str, Any]) -> None:
    current().hub.gate(client_id, payload)
