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
- A connection whose session state a statement may have changed (`SET`, `USE`, an open
  transaction, anything the classifier cannot analyse) is closed, never handed to the next call.
Connections are checked before use, so a server restart costs no failed call.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiomysql
import pymysql
from pydantic import BaseModel, Field, ValidationError
from pymysql.constants import CLIENT

from config import ConfigError
from sql import ANY_TABLE, READ, classify_sql, split_statements

logger = logging.getLogger("agent_mcp.database")

#: Rows read per round trip from the server's (unbuffered) result.
FETCH_BATCH = 500
#: Characters of one cell shown in a result table.
MAX_CELL = 120
#: Extra seconds the client waits beyond the server's limit, so the server's own error comes first.
CLIENT_GRACE = 2.0
KILL_TIMEOUT = 5.0
POOL_RECYCLE_SECONDS = 3600

_ENV = {"host": "MYSQL_HOST", "port": "MYSQL_PORT", "user": "MYSQL_USER", "password": "MYSQL_PASS", "db": "MYSQL_DB"}


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

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> DatabaseSettings:
        """Connection settings from MYSQL_HOST, MYSQL_PORT, MYSQL_USER, MYSQL_PASS, MYSQL_DB (the rest default)."""
        values = {key: env[name] for key, name in _ENV.items() if env.get(name, "").strip()}
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            problems = "; ".join(f"{_ENV.get(str(e['loc'][0]), e['loc'][0])}: {e['msg']}" for e in exc.errors())
            raise ConfigError(f"MySQL settings in the environment / .env: {problems}") from None

    def where(self) -> str:
        """`user@host:port/db`, for messages (never the password)."""
        return f"{self.user}@{self.host}:{self.port}" + (f"/{self.db}" if self.db else "")


# ── Errors ──────────────────────────────────────────────────────────────────────────────────

_HINTS = {
    1044: "this MySQL user has no rights on that database: check MYSQL_DB or ask for a GRANT",
    1045: "wrong MYSQL_USER or MYSQL_PASS",
    1049: "that database does not exist: check MYSQL_DB",
    1054: "check the column names (DESCRIBE <table> lists them)",
    1064: "fix the SQL (one statement at a time; statements are separated by ';')",
    1142: "this MySQL user has no right to do that; a read may still work, otherwise an administrator must GRANT it",
    1143: "this MySQL user has no right to that column; an administrator must GRANT it",
    1146: "check the table name (SHOW TABLES lists them)",
    1148: "LOAD DATA LOCAL is disabled",
    1792: "it was taken for a read and ran in a read-only transaction, but it writes; send it as a write",
    1969: "the server's time limit stopped it; narrow the query (WHERE, LIMIT, an index)",
    2002: "is the MySQL server running? check MYSQL_HOST and MYSQL_PORT",
    2003: "is the MySQL server running? check MYSQL_HOST and MYSQL_PORT",
    2006: "the connection was lost while the statement ran; a write may or may not have been applied",
    2013: "the connection was lost while the statement ran; a write may or may not have been applied",
    4166: "LOAD DATA LOCAL is disabled",
}


class DatabaseError(Exception):
    """A database call failed; `str()` is the message for the user, with what to do next."""


class ConnectError(DatabaseError):
    """No usable connection: the server is down or unreachable, or the credentials are refused."""


class StatementError(DatabaseError):
    """The server refused or failed one statement (syntax, unknown table, no rights, its time limit)."""


class StatementTimeout(StatementError):
    """A statement outlived the client-side limit; its connection was dropped and its server thread killed."""


def describe_error(exc: BaseException) -> str:
    """`MySQL error <code>: <server message> — <what to do>` for a PyMySQL error, else its text."""
    args = exc.args if isinstance(exc, pymysql.err.MySQLError) else ()
    if len(args) >= 2 and isinstance(args[0], int):
        hint = _HINTS.get(args[0])
        return f"MySQL error {args[0]}: {args[1]}" + (f" — {hint}" if hint else "")
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


# ── Statements and results ──────────────────────────────────────────────────────────────────


@dataclass
class StatementResult:
    """One statement's outcome: a result set (`columns`, the first rows, `row_count` of all rows) or rows affected."""

    sql: str
    columns: list[str] | None = None
    rows: list[tuple[Any, ...]] = field(default_factory=list)
    row_count: int = 0
    insert_id: int | None = None


@dataclass
class Outcome:
    """What a call did: the statements that ran, and the error that stopped it (if any)."""

    statements: list[str]
    results: list[StatementResult] = field(default_factory=list)
    error: DatabaseError | None = None
    notes: list[str] = field(default_factory=list)


