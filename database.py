"""MySQL / MariaDB access for `db_query` and `!db`: an aiomysql pool, statement-by-statement execution.

The gate decides whether a call may run; this module enforces again in the database, so a
mistake in one layer is caught by the next:
- SQL is split into statements with the same parser the gate classifies with (sqlglot, MySQL
  dialect), and each statement is sent on its own over a connection whose handshake does not
  ask for multi-statements: where the parser and the server disagree about where a statement
  ends (a string literal under `NO_BACKSLASH_ESCAPES`), the server refuses the hidden second
  statement instead of running it.
- A statement classified as a plain read runs inside `START TRANSACTION READ ONLY`, so a read
  that writes after all (a stored function with side effects) is refused by the server.
- `LOAD DATA LOCAL` is off; every statement has a server-side time limit (MariaDB
  `max_statement_time`, MySQL `max_execution_time`) and a client-side one slightly longer,
  after which the connection is dropped and the server thread killed.
- A connection left inside a transaction is closed (the server rolls it back), never handed on.
- Every call starts from a clean session and leaves one: `COM_RESET_CONNECTION` before and after
  it (clears user variables,
  temporary tables, prepared statements, session variables, locks and transactions; MariaDB
  keeps the active role and the current database through it, so both are set again), then
  `sql_mode` pinned to the grammar the classifier parses (see PINNED_SQL_MODE), the statement
  time limit, `SET ROLE` and `USE` of the agent database.
- Enforced mode (see db_roles.py, db_runners.py): each call runs on a runner account of its own whose
  one role holds exactly what the call's gate decision covers. When the accounts cannot be limited
  (`enforce` says why), calls run on the classifier alone.
A dead pooled connection is reconnected before use, so a server restart costs no failed call.
What a call returns (results, errors) and its text are in db_results.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiomysql
import pymysql
from dotenv import dotenv_values
from pydantic import BaseModel, Field, ValidationError
from pymysql.constants import CLIENT

import db_roles
import db_runners
import metrics
import sql as sql_rules  # `sql` is the name of the SQL text in this module
import turns
from config import ConfigError
from db_results import (
    ConnectError,
    Outcome,
    StatementError,
    StatementResult,
    StatementTimeout,
    describe_error,
    format_outcome,
)
from sql import split_statements

logger = logging.getLogger("agent_mcp.database")

#: Rows read per round trip from the server's (unbuffered) result.
FETCH_BATCH = 500
#: Extra seconds the client waits beyond the server's limit, so the server's own error comes first.
CLIENT_GRACE = 2.0
KILL_TIMEOUT = 5.0
POOL_RECYCLE_SECONDS = 3600

_ENV = {"host": "MYSQL_HOST", "port": "MYSQL_PORT", "user": "MYSQL_USER", "password": "MYSQL_PASS", "db": "MYSQL_DB",
        "grantor_user": "MYSQL_GRANTOR_USER", "grantor_password": "MYSQL_GRANTOR_PASS",
        "instance": "MYSQL_INSTANCE", "runners": "MYSQL_RUNNERS"}
#: The accounts `agentctl db-setup` made (0600, in the data dir): they replace MYSQL_USER/MYSQL_PASS.
ACCOUNTS_FILE = "db-accounts.env"
ACCOUNT_VARS = ("MYSQL_USER", "MYSQL_PASS", "MYSQL_GRANTOR_USER", "MYSQL_GRANTOR_PASS", "MYSQL_INSTANCE",
                "MYSQL_RUNNERS", "MYSQL_SETUP_ID")
#: The sql_mode of every call: the server's default grammar, which the classifier parses. Pinned rather than
#: taken from the server, whose mode may hold NO_BACKSLASH_ESCAPES or ANSI_QUOTES (strings and names split
#: elsewhere than the classifier splits them), ORACLE/MSSQL/ANSI, PIPES_AS_CONCAT or IGNORE_SPACE.
PINNED_SQL_MODE = "STRICT_TRANS_TABLES,ERROR_FOR_DIVISION_BY_ZERO,NO_AUTO_CREATE_USER,NO_ENGINE_SUBSTITUTION"
_MYSQL_SQL_MODE = "STRICT_TRANS_TABLES,ERROR_FOR_DIVISION_BY_ZERO,NO_ENGINE_SUBSTITUTION"  # MySQL 8 has no NO_AUTO_…
#: The protocol command byte of COM_RESET_CONNECTION (PyMySQL names no constant for it).
COM_RESET_CONNECTION = 0x1F
ENFORCED, CLASSIFIER_ONLY = "enforced", "classifier only"


class DatabaseSettings(BaseModel):
    """Where and how to connect (`from_env` reads the `MYSQL_*` variables) and the limits of a call."""

    host: str = "127.0.0.1"
    port: int = Field(3306, ge=1, le=65535)
    user: str = Field(min_length=1)
    password: str = Field("", repr=False)
    db: str | None = None
    #: Server-side limit of one statement, in seconds (the client waits `client_grace` longer).
    timeout: float = Field(30.0, gt=0)
    #: Rows of one result shown; the row count still counts them all.
    max_rows: int = Field(200, ge=1)
    pool_size: int = Field(5, ge=1)
    client_grace: float = Field(CLIENT_GRACE, ge=0)
    #: The account that fills the runners' roles (`agentctl db-setup`); never runs model SQL.
    grantor_user: str | None = None
    grantor_password: str = Field("", repr=False)
    #: What the account names are derived from besides the database (db_roles.names_for).
    instance: str = Field("", max_length=64)
    #: Runner accounts db-setup made: at most this many calls run at once (with the other instances).
    runners: int = Field(db_roles.DEFAULT_RUNNERS, ge=1, le=db_roles.MAX_RUNNERS)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> DatabaseSettings:
        """Connection settings from MYSQL_HOST, MYSQL_PORT, MYSQL_USER, MYSQL_PASS, MYSQL_DB (the rest default)."""
        values = {key: env[name] for key, name in _ENV.items() if env.get(name, "").strip()}
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            problems = "; ".join(f"{_ENV.get(str(e['loc'][0]), e['loc'][0])}: {e['msg']}" for e in exc.errors())
            raise ConfigError(f"MySQL settings in the environment / .env: {problems}") from None

    def connect_args(self, *, grantor: bool = False) -> dict[str, Any]:
        """aiomysql keyword arguments of the runner (or the grantor); no database: the runner reaches it
        only through a role, and `USE` follows `SET ROLE` on every call."""
        user, password = (self.grantor_user, self.grantor_password) if grantor else (self.user, self.password)
        return {"host": self.host, "port": self.port, "user": user, "password": password, "db": None,
                "charset": "utf8mb4", "autocommit": True, "local_infile": False,
                "connect_timeout": min(10.0, self.timeout + self.client_grace)}

    def names(self) -> db_roles.Names:
        """The accounts, roles and admin schema of enforced mode (needs `db`)."""
        assert self.db
        return db_roles.names_for(self.db, self.instance, self.runners)

    def where(self) -> str:
        """`user@host:port/db` (db-setup's runners as `first…last`), for messages (never the password)."""
        user = self.user
        if self.grantor_user and self.db:
            names = self.names()
            user = names.runner(1) + (f"…{names.runner(names.runners)}" if names.runners > 1 else "")
        return f"{user}@{self.host}:{self.port}" + (f"/{self.db}" if self.db else "")


# ── The pool ────────────────────────────────────────────────────────────────────────────────


@dataclass
class _Call:
    """How one call's connection ended: reusable (reset cleanly), or abandoned mid-statement, on which runner."""

    reusable: bool = False
    abandoned: bool = False
    runner: int | None = None


class Database:
    """MySQL access with safe per-call settings; `run(sql, access)` executes one statement at a time, with only
    the privileges `access` covers when the accounts can be limited (see `enforce`)."""

    def __init__(self, settings: DatabaseSettings):
        self.settings = settings
        self._pool: aiomysql.Pool | None = None
        # connection → `connected_time` of the server session our settings were applied to
        # (a reconnect in place starts a new session, which needs them again).
        self._prepared: weakref.WeakKeyDictionary[aiomysql.Connection, float] = weakref.WeakKeyDictionary()
        self._kills: set[asyncio.Task[None]] = set()
        #: The runners of enforced mode; None: calls run on the classifier alone (`problem` says why).
        self.runners: db_runners.Runners | None = None
        self.problem: str | None = "not checked yet"
        #: A warning about the accounts that does not stop enforcement (a grantor holding more than it needs).
        self.warning: str | None = None
        self._recheck = False
        #: Whether the server tells table names apart by case (`lower_case_table_names` = 0), read when
        #: connecting; None until a connection was made. The gate keys tables by this rule.
        self.case_sensitive: bool | None = None

    @property
    def client_timeout(self) -> float:
        return self.settings.timeout + self.settings.client_grace

    @property
    def mode(self) -> str:
        """`enforced`, or `classifier only` (then `problem` says why)."""
        return ENFORCED if self.runners is not None else CLASSIFIER_ONLY

    def describe_mode(self) -> str:
        """One line: how calls are limited, and for classifier-only mode why and what fixes it."""
        if self.runners is not None:
            names = self.runners.names
            return (f"enforced by the database: each db_query call runs on one of {names.runners} runner accounts "
                    f"({names.runner(1)}…) whose role holds exactly what its gate decision covers")
        return (f"classifier only: {self.problem} — db_query calls are limited by the gate's SQL classifier alone; "
                "`agentctl db-setup` makes accounts the database can limit")

    def _connect_args(self) -> dict[str, Any]:
        return self.settings.connect_args()

    async def open(self) -> None:
        """Create the pool of classifier-only mode (connections are made on demand, so this works while the
        server is down)."""
        if self._pool is None and self.runners is None:
            self._pool = await aiomysql.create_pool(minsize=0, maxsize=self.settings.pool_size,
                                                    pool_recycle=POOL_RECYCLE_SECONDS, **self._connect_args())

    async def close(self) -> None:
        """Close every connection and wait for pending kills of abandoned statements."""
        if self._kills:
            await asyncio.gather(*self._kills, return_exceptions=True)
        if self._pool is not None:
            self._pool.close()
            await self._pool.wait_closed()
            self._pool = None
        if self.runners is not None:
            await self.runners.close()

    async def check(self) -> str | None:
        """None when a connection can be made and used, else why not (for start-up logs)."""
        outcome = await self.run("SELECT 1")
        return str(outcome.error) if outcome.error else None

    async def enforce(self) -> str | None:
        """Switch to enforced mode if the accounts allow it; None when enforced, else why not (also in `problem`).

        Needs MYSQL_DB and the accounts of `agentctl db-setup`: a grantor that can call the admin
        schema's procedures, and runners that hold nothing but USAGE and their own role. Only reads.
        """
        self.problem = await self._enforcement_problem()
        # The server did not answer: check again at the next call instead of staying unlimited.
        self._recheck = self.problem is not None and self.problem.startswith("cannot check")
        return self.problem

    async def _enforcement_problem(self) -> str | None:
        s = self.settings
        if not s.db:
            return "MYSQL_DB is not set (roles grant on one agent database)"
        if not s.grantor_user:
            return await self._plain_account_problem()
        names = s.names()
        runners = db_runners.Runners(names, runner_connect=s.connect_args(),
                                     grantor_connect=s.connect_args(grantor=True))
        try:
            problem = await self._check_accounts(runners)
        except (pymysql.err.MySQLError, OSError) as exc:
            problem = f"cannot check the accounts of {names.db} at {s.host}:{s.port}: {describe_error(exc)}"
        if problem is not None:
            await runners.close()
            return problem
        if self.runners is not None:
            await self.runners.close()
        self.runners = runners
        return None

    async def _plain_account_problem(self) -> str:
        """Why one account of its own (MYSQL_USER without db-setup's runners) cannot be limited: what it holds."""
        s = self.settings
        try:
            async with aiomysql.connect(**self._connect_args()) as conn, conn.cursor() as cur:
                await cur.execute("SHOW GRANTS")
                lines = [db_roles.without_password(str(r[0])) for r in await cur.fetchall()]
        except (pymysql.err.MySQLError, OSError) as exc:
            return f"cannot check the account {s.where()}: {describe_error(exc)}"
        held = next((x for x in lines if not x.startswith("GRANT USAGE ON *.* TO ")), "its own privileges")
        return (f"{s.user} cannot be limited: it is one account holding {held}, not the runner accounts of "
                "`agentctl db-setup`")

    async def _check_accounts(self, runners: db_runners.Runners) -> str | None:
        names = runners.names
        try:
            _tables, self.case_sensitive = await runners.tables()
        except pymysql.err.MySQLError as exc:
            if db_runners.is_connection_error(exc):
                raise
            return (f"the grantor {names.grantor} cannot use {names.admin_schema} ({describe_error(exc)}); "
                    "run `agentctl db-setup`")
        version = await runners.server_version()
        if version is None or version < db_roles.MIN_VERSION:
            return f"enforcement needs MariaDB ≥ {'.'.join(map(str, db_roles.MIN_VERSION))}"
        self.warning = await runners.grantor_problem()
        for k in names.slots():
            problem = await runners.check_runner(k)
            if problem is not None:
                return f"{names.runner(k)} cannot be limited: {problem}"
        return None

    async def _privileges(self, access: turns.DbAccess | None) -> db_roles.Privileges:
        """The grants a call with this gate decision runs with (nothing without one: fail closed)."""
        assert self.runners is not None and self.settings.db
        if access is None:
            return frozenset()
        if access.source == turns.ADMIN:
            return db_roles.everything(self.settings.db)
        tables, case_sensitive = await self.runners.tables()
        pairs: list[tuple[str, str]] = list(access.pairs)
        if access.allows is not None:
            pairs += db_roles.standing_pairs(access.allows, tables, operations=sql_rules.OPERATIONS,
                                             case_sensitive=case_sensitive)
        return db_roles.privileges_for(pairs, db=self.settings.db, tables=tables, case_sensitive=case_sensitive)

    async def _prepare(self, conn: aiomysql.Connection) -> None:
        """Make sure this server session has multi-statements off."""
        if self._prepared.get(conn) == conn.connected_time:
            return
        if conn.client_flag & CLIENT.MULTI_STATEMENTS:
            # aiomysql always asks for multi-statements in the handshake; reconnect without it.
            conn.client_flag &= ~CLIENT.MULTI_STATEMENTS
            await conn.ensure_closed()
            await conn.ping(reconnect=True)
        async with conn.cursor() as cur:
            await cur.execute("SELECT @@lower_case_table_names")
            row = await cur.fetchone()
            self.case_sensitive = row is not None and str(row[0]) == "0"
        self._prepared[conn] = conn.connected_time

    async def _clean(self, conn: aiomysql.Connection, role: str | None) -> None:
        """Start the call from a clean session: reset, pinned sql_mode and time limit, the call's role, `USE`."""
        await self._reset(conn)
        await self._settings(conn, role)
        if self.settings.db:
            try:
                await conn.select_db(self.settings.db)
            except pymysql.err.OperationalError as exc:
                if self.runners is None or exc.args[0] not in (1044, 1049):
                    raise
                # The role holds nothing in the agent database, so no `USE`; a reset keeps the previous
                # call's database, so this call gets a new session, which has none selected.
                conn.close()
                await conn.ping(reconnect=True)
                await self._prepare(conn)
                await self._settings(conn, role)

    @staticmethod
    async def _reset(conn: aiomysql.Connection) -> None:
        """COM_RESET_CONNECTION: aiomysql offers no call for it, so the command byte is sent and its OK read here."""
        async with asyncio.timeout(KILL_TIMEOUT):
            await conn._execute_command(COM_RESET_CONNECTION, b"")
            await conn._read_ok_packet()

    async def _settings(self, conn: aiomysql.Connection, role: str | None) -> None:
        async with conn.cursor() as cur:
            if "mariadb" in conn.get_server_info().lower():
                await cur.execute("SET SESSION sql_mode = %s, max_statement_time = %s",
                                  (PINNED_SQL_MODE, self.settings.timeout))
            else:  # MySQL ≥ 5.7.8: milliseconds, SELECT only (the client-side limit covers the rest)
                await cur.execute("SET SESSION sql_mode = %s, max_execution_time = %s",
                                  (_MYSQL_SQL_MODE, int(self.settings.timeout * 1000)))
            if role is not None:
                # The runner's only role; its privileges are read again here (a refill since the last call).
                await cur.execute(f"SET ROLE {db_roles.quote(role)}")

    async def _ready(self, conn: aiomysql.Connection, role: str | None) -> None:
        """A connection the server dropped (KILL, restart) reconnects; then the clean state of a call."""
        await conn.ping(reconnect=True)
        await self._prepare(conn)
        await self._clean(conn, role)

    def _connect_error(self, exc: BaseException) -> ConnectError:
        if isinstance(exc, TimeoutError):
            return ConnectError(f"cannot connect to MySQL as {self.settings.where()}: no answer within "
                                f"{self.client_timeout:g} s — is the server overloaded or unreachable?")
        return ConnectError(f"cannot connect to MySQL as {self.settings.where()}: {describe_error(exc)}")

    @contextlib.asynccontextmanager
    async def _lease(self, access: turns.DbAccess | None) -> AsyncIterator[tuple[aiomysql.Connection, _Call]]:
        """A clean connection for one call: a runner whose role holds what `access` covers (enforced), or one of
        the pool; given back when the block ends (closed when `_Call.reusable` is false)."""
        call = _Call()
        if self.runners is None:
            pool = self._pool
            assert pool is not None
            conn = None
            try:
                async with asyncio.timeout(self.client_timeout):
                    conn = await pool.acquire()
                    await self._ready(conn, None)
            except (pymysql.err.MySQLError, OSError, TimeoutError) as exc:
                if conn is not None:
                    conn.close()
                    pool.release(conn)
                raise self._connect_error(exc) from exc
            try:
                yield conn, call
            finally:
                if not call.reusable:
                    conn.close()  # the server rolls back whatever was left open and releases its locks
                pool.release(conn)
            return
        runners = self.runners
        try:
            privileges = await self._privileges(access)
            slot = await runners.lease(privileges, self.client_timeout)
        except db_runners.RunnerError as exc:
            raise ConnectError(str(exc)) from exc
        except (pymysql.err.MySQLError, OSError) as exc:
            raise ConnectError(f"the grantor account could not prepare this call: {describe_error(exc)}") from exc
        call.runner = slot.k
        try:
            try:
                async with asyncio.timeout(self.client_timeout):
                    conn = await runners.connection(slot)
                    await self._ready(conn, runners.names.role(slot.k))
            except (pymysql.err.MySQLError, OSError, TimeoutError) as exc:
                if slot.conn is not None:
                    slot.conn.close()
                raise self._connect_error(exc) from exc
            yield conn, call
            if not call.reusable:
                conn.close()
        finally:
            runners.release(slot, dirty=call.abandoned)
            if any(p in ("CREATE", "DROP", "ALTER", db_roles.ALL) for g in privileges for p in g.privileges):
                runners.tables_changed()

    async def run(self, sql: str, access: turns.DbAccess | None = None) -> Outcome:
        """Execute `sql` statement by statement and stop at the first failure; never raises DatabaseError.

        In enforced mode the call has exactly the privileges `access` (its gate decision) covers:
        none at all without one.
        """
        outcome = Outcome(split_statements(sql))
        if not outcome.statements:
            outcome.error = StatementError("no SQL statement given")
            return outcome
        if self._recheck:
            await self.enforce()
        await self.open()
        try:
            async with self._lease(access) as (conn, call):
                await self._statements(conn, call, outcome)
        except ConnectError as exc:
            outcome.error = exc
        return outcome

    async def _statements(self, conn: aiomysql.Connection, call: _Call, outcome: Outcome) -> None:
        """Run the call's statements; leave `call.reusable` true only for a session that can be reset and reused."""
        try:
            for statement in outcome.statements:
                op, _tables = sql_rules.classify_sql(statement)
                outcome.results.append(await self._run_one(conn, statement, call, read=op == sql_rules.READ))
            if conn.get_transaction_status():
                outcome.notes.append("Note: the transaction these statements opened was not committed; "
                                     "it has been rolled back.")
                return
        except StatementError as exc:
            outcome.error = exc
            if conn.closed or conn.get_transaction_status():
                return
        # Reset now too, not only before the next call: table locks, HANDLERs and the role's privileges must not
        # outlive the call on an idle connection (another client would wait on those locks).
        try:
            await self._reset(conn)
            call.reusable = True
        except (pymysql.err.MySQLError, OSError, TimeoutError):
            pass

    async def _run_one(self, conn: aiomysql.Connection, sql: str, call: _Call, *, read: bool) -> StatementResult:
        thread_id = conn.thread_id()
        wrap = read and not conn.get_transaction_status()  # inside the caller's own transaction, leave it be
        result = StatementResult(sql)
        try:
            async with asyncio.timeout(self.client_timeout), conn.cursor(aiomysql.SSCursor) as cur:
                if wrap:
                    await cur.execute("START TRANSACTION READ ONLY")
                await cur.execute(sql)
                if cur.description is None:
                    result.row_count, result.insert_id = max(cur.rowcount, 0), cur.lastrowid or None
                else:
                    result.columns = [d[0] for d in cur.description]
                    while batch := await cur.fetchmany(FETCH_BATCH):
                        result.row_count += len(batch)
                        result.rows.extend(batch[:self.settings.max_rows - len(result.rows)])
                if wrap:
                    await cur.execute("COMMIT")
            return result
        except pymysql.err.MySQLError as exc:
            raise StatementError(describe_error(exc)) from exc
        except TimeoutError as exc:
            conn.close()
            call.abandoned = True
            await self._kill(thread_id, call.runner)
            raise StatementTimeout(f"the statement did not finish within {self.client_timeout:g} s, so it was "
                                   "stopped — narrow the query (WHERE, LIMIT, an index)") from exc
        except asyncio.CancelledError:
            # The turn was cancelled: do not leave the statement running on the server.
            conn.close()
            call.abandoned = True
            task = asyncio.get_running_loop().create_task(self._kill(thread_id, call.runner))
            self._kills.add(task)
            task.add_done_callback(self._kills.discard)
            raise

    async def _kill(self, thread_id: int, runner: int | None) -> None:
        """Kill an abandoned server thread from a separate connection of its own account (best effort; a runner
        is swept before its next call in any case)."""
        args = self._connect_args()
        if runner is not None and self.runners is not None:
            args["user"] = self.runners.names.runner(runner)
        try:
            async with asyncio.timeout(KILL_TIMEOUT), aiomysql.connect(**args) as conn, \
                    conn.cursor() as cur:
                await cur.execute("KILL %s", (thread_id,))
        except pymysql.err.MySQLError as exc:
            if exc.args and exc.args[0] == 1094:  # unknown thread: it has ended already
                return
            logger.warning("could not kill MySQL thread %s: %s", thread_id, describe_error(exc))
        except (OSError, TimeoutError) as exc:
            logger.warning("could not kill MySQL thread %s: %s", thread_id, exc)


async def run_query(db: Database, sql: str, access: turns.DbAccess | None = None,
                    observed: metrics.Metrics = metrics.OFF) -> Outcome:
    """Run `sql` with what `access` covers; the call is counted and timed in `observed`."""
    started = time.perf_counter()
    outcome = await db.run(sql, access)
    observed.db_query(outcome.error is None, time.perf_counter() - started)
    return outcome


async def query_text(db: Database, sql: str, access: turns.DbAccess | None = None) -> str:
    """Run `sql` with what `access` covers and return the text for the user (results, or an ERROR line first)."""
    return format_outcome(await run_query(db, sql, access))


def read_accounts(path: Path) -> dict[str, str]:
    """The MYSQL_* account variables `agentctl db-setup` wrote to `path` ({} when there is none)."""
    if not path.is_file():
        return {}
    values = dotenv_values(path)
    return {k: v for k, v in values.items() if k in (*ACCOUNT_VARS, "MYSQL_DB") and v is not None}
