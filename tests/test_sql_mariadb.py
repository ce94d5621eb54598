"""Real MariaDB judges the classifier's keys: a statement run in a database holding ONLY the tables the
classifier named must never miss a table (error 1146), so no table it reads or changes goes unnamed.

For each crafted statement whose keys are plain tables (no `*`, no other schema), a fresh database is
made with exactly those tables, the statement runs there as root, and the server's answer is checked:
success or any error but "table doesn't exist". Where a CTE hides a name, the table of that name is
absent, so the server proves the CTE (not the table) was read. The test creates and drops its databases.
"""

from __future__ import annotations

import os
import random
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pymysql
import pytest

import gate
import sql
from database import Database, DatabaseSettings
from tests import needs
from tests.conftest import openai_model
from tests.runtime import runtime
from tests.sql_attack_corpus import ROLE_SWITCHES
from tests.sql_cases import SQL_CORPUS
from tests.sql_corpus import ATTACKS, CASE_SENSITIVE, CTE_SCOPES, KEYWORD_NAMES, SHOW_WHERE

SERVER = {"host": os.environ.get("TEST_MYSQL_HOST", "127.0.0.1"),
          "port": int(os.environ.get("TEST_MYSQL_PORT", "3306")),
          "user": os.environ.get("TEST_MYSQL_USER", "root"),
          "password": os.environ.get("TEST_MYSQL_PASS", "")}
NO_SUCH_TABLE = 1146
COLUMNS = "(id INT PRIMARY KEY, a INT, note VARCHAR(20), name VARCHAR(20), n INT)"


def _connect(**extra: Any) -> pymysql.Connection:
    return pymysql.connect(**SERVER, autocommit=True, connect_timeout=5, **extra)


@pytest.fixture(scope="module")
def server() -> Iterator[pymysql.Connection]:
    try:
        conn = _connect()
    except pymysql.err.OperationalError as exc:
        needs.absent("mariadb", f"MariaDB is not reachable at {SERVER['host']}:{SERVER['port']}: {exc}")
    with conn:
        yield conn


def _judged(text: str, case_sensitive: bool) -> set[str] | None:
    """The tables to create for a statement whose keys the server can check here (plain table names
    under the server's own case rule), else None. SHOW/DESCRIBE of a table show its schema only
    (`__meta__`): alone they are not judged; with a WHERE that reads tables, the table they describe
    is created too. A table the statement creates is not created before it."""
    keys = set(sql.classify_sql(text, case_sensitive=case_sensitive)[1])
    tables = keys - {sql.META}
    if sql.ANY_TABLE in tables or any("." in k or "`" in k for k in tables):
        return None
    if sql.META in keys and text.split()[0].upper() in ("SHOW", "DESC", "DESCRIBE", "EXPLAIN"):
        if not tables:
            return None
        tables |= {k for k in sql._guess_tables(text, case_sensitive) if "." not in k}
    words = text.upper().split()
    if words[:2] == ["CREATE", "TABLE"] or words[:3] == ["CREATE", "TEMPORARY", "TABLE"]:
        created = text.split()[3 if words[1] == "TEMPORARY" else 2]
        tables.discard(created if case_sensitive else created.lower())
    return tables


def _run_alone(conn: pymysql.Connection, text: str, tables: set[str]) -> tuple[int, str] | None:
    """Run `text` in a new database holding only `tables`, on a connection of its own (its temporary
    tables and variables end with it): None when it ran, else (error code, message)."""
    name = f"sqlcls_judge_{secrets.token_hex(4)}"
    with conn.cursor() as cur:
        cur.execute(f"CREATE DATABASE `{name}`")
        try:
            for table in tables:
                cur.execute(f"CREATE TABLE `{name}`.`{table}` {COLUMNS}")
                cur.execute(f"INSERT INTO `{name}`.`{table}` VALUES (1, 1, 'x', 'nobody', 1)")
            with _connect(database=name) as alone, alone.cursor() as run:
                run.execute("SET SESSION sql_mode = 'STRICT_TRANS_TABLES'")  # what db_query's connections pin
                try:
                    for statement in sql.split_statements(text):
                        run.execute(statement)
                        run.fetchall()
                except pymysql.err.MySQLError as exc:
                    return (exc.args[0], str(exc.args[1])) if len(exc.args) > 1 else (0, str(exc))
            return None
        finally:
            cur.execute(f"DROP DATABASE IF EXISTS `{name}`")


def _lower_case_table_names(server: pymysql.Connection) -> str:
    with server.cursor() as cur:
        cur.execute("SELECT @@lower_case_table_names")
        ((lower,),) = cur.fetchall()
    return str(lower)


_ALL = [text for text, _, _ in ATTACKS + CASE_SENSITIVE + SQL_CORPUS]
_CHUNK = 12  # statements per test: each stays well inside the per-test timeout on a loaded machine
_CHUNKS = [_ALL[i:i + _CHUNK] for i in range(0, len(_ALL), _CHUNK)]


