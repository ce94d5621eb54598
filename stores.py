"""A session at rest: its record, and where it persists (the store interface, in memory, SQLite).

The live sessions and their bounds are `sessions.SessionManager`'s; the shared store of several
instances (Redis) is `shared_store.RedisStore`, and `shared_store.open_store` picks one from the
`SESSION_STORE` setting.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import operator
import os
import sqlite3
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiosqlite
import orjson

logger = logging.getLogger("agent_mcp.state")

FIRST_SHORTHAND = 101
DEFAULT_TOOL_PREVIEW = 500


class SessionError(Exception):
    """A session cannot be found or changed; the message says which and why."""


class StoreFault(SessionError):
    """A write to the session store at `path` failed (disk full, file gone read-only); nothing of it was
    committed. The SessionManager keeps the change in memory and writes it again (see SessionManager.save)."""

    def __init__(self, message: str, path: Path):
        super().__init__(message)
        self.path = path


class StoreLocked(StoreFault):
    """Another process holds the session store's write lock (SQLite's `database is locked`): waiting may help."""


#: What a store locked by another process is called, wherever it is said (logs, status and error events).
LOCKED = "the session store is locked by another process: {path}"


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
    #: How much of `history` was checked against the stored limits (SessionManager._bound_history): the number
    #: of messages and the last of them. Not stored.
    bounded: tuple[int, dict[str, Any]] | None = field(default=None, repr=False, compare=False)

    def to_record(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "history": self.history,
            "tool_preview_length": self.tool_preview_length,
            "settings": self.settings,
            "created": self.created,
            **({"running": self.running} if self.running else {}),
        }

    def to_json(self) -> str:
        """The record as JSON, as a store keeps it (`dumps`)."""
        return dumps(self.to_record())

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


def dumps(value: Any) -> str:
    """JSON as a store keeps it.

    orjson, not `json.dumps`: at 1,000 messages `json.dumps` took 0.7 ms a session, orjson 0.04 ms (issue 31).
    What orjson refuses (an integer beyond 64 bits in a tool call's arguments) goes through `json`; NaN and
    infinities, which `json` would write as tokens no JSON parser but Python's reads, become null."""
    try:
        return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode()
    except TypeError:
        return json.dumps(value, ensure_ascii=False)


class SessionStore:
    """Where sessions persist. The memory store keeps nothing across restarts (tests).

    A `shared` store (Redis) is written and read by several instances at once: the manager reads
    a session again whenever a request takes it (`fetch`, under the store's `lease`) and before
    every listing (`fetch_all`), and shorthand ids come from the store (`allocate_shorthand`).
    """

    shared = False

    async def open(self) -> None:
        """Prepare the store (create tables)."""

    async def close(self) -> None:
        """Release connections."""

    async def load(self) -> tuple[list[Session], int]:
        """Every stored session and the last shorthand id handed out (0 if none)."""
        return [], 0

    def describe(self) -> str:
        """Where sessions are kept (the start-up log says it)."""
        return "in memory only (gone when the server stops)"

    async def instances(self) -> int:
        """How many servers use this store now (more than 1 only for a shared store)."""
        return 1

    async def save(self, session: Session, last_shorthand: int, *, create: bool = True) -> bool:
        """Insert or replace one session and record the shorthand counter. Without `create`, a session the
        store no longer has (removed by another instance: shared stores) is not written again: False."""
        return True

    async def delete(self, client_id: str) -> None:
        """Forget one session (its shorthand id is never reused)."""

    # Shared stores only:

    async def fetch(self, client_id: str) -> Session | None:
        """The stored session as it is now."""
        raise NotImplementedError

    async def fetch_all(self) -> list[Session]:
        """Every stored session as it is now."""
        raise NotImplementedError

    async def allocate_shorthand(self) -> int:
        """A shorthand id no instance has handed out."""
        raise NotImplementedError

    @contextlib.asynccontextmanager
    async def lease(self, client_id: str, holder: str) -> AsyncIterator[None]:
        """Hold the session's turn lease (every instance's requests on it run one at a time)."""
        yield

    async def orphans(self) -> list[str]:
        """Sessions marked running whose lease nobody holds: their process died."""
        return []

    async def mark_gone(self, client_id: str, why: str) -> None:
        """Remember why a session was removed (see SessionManager.take_gone)."""

    async def take_gone(self, client_id: str) -> str | None:
        """Why the session was removed, once."""
        return None


class MemoryStore(SessionStore):
    """Sessions live only as long as the process."""


#: The files SQLite keeps next to a database (they hold its data too).
SIDE_FILES = ("-wal", "-shm", "-journal")


def make_private(path: Path) -> None:
    """Create the database file 0600 if missing (whatever the umask and the directory's mode), and make it and
    its side files 0600 if they exist: SQLite creates the -wal, -shm and -journal files with the database's
    mode, so they follow."""
    os.close(os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600))
    for name in ("", *SIDE_FILES):
        side = path.with_name(path.name + name)
        with contextlib.suppress(FileNotFoundError):
            if side.stat().st_mode & 0o077 and side.stat().st_uid == os.getuid():
                os.chmod(side, 0o600)