def _cell(value: Any) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, (bytes, bytearray)):
        try:
            text = bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            text = "0x" + bytes(value[:MAX_CELL]).hex()
    else:
        text = str(value)
    text = text.replace("\r\n", "\\n").replace("\n", "\\n").replace("\t", " ")
    return text if len(text) <= MAX_CELL else text[:MAX_CELL - 1] + "…"


def format_table(columns: list[str], rows: list[tuple[Any, ...]]) -> str:
    """A pipe table: header, `-+-` rule, one line per row, each column padded to its widest cell."""
    cells = [[_cell(v) for v in row] for row in rows]
    header = [_cell(c) for c in columns]
    widths = [max([len(header[i]), *(len(r[i]) for r in cells)]) for i in range(len(columns))]

    def line(values: list[str]) -> str:
        return " | ".join(v.ljust(w) for v, w in zip(values, widths, strict=True)).rstrip()

    return "\n".join([line(header), "-+-".join("-" * w for w in widths), *(line(r) for r in cells)])


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def format_result(result: StatementResult) -> str:
    """A result set as a table with its row count, or `OK — rows affected: N`."""
    if result.columns is None:
        insert = f" (last insert id: {result.insert_id})" if result.insert_id else ""
        return f"OK — rows affected: {result.row_count}{insert}"
    if not result.rows:
        return format_table(result.columns, []) + "\n(no rows)"
    count = f"({_plural(result.row_count, 'row')}"
    if result.row_count > len(result.rows):
        count += f"; the first {_plural(len(result.rows), 'row')} shown — add WHERE or LIMIT to see the others"
    return format_table(result.columns, result.rows) + "\n" + count + ")"


def _one_line(sql: str, width: int = 80) -> str:
    flat = " ".join(sql.split())
    return flat if len(flat) <= width else flat[:width - 1] + "…"


def format_outcome(outcome: Outcome) -> str:
    """The text a user or the model gets: results, and an `ERROR:` first line when something failed."""
    total = len(outcome.statements)
    blocks = [format_result(r) if total == 1 else f"[{i}/{total}] {_one_line(r.sql)}\n{format_result(r)}"
              for i, r in enumerate(outcome.results, 1)]
    head = []
    if outcome.error is not None:
        done = len(outcome.results)
        if isinstance(outcome.error, ConnectError) or total <= 1:
            head.append(f"ERROR: {outcome.error}")
        else:
            rest = total - done - 1
            fate = ["statement 1 ran (changes it made are kept)" if done == 1 else
                    f"statements 1–{done} ran (changes they made are kept)"] if done else []
            fate += [f"the {_plural(rest, 'statement')} after it did not run"] if rest else []
            fate_text = "; ".join(fate)
            head.append(f"ERROR: statement {done + 1} of {total} failed: {outcome.error}\n"
                        f"{fate_text[:1].upper()}{fate_text[1:]}.")
    return "\n\n".join([*head, *blocks, *outcome.notes]).strip()


# ── The pool ────────────────────────────────────────────────────────────────────────────────


