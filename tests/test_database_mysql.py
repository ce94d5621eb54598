"""database.py and plugin_database_mysql against a real MariaDB: results, enforcement, timeouts, reconnects, gates.

The shared server (127.0.0.1:3306, root without password; override with TEST_MYSQL_HOST/PORT/
USER/PASS) gets a database and two users of its own per test run, dropped afterwards. The restart
test starts a private mariadbd in a temporary data directory, so it can stop and start a server
without disturbing anyone. Nothing here is skipped: without MariaDB these tests fail and say so.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pymysql
import pytest

from config import ConfigError
from database import Database, DatabaseSettings, query_text, split_statements
from db_results import StatementResult, format_result, format_table
from shell_client import ShellClient
from sql import classify_sql
from tests import needs
from tests.conftest import ConfigDir, free_port, openai_model
from tests.fakes.backend import text, tool_call
from tests.plugin_host import call_tool, isolate_env, plugin, plugin_runtime, report
from tests.runtime import ALL_OPEN, execute, runtime, turn
from tests.sql_cases import SQL_CORPUS
from tests.turns import answer, collect_turn
from tests.waiting import succeeds, until, within_sync

SERVER = {"host": os.environ.get("TEST_MYSQL_HOST", "127.0.0.1"),
          "port": int(os.environ.get("TEST_MYSQL_PORT", "3306")),
          "user": os.environ.get("TEST_MYSQL_USER", "root"),
          "password": os.environ.get("TEST_MYSQL_PASS", "")}
PLUGIN = "plugin_database_mysql"
PEOPLE = [(1, "ada", "ada@example.org"), (2, "bob", None), (3, "cy", "cy@example.org")]


def _connect(**override: Any) -> pymysql.Connection:
    return pymysql.connect(**{**SERVER, **override}, autocommit=True, connect_timeout=5)


@dataclass
class RunDatabase:
    """The per-run database on the shared server, a read-write and a read-only user for it."""

    name: str
    users: dict[str, tuple[str, str]]  # role (rw, ro) → (user, password)

    def query(self, sql: str, *args: Any) -> tuple[tuple[Any, ...], ...]:
        """Run one statement as the server's administrator, in this database."""
        with _connect(database=self.name) as conn, conn.cursor() as cur:
            cur.execute(sql, args or None)
            return cur.fetchall()

    def env(self, role: str = "rw", **extra: str) -> dict[str, str]:
        user, password = self.users[role]
        return {"MYSQL_HOST": SERVER["host"], "MYSQL_PORT": str(SERVER["port"]), "MYSQL_USER": user,
                "MYSQL_PASS": password, "MYSQL_DB": self.name, **extra}

    def settings(self, role: str = "rw", **extra: Any) -> DatabaseSettings:
        return DatabaseSettings.from_env(self.env(role)).model_copy(update=extra)


@pytest.fixture(autouse=True)
def _no_mysql_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The process environment beats .env: a developer's MYSQL_* must not redirect these tests."""
    isolate_env(monkeypatch)