@pytest.mark.parametrize("texts", _CHUNKS, ids=[f"statements {i * _CHUNK + 1}-{i * _CHUNK + len(c)}"
                                                for i, c in enumerate(_CHUNKS)])
def test_the_server_never_reads_a_table_the_classifier_did_not_name(server: pymysql.Connection,
                                                                    texts: list[str]) -> None:
    case_sensitive = _lower_case_table_names(server) == "0"
    missed = []
    for text in texts:
        tables = _judged(text, case_sensitive)
        if tables is None:
            continue
        error = _run_alone(server, text, tables)
        if error is not None and error[0] == NO_SUCH_TABLE:
            missed.append((text, sorted(tables), error[1]))
    assert missed == [], "\n".join(map(str, missed))


# Crafted statements MariaDB refuses whatever the tables (kept to show how they are keyed).
_NOT_MARIADB = {"SELECT * FROM secrets UNION (WITH secrets AS (SELECT 1) SELECT * FROM secrets)",
                "SELECT * FROM dual d"}


@pytest.mark.parametrize("text", [t for t, _, _ in CTE_SCOPES + SHOW_WHERE + KEYWORD_NAMES if t not in _NOT_MARIADB
                                  and _judged(t, True) is not None and _judged(t, False) is not None])
def test_crafted_statements_run_against_exactly_the_tables_they_name(server: pymysql.Connection, text: str) -> None:
    # The check above has teeth: these statements really run with nothing but their named tables.
    tables = _judged(text, _lower_case_table_names(server) == "0")
    if tables is None:
        pytest.skip("keyed * or another schema: nothing for the server to judge here")
    assert _run_alone(server, text, tables) is None


def test_a_cte_hides_the_table_only_where_the_server_says_so(server: pymysql.Connection) -> None:
    # The classifier's one real choice: the same name as a CTE and as a table. Where it says "CTE"
    # the server must not need the table; where it says "table" the server must need it.
    hidden = "WITH secrets AS (SELECT 1 AS a) SELECT * FROM secrets"
    real = "SELECT (WITH secrets AS (SELECT 1) SELECT 1) AS x, s.* FROM secrets s"
    assert sql.classify_sql(hidden)[1] == {sql.META} and sql.classify_sql(real)[1] == {"secrets"}
    assert _run_alone(server, hidden, set()) is None
    error = _run_alone(server, real, set())
    assert error is not None and error[0] == NO_SUCH_TABLE
    assert _run_alone(server, real, {"secrets"}) is None


async def test_the_database_reads_the_servers_case_rule_when_it_connects(server: pymysql.Connection) -> None:
    with server.cursor() as cur:
        cur.execute("SELECT @@lower_case_table_names")
        ((lower,),) = cur.fetchall()
    db = Database(DatabaseSettings(host=SERVER["host"], port=SERVER["port"], user=SERVER["user"],
                                   password=SERVER["password"]))
    assert db.case_sensitive is None  # not connected yet: the gate matches keys both ways
    try:
        assert await db.check() is None
        assert db.case_sensitive is (str(lower) == "0")
    finally:
        await db.close()


async def test_the_mysql_plugin_hands_the_case_rule_to_the_gate(server: pymysql.Connection, tmp_path: Path,
                                                                 fake_openai: Any) -> None:
    with server.cursor() as cur:
        cur.execute("SELECT @@lower_case_table_names")
        ((lower,),) = cur.fetchall()
    env = {"MYSQL_HOST": SERVER["host"], "MYSQL_PORT": str(SERVER["port"]), "MYSQL_USER": SERVER["user"],
           "MYSQL_PASS": SERVER["password"]}
    models = {"fake": openai_model(fake_openai)}
    async with runtime(tmp_path, models, env=env, plugins=("plugin_database_mysql",)) as rt:
        assert gate.case_rule(rt.tools.entry("db_query")) is (str(lower) == "0")


def _outcome(conn: pymysql.Connection, text: str) -> tuple[Any, ...]:
    """What MariaDB does with `text` sent as one query in a new database holding `users`, `t` and
    `secrets` (one row each): its rows or its error code, then every table's rows after it."""
    name = f"sqlcls_read_{secrets.token_hex(4)}"
    with conn.cursor() as cur:
        cur.execute(f"CREATE DATABASE `{name}`")
        try:
            for table in ("users", "t", "secrets"):
                cur.execute(f"CREATE TABLE `{name}`.`{table}` {COLUMNS}")
                cur.execute(f"INSERT INTO `{name}`.`{table}` VALUES (1, 1, '{table}', 'nobody', 1)")
            with _connect(database=name) as alone, alone.cursor() as run:
                run.execute("SET SESSION sql_mode = 'STRICT_TRANS_TABLES'")
                try:
                    run.execute(text)
                    result: Any = run.fetchall()
                except pymysql.err.MySQLError as exc:
                    result = exc.args[0]
            after = []
            for table in ("users", "t", "secrets"):
                cur.execute(f"SELECT * FROM `{name}`.`{table}` ORDER BY id")
                after.append(cur.fetchall())
            return result, tuple(after)
        finally:
            cur.execute(f"DROP DATABASE IF EXISTS `{name}`")


