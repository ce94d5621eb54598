"""Approvals that reach further than one call (grants), and the tamper-evident record of every decision.

A grant is what a human said when answering a gate: allow this tool (or these tables with this
permission) for N minutes, for the rest of the session, or for calls of the same shape (the same
statement with other values; the same values of a tool's defining arguments). Grants are kept per
session in SQLite, survive restarts until they expire, and end at once when revoked.

The audit log is one append-only table in the same file: every gate decision, grant, use of a
grant, revocation and gate-policy change, each record carrying the SHA-256 of the one before, so a
changed or missing record breaks the chain (`verify_file`, `agentctl audit-verify`). Records name who,
what and when, and hold a digest of the arguments, never the arguments themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import secrets
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import stores

logger = logging.getLogger("agent_mcp.grants")

#: Decisions a gate accepts: once, a grant of one of the scopes below, or no.
ALLOW, REJECT = "allow", "reject"
TIMED, SESSION, PATTERN = "allow_for", "allow_session", "allow_pattern"
GRANT_SCOPES = (TIMED, SESSION, PATTERN)
DECISIONS = (ALLOW, *GRANT_SCOPES, REJECT)
DEFAULT_MINUTES = 15
MAX_MINUTES = 24 * 60
#: The gate key of a statement that could not be analysed (sql.ANY_TABLE): never covered by a grant.
ANY = "*"
GENESIS = "0" * 64
AUDIT_FILE = "audit.sqlite3"
#: With several instances on one Redis, a session's grants are kept there at most this long after a change.
SHARED_SECONDS = 30 * 86400


class GrantError(ValueError):
    """An answer that cannot become a grant; the message says what to answer instead."""


@dataclass(frozen=True)
class Decision:
    """A human's answer to a gate: `word` (DECISIONS), the minutes of a timed grant, who answered."""

    word: str
    by: str = ""
    minutes: int = DEFAULT_MINUTES

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


def _record_hash(prev: str, fields: list[Any]) -> str:
    return hashlib.sha256((prev + json.dumps(fields, ensure_ascii=False, default=str)).encode()).hexdigest()


#: The columns of an audit record that its hash covers, in order.
AUDIT_FIELDS = ("seq", "ts", "event", "session", "actor", "tool", "op", "tables", "args_digest", "outcome",
                "grant_id", "detail")


@dataclass(frozen=True)
class Broken:
    """The first record where the audit chain does not hold, and why."""

    seq: int
    why: str


def verify_rows(rows: Iterable[tuple[Any, ...]]) -> tuple[int, Broken | None]:
    """Check the chain of `(…AUDIT_FIELDS, prev, hash)` rows in order: (records checked, first break or None)."""
    prev, expected, count = GENESIS, 1, 0
    for row in rows:
        fields, stored_prev, stored_hash = list(row[:len(AUDIT_FIELDS)]), row[-2], row[-1]
        seq = fields[0]
        if seq != expected:
            return count, Broken(expected, f"record {expected} is missing (the next one is {seq})")
        if stored_prev != prev:
            return count, Broken(seq, "its link to the record before does not match (that one was changed)")
        if _record_hash(prev, fields) != stored_hash:
            return count, Broken(seq, "its contents do not match its hash (it was changed)")
        prev, expected, count = stored_hash, expected + 1, count + 1
    return count, None