@pytest.fixture(scope="module")
def mariadb() -> Iterator[RunDatabase]:
    try:
        admin = _connect()
    except pymysql.err.MySQLError as exc:
        needs.absent("mariadb", f"MariaDB is not reachable at {SERVER['host']}:{SERVER['port']} as {SERVER['user']} "
                                f"({exc}): install and start mariadb-server (.ci/run starts it), or point "
                                "TEST_MYSQL_HOST, TEST_MYSQL_PORT, TEST_MYSQL_USER and TEST_MYSQL_PASS at one")
    suffix = secrets.token_hex(4)
    db = RunDatabase(f"agent_mcp_test_{suffix}",
                      {role: (f"amcp_{role}_{suffix}", secrets.token_hex(12)) for role in ("rw", "ro")})
    grants = {"rw": "ALL PRIVILEGES", "ro": "SELECT"}
    try:
        with admin.cursor() as cur:
            cur.execute(f"CREATE DATABASE `{db.name}`")
            for role, (user, password) in db.users.items():
                cur.execute("CREATE USER %s@'%%' IDENTIFIED BY %s", (user, password))
                cur.execute(f"GRANT {grants[role]} ON `{db.name}`.* TO %s@'%%'", (user,))
        # A function that writes, and a view that hides it: a SELECT on the view parses as a plain read.
        db.query("CREATE TABLE audit (n INT)")
        db.query("CREATE FUNCTION bump() RETURNS INT MODIFIES SQL DATA BEGIN INSERT INTO audit VALUES (1); "
                 "RETURN 1; END")
        db.query("CREATE VIEW bumped AS SELECT bump() AS b")
        yield db
    finally:
        with admin.cursor() as cur:
            cur.execute(f"DROP DATABASE IF EXISTS `{db.name}`")
            for user, _ in db.users.values():
                cur.execute("DROP USER IF EXISTS %s@'%%'", (user,))
        admin.close()


@pytest.fixture
def people(mariadb: RunDatabase) -> RunDatabase:
    """A fresh `people` table with three rows, and an empty `audit` table."""
    mariadb.query("DROP TABLE IF EXISTS people")
    mariadb.query("CREATE TABLE people (id INT AUTO_INCREMENT PRIMARY KEY, name VARCHAR(40) NOT NULL, "
                  "email VARCHAR(80) NULL)")
    mariadb.query("INSERT INTO people VALUES " + ", ".join(["(%s, %s, %s)"] * len(PEOPLE)),
                  *[v for row in PEOPLE for v in row])
    mariadb.query("DELETE FROM audit")
    return mariadb


async def run_text(settings: DatabaseSettings, *statements: str) -> list[str]:
    """Each SQL text's output, run one after another on one pool."""
    db = Database(settings)
    try:
        return [await query_text(db, sql) for sql in statements]
    finally:
        await db.close()


# ── Pure helpers ────────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize(("sql", "expected"), [
    ("SELECT 1", ["SELECT 1"]),
    ("SELECT 1; SELECT 2;", ["SELECT 1", "SELECT 2"]),
    ("SELECT ';' AS s; -- a;b\nSELECT 2", ["SELECT ';' AS s", "-- a;b\nSELECT 2"]),
    ("SELECT 1 /* x; y */ ;; ; -- only a comment", ["SELECT 1 /* x; y */"]),
    ("SELECT 1 /*!50000 ; DROP TABLE people */", ["SELECT 1 /*!50000 ; DROP TABLE people */"]),
    ("SELECT 'unterminated; DROP TABLE x", ["SELECT 'unterminated; DROP TABLE x"]),
    ("/*!40101 SET NAMES utf8mb4 */; SELECT 1", ["/*!40101 SET NAMES utf8mb4 */", "SELECT 1"]),
    ("  ;  ", []),
])
def test_split_statements_keeps_each_statements_text(sql: str, expected: list[str]) -> None:
    assert split_statements(sql) == expected


def test_format_table_pads_columns_and_marks_nulls_newlines_and_long_cells() -> None:
    table = format_table(["id", "note"], [(1, None), (22, "two\nlines"), (3, b"\xff\x00"), (4, "x" * 500)])
    lines = table.splitlines()
    assert lines[:4] == ["id | note", "---+" + "-" * 121, "1  | NULL", "22 | two\\nlines"]
    assert lines[4] == "3  | 0xff00" and lines[5].endswith("…") and len(lines[5]) == len("4  | ") + 120
    assert format_result(StatementResult("SELECT", ["a"], [], 0)) == "a\n-\n(no rows)"
    assert format_result(StatementResult("UPDATE t", row_count=3)) == "OK — rows affected: 3"