_CRAFTED = [t for t, _, _ in ATTACKS + SQL_CORPUS] + [r.format(role="no_such_role") for r in ROLE_SWITCHES]
_EXECUTABLE = [t for t in _CRAFTED if sql.EXECUTABLE_COMMENT.search(t) and sql.server_readings(t) not in (None, [t])]


@pytest.mark.parametrize("text", _EXECUTABLE, ids=[t[:60] for t in _EXECUTABLE])
def test_the_server_runs_one_of_the_readings_the_classifier_keys(server: pymysql.Connection, text: str) -> None:
    # The classifier keys every reading it makes of an executable comment; MariaDB must do exactly what
    # one of them does (same rows or error, same tables after), so no reading of the server's is missed.
    readings = sql.server_readings(text)
    assert readings
    # A reading of nothing but blanks is a query the server runs as nothing (it refuses a blank one).
    ran = [_outcome(server, reading if reading.strip() else "DO 0") for reading in readings]
    assert _outcome(server, text) in ran


def test_the_readings_check_has_teeth(server: pymysql.Connection) -> None:
    # A reading that drops a comment MariaDB runs is told apart from what MariaDB does.
    text = "SELECT * FROM users /*! , secrets */"
    assert _outcome(server, text) != _outcome(server, "SELECT * FROM users")
    assert _outcome(server, text) == _outcome(server, "SELECT * FROM users   , secrets  ")


# Pieces of text for generated statements: comment openers of every form, and code that closes, quotes,
# hides or continues them.
_OPENERS = ["/*!", "/*M!", "/*!50000", "/*!50700 ", "/*!100000", "/*!100400 ", "/*!999999 ", "/*M!999999 ",
            "/*M!50700", "/*", "/*!40101", "/*M!100000"]
_CODE = [" , secrets", " , t", " WHERE 1", " WHERE a = 1 -", " UNION SELECT * FROM secrets", " AS x", "1", "-", "--",
         "-- x\n", "# x\n", "# */", "-- */", "'*/'", '"*/"', "`x*/`", "'/*'", "\n", " ", "'", "!", "*", "/", "*/",
         " LIMIT 1", "+1", ";"]


def _generated(rng: random.Random, depth: int = 0) -> str:
    if rng.random() < 0.45 or depth > 2:
        return rng.choice(_CODE)
    inner = "".join(_generated(rng, depth + 1) for _ in range(rng.randint(0, 3)))
    return rng.choice(_OPENERS) + inner + ("*/" if rng.random() < 0.9 else "")


def test_generated_comments_are_read_as_mariadb_reads_them(server: pymysql.Connection) -> None:
    # 300 statements built from comment pieces (fixed seed, all reads): whatever MariaDB does with one,
    # one of its readings does too, and a secret it returns is always keyed (or the statement is keyed `*`).
    rng = random.Random(39)
    texts = ["SELECT * FROM users" + "".join(_generated(rng) for _ in range(rng.randint(1, 4))) for _ in range(300)]
    name = f"sqlcls_gen_{secrets.token_hex(4)}"
    with server.cursor() as cur:
        cur.execute(f"CREATE DATABASE `{name}`")
        try:
            for table in ("users", "t", "secrets"):
                cur.execute(f"CREATE TABLE `{name}`.`{table}` {COLUMNS}")
                cur.execute(f"INSERT INTO `{name}`.`{table}` VALUES (1, 1, '{table}', 'nobody', 1)")
            with _connect(database=name) as conn, conn.cursor() as run:
                run.execute("SET SESSION sql_mode = 'STRICT_TRANS_TABLES'")

                def result(text: str) -> Any:
                    try:
                        run.execute(text or "DO 0")  # a reading of nothing: a query that runs nothing
                        return run.fetchall()
                    except pymysql.err.MySQLError as exc:
                        return exc.args[0]

                missed = []
                for text in texts:
                    got, keys, readings = result(text), sql.classify_sql(text)[1], sql.server_readings(text)
                    if "'secrets'" in repr(got) and not {"secrets", "*"} & keys:
                        missed.append((text, "a secret it does not key"))
                    if readings is not None and got not in [result(r.strip()) for r in readings]:
                        missed.append((text, "no reading does what MariaDB does"))
        finally:
            cur.execute(f"DROP DATABASE IF EXISTS `{name}`")
    assert missed == [], "\n".join(map(str, missed))
