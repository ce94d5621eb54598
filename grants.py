"""Approvals that reach further than one call (grants), and the tamper-evident record of every decision.

A grant is what a human said when answering a gate: allow this tool (or these tables with this
permission) for N minutes, for the rest of the session, or for calls of the same shape (the same
statement with other values; the same values of a tool's defining arguments). Grants are kept per
session in SQLite, survive restarts until they expire, and end at once when revoked.

The audit log is one append-only table in the same file: every gate decision, grant, use of a
grant, revocation and gate-policy change, chained with a keyed MAC and checkpointed outside the file
(`audit_chain`), so a changed, missing, added or cut record is found (`verify_file`, `agentctl
audit-verify`). Records name who, what and when, and hold a digest of the arguments, never the
arguments themselves. A grant is honoured only in the session and store its MAC binds it to (`sqlite:<log
id>` for the file, `redis:<prefix>` for Redis), while its grant record is in the verified chain and no
revocation of its id is known: a row added, edited, copied into another session or store, or put back
after its revocation is ignored, with a warning and a `grant_forged` audit record.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import hmac
import json
import logging
import os
import secrets
import sqlite3
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import audit_chain
import stores
from audit_chain import AUDIT_FIELDS, GENESIS, AuditError, AuditRecord, Head
from decisions import DECISIONS, DEFAULT_MINUTES, GRANT_SCOPES, MAX_MINUTES, PATTERN, TIMED

logger = logging.getLogger("agent_mcp.grants")
#: The audit head at start and stop: logged whatever the server's log level, for `agentctl audit-verify --log`.
head_logger = logging.getLogger("agent_mcp.grants.head")
head_logger.setLevel(logging.INFO)

#: The gate key of a statement that could not be analysed (sql.ANY_TABLE): never covered by a grant.
ANY = "*"
AUDIT_FILE = "audit.sqlite3"
#: With several instances on one Redis, a session's grants are kept there at most this long after a change.
SHARED_SECONDS = 30 * 86400
#: The Redis value format whose MAC binds the grant to its prefix and session (older ones are not honoured).
SHARED_FORMAT = 2
#: Share a grant (KEYS: its session's hash, the revoked ids, the owners; ARGV: id, value, session, seconds) unless
#: its id was revoked: a use counted on one instance must not put back a grant another one just revoked.
_SET_UNLESS_REVOKED = """if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) redis.call('EXPIRE', KEYS[1], ARGV[4])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[3]) return 1"""
#: A session's grants (KEYS[1]) with, for each, whether its id was revoked (KEYS[2]): id, value, 0|1, … in one trip.
_GRANTS_AND_REVOKED = """local rows, out = redis.call('HGETALL', KEYS[1]), {}
for i = 1, #rows, 2 do out[#out + 1] = rows[i] out[#out + 1] = rows[i + 1]
out[#out + 1] = redis.call('HEXISTS', KEYS[2], rows[i]) end return out"""


#: What the log's writer task takes from its queue: a statement (SQL, parameters, the head it seals or None), or
#: a future it resolves once everything queued before it is written.
_Work = tuple[str, tuple[Any, ...], tuple[int, str] | None] | asyncio.Future[None]

class GrantError(ValueError):
    """An answer that cannot become a grant; the message says what to answer instead."""


@dataclass(frozen=True)
class Decision:
    """A human's answer to a gate: `word` (DECISIONS), the minutes of a timed grant, who answered."""

    word: str
    by: str = ""
    minutes: int = DEFAULT_MINUTES
    #: What the human filled in, for a question that asks for values (an MCP server's elicitation form).
    content: dict[str, Any] | None = field(default=None, compare=False)

    @classmethod
    def parse(cls, word: str, by: str = "", minutes: Any = None, *, may_grant: bool = True) -> Decision:
        """A checked decision; GrantError says what is wrong (an unknown word, minutes out of range,
        a grant asked by a client that may only allow once or reject)."""
        if word not in DECISIONS:
            raise GrantError(f"decision must be one of: {', '.join(DECISIONS)}")
        if word in GRANT_SCOPES and not may_grant:
            raise GrantError(f"{word} creates a grant, which only the shell, an admin API client or a human MCP "
                             "token may do; answer allow (this call only) or reject")
        if minutes is None:
            minutes = DEFAULT_MINUTES
        if isinstance(minutes, bool) or not isinstance(minutes, int) or not 1 <= minutes <= MAX_MINUTES:
            raise GrantError(f"minutes must be a whole number from 1 to {MAX_MINUTES}, not {minutes!r}")
        return cls(word, by, minutes)


@dataclass
class Grant:
    """How far one yes reaches: a session, tool, gate section, keys (tables or the tool), one permission."""

    id: str
    session: str
    scope: str
    tool: str
    section: str
    keys: tuple[str, ...]
    op: str
    granted_by: str
    created: float
    expires: float | None = None
    #: For PATTERN grants: the digest of the call's shape, and the shape as shown to the human.
    pattern: str = ""
    shape: str = ""
    uses: int = 0
    revoked: float | None = None
    #: The seq of the audit record that created it: a grant is honoured only if that record is in the chain.
    audit_seq: int = 0

    def active(self, now: float) -> bool:
        return self.revoked is None and (self.expires is None or now < self.expires)

    def covers(self, tool: str, section: str, keys: Iterable[str], op: str, pattern: Callable[[], str],
               now: float) -> bool:
        """Whether this grant allows a call: never when expired or revoked, never for a statement that could
        not be analysed, a shape grant only for exactly its shape (`pattern()`: the call's, computed only
        when a shape grant is asked), the others for their keys and permission."""
        wanted = set(keys)
        if not self.active(now) or not wanted or ANY in wanted or section != self.section or op != self.op:
            return False
        if section == "tools" and tool != self.tool:
            return False
        if self.scope == PATTERN:
            return tool == self.tool and wanted == set(self.keys) and bool(self.pattern) and pattern() == self.pattern
        return wanted <= set(self.keys)

    def describe(self, now: float) -> str:
        what = (f"{self.op} on {', '.join(self.keys)}" if self.section == "db" else f"{self.tool} ({self.op})")
        if self.scope == PATTERN:
            what += f", calls shaped like: {self.shape}"
        if self.revoked is not None:
            left = "revoked"
        elif self.expires is None:
            left = "until the session ends"
        elif now >= self.expires:
            left = "expired"
        else:
            left = f"{max(1, round((self.expires - now) / 60))} min left"
        return f"[{self.id}] {what} — {left}; granted by {self.granted_by}, used {self.uses}×"


def digest(value: Any) -> str:
    """SHA-256 of a value's canonical JSON (sorted keys): what the audit log keeps of arguments."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, ensure_ascii=False, default=str).encode()).hexdigest()


def canonical(grant: Grant) -> str:
    """A grant's record as its MAC covers it."""
    return json.dumps(asdict(grant), sort_keys=True)


class GrantStore(stores.SqliteFile):
    """Grants (kept in memory) and the audit chain, in `<data dir>/audit.sqlite3`.

    Decisions are made from memory; every change and audit record is written by one writer task,
    in order, a burst in one transaction, so a tool call never waits for the disk; after each burst
    the chain's head is checkpointed (head file, log line, Redis). `flush()` waits until everything
    so far is written; `close()` flushes. One process at a time holds the file (`<file>.lock`).
    `open()` verifies the whole chain against its head and refuses (AuditError) a log that does not hold.
    """

    SCHEMA = (
        # Every commit on disk before its head is checkpointed: a power cut must not make the head longer.
        "PRAGMA synchronous=FULL",
        "CREATE TABLE IF NOT EXISTS grants (id TEXT PRIMARY KEY, session TEXT NOT NULL, record TEXT NOT NULL)",
        "CREATE TABLE IF NOT EXISTS audit (seq INTEGER PRIMARY KEY, ts REAL NOT NULL, event TEXT NOT NULL,"
        " session TEXT, actor TEXT, tool TEXT, op TEXT, tables TEXT, args_digest TEXT, outcome TEXT,"
        " grant_id TEXT, detail TEXT, prev TEXT NOT NULL, hash TEXT NOT NULL)",
        audit_chain.META_TABLE,
    )
    _INSERT = (f"INSERT INTO audit ({', '.join(AUDIT_FIELDS)}, prev, hash) "
               f"VALUES ({', '.join('?' * (len(AUDIT_FIELDS) + 2))})")

    def __init__(self, path: Path, clock: Any = time.time, key_file: Path | None = None):
        super().__init__(path)
        self.clock = clock
        self.key_file = key_file or audit_chain.key_path(self.path.parent)
        self.head_file = self.path.parent / audit_chain.HEAD_FILE
        self._key = b""
        self._log_id = ""
        self._lock: int | None = None
        self.grants: dict[str, list[Grant]] = {}
        self._last: tuple[int, str] = (0, GENESIS)
        #: The head of what is committed to the file (`_last` runs ahead of it by what is queued).
        self._committed: tuple[int, str] = (0, GENESIS)
        self._ignored: set[tuple[str, str]] = set()
        #: Grants known to be revoked or ended (the chain, this process, Redis tombstones): no copy counts again.
        self._revoked: set[str] = set()
        self._deferred: list[AuditRecord] = []
        self._queue: asyncio.Queue[_Work | None] = asyncio.Queue()
        self._writer: asyncio.Task[None] | None = None
        self._observers: list[Callable[[str], None]] = []
        #: Several instances on one Redis (shared_link.Link): grants are shared there (see `refresh`).
        self.link: Any = None
        self._shared: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._sharer: asyncio.Task[None] | None = None
        self._shared_idle = asyncio.Event()
        self._shared_idle.set()

    def observe(self, callback: Callable[[str], None]) -> Callable[[], None]:
        """Call `callback(session)` whenever a session's grants change; returns the function that stops it."""
        self._observers.append(callback)
        return lambda: self._observers.remove(callback) if callback in self._observers else None

    def _changed(self, session: str) -> None:
        for callback in list(self._observers):
            callback(session)

    async def open(self) -> None:
        self._take_lock()
        try:
            await super().open()
            await self._open_chain()
        except BaseException:
            await self.close()
            raise
        self._writer = asyncio.create_task(self._write(), name="grant-store-writer")

    def _take_lock(self) -> None:
        lock = self.path.with_name(self.path.name + ".lock")
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise AuditError(f"cannot open {lock} ({exc.strerror}): make the data dir writable") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise AuditError(f"{self.path} is in use by another process (a running server holds {lock}): change "
                             "grants through that server (agentctl does when its shell endpoint answers, or "
                             "!grants revoke in the shell), or stop it first") from None
        self._lock = fd

    async def _open_chain(self) -> None:
        """Load the key, take over an unkeyed log, verify the chain against its head, load the grants it backs."""
        db = self._conn()
        meta = {key: value for key, value in await (await db.execute("SELECT key, value FROM audit_meta")).fetchall()}
        async with db.execute("SELECT COUNT(*) FROM audit") as cur:
            rows = (await cur.fetchone() or (0,))[0]
        async with db.execute("PRAGMA table_info(grants)") as cur:
            if "mac" not in [c[1] async for c in cur]:
                await db.execute("ALTER TABLE grants ADD COLUMN mac TEXT NOT NULL DEFAULT ''")
        try:
            # An existing keyed log whose key is gone must not get a new key: it could never be verified again.
            self._key = audit_chain.load_key(self.key_file, create=not meta)
        except AuditError as exc:
            raise AuditError(f"audit log {self.path}: {exc}") from None
        migrated = None
        if not meta:
            migrated = await self._start_chain(db, rows)
        verified = await asyncio.to_thread(self._verify)
        self._log_id, self._last = verified.head.log_id, (verified.head.count, verified.head.last)
        self._revoked |= verified.revoked
        if verified.after_checkpoint:
            logger.warning("audit log %s: %d record(s) were written after the last checkpointed head (the server "
                           "stopped between the two); the head is moved on", self.path, verified.after_checkpoint)
        now = self.clock()
        async with db.execute("SELECT id, session, record, mac FROM grants") as cur:
            async for grant_id, session, record, mac in cur:
                grant = self._backed(grant_id, session, record, mac, verified, migrated)
                if grant is not None and grant.active(now):
                    self.grants.setdefault(grant.session, []).append(grant)
        # Ended and unbacked grants stay in the audit log; the table keeps only those that can still allow.
        kept = [g.id for grants in self.grants.values() for g in grants]
        await db.execute(f"DELETE FROM grants WHERE id NOT IN ({','.join('?' * len(kept))})", kept)
        for grants in self.grants.values():
            for grant in grants:
                await db.execute(*self._grant_row(grant))
        await db.commit()
        self._committed = self._last
        self._checkpoint(Head(self._log_id, *self._last), "at start")
        if migrated is not None:
            self.audit(AuditRecord.migrated(migrated))
        for record in self._deferred:
            self.audit(record)
        self._deferred.clear()

    async def _start_chain(self, db: Any, rows: int) -> int | None:
        """Give a new log (or one written before the key) its id and keyed-chain header; returns how many
        unkeyed records were taken over (None for a new log)."""
        unkeyed, last = 0, GENESIS
        if rows:
            unkeyed, last = await asyncio.to_thread(self._check_unkeyed)
        await db.executemany("INSERT INTO audit_meta (key, value) VALUES (?, ?)",
                             [("format", audit_chain.FORMAT), ("log_id", secrets.token_hex(8)),
                              ("unkeyed", str(unkeyed))])
        await db.commit()
        meta = {key: value for key, value in await (await db.execute("SELECT key, value FROM audit_meta")).fetchall()}
        start = audit_chain.start_mac(self._key, meta["log_id"], unkeyed, last)
        if unkeyed:
            # The head of the unkeyed part; the audit_migrated record written at open extends it.
            audit_chain.write_head(self.head_file, Head(meta["log_id"], unkeyed, last), self._key)
        else:
            audit_chain.write_head(self.head_file, Head(meta["log_id"], 0, start), self._key)
        if unkeyed:
            logger.warning("audit log %s: taking over %d records written before the audit key; they are checked "
                           "and bound into the keyed chain", self.path, unkeyed)
        return unkeyed if rows else None

    def _check_unkeyed(self) -> tuple[int, str]:
        with contextlib.closing(sqlite3.connect(self.path)) as db:
            prev, count = GENESIS, 0
            for row in db.execute(f"SELECT {', '.join(AUDIT_FIELDS)}, prev, hash FROM audit ORDER BY seq"):
                fields = list(row[:len(AUDIT_FIELDS)])
                if fields[0] != count + 1 or row[-2] != prev or audit_chain.record_hash(prev, fields) != row[-1]:
                    raise AuditError(f"audit log {self.path} (written before the audit key) is broken at record "
                                     f"{count + 1}: run agentctl audit-verify, move the file aside to start a new "
                                     "log (keep it as evidence)")
                prev, count = row[-1], count + 1
        return count, prev

    def _verify(self) -> audit_chain.Verified:
        with contextlib.closing(sqlite3.connect(self.path)) as db:
            try:
                head = audit_chain.read_head(self.head_file, self._key)
                return audit_chain.verify_log(db, self._key, head, str(self.head_file))
            except AuditError as exc:
                raise AuditError(f"audit log {self.path} does not verify: {exc}; run agentctl audit-verify, and move "
                                 f"{self.path} and {self.head_file} aside (keep them as evidence) to start a new "
                                 "log") from None

    def _backed(self, grant_id: str, session: str, record: str, mac: str, verified: audit_chain.Verified,
                migrated: int | None) -> Grant | None:
        """The stored grant if its row is the server's (its MAC binds it to this log and session) and its grant
        record is in the chain; otherwise None, logged and audited as a forgery."""
        grant, why = stored_grant(self._key, self.store_id, session, grant_id, record, mac, verified, migrated)
        if grant is None:
            self._forged(grant_id, session, f"{self.path} (grants table)", why)
        return grant

    @property
    def store_id(self) -> str:
        """What the MAC of this file's grant rows binds them to: this log (its id)."""
        return f"sqlite:{self._log_id}"

    def _forged(self, grant_id: str, session: str, where: str, why: str) -> None:
        """A stored grant that is not the server's, found where grants are loaded: a warning and an audit record,
        once per copy and process."""
        if (grant_id, where) in self._ignored:
            return
        self._ignored.add((grant_id, where))
        logger.warning("grant %s found in %s for session %s is ignored as a forgery: %s", _shown(grant_id),
                       where, _shown(session), why)
        record = AuditRecord.grant_forged(session[:200], grant_id[:64], where, why)
        if self._writer is None:  # found while opening: recorded after the head of the verified chain
            self._deferred.append(record)
        else:
            self.audit(record)

    def _grant_row(self, grant: Grant) -> tuple[str, tuple[Any, ...]]:
        record = canonical(grant)
        return ("INSERT OR REPLACE INTO grants (id, session, record, mac) VALUES (?, ?, ?, ?)",
                (grant.id, grant.session, record, audit_chain.grant_mac(self._key, self.store_id, grant.session,
                                                                        record)))

    def _checkpoint(self, head: Head, when: str = "") -> None:
        """Write the head where the log cannot reach it: the head file and the server log (Redis: `_write`)."""
        try:
            audit_chain.write_head(self.head_file, head, self._key)
        except OSError as exc:
            logger.error("writing the audit head %s failed (%s): audit-verify will report a cut tail until the "
                         "next write succeeds", self.head_file, exc.strerror or exc)
        # The start and stop lines are logged whatever the log level (head_logger): audit-verify --log reads them.
        (head_logger if when else logger).info("audit head %s%s", head.sealed(self._key), f" ({when})" if when else "")

    async def _write(self) -> None:
        db = self._conn()
        while (item := await self._queue.get()) is not None:
            batch: list[_Work | None] = [item]  # None: the last (the writer stops)
            while not self._queue.empty() and batch[-1] is not None:
                batch.append(self._queue.get_nowait())
            head = None
            try:
                for work in batch:
                    if isinstance(work, tuple):
                        await db.execute(work[0], work[1])
                        head = work[2] or head
                await db.commit()
            except Exception:  # the log says so; grants in memory still decide
                logger.exception("writing %s failed", self.path)
                head = None
            if head is not None:
                sealed = Head(self._log_id, *head)
                self._committed = head
                self._checkpoint(sealed)
                await self._share_head(sealed)
            for work in batch:
                if isinstance(work, asyncio.Future) and not work.done():
                    work.set_result(None)
            if batch[-1] is None:
                return

    async def _share_head(self, head: Head) -> None:
        if self.link is None:
            return
        try:
            async with asyncio.timeout(2):
                await self.link.client.set(self.link.key("audit-head", head.log_id), head.sealed(self._key))
        except Exception as exc:  # Redis down: the head file and the log line still hold it
            logger.warning("checkpointing the audit head in Redis failed: %s", exc)

    async def flush(self) -> None:
        """Wait until every change and audit record so far is in the file."""
        if self._writer is None or self._writer.done():
            return
        written: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(written)
        await written

    async def close(self) -> None:
        if self._writer is not None and not self._writer.done():
            self._queue.put_nowait(None)
            await self._writer
            self._checkpoint(Head(self._log_id, *self._committed), "at stop")  # what is in the file
        if self._sharer is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(2):
                    await self._shared_idle.wait()
            self._sharer.cancel()
        await super().close()
        if self._lock is not None:
            os.close(self._lock)  # releases the flock
            self._lock = None

    # ── shared with other instances (Redis) ──

    def _share(self, op: str, value: Any) -> None:
        if self.link is None:
            return
        self._shared.put_nowait((op, value))
        self._shared_idle.clear()
        if self._sharer is None or self._sharer.done():
            self._sharer = asyncio.get_running_loop().create_task(self._share_forever(), name="grant-sharer")

    async def _share_forever(self) -> None:
        r = self.link.client
        while True:
            batch = [await self._shared.get()]
            while not self._shared.empty():
                batch.append(self._shared.get_nowait())
            tombs = self.link.key("grants-revoked")
            try:
                # A session's grants given on other instances end with it too: their ids are tombstoned below.
                dropped = {s: await r.hkeys(self.link.key("grants", s)) for op, s in batch if op == "drop"}
                pipe = r.pipeline(transaction=True)
                for op, value in batch:
                    if op == "set":  # not over a revoke made meanwhile on another instance (a use in flight)
                        pipe.eval(_SET_UNLESS_REVOKED, 3, self.link.key("grants", value.session), tombs,
                                  self.link.key("grant-owners"), value.id, self._shared_value(value), value.session,
                                  SHARED_SECONDS)
                    elif op == "del":
                        pipe.hdel(self.link.key("grants", value.session), value.id)
                        pipe.hdel(self.link.key("grant-owners"), value.id)
                        # Recorded by id: a copy of the entry, anywhere, is never honoured again (`refresh`).
                        pipe.hset(tombs, value.id, value.session)
                        pipe.expire(tombs, SHARED_SECONDS)
                    else:  # "drop": a session's grants end with it
                        pipe.delete(self.link.key("grants", value))
                        if dropped.get(value):
                            pipe.hset(tombs, mapping=dict.fromkeys(dropped[value], value))
                            pipe.expire(tombs, SHARED_SECONDS)
                await pipe.execute()
            except Exception:  # Redis unreachable: the instance says so elsewhere; these changes are lost
                logger.exception("sharing %d grant change(s) through Redis failed", len(batch))
            if self._shared.empty():
                self._shared_idle.set()

    async def refresh(self, session: str) -> None:
        """With several instances on one Redis: take the session's grants as they are there now (another
        instance may have added, used or revoked one). Nothing without a shared store."""
        if self.link is None:
            return
        await self._shared_idle.wait()  # this instance's own changes first
        key = self.link.key("grants", session)
        with self.link.calling():
            flat = await self.link.client.eval(_GRANTS_AND_REVOKED, 2, key, self.link.key("grants-revoked"))
        rows = {flat[i]: flat[i + 1] for i in range(0, len(flat), 3)}
        self._revoked |= {flat[i] for i in range(0, len(flat), 3) if flat[i + 2]}
        now = self.clock()
        found = [g for g in (self._shared_grant(session, i, r, f"Redis ({key})") for i, r in rows.items())
                 if g and g.active(now)]
        if found:
            self.grants[session] = sorted(found, key=lambda g: g.created)
        else:
            self.grants.pop(session, None)

    def _shared_value(self, grant: Grant) -> str:
        """A grant as kept in Redis: its record and a MAC binding it to this prefix and its session."""
        record = canonical(grant)
        return json.dumps({"v": SHARED_FORMAT, "record": record,
                           "mac": audit_chain.grant_mac(self._key, self.shared_id, grant.session, record)})

    @property
    def shared_id(self) -> str:
        """What the MAC of a grant kept in Redis binds it to: the key prefix of this Redis store."""
        return f"redis:{self.link.prefix}"

    def _shared_grant(self, session: str, grant_id: str, value: str, where: str) -> Grant | None:
        """A grant read from Redis, if an instance holding the audit key wrote it for this prefix and session
        and it is not known to be revoked; otherwise None (a forgery: warned and audited)."""
        grant, why = shared_grant(self._key, self.shared_id, session, grant_id, value, grant_id in self._revoked)
        if grant is None and why == OLDER_FORMAT:
            if (grant_id, where) not in self._ignored:
                self._ignored.add((grant_id, where))
                logger.warning("grant %s in %s was written by an earlier version (not bound to its session): it "
                               "is not honoured; give it again", _shown(grant_id), where)
        elif grant is None:
            self._forged(grant_id, session, where, why)
        return grant

    async def refresh_all(self) -> None:
        """`refresh` of every session that has grants on the shared store (the admin's list and `revoke all`
        must see grants given on other instances, not only those this one has met)."""
        if self.link is None:
            return
        with self.link.calling():
            sessions = set(await self.link.client.hvals(self.link.key("grant-owners")))
        for session in sorted(sessions | set(self.grants)):
            await self.refresh(session)

    async def find_owner(self, grant_id: str) -> str | None:
        """`owner`, on every instance of a shared store."""
        if self.link is None:
            return self.owner(grant_id)
        with self.link.calling():
            session = await self.link.client.hget(self.link.key("grant-owners"), grant_id)
        if session is None:
            return None
        await self.refresh(session)
        return self.owner(grant_id)

    # ── grants ──

    def active(self, session: str) -> list[Grant]:
        """The session's grants that can still allow, oldest first."""
        now = self.clock()
        return [g for g in self.grants.get(session, ()) if g.active(now)]

    def find(self, session: str, tool: str, section: str, keys: Iterable[str], op: str,
             pattern: Callable[[], str]) -> Grant | None:
        now = self.clock()
        keys = tuple(keys)
        return next((g for g in self.grants.get(session, ()) if g.session == session and g.id not in self._revoked
                     and g.covers(tool, section, keys, op, pattern, now)), None)

    def owner(self, grant_id: str) -> str | None:
        """The session an active grant belongs to, or None."""
        now = self.clock()
        return next((g.session for grants in self.grants.values() for g in grants
                     if g.id == grant_id and g.active(now)), None)

    def add(self, grant: Grant) -> Grant:
        self.grants.setdefault(grant.session, []).append(grant)
        self._save(grant)
        self._changed(grant.session)
        return grant

    def used(self, grant: Grant) -> None:
        grant.uses += 1
        self._save(grant)
        self._changed(grant.session)

    def revoke(self, session: str, which: str, actor: str, detail: str = "") -> list[Grant]:
        """End the session's grant `which` (its id) or every active one (`all`), each audited as revoked
        by `actor`; returns those revoked."""
        now = self.clock()
        ended = [g for g in self.active(session) if which in ("all", g.id)]
        for grant in ended:
            grant.revoked = now
            self._revoked.add(grant.id)
            self._queue.put_nowait(("DELETE FROM grants WHERE id = ?", (grant.id,), None))
            self._share("del", grant)
            self.audit(AuditRecord.revoke(session, actor, grant.tool, grant.op,
                                          grant.keys if grant.section == "db" else (), grant.id, detail))
        kept = [g for g in self.grants.get(session, ()) if g not in ended and g.active(now)]
        if kept:
            self.grants[session] = kept
        else:
            self.grants.pop(session, None)
        if ended:
            self._changed(session)
        return ended

    def forget(self, session: str) -> None:
        """A deleted session's grants end with it (a later session with the same id starts with none)."""
        if (ended := self.grants.pop(session, None)) is not None:
            self._revoked |= {g.id for g in ended}
            self._queue.put_nowait(("DELETE FROM grants WHERE session = ?", (session,), None))
            # In the chain, so a row of this session put back by hand is not honoured again.
            self.audit(AuditRecord.grants_dropped(session))
        self._share("drop", session)

    def _save(self, grant: Grant) -> None:
        self._queue.put_nowait((*self._grant_row(grant), None))
        self._share("set", grant)

    # ── the audit chain ──

    def audit(self, record: AuditRecord) -> int:
        """Append one record (its MAC covers the one before); returns its sequence number."""
        seq, prev = self._last[0] + 1, self._last[1]
        fields = [seq, self.clock(), record.event, record.session, record.actor, record.tool, record.op,
                  json.dumps(sorted(record.tables)), digest(record.args) if record.args is not None else "",
                  record.outcome, record.grant_id, record.detail]
        mac = audit_chain.record_mac(self._key, prev, fields)
        self._last = (seq, mac)
        self._queue.put_nowait((self._INSERT, (*fields, prev, mac), (seq, mac)))
        return seq


#: Why `shared_grant` passes over a Redis value written before grants were bound (not a forgery).
OLDER_FORMAT = "written by an earlier version"


def _shown(text: str) -> str:
    """A stored id or session as a log line shows it: quoted, cut short (it may be an attacker's)."""
    return repr(str(text)[:64])


def stored_grant(key: bytes, store: str, session: str, grant_id: str, record: str, mac: str | None,
                 verified: audit_chain.Verified | None, migrated: int | None = None) -> tuple[Grant | None, str]:
    """The grant a stored row holds, kept under `grant_id` for `session` in `store`, if it is the server's:
    its MAC binds it there and, with `verified` (the chain of the file that keeps it), its grant record is
    in that chain and it was not revoked or ended. Else (None, why)."""
    try:
        grant = from_record(record)
    except (ValueError, KeyError, TypeError):
        return None, "its record is not a grant record"
    if grant.id != grant_id:
        return None, f"it holds the record of grant {_shown(grant.id)} (copied or edited by hand)"
    if grant.session != session:
        return None, f"it holds a grant of session {_shown(grant.session)} (copied into another session)"
    old = verified.grant_records.get(grant.id) if verified is not None else None
    if migrated is not None and not mac and old is not None:
        grant.audit_seq = old  # written before the key: backed by its record in the old chain
    elif not hmac.compare_digest(audit_chain.grant_mac(key, store, session, record), mac or ""):
        # A row written before grants were bound to their store counts only while the chain backs it.
        if verified is None or not hmac.compare_digest(audit_chain.legacy_grant_mac(key, record), mac or ""):
            return None, ("its MAC does not hold for this store and session (copied from another store or "
                          "session, edited by hand, or written with another audit key)")
    why = verified.why_not(grant.id, session, grant.audit_seq) if verified is not None else None
    return (None, why) if why else (grant, "")


def shared_grant(key: bytes, store: str, session: str, grant_id: str, value: str, revoked: bool
                 ) -> tuple[Grant | None, str]:
    """The grant a Redis value holds, kept under `grant_id` in `session`'s hash of `store` (`redis:<prefix>`),
    if an instance holding the audit key wrote it there and it is not `revoked`; else (None, why), why being
    OLDER_FORMAT for an honest value of an earlier version."""
    try:
        data = json.loads(value)
        record, mac = str(data["record"]), str(data["mac"])
    except (ValueError, KeyError, TypeError):
        return None, "its value is not a grant entry"
    grant, why = stored_grant(key, store, session, grant_id, record, mac, None)
    if grant is None and data.get("v") != SHARED_FORMAT:
        if hmac.compare_digest(audit_chain.legacy_grant_mac(key, record), mac) and why.startswith("its MAC"):
            return None, OLDER_FORMAT
    if grant is not None and revoked:
        return None, "it was revoked (a copy put back after its revocation)"
    return grant, why


def from_record(record: str) -> Grant:
    """A grant from its stored record (`canonical`)."""
    data = json.loads(record)
    return Grant(**{**data, "keys": tuple(data["keys"])})


def new_grant_id() -> str:
    return "g" + secrets.token_hex(3)


def new_grant(session: str, decision: Decision, tool: str, section: str, keys: Iterable[str], op: str,
              pattern: str = "", shape: str = "", now: float | None = None) -> Grant:
    """The grant `decision` creates for a gated call (the caller checked that its keys can be granted)."""
    now = time.time() if now is None else now
    expires = now + decision.minutes * 60 if decision.word == TIMED else None
    return Grant(new_grant_id(), session, decision.word, tool, section, tuple(sorted(keys)), op, decision.by, now,
                 expires, pattern if decision.word == PATTERN else "", shape if decision.word == PATTERN else "")