def test_settings_from_env_name_the_bad_variable() -> None:
    settings = DatabaseSettings.from_env({"MYSQL_USER": "app", "MYSQL_PASS": "s3cret", "MYSQL_TIMEOUT": "1"})
    assert (settings.host, settings.port, settings.db, settings.timeout) == ("127.0.0.1", 3306, None, 30)
    assert "s3cret" not in repr(settings) and settings.where() == "app@127.0.0.1:3306"
    with pytest.raises(ConfigError, match="MYSQL_PORT"):
        DatabaseSettings.from_env({"MYSQL_USER": "app", "MYSQL_PORT": "mysql"})
    with pytest.raises(ConfigError, match="MYSQL_USER"):
        DatabaseSettings.from_env({})


# ── database.py against the shared server ───────────────────────────────────────────────────


async def test_select_shows_a_table_with_its_row_count_and_writes_rows_affected(people: RunDatabase) -> None:
    select, insert, batch, capped = await run_text(
        people.settings(max_rows=2),
        "SELECT id, name, email FROM people WHERE id < 3 ORDER BY id",
        "INSERT INTO people (name) VALUES ('dee'), ('eve')",
        "UPDATE people SET email = NULL WHERE name = 'dee'; SELECT COUNT(*) AS n FROM people",
        "SELECT seq FROM seq_1_to_1000",
    )
    assert select == ("id | name | email\n"
                      "---+------+----------------\n"
                      "1  | ada  | ada@example.org\n"
                      "2  | bob  | NULL\n"
                      "(2 rows)")
    assert insert == "OK — rows affected: 2 (last insert id: 4)"
    assert batch == ("[1/2] UPDATE people SET email = NULL WHERE name = 'dee'\nOK — rows affected: 0\n\n"
                     "[2/2] SELECT COUNT(*) AS n FROM people\nn\n-\n5\n(1 row)")
    assert capped.endswith("(1000 rows; the first 2 rows shown — add WHERE or LIMIT to see the others)")
    assert capped.splitlines()[2:4] == ["1", "2"]


async def test_a_stored_function_is_a_write_and_a_view_hiding_one_runs_read_only(people: RunDatabase) -> None:
    # bump() writes, and nothing in the statement says so: a function that is no known builtin
    # is a write on any table for the gate...
    assert classify_sql("SELECT bump()") == ("write", frozenset({"*"}))
    # ...but a view can hide one: the gate sees a read of `bumped`, and the read-only transaction
    # it runs in refuses the write.
    assert classify_sql("SELECT b FROM bumped") == ("read", frozenset({"bumped"}))
    (out,) = await run_text(people.settings(), "SELECT b FROM bumped")
    assert out.startswith("ERROR: MySQL error 1792: Cannot execute statement in a READ ONLY transaction")
    assert people.query("SELECT COUNT(*) FROM audit") == ((0,),)


async def test_text_the_parser_reads_as_one_statement_never_runs_as_two(people: RunDatabase) -> None:
    # Without backslash escapes the server ends the string at \' and sees a DROP after it; sqlglot
    # sees one string literal, so neither the gate nor the split knows about the DROP. The
    # connection does not accept multi-statements, so the server refuses instead of dropping.
    sql = "SET SESSION sql_mode = 'NO_BACKSLASH_ESCAPES'; SELECT 'a\\'; DROP TABLE people; -- '"
    assert split_statements(sql)[1] == "SELECT 'a\\'; DROP TABLE people; -- '"
    assert "people" not in classify_sql(sql)[1]
    (out,) = await run_text(people.settings(), sql)
    assert out.startswith("ERROR: statement 2 of 2 failed: MySQL error 1064") and "DROP TABLE people" in out
    assert people.query("SELECT COUNT(*) FROM people") == ((3,),)


@pytest.mark.parametrize("sql", ["SELECT 1 /*!; DROP TABLE people */", "SELECT 1 /*M!50000 ; DROP TABLE people */"])
async def test_executable_comments_cannot_stack_a_second_statement(people: RunDatabase, sql: str) -> None:
    assert classify_sql(sql)[1] >= {"*"}  # the gate asks about a write on any table
    (out,) = await run_text(people.settings(), sql)
    assert out.startswith("ERROR: MySQL error 1064") and "DROP TABLE people" in out
    assert people.query("SELECT COUNT(*) FROM people") == ((3,),)


