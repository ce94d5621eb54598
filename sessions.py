"""The live sessions: the manager (write-through to a SessionStore), their bounds, history trimming.

A session's record and its persistence are `stores.py`'s; the manager holds the sessions in
memory, hands out shorthand ids, runs one request at a time on each (`hold`), and expires and
evicts them by client class (`SessionPolicy`).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from stores import FIRST_SHORTHAND, LOCKED, Session, SessionError, SessionStore, StoreFault, StoreLocked

logger = logging.getLogger("agent_mcp.state")

#: Defaults of the session bounds (plugins-enabled.json `sessions`; see SessionPolicy).
DEFAULT_MAX_SESSIONS = 1000
DEFAULT_MAX_HISTORY = 1000
DEFAULT_MAX_MESSAGE_CHARS = 200_000
TRUNCATED = "\n…(truncated: longer than the stored message limit)"
#: Seconds between two looks for turns whose instance died (shared stores; see SessionManager.recover).
RECOVER_SECONDS = 1.0
#: Removed sessions whose reason is remembered for a client that comes back (SessionManager.take_gone).
MAX_GONE = 4096
#: Seconds a write waits while another process holds the session store's lock before it fails (the default of
#: SESSION_STORE_LOCK_SECONDS; see SessionManager.save).
DEFAULT_LOCK_SECONDS = 30.0
#: Seconds between two tries of a write to a locked store (each try also waits in the store: SqliteStore.BUSY_SECONDS).
LOCK_PAUSE_SECONDS = 0.1
#: Seconds between two tries to write the sessions a failed save left in memory (`_retry_unwritten`).
RETRY_SECONDS = 1.0
#: What the clients of a session whose change a write could not store are told, after why.
KEPT = ("this change was not saved yet: it is kept in memory and written as soon as the store takes it "
        "(tried every {retry:g} s)")
#: … once it is written after all.
WRITTEN = "[session] the session store took this session's unsaved changes again: they are saved"
#: Seconds between two log lines about evictions of one client class (`_evict`: the second gives the count since).
EVICTION_LOG_SECONDS = 60.0


class Stopping(SessionError):
    """This server is stopping and starts no more turns (HTTP: 503, so the request is sent again)."""


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
                 clock: Callable[[], float] = time.time, is_busy: Callable[[str], bool] | None = None,
                 lock_seconds: float = DEFAULT_LOCK_SECONDS):
        self.store = store
        self.policy = policy or SessionPolicy()
        self.clock = clock
        self.is_busy = is_busy
        #: How long a write waits for a store locked by another process (SESSION_STORE_LOCK_SECONDS).
        self.lock_seconds = lock_seconds
        self.forgotten: list[ForgetHook] = []
        #: Called with (client id, request id) for a request found to have died with its process.
        self.interrupted: Callable[[str, str], None] | None = None
        #: Called with (client id, text) to tell a session's clients what its store does (locked: waiting; its
        #: unsaved changes written after all).
        self.store_news: Callable[[str, str], None] | None = None
        #: Sessions a failed write left changed in memory only, and since when (monotonic): `_retry_unwritten`
        #: writes them as soon as the store takes writes again.
        self._unwritten: dict[str, float] = {}
        self._retrier: asyncio.Task[None] | None = None
        self._closed = False
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
        #: Per client class, sessions evicted and not yet logged, and when the last line was written (`_evict`).
        self._evicted: dict[str, int] = {}
        self._evictions_logged: dict[str, float] = {}

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
        for task in (self._sweeper, self._recoverer, self._retrier):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._sweeper = self._recoverer = self._retrier = None
        self._closed = True
        await self._write_unwritten()  # a last try: what still fails is named in the log, never dropped unsaid
        if self._unwritten:
            logger.error("the server stops with unsaved changes of %d session(s), which are lost: %s (%s could not "
                         "be written)", len(self._unwritten), ", ".join(self._unwritten), self.store.describe())
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
        self._unwritten.pop(client_id, None)  # nothing of it is to be written any more
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
            known = self._sessions.get(client_id)
            if known is None:
                self._add(fresh)
            elif not known.lock.locked():
                self._take(known, fresh)

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
    async def hold(self, session: Session, turn_id: str, ended: Callable[[], Awaitable[None]] | None = None,
                   saves_at_once: bool = False) -> AsyncIterator[bool]:
        """Hold `session` for one request; yields whether the session is new.

        Requests on a session run one at a time, in the order they asked (on every instance of a
        shared store: the store's lease, and the session is read again once held). While held, the
        session is stored marked `running`, so a request that dies with its process is found and
        ended (`recover`); on leaving it is saved, unless it was removed meanwhile. `ended` runs
        after that save and before the session is let go, when the request finished without an
        exception: its `done` then comes before anything the next request (on any instance) says.
        `saves_at_once`: the request saves the session itself first thing (an LLM turn stores its
        user message), and the mark goes with that save instead of one of its own (a save is a trip to
        the store: a Redis store writes the whole session, issue 31); a new session and a shared store
        (other instances go by the mark) are saved at once all the same.
        """
        async with session.lock, self.store.lease(session.client_id, turn_id):
            created = await self._reload(session) if self.store.shared else session.client_id in self._unsaved
            if session.running and self.interrupted is not None:
                self.interrupted(session.client_id, session.running)  # its process died; say so first
            session.running = turn_id
            finished = False
            try:
                # (A new session whose request saves at once is saved there: the store is written once, and when
                # it refuses, the user's message is in the session it keeps in memory.)
                if not saves_at_once or self.store.shared:
                    await self.save(session)
                yield created
                finished = True
            finally:
                session.running = None
                if self._sessions.get(session.client_id) is session:
                    if finished:
                        await self.save(session)
                    elif session.client_id not in self._unwritten:  # (else kept already: `_retry_unwritten` writes it)
                        # An error is on its way already: one try, no wait; a failure stays kept and retried.
                        with contextlib.suppress(StoreFault):
                            await self.save(session, wait=False)
                if finished and ended is not None:
                    await ended()

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

    async def save(self, session: Session, *, wait: bool = True) -> None:
        """Store the session (its history bounded first) as active now; a new one may evict its class's LRU.

        While another process holds the store's lock, the write is tried again for up to `lock_seconds` (without
        `wait`: once), and the session's clients are told why they wait. A write that fails (still locked, disk
        full, read-only) raises StoreFault saying so; the session keeps the change in memory and is written
        as soon as the store takes it (`_retry_unwritten`), or by its next save."""
        if self._sessions.get(session.client_id) is not session:
            return
        if not session.shorthand:
            session.shorthand = await self.store.allocate_shorthand()
            self._by_short[session.shorthand] = session.client_id
        self._bound_history(session)
        self._touch(session)
        await self._store(session, wait)

    async def _store(self, session: Session, wait: bool) -> None:
        """Write the session as it is (see `save`)."""
        client_id = session.client_id

        async def write() -> bool | None:
            if self._sessions.get(client_id) is not session:
                return None  # removed while it waited for the store's lock: not written back
            return await self.store.save(session, self._last_short, create=client_id in self._unsaved)

        try:
            written = await self._waiting(client_id, write, wait)
        except StoreFault as exc:
            self._keep(client_id, exc, wait)
            raise type(exc)(self._kept(exc, wait), exc.path) from None
        if client_id in self._unwritten:
            since = self._unwritten.pop(client_id)
            logger.warning("session %s saved to %s after all, %.1f s after its first failed write", client_id,
                           self.store.describe(), time.monotonic() - since)
            self._tell(client_id, WRITTEN)
        if written is None:
            return
        if written is False:
            self._drop(client_id)  # removed on another instance meanwhile: not brought back
            return
        if client_id in self._unsaved:
            self._unsaved.discard(client_id)
            kind = self._kind[client_id]
            await self._evict(kind, self.policy.limits(kind).max_sessions, keep=client_id)

    async def _waiting(self, client_id: str, write: Callable[[], Awaitable[Any]], wait: bool = True) -> Any:
        """`write()`, tried again while the store is locked by another process, for up to `lock_seconds`
        (without `wait`: once); the session's clients are told once that it waits, and why."""
        deadline = time.monotonic() + (self.lock_seconds if wait else 0.0)
        started, told = time.monotonic(), False
        while True:
            try:
                result = await write()
            except StoreLocked as exc:
                if time.monotonic() >= deadline:
                    raise
                if not told:
                    told = True
                    logger.warning("%s; session %s waits for it up to %g s (SESSION_STORE_LOCK_SECONDS)",
                                   LOCKED.format(path=exc.path), client_id, self.lock_seconds)
                    self._tell(client_id, f"{LOCKED.format(path=exc.path)}; retrying (for up to "
                                          f"{self.lock_seconds:g} s)")
                await asyncio.sleep(LOCK_PAUSE_SECONDS)
                continue
            if told:
                logger.warning("the session store is writable again: session %s waited %.1f s for its lock",
                               client_id, time.monotonic() - started)
            return result

    def _kept(self, exc: StoreFault, waited: bool) -> str:
        """What a failed write says: why, what to do, and that its change is kept."""
        kept = KEPT.format(retry=RETRY_SECONDS)
        if isinstance(exc, StoreLocked):
            path = exc.path
            still = (f"still locked after {self.lock_seconds:g} s (SESSION_STORE_LOCK_SECONDS)" if waited
                     else "still locked")
            return (f"{LOCKED.format(path=path)}; {still}: find the process holding it (`fuser -v {path}` lists "
                    f"those that have it open besides agent-mcp) and let it finish or stop it; {kept}")
        return f"{str(exc).removesuffix('; this change was not saved')}; {kept}"

    def _keep(self, client_id: str, exc: StoreFault, waited: bool) -> None:
        """Remember that `client_id`'s session holds changes its store does not (retried until it does)."""
        if client_id not in self._unwritten:
            self._unwritten[client_id] = time.monotonic()
            logger.warning("session %s: %s", client_id, self._kept(exc, waited))
        if not self._closed and (self._retrier is None or self._retrier.done()):
            # In a context of its own: what it says belongs to no request (not the one that failed first).
            self._retrier = asyncio.create_task(self._retry_unwritten(), name="unsaved-sessions",
                                                context=contextvars.Context())

    async def _retry_unwritten(self) -> None:
        """Write the sessions failed writes left in memory, every RETRY_SECONDS, until none is left."""
        while self._unwritten:
            await asyncio.sleep(RETRY_SECONDS)
            try:
                await self._write_unwritten()
            except Exception:  # never the end of the retries
                logger.exception("writing the unsaved sessions failed")

    async def _write_unwritten(self) -> None:
        """One try to write each session a failed write left in memory, up to the first that fails again (the
        store still refuses). A session a request holds is left to it: its request saves it at its end."""
        for client_id in list(self._unwritten):
            session = self._sessions.get(client_id)
            if session is None:
                self._unwritten.pop(client_id, None)
            elif not session.lock.locked():
                try:
                    await self._store(session, wait=False)
                except StoreFault:
                    return

    def _bound_history(self, session: Session) -> None:
        """Drop the oldest whole turns beyond `max_history` messages; cut texts over `max_message_chars`."""
        history, policy = session.history, self.policy
        if len(history) > policy.max_history:
            history[:] = trim_history(history, policy.max_history)
        # Only the messages added since the last check (a history is appended to; anything else checks it all).
        count, last = session.bounded or (0, None)
        start = count if 0 < count <= len(history) and history[count - 1] is last else 0
        for msg in itertools.islice(history, start, None):
            content = msg.get("content")
            if isinstance(content, str) and len(content) > policy.max_message_chars:
                msg["content"] = content[: policy.max_message_chars] + TRUNCATED
        session.bounded = (len(history), history[-1]) if history else None

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
        await self._waiting(client_id, lambda: self.store.delete(client_id))
        for hook in list(self.forgotten):
            try:
                hook(client_id)
            except Exception:
                logger.exception("session hook %r failed for %s", hook, client_id)
        return session

    def _tell(self, client_id: str, text: str) -> None:
        if self.store_news is not None:
            self.store_news(client_id, text)

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
        members: Mapping[str, Session] = self._lru.get(kind, {})
        excess = len(members) - cap
        if excess <= 0:
            return []
        idle = (s for s in members.values() if s.client_id != keep and not self.busy(s))
        victims = list(itertools.islice(idle, excess))  # the least recently active first
        evicted = [s.client_id for s in victims if await self._remove_idle(s, "evicted")]
        if evicted:
            self._evicted[kind] = self._evicted.get(kind, 0) + len(evicted)
            now = time.monotonic()
            if now - self._evictions_logged.get(kind, -EVICTION_LOG_SECONDS) >= EVICTION_LOG_SECONDS:
                self._evictions_logged[kind] = now  # at the cap, every new session evicts one: not a line each
                logger.info("evicted %d least recently used %s session(s) over the cap of %d (at most one such line "
                            "a minute)", self._evicted.pop(kind), kind, cap)
        return evicted

    async def _remove_idle(self, session: Session, why: str) -> bool:
        """Forget `session` unless it is busy or already gone (another task may have run meanwhile)."""
        if self._sessions.get(session.client_id) is not session or self.busy(session):
            return False
        await self._forget(session.client_id, why)
        return True