class SqliteFile:
    """One aiosqlite connection to a file in WAL mode (it and its side files 0600), its tables created by
    `SCHEMA` at open."""

    SCHEMA: tuple[str, ...] = ()
    #: Seconds a statement waits for a lock another connection holds before it fails (sqlite3's `timeout`).
    BUSY_SECONDS = 5.0
    #: Each statement its own transaction (no `commit()` to send after it), for a store whose writes are one
    #: statement each.
    AUTOCOMMIT = False

    def __init__(self, path: Path):
        self.path = Path(path)
        self._db: aiosqlite.Connection | None = None

    async def open(self) -> None:
        """Open (creating the file and its directory); SessionError names the file when that fails."""
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            make_private(self.path)
            autocommit = {"isolation_level": None} if self.AUTOCOMMIT else {}
            self._db = await aiosqlite.connect(self.path, timeout=self.BUSY_SECONDS, **autocommit)
            await self._db.execute("PRAGMA journal_mode=WAL")
            for statement in self.SCHEMA:
                await self._db.execute(statement)
            await self._db.commit()
        except (OSError, sqlite3.Error) as exc:
            await self.close()
            raise SessionError(f"cannot open {self.path} ({exc}): make it and its directory writable, "
                               "or set AGENT_DATA_DIR (or SESSION_STORE) to a writable place") from None

    async def close(self) -> None:
        if self._db is not None:
            await self._db.close()
            self._db = None

    def _conn(self) -> aiosqlite.Connection:
        if self._db is None:
            raise SessionError(f"{self.path} is not open")
        return self._db


#: A session's newest messages ride in its record (a save stays one statement) until there are more than
#: TAIL_MESSAGES of them or the record passes TAIL_BYTES; then they move to rows of `messages`, each written
#: once, so a save no longer writes the whole history (issue 31: at 1,000 messages a turn's two saves were a
#: third of its cost).
TAIL_MESSAGES = 32
TAIL_BYTES = 64 * 1024


@dataclass(slots=True)
class _Layout:
    """Where the store holds a session's history: rows `first` … `first + count - 1` of `messages`, then the
    record's tail. `written` is that history as the message objects saved (what the next save compares)."""

    first: int = 0
    count: int = 0
    written: list[dict[str, Any]] = field(default_factory=list)


def _kept(history: list[dict[str, Any]], written: list[dict[str, Any]]) -> tuple[int, int]:
    """(k, m): `history[:m]` are `written[k:k + m]`, the same objects (a history only grows at its end, loses
    its oldest turns, or is cut back at its end; anything else keeps nothing). Stored messages are never
    edited in place: a message that changes is a new object."""
    if not history or not written:
        return 0, 0
    head = history[0]
    k = next((i for i, m in enumerate(written) if m is head), None)
    if k is None:
        return 0, 0
    n = min(len(history), len(written) - k)
    if all(map(operator.is_, history[:n], written[k:k + n])):
        return k, n
    m = 0
    while history[m] is written[k + m]:
        m += 1
    return k, m