async def test_load_data_local_is_refused(people: RunDatabase, tmp_path: Path) -> None:
    source = tmp_path / "rows.csv"
    source.write_text("9,mallory,m@example.org\n")
    (out,) = await run_text(people.settings(),
                            f"LOAD DATA LOCAL INFILE '{source}' INTO TABLE people FIELDS TERMINATED BY ','")
    assert out.startswith("ERROR: MySQL error 4166") and "LOAD DATA LOCAL is disabled" in out
    assert people.query("SELECT COUNT(*) FROM people") == ((3,),)


async def test_server_and_client_time_limits(people: RunDatabase) -> None:
    server_side, client_side = await run_text(
        people.settings(timeout=0.5, client_grace=0.5),
        "SELECT MAX(SHA2(seq, 256)) FROM seq_1_to_1000000000",
        # With the server's limit switched off, the client's own limit stops the statement.
        "SET SESSION max_statement_time = 0; SELECT SLEEP(30) AS agent_mcp_sleeper",
    )
    assert server_side.startswith("ERROR: MySQL error 1969: Query execution was interrupted (max_statement_time "
                                  "exceeded) — the server's time limit stopped it")
    assert client_side.startswith("ERROR: statement 2 of 2 failed: the statement did not finish within 1 s, so it "
                                  "was stopped")
    # The abandoned statement was killed on the server, not left running.
    assert people.query(
        "SELECT COUNT(*) FROM information_schema.processlist WHERE info LIKE %s AND id <> CONNECTION_ID()",
        "%agent_mcp_sleeper%",
    ) == ((0,),)


async def test_a_cancelled_call_kills_its_statement(people: RunDatabase) -> None:
    running = "SELECT COUNT(*) FROM information_schema.processlist WHERE info LIKE %s AND id <> CONNECTION_ID()"
    db = Database(people.settings())
    call = asyncio.create_task(db.run("SELECT SLEEP(30) AS agent_mcp_cancelled"))

    def runs() -> bool:
        assert not call.done()
        return people.query(running, "%agent_mcp_cancelled%") == ((1,),)

    await until(runs, "the server to run the statement", 10)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await db.close()  # waits for the kill
    assert people.query(running, "%agent_mcp_cancelled%") == ((0,),)


async def test_a_killed_connection_is_reestablished(people: RunDatabase) -> None:
    db = Database(people.settings(pool_size=1))
    try:
        first = (await db.run("SELECT CONNECTION_ID()")).results[0].rows[0][0]
        people.query("KILL %s", first)  # what a server restart does to every open connection
        outcome = await db.run("SELECT CONNECTION_ID(), COUNT(*) FROM people")
        assert outcome.error is None
        (again, count), = outcome.results[0].rows
        assert again != first and count == 3
    finally:
        await db.close()


async def test_session_changes_do_not_leak_into_the_next_call(people: RunDatabase) -> None:
    db = Database(people.settings(pool_size=1))
    try:
        set_var, read_var, opened, after = [await query_text(db, sql) for sql in (
            "SET @secret = 42; SELECT @secret AS v",
            "SELECT @secret AS v",
            "START TRANSACTION; DELETE FROM people",
            "SELECT COUNT(*) AS n FROM people",
        )]
        assert set_var.endswith("v\n--\n42\n(1 row)") and read_var == "v\n----\nNULL\n(1 row)"
        assert opened.endswith("Note: the transaction these statements opened was not committed; it has been "
                               "rolled back.")
        assert after == "n\n-\n3\n(1 row)"
    finally:
        await db.close()


