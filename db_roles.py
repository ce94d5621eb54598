"""What one `db_query` call may do, as MariaDB privileges: privilege sets, and the roles that carry them.

The gate decides a call may run and records what its decision covers on the turn
(`turns.DbAccess`). This module turns that into table privileges on the agent database and a
MariaDB role holding exactly them; `database.py` activates the role (`SET ROLE`) on a clean
connection of the RUNNER account, which holds nothing but USAGE and these roles. So a statement
the classifier misread fails in the database instead of running.

- Operations → privileges: read → SELECT; write → SELECT, INSERT, UPDATE, DELETE; ddl → write's
  plus CREATE, DROP, ALTER, INDEX (TRUNCATE needs DROP); `*` (any table) → SELECT on the whole
  agent database for a read, ALL on it otherwise (never anything global); `__meta__` (names and
  columns, no rows) → REFERENCES on the database and on each table: MariaDB lets SHOW TABLES,
  SHOW CREATE TABLE, DESCRIBE, SHOW COLUMNS and SHOW INDEX through with it and refuses every
  row. REFERENCES also lets a table be given a FOREIGN KEY to another, and inserting into it
  would then tell which key values exist there: so in a set that may CREATE or ALTER, the
  `__meta__` part is left out.
- A table-level GRANT on a table that does not exist is refused by MariaDB unless it includes
  CREATE (so a ddl approval can create its table); read/write grants on missing tables are
  skipped (the statement then fails: table does not exist, or no privilege).
- One role per distinct privilege set, named by a digest of it (`<prefix><12 hex>`), made by
  the GRANTOR account on first use (CREATE ROLE needs the global CREATE USER privilege; ALL on
  the agent database WITH GRANT OPTION lets it grant the rest) and granted to the runner. At
  most `max_roles` are kept: the least recently used role no call is using is dropped. Roles
  of the prefix found at start are dropped (stale).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import aiomysql
import pymysql

from sql import ANY_TABLE, DDL, META, READ, SYSTEM_SCHEMAS, WRITE, table_key

logger = logging.getLogger("agent_mcp.db_roles")

#: Strongest first: the standing set gives a table the strongest operation the policy allows.
RANKED_OPS = (DDL, WRITE, READ)
PRIVILEGES = {
    READ: ("SELECT",),
    WRITE: ("SELECT", "INSERT", "UPDATE", "DELETE"),
    DDL: ("SELECT", "INSERT", "UPDATE", "DELETE", "CREATE", "DROP", "ALTER", "INDEX"),
}
META_PRIVILEGE = "REFERENCES"
ALL = "ALL PRIVILEGES"
#: Privileges that let a statement add a FOREIGN KEY (which REFERENCES would then open).
_SHAPE_CHANGING = frozenset({"CREATE", "ALTER", ALL})
DEFAULT_PREFIX = "amcp_"
DEFAULT_MAX_ROLES = 64
#: A table-level grant on a table that is not there (1146), or one the grantor may not give (1044/1142/1147).
_SKIPPABLE = frozenset({1044, 1142, 1146, 1147})
_PASSWORD = re.compile(r"\s+IDENTIFIED\s+(BY|VIA|WITH)\b.*$", re.IGNORECASE | re.DOTALL)


@dataclass(frozen=True, order=True)
class TableGrant:
    """Privileges on one object: `schema`.`table`, or the whole schema when `table` is ""."""

    schema: str
    table: str
    privileges: tuple[str, ...]

    def sql(self, role: str) -> str:
        what = quote(self.table) if self.table else "*"
        return f"GRANT {', '.join(self.privileges)} ON {quote(self.schema)}.{what} TO {quote(role)}"


#: A privilege set: what one call may do, as grants (empty: nothing at all, `SET ROLE NONE`).
Privileges = frozenset[TableGrant]


def quote(name: str) -> str:
    """A MariaDB identifier in backquotes."""
    return "`" + name.replace("`", "``") + "`"


def _key_parts(key: str) -> list[str]:
    """The parts of a gate key (`name`, `schema.name`, a part in backquotes when it holds a dot; sql.table_key)."""
    parts, i = [], 0
    while i < len(key):
        if key[i] == "`":
            j, chars = i + 1, []
            while j < len(key) and not (key[j] == "`" and key[j + 1:j + 2] != "`"):
                chars.append(key[j])
                j += 2 if key[j] == "`" else 1
            parts.append("".join(chars))
            i = j + 1
        else:
            j = key.find(".", i)
            j = len(key) if j < 0 else j
            parts.append(key[i:j])
            i = j
        i += 1 if key[i:i + 1] == "." else 0
    return parts


def _table_of(key: str, db: str, case_sensitive: bool) -> tuple[str, str] | None:
    """(schema, table) of a gate key naming a real table, or None (`*`, `__meta__`, system schemas)."""
    if key in (ANY_TABLE, META):
        return None
    parts = _key_parts(key)
    if len(parts) == 1:
        return db, parts[0]
    if len(parts) != 2:
        return None
    schema, name = parts
    if (schema == db) if case_sensitive else (schema.lower() == db.lower()):
        return db, name
    return None if schema.lower() in SYSTEM_SCHEMAS else (schema, name)


def privileges_for(pairs: Iterable[tuple[str, str]], *, db: str, tables: Iterable[str],
                   case_sensitive: bool) -> Privileges:
    """The grants for (gate key, operation) pairs on agent database `db`, whose tables are `tables`."""
    wanted: dict[tuple[str, str], set[str]] = {}
    meta = False
    for key, op in pairs:
        if key == META:
            meta = True
            continue
        if key == ANY_TABLE:
            wanted.setdefault((db, ""), set()).update(PRIVILEGES[READ] if op == READ else (ALL,))
            continue
        where = _table_of(key, db, case_sensitive)
        if where is not None and op in PRIVILEGES:
            wanted.setdefault(where, set()).update(PRIVILEGES[op])
    if meta and not any(p in _SHAPE_CHANGING for privs in wanted.values() for p in privs):
        for obj in [(db, ""), *((db, t) for t in tables)]:
            wanted.setdefault(obj, set()).add(META_PRIVILEGE)
    grants = set()
    for (schema, table), privs in wanted.items():
        ordered = (ALL,) if ALL in privs else tuple(sorted(privs))
        grants.add(TableGrant(schema, table, ordered))
    return frozenset(grants)


def standing_pairs(allows: Callable[[str, str], bool], tables: Iterable[str], *, operations: Iterable[str],
                   case_sensitive: bool) -> list[tuple[str, str]]:
    """What a session's policy lets run unasked: each table of the agent database with the strongest
    operation `allows(key, op)` grants, plus `*` and `__meta__` when allowed (never a system schema)."""
    known = [op for op in RANKED_OPS if op in set(operations)]
    pairs = []
    for table in tables:
        op = next((op for op in known if allows(table_key(table, case_sensitive=case_sensitive), op)), None)
        if op is not None:
            pairs.append((table, op))
    any_op = next((op for op in known if allows(ANY_TABLE, op)), None)
    if any_op is not None:
        pairs.append((ANY_TABLE, any_op))
    if READ in known and allows(META, READ):
        pairs.append((META, READ))
    return pairs


def role_name(prefix: str, privileges: Privileges) -> str:
    """`<prefix><12 hex>`: the name of the role holding exactly `privileges`."""
    text = json.dumps(sorted([g.schema, g.table, list(g.privileges)] for g in privileges))
    return prefix + hashlib.sha256(text.encode()).hexdigest()[:12]


def without_password(grant_line: str) -> str:
    """A SHOW GRANTS line without its `IDENTIFIED BY PASSWORD '…'` part (for messages)."""
    return _PASSWORD.sub("", grant_line)


def mariadb_version(server_info: str) -> tuple[int, ...] | None:
    """(major, minor, patch) of a MariaDB server string (`5.5.5-10.11.19-MariaDB-…`), None for MySQL."""
    if "mariadb" not in server_info.lower():
        return None
    found = re.findall(r"(\d+)\.(\d+)\.(\d+)", server_info)
    real = [tuple(map(int, f)) for f in found if f != ("5", "5", "5")]
    return real[0] if real else None


# ── Verification ────────────────────────────────────────────────────────────────────────────


async def runner_problem(conn: aiomysql.Connection, *, prefix: str, db: str) -> str | None:
    """Why the runner account on `conn` cannot be limited by roles (None: it can).

    It must be MariaDB ≥ 10.2.4 (roles, COM_RESET_CONNECTION), and with no role active the account
    may hold nothing but USAGE and roles of `prefix`: no FILE, PROCESS, SUPER, no global, database,
    table or column privilege of its own, nothing through PUBLIC, and see no table of `db`.
    """
    version = mariadb_version(conn.get_server_info())
    if version is None:
        return "the server is not MariaDB (MySQL's roles are not used here)"
    if version < (10, 2, 4):
        return f"MariaDB {'.'.join(map(str, version))} is older than 10.2.4 (no COM_RESET_CONNECTION)"
    async with conn.cursor() as cur:
        await cur.execute("SET ROLE NONE")
        await cur.execute("SHOW GRANTS")
        for (line,) in await cur.fetchall():
            text = without_password(str(line))
            # USAGE; and a default role, harmless since every call sets its role (any account may set its own)
            if re.match(r"GRANT USAGE ON \*\.\* TO |SET DEFAULT ROLE ", text):
                continue
            role = re.match(r"GRANT `([^`]+)` TO `", text)
            if role and role.group(1).startswith(prefix) and "WITH ADMIN OPTION" not in text.upper():
                continue
            return f"the account holds more than USAGE and its {prefix}* roles: {text}"
        if version >= (10, 11):
            await cur.execute("SHOW GRANTS FOR PUBLIC")
            if await cur.fetchall():
                return "the PUBLIC role holds privileges (every account has them)"
        await cur.execute("SELECT PRIVILEGE_TYPE FROM information_schema.USER_PRIVILEGES "
                          "WHERE PRIVILEGE_TYPE <> 'USAGE' UNION ALL SELECT PRIVILEGE_TYPE FROM "
                          "information_schema.SCHEMA_PRIVILEGES UNION ALL SELECT PRIVILEGE_TYPE FROM "
                          "information_schema.TABLE_PRIVILEGES LIMIT 1")
        extra = await cur.fetchall()
        if extra:
            return f"the account holds a privilege outside its roles ({extra[0][0]})"
        await cur.execute("SELECT COUNT(*) FROM information_schema.TABLES WHERE TABLE_SCHEMA = %s", (db,))
        (seen,), = await cur.fetchall()
        if seen:
            return f"with no role active the account still sees {seen} table(s) of {db} (anonymous or PUBLIC grants)"
    return None


# ── Roles ───────────────────────────────────────────────────────────────────────────────────


class RoleError(Exception):
    """The grantor could not make or grant a role; the call does not run (fail closed)."""


class Roles:
    """The roles of one server instance: made on first use by the grantor, granted to the runner, bounded.

    `connect` opens a grantor connection (aiomysql keyword arguments). `runner` is the runner's
    account as `CURRENT_USER()` names it (`user@host`).
    """

    def __init__(self, connect: dict[str, Any], *, runner: str, db: str, prefix: str = DEFAULT_PREFIX,
                 max_roles: int = DEFAULT_MAX_ROLES, table_ttl: float = 1.0):
        self._connect = connect
        user, _, host = runner.rpartition("@")
        self.runner = f"{quote(user)}@{quote(host)}"
        self.db, self.prefix, self.max_roles, self.table_ttl = db, prefix, max_roles, table_ttl
        #: role name → its grants, least recently used first.
        self._known: OrderedDict[str, Privileges] = OrderedDict()
        self._busy: dict[str, int] = {}
        self._lock = asyncio.Lock()
        self._conn: aiomysql.Connection | None = None
        self._tables: tuple[float, list[str]] | None = None

    async def _grantor(self) -> aiomysql.Connection:
        if self._conn is None or self._conn.closed:
            self._conn = await aiomysql.connect(**self._connect)
        return self._conn

    async def _execute(self, sql: str, args: Any = None) -> list[tuple[Any, ...]]:
        conn = await self._grantor()
        try:
            async with conn.cursor() as cur:
                await cur.execute(sql, args)
                return list(await cur.fetchall())
        except (pymysql.err.OperationalError, OSError) as exc:
            if isinstance(exc, pymysql.err.OperationalError) and exc.args and exc.args[0] < 2000:
                raise  # the server refused it; the connection is fine
            conn.close()
            raise

    async def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    async def tables(self) -> list[str]:
        """The tables of the agent database (read by the grantor, kept `table_ttl` seconds)."""
        now = asyncio.get_running_loop().time()
        if self._tables is None or now - self._tables[0] > self.table_ttl:
            async with self._lock:
                rows = await self._execute("SELECT TABLE_NAME FROM information_schema.TABLES WHERE TABLE_SCHEMA = %s",
                                           (self.db,))
            self._tables = (now, sorted(str(r[0]) for r in rows))
        return self._tables[1]

    def tables_changed(self) -> None:
        """A call that may have created or dropped tables ran: read them again next time."""
        self._tables = None

    async def probe(self) -> str | None:
        """Why the grantor cannot make roles for the agent database (None: it can), by making one."""
        name = f"{self.prefix}probe"
        try:
            async with self._lock:
                await self._execute(f"CREATE ROLE IF NOT EXISTS {quote(name)}")
                await self._execute(f"GRANT {META_PRIVILEGE} ON {quote(self.db)}.* TO {quote(name)}")
                await self._execute(f"DROP ROLE {quote(name)}")
        except (pymysql.err.MySQLError, OSError) as exc:
            return f"the grantor cannot make roles for {self.db}: {exc.args[-1] if exc.args else exc}"
        return None

    async def drop_stale(self, found: Iterable[str]) -> int:
        """Drop roles of our prefix from an earlier run (`found`: names seen on the runner and grantor)."""
        stale = [r for r in set(found) if r.startswith(self.prefix) and r not in self._known]
        async with self._lock:
            for role in stale:
                await self._execute(f"DROP ROLE IF EXISTS {quote(role)}")
        return len(stale)

    async def found(self) -> list[str]:
        """Roles the grantor administers (it made them)."""
        rows = await self._execute("SELECT ROLE_NAME FROM information_schema.APPLICABLE_ROLES")
        return [str(r[0]) for r in rows]

    async def acquire(self, privileges: Privileges) -> str | None:
        """The role holding exactly `privileges`, made if needed and marked in use; None for the empty set."""
        if not privileges:
            return None
        name = role_name(self.prefix, privileges)
        async with self._lock:
            if name not in self._known:
                await self._make(name, privileges)
                self._known[name] = privileges
            self._known.move_to_end(name)
            self._busy[name] = self._busy.get(name, 0) + 1
            await self._evict()
        return name

    def release(self, name: str | None) -> None:
        if name is not None and name in self._busy:
            self._busy[name] -= 1
            if not self._busy[name]:
                del self._busy[name]

    def forget(self, name: str) -> None:
        """The role is gone from the server (dropped elsewhere): make it again on next use."""
        self._known.pop(name, None)

    async def _make(self, name: str, privileges: Privileges) -> None:
        try:
            await self._execute(f"CREATE ROLE IF NOT EXISTS {quote(name)}")
            for grant in sorted(privileges):
                try:
                    await self._execute(grant.sql(name))
                except pymysql.err.MySQLError as exc:
                    if not (exc.args and exc.args[0] in _SKIPPABLE):
                        raise
            await self._execute(f"GRANT {quote(name)} TO {self.runner}")
        except (pymysql.err.MySQLError, OSError) as exc:
            raise RoleError(f"could not prepare the database role of this call: {exc.args[-1] if exc.args else exc}"
                            " — run `agentctl db-setup` to repair the accounts") from exc

    async def _evict(self) -> None:
        idle = [n for n in self._known if n not in self._busy]
        for name in idle[:max(0, len(self._known) - self.max_roles)]:
            try:
                await self._execute(f"DROP ROLE IF EXISTS {quote(name)}")
            except (pymysql.err.MySQLError, OSError) as exc:
                logger.warning("could not drop the unused role %s: %s", name, exc)
                continue
            del self._known[name]

    def __len__(self) -> int:
        return len(self._known)