class SqliteStore(SqliteFile, SessionStore):
    """Sessions in one SQLite file: history, model, shorthand ids survive restarts.

    A session is a row of `sessions` (its record: settings, the newest messages) and its older messages are
    rows of `messages`, numbered by `seq`. The record says which rows are its history (`rows`: first seq,
    count): it is written last, so a save cut short leaves the session as it was, and rows outside that range
    are leftovers, deleted when the session's messages next move to rows. Records written before (the whole
    history in the record) are read as they are and take this form at their next save."""

    def describe(self) -> str:
        return f"SQLite {self.path}"

    SCHEMA = (
        # WAL without an fsync per commit: a killed process loses nothing committed (power loss may lose
        # the last commits). A turn commits as it starts, with the user's message, and as it ends.
        "PRAGMA synchronous=NORMAL",
        "CREATE TABLE IF NOT EXISTS sessions ("
        " client_id TEXT PRIMARY KEY, shorthand INTEGER UNIQUE NOT NULL,"
        " record TEXT NOT NULL, updated REAL NOT NULL)",
        "CREATE TABLE IF NOT EXISTS messages ("
        " client_id TEXT NOT NULL, seq INTEGER NOT NULL, body TEXT NOT NULL,"
        " PRIMARY KEY (client_id, seq)) WITHOUT ROWID",
        "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    )
    #: A save is one statement, sent to SQLite's thread once (a session's row; `last_shorthand` only when it
    #: changed): three round trips to that thread were 0.3 ms of a turn's three saves (issue 31). The two rows
    #: need no common transaction: `load` takes the larger of `last_shorthand` and the highest stored id. When
    #: the tail moves to rows, the rows, the record and the deletion of leftovers are one transaction.
    AUTOCOMMIT = True
    #: Short: a write to a locked file fails soon, and SessionManager tries again, telling the session's clients
    #: why they wait, for up to its `lock_seconds`.
    BUSY_SECONDS = 0.5
    _written_shorthand = -1

    def __init__(self, path: Path):
        super().__init__(path)
        self._layouts: dict[str, _Layout] = {}
        #: One save or delete at a time: a save reads the layout the last one left, and a move to rows is a
        #: transaction on the one connection that nothing else may write into.
        self._one_at_a_time = asyncio.Lock()

    async def load(self) -> tuple[list[Session], int]:
        db = self._conn()
        rows: dict[str, dict[int, str]] = {}
        async with db.execute("SELECT client_id, seq, body FROM messages") as cur:
            async for client_id, seq, body in cur:
                rows.setdefault(client_id, {})[seq] = body
        sessions = []
        async with db.execute("SELECT client_id, shorthand, record, updated FROM sessions ORDER BY shorthand") as cur:
            async for client_id, shorthand, record, updated in cur:
                try:
                    data = json.loads(record)  # (not orjson: it reads an integer beyond 64 bits as a float)
                    layout = _Layout()
                    if "history" not in data:
                        layout.first, layout.count = (int(x) for x in data.get("rows", (0, 0)))
                        mine = rows.get(client_id, {})
                        data["history"] = [json.loads(mine[seq]) for seq in
                                           range(layout.first, layout.first + layout.count)] + list(data["tail"])
                    session = Session.from_record(client_id, shorthand, data, updated)
                except (ValueError, KeyError, TypeError) as exc:
                    # One damaged row must not take the others down; it stays in the file.
                    logger.error("session %s in %s is damaged and was skipped: %s", client_id, self.path, exc)
                    continue
                layout.written = list(session.history)
                self._layouts[client_id] = layout
                sessions.append(session)
        async with db.execute("SELECT value FROM meta WHERE key = 'last_shorthand'") as cur:
            row = await cur.fetchone()
        last = max([int(row[0]) if row else 0, *(s.shorthand for s in sessions)])
        return sessions, last

    async def save(self, session: Session, last_shorthand: int, *, create: bool = True) -> bool:
        async with self._one_at_a_time:
            await self._save(session, last_shorthand)
        return True

    async def _save(self, session: Session, last_shorthand: int) -> None:
        db = self._conn()
        history, client_id = session.history, session.client_id
        was = self._layouts.get(client_id) or _Layout()
        now = _Layout(first=was.first + was.count, written=list(history))  # no row kept: new rows after the old
        k, m = _kept(history, was.written)
        if k < was.count <= k + m:  # the rows from k on are all still the history's start
            now.first, now.count = was.first + k, was.count - k
        record = session.to_record()
        del record["history"]
        record["rows"], record["tail"] = [now.first, now.count], history[now.count:]
        body = dumps(record)
        moved = len(record["tail"]) > TAIL_MESSAGES or len(body) > TAIL_BYTES
        async with self._writing():
            if moved:  # the tail becomes rows, after the record's range, in one transaction with the record
                await db.execute("BEGIN")
                await db.executemany("INSERT OR REPLACE INTO messages (client_id, seq, body) VALUES (?, ?, ?)",
                                     [(client_id, now.first + now.count + i, dumps(msg))
                                      for i, msg in enumerate(record["tail"])])
                now.count += len(record["tail"])
                record["rows"], record["tail"] = [now.first, now.count], []
                body = dumps(record)
            await db.execute(
                "INSERT OR REPLACE INTO sessions (client_id, shorthand, record, updated) VALUES (?, ?, ?, ?)",
                (client_id, session.shorthand, body, session.updated),
            )
            if moved:  # and the leftovers go: rows the record no longer names
                await db.execute("DELETE FROM messages WHERE client_id = ? AND (seq < ? OR seq >= ?)",
                                 (client_id, now.first, now.first + now.count))
                await db.commit()
            self._layouts[client_id] = now
            if last_shorthand != self._written_shorthand:
                await db.execute(
                    "INSERT OR REPLACE INTO meta (key, value) VALUES ('last_shorthand', ?)", (str(last_shorthand),)
                )
                self._written_shorthand = last_shorthand

    async def delete(self, client_id: str) -> None:
        db = self._conn()
        async with self._one_at_a_time, self._writing():
            await db.execute("DELETE FROM sessions WHERE client_id = ?", (client_id,))
            self._layouts.pop(client_id, None)
            await db.execute("DELETE FROM messages WHERE client_id = ?", (client_id,))

    @contextlib.asynccontextmanager
    async def _writing(self) -> AsyncIterator[None]:
        """A write that fails is rolled back and becomes one StoreFault that names the file and the fix (StoreLocked
        when another process holds the file's lock); what was committed before stays. A write cancelled midway
        is rolled back too: its transaction must not stay open for the next saves to write into."""
        try:
            yield
        except (OSError, sqlite3.Error) as exc:
            await self._rollback()
            if _busy(exc):
                raise StoreLocked(f"{LOCKED.format(path=self.path)}; this change was not saved", self.path) from None
            raise StoreFault(f"cannot write {self.path} ({exc}): free disk space there or make it writable; "
                             "this change was not saved", self.path) from None
        except asyncio.CancelledError:
            await asyncio.shield(self._rollback())
            raise

    async def _rollback(self) -> None:
        with contextlib.suppress(sqlite3.Error, ValueError):
            await self._conn().rollback()


def _busy(exc: BaseException) -> bool:
    """Whether SQLite failed because another connection holds a lock (SQLITE_BUSY, SQLITE_LOCKED and their
    extended codes), not because the disk or the file refused the write."""
    code = getattr(exc, "sqlite_errorcode", None)
    return isinstance(code, int) and code & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)


def open_store(url: str | None, data_dir: Path) -> SessionStore:
    """A store from a `SESSION_STORE` setting: `sqlite` (default), `sqlite:///path`, or `memory`."""
    url = (url or "sqlite").strip()
    if url == "memory":
        return MemoryStore()
    if url == "sqlite":
        return SqliteStore(data_dir / "sessions.sqlite3")
    if url.startswith("sqlite:///"):
        return SqliteStore(Path(url.removeprefix("sqlite:///")))
    shown = f"{url.split(':', 1)[0]}:…" if "@" in url or "://" in url else repr(url)  # never a password
    raise SessionError(f"SESSION_STORE={shown} is not supported; use 'sqlite' (the default), "
                       "'sqlite:///<path>', 'memory', or redis://host:port/db for several instances on one Redis")