async def test_clear_errors(people: RunDatabase) -> None:
    (missing,) = await run_text(people.settings(), "SELECT * FROM nobody")
    assert missing == (f"ERROR: MySQL error 1146: Table '{people.name}.nobody' doesn't exist — check the table name "
                       "(SHOW TABLES lists them)")
    (denied,) = await run_text(people.settings("ro"), "INSERT INTO people (name) VALUES ('x')")
    assert denied.startswith("ERROR: MySQL error 1142: INSERT command denied to user")
    assert "no right to do that" in denied and people.query("SELECT COUNT(*) FROM people") == ((3,),)
    password = people.users["rw"][1]
    (refused,) = await run_text(people.settings(password="wrong-" + password), "SELECT 1")
    assert refused.startswith(f"ERROR: cannot connect to MySQL as {people.users['rw'][0]}@")
    assert "MySQL error 1045" in refused and "wrong MYSQL_USER or MYSQL_PASS" in refused and password not in refused
    (unknown_db,) = await run_text(people.settings(db="no_such_db_" + secrets.token_hex(3)), "SELECT 1")
    assert "MySQL error 1044" in unknown_db or "MySQL error 1049" in unknown_db
    (down,) = await run_text(people.settings(port=free_port()), "SELECT 1")
    assert "MySQL error 2003" in down and "is the MySQL server running?" in down
    (partial,) = await run_text(people.settings(), "SELECT 1 AS a; SELEC 2; SELECT 3")
    assert partial.startswith("ERROR: statement 2 of 3 failed: MySQL error 1064")
    assert "Statement 1 ran (changes it made are kept); the 1 statement after it did not run." in partial


# ── db_query and !db through the agent ─────────────────────────────────────────────────────


def tool_results(backend: Any) -> list[str]:
    """The tool results the model received in the last request, after the newest user message."""
    messages = backend.requests[-1].json["messages"]
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    return [m["content"] for m in messages[last_user:] if m["role"] == "tool"]


def _snapshot(db: RunDatabase, corpus: str) -> dict[str, Any]:
    """Everything a statement could change, as the administrator sees it: this database's tables
    (names and checksums), routines, events, triggers, views; the server's databases and accounts
    that `corpus` names (a statement can only create or drop what it names; other tests running at
    the same time create databases and accounts of their own)."""
    def named(rows: Any) -> list[Any]:
        return [row for row in rows if str(row[0]).lower() in corpus]

    tables = [row[0] for row in db.query("SHOW TABLES")]
    schema = "SELECT {} FROM information_schema.{} WHERE {} = %s ORDER BY 1"
    return {
        "tables": {t: db.query(f"CHECKSUM TABLE `{t}` EXTENDED") for t in tables},
        "routines": db.query(schema.format("routine_name", "routines", "routine_schema"), db.name),
        "events": db.query(schema.format("event_name", "events", "event_schema"), db.name),
        "triggers": db.query(schema.format("trigger_name", "triggers", "trigger_schema"), db.name),
        "views": db.query(schema.format("table_name", "views", "table_schema"), db.name),
        "databases": named(db.query("SHOW DATABASES")),
        "accounts": named(db.query("SELECT user, host FROM mysql.user ORDER BY 1, 2")),
    }


async def test_every_write_of_the_sql_table_is_gated_and_changes_nothing(people: RunDatabase, fake_openai: Any,
                                                                         tmp_path: Path) -> None:
    """Reads allowed on every table, writes gated, a client that cannot approve: each write-classified
    statement of tests/sql_cases.py through the real db_query path is refused, and the server is unchanged."""
    for table in ("users", "orders", "logs", "staging", "t", "a", "b", "docs", "items"):
        people.query(f"CREATE TABLE IF NOT EXISTS `{table}` (id INT PRIMARY KEY, a INT, note VARCHAR(20))")
        people.query(f"REPLACE INTO `{table}` VALUES (1, 1, 'x'), (2, 2, 'y')")
    writes = [sql for sql, op, _ in SQL_CORPUS if op in ("write", "ddl") and sql.strip(" ;")]
    gates = {"db": {"*": {"read": True}, "__meta__": {"read": True}}, "tools": {}}
    corpus = "\n".join(writes).lower()
    before = _snapshot(people, corpus)
    async with runtime(tmp_path, {"fake": openai_model(fake_openai)}, env=people.env(), gates=gates,
                       rate_limits={}, plugins=(PLUGIN,)) as rt:
        for sql in writes:
            result = await execute(rt, "llama-10.0.0.9", "db_query", {"sql": sql})
            assert result.startswith("TOOL CALL REJECTED") and "cannot give it" in result, (sql, result)
    assert _snapshot(people, corpus) == before
    assert len(writes) > 150