class Database:
    """An aiomysql pool with safe per-connection settings; `run(sql)` executes one statement at a time."""

    def __init__(self, settings: DatabaseSettings):
        self.settings = settings
        self._pool: aiomysql.Pool | None = None
        # connection → `connected_time` of the server session our settings were applied to
        # (a reconnect in place starts a new session, which needs them again).
        self._prepared: weakref.WeakKeyDictionary[aiomysql.Connection, float] = weakref.WeakKeyDictionary()
        self._kills: set[asyncio.Task[None]] = set()
        #: Whether the server tells table names apart by case (`lower_case_table_names` = 0), read when
        #: connecting; None until a connection was made. The gate keys tables by this rule.
        self.case_sensitive: bool | None = None

    @property
    def client_timeout(self) -> float:
        return self.settings.timeout + self.settings.client_grace

    def _connect_args(self) -> dict[str, Any]:
        s = self.settings
        return {"host": s.host, "port": s.port, "user": s.user, "password": s.password, "db": s.db,
                "charset": "utf8mb4", "autocommit": True, "local_infile": False,
                "connect_timeout": min(10.0, self.client_timeout)}

    async def open(self) -> None:
        """Create the pool (connections are made on demand, so this works while the server is down)."""
        if self._pool is None:
            self._pool = await aiomysql.create_pool(minsize=0, maxsize=self.settings.pool_size,
                                                    pool_recycle=POOL_RECYCLE_SECONDS, **self._connect_args())

    async def close(self) -> None:
        """Close the pool and wait for pending kills of abandoned statements."""
        if self._kills:
            await asyncio.gather(*self._kills, return_exceptions=True)
        if self._pool is not None:
            self._pool.close()
            await self._pool.wait_closed()
            self._pool = None

    async def check(self) -> str | None:
        """None when a connection can be made and used, else why not (for start-up logs)."""
        outcome = await self.run("SELECT 1")
        return str(outcome.error) if outcome.error else None

    async def _prepare(self, conn: aiomysql.Connection) -> None:
        """Make sure this server session has multi-statements off and the statement time limit."""
        if self._prepared.get(conn) == conn.connected_time:
            return
        if conn.client_flag & CLIENT.MULTI_STATEMENTS:
            # aiomysql always asks for multi-statements in the handshake; reconnect without it.
            conn.client_flag &= ~CLIENT.MULTI_STATEMENTS
            await conn.ensure_closed()
            await conn.ping(reconnect=True)
        async with conn.cursor() as cur:
            if "mariadb" in conn.get_server_info().lower():
                await cur.execute("SET SESSION max_statement_time = %s", (self.settings.timeout,))
            else:  # MySQL ≥ 5.7.8: milliseconds, SELECT only (the client-side limit covers the rest)
                await cur.execute("SET SESSION max_execution_time = %s", (int(self.settings.timeout * 1000),))
            await cur.execute("SELECT @@lower_case_table_names")
            row = await cur.fetchone()
            self.case_sensitive = row is not None and str(row[0]) == "0"
        self._prepared[conn] = conn.connected_time

    async def _acquire(self, pool: aiomysql.Pool) -> aiomysql.Connection:
        conn = None
        try:
            async with asyncio.timeout(self.client_timeout):
                conn = await pool.acquire()
                await conn.ping(reconnect=True)  # a connection the server dropped (KILL, restart) reconnects here
                await self._prepare(conn)
            return conn
        except BaseException as exc:
            if conn is not None:
                conn.close()
                pool.release(conn)
            if isinstance(exc, (pymysql.err.MySQLError, OSError)):
                raise ConnectError(
                    f"cannot connect to MySQL as {self.settings.where()}: {describe_error(exc)}"
                ) from exc
            if isinstance(exc, TimeoutError):
                raise ConnectError(f"cannot connect to MySQL as {self.settings.where()}: no answer within "
                                   f"{self.client_timeout:g} s — is the server overloaded or unreachable?") from exc
            raise

    async def run(self, sql: str) -> Outcome:
        """Execute `sql` statement by statement and stop at the first failure; never raises DatabaseError."""
        outcome = Outcome(split_statements(sql))
        if not outcome.statements:
            outcome.error = StatementError("no SQL statement given")
            return outcome
        await self.open()
        pool = self._pool
        assert pool is not None
        try:
            conn = await self._acquire(pool)
        except ConnectError as exc:
            outcome.error = exc
            return outcome
        reusable, session_changed = False, False
        try:
            for statement in outcome.statements:
                op, tables = classify_sql(statement)
                session_changed = session_changed or ANY_TABLE in tables  # SET, USE, BEGIN, unknown …
                outcome.results.append(await self._run_one(conn, statement, read=op == READ))
            if conn.get_transaction_status():
                outcome.notes.append("Note: the transaction these statements opened was not committed; "
                                     "it has been rolled back.")
            else:
                reusable = not session_changed
        except StatementError as exc:
            outcome.error = exc
        finally:
            if not reusable:
                conn.close()  # the server rolls back whatever was left open
            pool.release(conn)
        return outcome

    async def _run_one(self, conn: aiomysql.Connection, sql: str, *, read: bool) -> StatementResult:
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
            await self._kill(thread_id)
            raise StatementTimeout(f"the statement did not finish within {self.client_timeout:g} s, so it was "
                                   "stopped — narrow the query (WHERE, LIMIT, an index)") from exc
        except asyncio.CancelledError:
            # The turn was cancelled: do not leave the statement running on the server.
            conn.close()
            task = asyncio.get_running_loop().create_task(self._kill(thread_id))
            self._kills.add(task)
            task.add_done_callback(self._kills.discard)
            raise

    async def _kill(self, thread_id: int) -> None:
        """Kill an abandoned server thread from a separate connection (best effort)."""
        try:
            async with asyncio.timeout(KILL_TIMEOUT), aiomysql.connect(**self._connect_args()) as conn, \
                    conn.cursor() as cur:
                await cur.execute("KILL %s", (thread_id,))
        except pymysql.err.MySQLError as exc:
            if exc.args and exc.args[0] == 1094:  # unknown thread: it has ended already
                return
            logger.warning("could not kill MySQL thread %s: %s", thread_id, describe_error(exc))
        except (OSError, TimeoutError) as exc:
            logger.warning("could not kill MySQL thread %s: %s", thread_id, exc)


async def query_text(db: Database, sql: str) -> str:
    """Run `sql` and return the text for the user or the model (results, or an ERROR line first)."""
    return format_outcome(await db.run(sql))