class GrantStore(stores.SqliteFile):
    """Grants (kept in memory) and the audit chain, in `<data dir>/audit.sqlite3`.

    Decisions are made from memory; every change and audit record is written by one writer task,
    in order, a burst in one transaction, so a tool call never waits for the disk. `flush()`
    waits until everything so far is written; `close()` flushes.
    """

    SCHEMA = (
        "PRAGMA synchronous=NORMAL",
        "CREATE TABLE IF NOT EXISTS grants (id TEXT PRIMARY KEY, session TEXT NOT NULL, record TEXT NOT NULL)",
        "CREATE TABLE IF NOT EXISTS audit (seq INTEGER PRIMARY KEY, ts REAL NOT NULL, event TEXT NOT NULL,"
        " session TEXT, actor TEXT, tool TEXT, op TEXT, tables TEXT, args_digest TEXT, outcome TEXT,"
        " grant_id TEXT, detail TEXT, prev TEXT NOT NULL, hash TEXT NOT NULL)",
    )
    _INSERT = (f"INSERT INTO audit ({', '.join(AUDIT_FIELDS)}, prev, hash) "
               f"VALUES ({', '.join('?' * (len(AUDIT_FIELDS) + 2))})")

    def __init__(self, path: Path, clock: Any = time.time):
        super().__init__(path)
        self.clock = clock
        self.grants: dict[str, list[Grant]] = {}
        self._last: tuple[int, str] = (0, GENESIS)
        self._queue: asyncio.Queue[tuple[str, tuple[Any, ...]] | asyncio.Future[None] | None] = asyncio.Queue()
        self._writer: asyncio.Task[None] | None = None
        self._observers: list[Callable[[str], None]] = []
        #: Several instances on one Redis (shared.Link): grants are shared there (see `refresh`).
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
        await super().open()
        db = self._conn()
        now = self.clock()
        async with db.execute("SELECT record FROM grants") as cur:
            async for (record,) in cur:
                grant = _grant(record)
                if grant.active(now):
                    self.grants.setdefault(grant.session, []).append(grant)
        # Ended grants stay in the audit log; the table keeps only those that can still allow.
        kept = [g.id for grants in self.grants.values() for g in grants]
        await db.execute(f"DELETE FROM grants WHERE id NOT IN ({','.join('?' * len(kept))})", kept)
        async with db.execute("SELECT seq, hash FROM audit ORDER BY seq DESC LIMIT 1") as cur:
            last = await cur.fetchone()
        self._last = (int(last[0]), str(last[1])) if last else (0, GENESIS)
        await db.commit()
        self._writer = asyncio.create_task(self._write(), name="grant-store-writer")

    async def _write(self) -> None:
        db = self._conn()
        while (item := await self._queue.get()) is not None:
            batch = [item]
            while not self._queue.empty() and batch[-1] is not None:
                batch.append(self._queue.get_nowait())
            try:
                for work in batch:
                    if isinstance(work, tuple):
                        await db.execute(*work)
                await db.commit()
            except Exception:  # the log says so; grants in memory still decide
                logger.exception("writing %s failed", self.path)
            for work in batch:
                if isinstance(work, asyncio.Future) and not work.done():
                    work.set_result(None)
            if batch[-1] is None:
                return

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
        if self._sharer is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(2):
                    await self._shared_idle.wait()
            self._sharer.cancel()
        await super().close()

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
            pipe = r.pipeline(transaction=True)
            for op, value in batch:
                if op == "set":
                    key = self.link.key("grants", value.session)
                    pipe.hset(key, value.id, json.dumps(asdict(value)))
                    pipe.expire(key, SHARED_SECONDS)
                    pipe.hset(self.link.key("grant-owners"), value.id, value.session)
                elif op == "del":
                    pipe.hdel(self.link.key("grants", value.session), value.id)
                    pipe.hdel(self.link.key("grant-owners"), value.id)
                else:  # "drop": a session's grants end with it
                    pipe.delete(self.link.key("grants", value))
            try:
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
        with self.link.calling():
            rows = await self.link.client.hgetall(self.link.key("grants", session))
        now = self.clock()
        found = [g for g in (_grant(r) for r in rows.values()) if g.active(now)]
        if found:
            self.grants[session] = sorted(found, key=lambda g: g.created)
        else:
            self.grants.pop(session, None)

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
        return next((g for g in self.grants.get(session, ()) if g.covers(tool, section, keys, op, pattern, now)),
                    None)

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
            self._queue.put_nowait(("DELETE FROM grants WHERE id = ?", (grant.id,)))
            self._share("del", grant)
            self.audit("revoke", session=session, actor=actor, tool=grant.tool, op=grant.op,
                       tables=grant.keys if grant.section == "db" else (), grant_id=grant.id, outcome="revoked",
                       detail=detail)
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
        if self.grants.pop(session, None) is not None:
            self._queue.put_nowait(("DELETE FROM grants WHERE session = ?", (session,)))
        self._share("drop", session)

    def _save(self, grant: Grant) -> None:
        self._queue.put_nowait(("INSERT OR REPLACE INTO grants (id, session, record) VALUES (?, ?, ?)",
                                (grant.id, grant.session, json.dumps(asdict(grant)))))
        self._share("set", grant)

    # ── the audit chain ──

    def audit(self, event: str, *, session: str = "", actor: str = "", tool: str = "", op: str = "",
              tables: Iterable[str] = (), args: Any = None, outcome: str = "", grant_id: str = "",
              detail: str = "") -> int:
        """Append one record (its hash covers the one before); returns its sequence number."""
        seq, prev = self._last[0] + 1, self._last[1]
        fields = [seq, self.clock(), event, session, actor, tool, op, json.dumps(sorted(tables)),
                  digest(args) if args is not None else "", outcome, grant_id, detail]
        record_hash = _record_hash(prev, fields)
        self._last = (seq, record_hash)
        self._queue.put_nowait((self._INSERT, (*fields, prev, record_hash)))
        return seq


def _grant(record: str) -> Grant:
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


# ── offline access (agentctl) ───────────────────────────────────────────────────────────────


@contextlib.contextmanager
def _offline(path: Path) -> Iterator[sqlite3.Connection]:
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: the server has recorded no gate decision in this data dir")
    with contextlib.closing(sqlite3.connect(path)) as db:
        yield db


def read_audit(path: Path, since: float | None = None, session: str | None = None) -> Iterator[dict[str, Any]]:
    """The audit records of a data dir's log, oldest first (for `agentctl audit`)."""
    with _offline(path) as db:
        query = f"SELECT {', '.join(AUDIT_FIELDS)} FROM audit WHERE ts >= ? AND (? IS NULL OR session = ?) ORDER BY seq"
        for row in db.execute(query, (since or 0, session, session)):
            record = dict(zip(AUDIT_FIELDS, row, strict=True))
            record["tables"] = json.loads(record["tables"] or "[]")
            yield record


def verify_file(path: Path) -> tuple[int, Broken | None]:
    """Check a data dir's audit chain (for `agentctl audit-verify`)."""
    with _offline(path) as db:
        return verify_rows(db.execute(f"SELECT {', '.join(AUDIT_FIELDS)}, prev, hash FROM audit ORDER BY seq"))


def read_grants(path: Path, now: float | None = None) -> list[Grant]:
    """The grants that can still allow (for `agentctl grants`)."""
    now = time.time() if now is None else now
    with _offline(path) as db:
        grants = [_grant(r) for (r,) in db.execute("SELECT record FROM grants")]
    return sorted((g for g in grants if g.active(now)), key=lambda g: g.created)


def revoke_offline(path: Path, which: str, actor: str) -> list[Grant]:
    """Revoke grants in a data dir while the server is stopped (`which`: an id, or `all`), audited."""
    revoked = [g for g in read_grants(path) if which in ("all", g.id)]

    async def run() -> None:
        store = GrantStore(path)
        await store.open()
        try:
            for grant in revoked:
                store.revoke(grant.session, grant.id, actor, detail="offline (agentctl)")
        finally:
            await store.close()

    asyncio.run(run())
    return revoked