async def test_db_query_through_the_gate(people: RunDatabase, fake_openai: Any, tmp_path: Path) -> None:
    gates = {"db": {"people": {"read": True}}, "tools": {}}
    async with runtime(tmp_path, {"fake": openai_model(fake_openai)}, env=people.env(), gates=gates,
                       plugins=(PLUGIN,)) as rt:
        # A read the gate defaults allow: no question, the table reaches the model.
        fake_openai.script(tool_call("db_query", {"sql": "SELECT name FROM people ORDER BY id"}), text("3 people"))
        _, events = await turn(rt, "who is there?")
        assert "gate" not in [e.name for e in events]
        assert tool_results(fake_openai) == ["name\n----\nada\nbob\ncy\n(3 rows)"]

        # An insert asks, is approved, runs.
        insert = "INSERT INTO people (name) VALUES ('dee')"
        fake_openai.script(tool_call("db_query", {"sql": insert}), text("added"))
        _, events = await turn(rt, "add dee", answer="allow")
        (asked,) = [e.data for e in events if e.name == "gate"]
        assert asked["tables"] == ["people"] and asked["tool_args"] == {"sql": insert, "operation_type": "write"}
        assert tool_results(fake_openai) == ["OK — rows affected: 1 (last insert id: 4)"]
        assert people.query("SELECT name FROM people WHERE id = 4") == (("dee",),)

        # DDL riding behind an allowed read: the gate asks about the DROP (ddl), the user says no.
        fake_openai.script(tool_call("db_query", {"sql": "SELECT * FROM people; DROP TABLE people"}), text("no"))
        _, events = await turn(rt, "list them", answer="reject")
        (asked,) = [e.data for e in events if e.name == "gate"]
        assert asked["tool_args"]["operation_type"] == "ddl"
        assert tool_results(fake_openai)[0].startswith("TOOL CALL REJECTED: the user rejected your db_query")
        assert people.query("SELECT COUNT(*) FROM people") == ((4,),)

        # A chat-proxy client cannot approve: the write is rejected without asking.
        fake_openai.script(tool_call("db_query", {"sql": "DELETE FROM people"}), text("no"))
        _, events = await turn(rt, "delete all", client_id="llama-10.0.0.9")
        assert "gate" not in [e.name for e in events] and "cannot give it" in tool_results(fake_openai)[0]
        assert people.query("SELECT COUNT(*) FROM people") == ((4,),)

        # !db: the same helpers, for the shell only.
        out, _ = await turn(rt, "!db SELECT COUNT(*) AS n FROM people")
        assert out == "n\n-\n4\n(1 row)\n"
        out, _ = await turn(rt, "!db DELETE FROM people", client_id="llama-10.0.0.9")
        assert out.startswith("ERROR: !db is accepted only from the interactive shell")
        assert people.query("SELECT COUNT(*) FROM people") == ((4,),)
        out, _ = await turn(rt, "!db")
        assert out.startswith(f"Usage: !db <sql>   run SQL directly on {people.users['rw'][0]}@")
        help_text, _ = await turn(rt, "!help")
        assert "!db <sql>" in help_text and "db_query" in help_text


