"""The runner accounts of enforced mode: claimed one per call, their role filled with that call's privileges.

See db_roles.py for the accounts. A `Runners` object holds this instance's grantor connection
(the only place its password is used) and the runners it claimed. A call leases a runner:
a claimed idle one, else one claimed now (`GET_LOCK` on the grantor connection, so two instances
never use one runner at once; every other session of the newly claimed runner is ended and its
grants are checked), else it waits. An idle runner whose role already holds the call's set is
preferred, so a few sets in turn cost no refills. Before the runner is handed out its lock is checked (a lost
grantor connection loses every lock: those runners are claimed again) and its role is refilled
unless it already holds exactly this call's privileges.
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass
from typing import Any

import aiomysql
import pymysql

from db_roles import Names, Privileges, mariadb_version, quote, spec, without_password

logger = logging.getLogger("agent_mcp.db_runners")

#: Seconds to wait for the sessions of a newly claimed runner to end after KILL.
SWEEP_TIMEOUT = 5.0


class RunnerError(Exception):
    """No runner could be prepared for this call; the call does not run (fail closed)."""


class _Lost(Exception):
    """The grantor connection (and with it every claimed lock) was lost: claim again."""


@dataclass(eq=False)
class Slot:
    """One runner account, as this instance holds it."""

    k: int
    generation: int
    conn: aiomysql.Connection | None = None
    #: What its role holds now (None: not known, refill before use).
    current: Privileges | None = None
    #: A call on it was abandoned (timeout, cancel): end its other sessions before the next call.
    dirty: bool = False
    busy: bool = False


def is_connection_error(exc: BaseException) -> bool:
    """A lost or refused connection (client-side codes ≥ 2000), not an error the server answered with."""
    if isinstance(exc, OSError):
        return True
    return isinstance(exc, pymysql.err.OperationalError) and bool(exc.args) and int(exc.args[0]) >= 2000


async def drain(cur: aiomysql.Cursor) -> None:
    """Read the rest of a CALL's results (a procedure's OK packet follows its result sets)."""
    while await cur.nextset():
        pass


async def runner_problem(conn: aiomysql.Connection, names: Names, k: int) -> str | None:
    """Why runner k on `conn` cannot be limited (None: it can): it must hold nothing but USAGE and role k
    (no admin option), PUBLIC nothing, and role k nothing outside the agent database."""
    role = names.role(k)
    async with conn.cursor() as cur:
        await cur.execute("SET ROLE NONE")
        await cur.execute("SHOW GRANTS")
        for (line,) in await cur.fetchall():
            text = without_password(str(line))
            if re.match(r"GRANT USAGE ON \*\.\* TO |SET DEFAULT ROLE ", text):
                continue
            if text.startswith(f"GRANT {quote(role)} TO ") and "WITH ADMIN OPTION" not in text.upper():
                continue
            return f"{names.runner(k)} holds more than USAGE and its role: {text}"
        version = mariadb_version(conn.get_server_info())
        if version is not None and version >= (10, 11):  # PUBLIC exists from 10.11
            await cur.execute("SHOW GRANTS FOR PUBLIC")
            if await cur.fetchall():
                return "the PUBLIC role holds privileges (every account has them)"
        await cur.execute(f"SET ROLE {quote(role)}")  # a role's grants are shown to whoever has it active
        await cur.execute(f"SHOW GRANTS FOR {quote(role)}")
        for (line,) in await cur.fetchall():
            text = str(line)
            if text.startswith("GRANT USAGE ON *.* TO ") or f" ON {quote(names.db)}." in text:
                continue
            return f"{role} holds a privilege outside {names.db}: {text}"
    return None


class Runners:
    """This instance's claimed runners, its grantor connection, and the agent database's tables."""

    def __init__(self, names: Names, *, runner_connect: dict[str, Any], grantor_connect: dict[str, Any],
                 table_ttl: float = 1.0):
        self.names = names
        self._runner_connect = runner_connect
        self._grantor_connect = grantor_connect
        self.table_ttl = table_ttl
        self._slots: dict[int, Slot] = {}
        self._lock = asyncio.Lock()  # one statement at a time on the grantor connection
        self._freed = asyncio.Event()
        self._conn: aiomysql.Connection | None = None
        self._generation = 0
        self._tables: tuple[float, list[str], bool] | None = None

    # ── the grantor connection ──────────────────────────────────────────────────────────────

    async def _grantor(self) -> aiomysql.Connection:
        if self._conn is None or self._conn.closed:
            self._conn = await aiomysql.connect(**self._grantor_connect)
            self._generation += 1  # a new session holds none of the old locks
        return self._conn

    async def _call(self, sql: str, args: Any = None) -> list[tuple[Any, ...]]:
        """One statement on the grantor connection (the caller holds `_lock`); a lost connection raises _Lost."""
        try:
            conn = await self._grantor()
            async with conn.cursor() as cur:
                await cur.execute(sql, args)
                rows = list(await cur.fetchall())
                await drain(cur)
                return rows
        except (pymysql.err.MySQLError, OSError) as exc:
            if not is_connection_error(exc):
                raise
            if self._conn is not None:
                self._conn.close()
            self._conn = None
            self._generation += 1
            raise _Lost(str(exc)) from exc

    async def _grantor_call(self, sql: str, args: Any = None) -> list[tuple[Any, ...]]:
        """A statement on the grantor connection, once more on a new connection if the first was lost."""
        async with self._lock:
            try:
                return await self._call(sql, args)
            except _Lost:
                return await self._call(sql, args)

    async def close(self) -> None:
        """Close every connection; the server releases this instance's locks with the grantor's session."""
        for slot in self._slots.values():
            if slot.conn is not None:
                slot.conn.close()
        self._slots.clear()
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    # ── checks ──────────────────────────────────────────────────────────────────────────────

    async def tables(self) -> tuple[list[str], bool]:
        """(tables of the agent database, whether names are case-sensitive), kept `table_ttl` seconds."""
        now = asyncio.get_running_loop().time()
        if self._tables is None or now - self._tables[0] > self.table_ttl:
            rows = await self._grantor_call(f"CALL {quote(self.names.admin_schema)}.`tables`()")
            if rows:
                case_sensitive = str(rows[0][1]) == "0"
            else:
                (lower,), = await self._grantor_call("SELECT @@lower_case_table_names")
                case_sensitive = str(lower) == "0"
            self._tables = (now, sorted(str(r[0]) for r in rows), case_sensitive)
        return self._tables[1], self._tables[2]

    def tables_changed(self) -> None:
        """A call that may have created or dropped tables ran: read them again next time."""
        self._tables = None

    async def grantor_problem(self) -> str | None:
        """What the grantor holds beyond EXECUTE on the two procedures (None: nothing)."""
        rows = await self._grantor_call("SHOW GRANTS")
        allowed = (f" ON PROCEDURE {quote(self.names.admin_schema)}.`refill` TO ",
                   f" ON PROCEDURE {quote(self.names.admin_schema)}.`tables` TO ")
        for (line,) in rows:
            text = without_password(str(line))
            if text.startswith("GRANT USAGE ON *.* TO ") or (text.startswith("GRANT EXECUTE ON PROCEDURE ")
                                                            and any(a in text for a in allowed)):
                continue
            return f"the grantor {self.names.grantor} holds more than it needs: {text} (run agentctl db-setup)"
        return None

    async def check_runner(self, k: int) -> str | None:
        """Why runner k cannot be limited (None: it can), on a connection of its own (changes nothing)."""
        try:
            conn = await aiomysql.connect(**self._runner(k))
        except (pymysql.err.MySQLError, OSError) as exc:
            if is_connection_error(exc):
                raise
            return f"cannot log in as {self.names.runner(k)}: {exc.args[-1] if exc.args else exc}"
        try:
            return await runner_problem(conn, self.names, k)
        except pymysql.err.MySQLError as exc:
            if is_connection_error(exc):
                raise
            return f"cannot check the grants of {self.names.runner(k)}: {exc.args[-1] if exc.args else exc}"
        finally:
            conn.close()

    async def server_version(self) -> tuple[int, ...] | None:
        """The MariaDB version the grantor is connected to (None: not MariaDB)."""
        async with self._lock:
            return mariadb_version((await self._grantor()).get_server_info())

    def _runner(self, k: int) -> dict[str, Any]:
        return {**self._runner_connect, "user": self.names.runner(k)}

    async def claimed_elsewhere(self) -> int:
        """How many runners other sessions (running instances) hold claimed now."""
        count = 0
        for k in self.names.slots():
            (owner,), = await self._grantor_call("SELECT IS_USED_LOCK(%s)", (self.names.lock(k),))
            count += owner is not None and k not in self._slots
        return count

    # ── leasing ─────────────────────────────────────────────────────────────────────────────

    async def lease(self, privileges: Privileges, wait: float) -> Slot:
        """A runner for one call, its role holding exactly `privileges`; waits up to `wait` seconds for a free one."""
        deadline = asyncio.get_running_loop().time() + wait
        while True:
            freed = self._freed
            # a runner whose role holds this set already; else one more runner; else any idle one (refilled)
            slot = self._idle(privileges)
            if slot is None and len(self._slots) < self.names.runners:
                slot = await self._claim()
            slot = slot or self._idle(None)
            if slot is not None:
                slot.busy = True
                try:
                    await self._ready(slot, privileges)
                except _Lost:
                    slot.busy = False
                    self._drop_claims()
                    continue
                except BaseException:
                    self.release(slot)
                    raise
                return slot
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                raise RunnerError(f"all {self.names.runners} runner accounts of {self.names.db} are in use (by this "
                                  "and other instances) — wait, or make more with `agentctl db-setup --runners N`")
            try:  # another instance's release is not signalled here: look again now and then
                await asyncio.wait_for(freed.wait(), min(left, 0.25))
            except TimeoutError:
                pass

    def release(self, slot: Slot, *, dirty: bool = False) -> None:
        """The call on `slot` ended (`dirty`: abandoned mid-statement)."""
        slot.busy = False
        slot.dirty = slot.dirty or dirty
        if self._slots.get(slot.k) is not slot and slot.conn is not None:
            slot.conn.close()  # its claim was lost meanwhile
        freed, self._freed = self._freed, asyncio.Event()
        freed.set()

    def _idle(self, privileges: Privileges | None) -> Slot | None:
        """An idle claimed runner (whose role holds `privileges`, unless None)."""
        for slot in self._slots.values():
            if not slot.busy and slot.generation == self._generation and (
                    privileges is None or slot.current == privileges):
                return slot
        return None

    def _drop_claims(self) -> None:
        """The grantor's session ended: none of the claims of an earlier session holds any more."""
        for k, slot in list(self._slots.items()):
            if slot.generation == self._generation:
                continue
            del self._slots[k]
            if not slot.busy and slot.conn is not None:
                slot.conn.close()  # a busy one is closed by `release` when its call ends

    async def _claim(self) -> Slot | None:
        """Claim a runner no instance holds (GET_LOCK), end its other sessions and check its grants."""
        async with self._lock:
            try:
                await self._grantor()
                if any(s.generation != self._generation for s in self._slots.values()):
                    self._drop_claims()
                slot = None
                for k in self.names.slots():
                    if k in self._slots:
                        continue
                    (got,), = await self._call("SELECT GET_LOCK(%s, 0)", (self.names.lock(k),))
                    if got == 1:
                        slot = Slot(k, self._generation)
                        break
            except _Lost:
                self._drop_claims()
                return None
            if slot is None:
                return None
            self._slots[slot.k] = slot
        slot.busy = True
        try:
            problem = await self._sweep(slot)
        except BaseException:
            await self._unclaim(slot)
            raise
        if problem is not None:
            await self._unclaim(slot)
            raise RunnerError(problem)
        slot.busy = False
        return slot

    async def _unclaim(self, slot: Slot) -> None:
        self._slots.pop(slot.k, None)
        if slot.conn is not None:
            slot.conn.close()
        async with self._lock:
            try:
                await self._call("SELECT RELEASE_LOCK(%s)", (self.names.lock(slot.k),))
            except (_Lost, pymysql.err.MySQLError):
                pass

    async def connection(self, slot: Slot) -> aiomysql.Connection:
        """The runner's own connection (made when missing; the caller pings and prepares it)."""
        if slot.conn is None or slot.conn.closed:
            slot.conn = await aiomysql.connect(**self._runner(slot.k))
        return slot.conn

    async def _sweep(self, slot: Slot) -> str | None:
        """End every other session of the runner (a call abandoned here or by another instance), then check it."""
        try:
            conn = await self.connection(slot)
            await conn.ping(reconnect=True)
            deadline = asyncio.get_running_loop().time() + SWEEP_TIMEOUT
            async with conn.cursor() as cur:
                while True:
                    await cur.execute("SELECT ID FROM information_schema.PROCESSLIST WHERE ID <> CONNECTION_ID()")
                    others = [int(r[0]) for r in await cur.fetchall()]
                    if not others:
                        break
                    if asyncio.get_running_loop().time() > deadline:
                        return (f"{self.names.runner(slot.k)} still has {len(others)} other session(s) after KILL; "
                                "the runner is not used")
                    for thread in others:
                        try:
                            await cur.execute(f"KILL {thread}")
                        except pymysql.err.OperationalError as exc:
                            if exc.args and exc.args[0] != 1094:  # 1094: it has ended already
                                raise
                    await asyncio.sleep(0.02)  # the killed sessions end on their own thread
            slot.dirty = False
            return await runner_problem(conn, self.names, slot.k)
        except (pymysql.err.MySQLError, OSError) as exc:
            if slot.conn is not None:
                slot.conn.close()
            return f"cannot use {self.names.runner(slot.k)}: {exc.args[-1] if exc.args else exc}"

    async def _ready(self, slot: Slot, privileges: Privileges) -> None:
        """Check the claim still holds, end abandoned sessions, and fill the role with `privileges`."""
        if slot.dirty:
            problem = await self._sweep(slot)
            if problem is not None:
                raise RunnerError(problem)
        async with self._lock:
            if slot.generation != self._generation or self._conn is None:
                raise _Lost("the grantor's session changed")
            (held,), = await self._call("SELECT IS_USED_LOCK(%s) = CONNECTION_ID()", (self.names.lock(slot.k),))
            if not held:
                raise _Lost("the runner's lock is no longer held")
            if slot.current == privileges:
                return
            slot.current = None
            try:
                await self._call(f"CALL {quote(self.names.admin_schema)}.`refill`(%s, %s)", (slot.k, spec(privileges)))
            except pymysql.err.MySQLError as exc:
                raise RunnerError(f"could not prepare the database role of this call: "
                                  f"{exc.args[-1] if exc.args else exc} — run `agentctl db-setup` to repair the "
                                  "accounts") from exc
            slot.current = privileges