async def test_plugin_config_sets_the_limits_and_refuses_unknown_keys(people: RunDatabase, tmp_path: Path) -> None:
    (tmp_path / "ok").mkdir()
    (tmp_path / "bad").mkdir()
    async with plugin_runtime(tmp_path / "ok", {PLUGIN: {"timeout": 5, "max_rows": 1}}, people.env()) as rt:
        assert plugin(rt, PLUGIN).db.settings.timeout == 5
        out = await call_tool(rt, "db_query", sql="SELECT name FROM people ORDER BY id")
        assert out == "name\n----\nada\n(3 rows; the first 1 row shown — add WHERE or LIMIT to see the others)"
    async with plugin_runtime(tmp_path / "bad", {PLUGIN: {"max_row": 1}}, people.env()) as rt:
        assert report(rt, PLUGIN).line() == (f"{PLUGIN} [failed]: plugin_config.{PLUGIN} in plugins-enabled.json: "
                                              "max_row: Extra inputs are not permitted")


async def test_db_query_as_a_user_without_write_rights(people: RunDatabase, fake_openai: Any,
                                                       tmp_path: Path) -> None:
    async with runtime(tmp_path, {"fake": openai_model(fake_openai)}, env=people.env("ro"), gates=ALL_OPEN,
                       plugins=(PLUGIN,)) as rt:
        fake_openai.script(tool_call("db_query", {"sql": "UPDATE people SET name = 'x'"}), text("denied"))
        await turn(rt, "rename everyone")
        (result,) = tool_results(fake_openai)
        assert result.startswith("ERROR: MySQL error 1142: UPDATE command denied to user")
        assert "an administrator must GRANT it" in result
        assert people.query("SELECT COUNT(*) FROM people WHERE name = 'x'") == ((0,),)


# ── A server restart, on a private server ──────────────────────────────────────────────────


def _binary(name: str) -> str:
    return needs.program(name, "mariadb", "mariadb-server-core")  # the restart test runs a private server


class PrivateMariaDB:
    """A MariaDB server in a temporary data directory on a free port, to stop and start at will."""

    def __init__(self, base: Path):
        self.base, self.port = base, free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = base / "server.log"
        self.as_root = ["--user=root"] if os.geteuid() == 0 else []
        subprocess.run([_binary("mariadb-install-db"), "--no-defaults", f"--datadir={base / 'data'}",
                        "--auth-root-authentication-method=normal", "--skip-test-db", *self.as_root],
                       check=True, capture_output=True, timeout=60)

    def start(self) -> None:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [_binary("mariadbd"), "--no-defaults", f"--datadir={self.base / 'data'}", f"--port={self.port}",
                 f"--socket={self.base / 'm.sock'}", f"--pid-file={self.base / 'm.pid'}", "--bind-address=127.0.0.1",
                 "--skip-log-bin", "--innodb-buffer-pool-size=16M", *self.as_root],
                stdout=subprocess.DEVNULL, stderr=log)
        proc = self.proc
        up = within_sync(lambda: proc.poll() is not None or succeeds(  # (a server that exited ends the wait)
            lambda: _connect(host="127.0.0.1", port=self.port, user="root", password="").close(),
            pymysql.err.OperationalError), 30)
        if not up or proc.poll() is not None:
            raise RuntimeError("private mariadbd did not start:\n" + self.log.read_text()[-2000:])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)
        self.proc = None


@pytest.fixture
def private_mariadb(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateMariaDB]:
    server = PrivateMariaDB(tmp_path_factory.mktemp("mariadb"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


async def test_db_query_survives_a_server_restart(private_mariadb: PrivateMariaDB, fake_openai: Any,
                                                  tmp_path: Path) -> None:
    env = {"MYSQL_USER": "root", "MYSQL_PORT": str(private_mariadb.port)}
    ask = tool_call("db_query", {"sql": "SELECT 40 + 2 AS answer"})
    ok = ["answer\n------\n42\n(1 row)"]

    async def ask_db(rt: Any) -> list[str]:
        fake_openai.script(ask, text("done"))
        await turn(rt, "what is the answer?")
        return tool_results(fake_openai)

    private_mariadb.stop()
    # Down at start: the plugin loads anyway and says what is wrong on each call.
    async with runtime(tmp_path, {"fake": openai_model(fake_openai)}, env=env, gates=ALL_OPEN,
                       plugins=(PLUGIN,)) as rt:
        (down,) = await ask_db(rt)
        assert down.startswith("ERROR: cannot connect to MySQL as <hidden>: ")  # the model never learns where
        assert "MySQL error 2003" in down and "is the MySQL server running?" in down
        private_mariadb.start()
        assert await ask_db(rt) == ok
        # Restarted between two calls of one session: the pooled connection reconnects, no call fails.
        private_mariadb.stop()
        private_mariadb.start()
        assert await ask_db(rt) == ok
        private_mariadb.stop()
        (down,) = await ask_db(rt)
        assert "MySQL error 2003" in down


async def test_enforced_calls_outlive_a_server_restart(private_mariadb: PrivateMariaDB, tmp_path: Path) -> None:
    """The runners' and the grantor's sessions all die with the server; the next call makes them again."""
    import agentctl
    import turns
    from database import ACCOUNTS_FILE, read_accounts

    (tmp_path / ".env").write_text(f"MYSQL_DB=restart_db\nMYSQL_PORT={private_mariadb.port}\n"
                                   f"AGENT_DATA_DIR={tmp_path / 'data'}\n")
    assert await asyncio.to_thread(agentctl.main, ["--config-dir", str(tmp_path), "db-setup", "--admin-user", "root",
                                                   "--admin-password", ""]) == 0
    with _connect(host="127.0.0.1", port=private_mariadb.port, user="root", password="") as conn:
        conn.query("CREATE TABLE restart_db.t (a INT)")
    accounts = read_accounts(tmp_path / "data" / ACCOUNTS_FILE)
    db = Database(DatabaseSettings.from_env({**accounts, "MYSQL_PORT": str(private_mariadb.port)}))
    access = turns.DbAccess("approval", frozenset({("t", "write")}))
    try:
        assert await db.enforce() is None
        for n in range(3):
            assert (await query_text(db, f"INSERT INTO t VALUES ({n})", access)).startswith("OK"), n
            private_mariadb.stop()
            private_mariadb.start()
        assert "(3 rows)" in await query_text(db, "SELECT * FROM t", access)
        assert "No database selected" in await query_text(db, "SELECT * FROM t", None)  # no decision: nothing
    finally:
        await db.close()


# ── Over HTTP, with shell.py's own client ───────────────────────────────────────────────────


async def test_shell_user_approves_an_insert_over_http(people: RunDatabase, config_dir: ConfigDir,
                                                       fake_openai: Any, start_server: Any) -> None:
    config_dir.models = {"fake": openai_model(fake_openai)}
    config_dir.plugins.append(PLUGIN)
    config_dir.gates = {"db": {"people": {"read": True}}, "tools": {}}
    server = start_server(config_dir, env=people.env())
    insert = "INSERT INTO people (name, email) VALUES ('dee', 'dee@example.org')"
    fake_openai.script(tool_call("db_query", {"sql": insert}), text("Added dee."))
    async with ShellClient(server.url, "shell-mysql", token=server.token) as client:
        await client.connect(max_wait=10)
        await client.submit("add dee")
        events = []
        async for ev in client.events():
            events.append(ev)
            if ev.name == "gate":
                assert ev.data["tables"] == ["people"] and ev.data["tool_args"]["operation_type"] == "write"
                await client.gate_response(ev.data["gate_id"], "allow")
            if ev.name == "done":
                break
        assert answer(events) == "Added dee."
        assert tool_results(fake_openai) == ["OK — rows affected: 1 (last insert id: 4)"]
        out = answer(await collect_turn(client, "!db SELECT name, email FROM people WHERE id = 4"))
    assert out == "name | email\n-----+----------------\ndee  | dee@example.org\n(1 row)\n"
    assert people.query("SELECT COUNT(*) FROM people") == ((4,),)
