"""The database enforces what the gate decided: a runner per call whose role holds its privileges, clean sessions.

Real MariaDB (127.0.0.1:3306, root without password; TEST_MYSQL_* override; skipped with its reason
when absent, tests/needs.py). Each run makes its own database and, with the real `agentctl db-setup`,
the accounts and roles named after it, and drops them. The victim tables hold canary values; the corpus is
tests/sql_attack_corpus.py plus every statement of tests/sql_cases.py, sent through the real
`db_query` pipeline (tool_calls.ToolPipeline: gate, then the plugin) as a client that cannot ask a
person, so only what policy opens runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pymysql
import pytest

import agentctl
import agentctl_db
import database
import db_roles
import gate
import sql as sql_module
import turns
from config import DEFAULTS_DIR
from database import Database, DatabaseSettings, query_text, read_accounts
from tests import needs
from tests.plugin_host import isolate_env, plugin, plugin_runtime
from tests.runtime import SHIPPED_NAMESPACES, ask, execute, with_events
from tests.sql_attack_corpus import ATTACKS, ROLE_SWITCHES, SELF_SERVICE
from tests.sql_cases import SQL_CORPUS
from tests.waiting import until

SERVER = {"host": os.environ.get("TEST_MYSQL_HOST", "127.0.0.1"),
          "port": int(os.environ.get("TEST_MYSQL_PORT", "3306")),
          "user": os.environ.get("TEST_MYSQL_USER", "root"),
          "password": os.environ.get("TEST_MYSQL_PASS", "")}
PLUGIN = "plugin_database_mysql"
SHIPPED = {"db": json.loads((DEFAULTS_DIR / "gate-defaults.json").read_text())["db"], "tools": {}}
USERS_RW = {"db": {**SHIPPED["db"], "users": {"read": True, "write": True, "ddl": False}}, "tools": {}}
VICTIMS = ("secrets", "Users", "outfile", "dumpfile", "dual")
PROXY_CLIENT = "llama-10.0.0.9"  # a client class that cannot ask a person: only policy runs


def _admin(**extra: Any) -> pymysql.Connection:
    return pymysql.connect(**{**SERVER, **extra}, autocommit=True, connect_timeout=5)


@dataclass
class Fixture:
    db: str
    names: db_roles.Names
    canary: str
    tmp: str
    config_dir: Path
    accounts: dict[str, str]
    classic: tuple[str, str]  # an account with ALL on the database: what the README used to recommend
    admin: pymysql.Connection | None = None

    def env(self, *, enforced: bool = True) -> dict[str, str]:
        base = {"MYSQL_HOST": SERVER["host"], "MYSQL_PORT": str(SERVER["port"]), "MYSQL_DB": self.db}
        if enforced:
            return {**base, **{k: v for k, v in self.accounts.items() if k != "MYSQL_DB"}}
        return {**base, "MYSQL_USER": self.classic[0], "MYSQL_PASS": self.classic[1]}

    def query(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        """One statement as the administrator, in this run's database (one connection for the run)."""
        if self.admin is None or not self.admin.open:
            self.admin = _admin()
            with self.admin.cursor() as cur:  # a lock left behind fails the snapshot instead of hanging it
                cur.execute("SET SESSION lock_wait_timeout = 10")
        self.admin.select_db(self.db)
        with self.admin.cursor() as cur:
            cur.execute(sql, args or None)
            return list(cur.fetchall())

    def fill(self) -> None:
        """(Re)create the tables: `users` with plain rows, the victims with canaries, a definer view and function."""
        with _admin() as conn, conn.cursor() as cur:  # a run on an unlimited account may have dropped it all
            cur.execute(f"CREATE DATABASE IF NOT EXISTS `{self.db}`")
        if self.admin is not None:
            self.admin.close()
            self.admin = None
        for name in ("users", *VICTIMS, "orders", "a", "b", "c", "t", "logs", "staging"):
            self.query(f"DROP TABLE IF EXISTS `{name}`")
        self.query("CREATE TABLE users (id INT PRIMARY KEY, name VARCHAR(200))")
        self.query("INSERT INTO users VALUES (1, 'ada'), (2, 'bob')")
        for name in VICTIMS:
            self.query(f"CREATE TABLE `{name}` (id INT PRIMARY KEY, s VARCHAR(200))")
            self.query(f"INSERT INTO `{name}` VALUES (1, %s), (2, %s)", *(f"{self.canary}{name}{n}" for n in (1, 2)))
        for name in ("orders", "a", "b", "c", "t", "logs", "staging"):
            self.query(f"CREATE TABLE `{name}` (id INT, x INT)")
        self.query("CREATE OR REPLACE SQL SECURITY DEFINER VIEW v_secrets AS SELECT * FROM secrets")
        self.query("DROP FUNCTION IF EXISTS leak")
        self.query("CREATE FUNCTION leak() RETURNS TEXT SQL SECURITY DEFINER RETURN (SELECT s FROM secrets LIMIT 1)")
        self.query("DROP PROCEDURE IF EXISTS leak_proc")
        self.query("CREATE PROCEDURE leak_proc() SQL SECURITY DEFINER SELECT * FROM secrets")

    def snapshot(self, *, skip: tuple[str, ...] = ()) -> dict[str, Any]:
        """Everything a statement could change: checksums, object lists, accounts and their grants, files."""
        try:
            return self._snapshot(skip)
        except pymysql.err.OperationalError as exc:
            if exc.args[0] != 1049:
                raise
            return {"database": "dropped"}

    def _snapshot(self, skip: tuple[str, ...]) -> dict[str, Any]:
        snap: dict[str, Any] = {}
        tables = [r[0] for r in self.query("SELECT TABLE_NAME FROM information_schema.TABLES WHERE TABLE_SCHEMA = %s "
                                           "AND TABLE_TYPE = 'BASE TABLE'", self.db)]
        names = ", ".join(f"`{t}`" for t in sorted(tables) if t not in skip)
        snap["checksums"] = self.query(f"CHECKSUM TABLE {names}") if names else []
        # Only what this run owns (other helpers change their own databases and accounts meanwhile).
        for what, sql in {
            "tables": "SELECT TABLE_NAME, TABLE_TYPE FROM information_schema.TABLES WHERE TABLE_SCHEMA = %s",
            "routines": "SELECT ROUTINE_NAME, ROUTINE_DEFINITION FROM information_schema.ROUTINES "
                        "WHERE ROUTINE_SCHEMA = %s",
            "triggers": "SELECT TRIGGER_NAME FROM information_schema.TRIGGERS WHERE TRIGGER_SCHEMA = %s",
            "views": "SELECT TABLE_NAME, VIEW_DEFINITION FROM information_schema.VIEWS WHERE TABLE_SCHEMA = %s",
            "events": "SELECT EVENT_NAME FROM information_schema.EVENTS WHERE EVENT_SCHEMA = %s",
        }.items():
            snap[what] = sorted(map(str, self.query(sql, self.db)))
        snap["schemata"] = self.query("SELECT SCHEMA_NAME FROM information_schema.SCHEMATA WHERE SCHEMA_NAME IN "
                                      "(%s, 'dbenforce_evil')", self.db)
        accounts = self.query("SELECT User, Host FROM mysql.user WHERE is_role = 'N' AND (User = 'root' OR User IN "
                              "('eve', 'evil') OR User LIKE %s OR User LIKE %s)", f"dbenforce\\_%\\_{self.canary[6:]}",
                              self.names.base.replace("_", "\\_") + "\\_%")
        snap["accounts"] = sorted(map(str, accounts))
        grants = {}
        for user, host in accounts:
            lines = [r[0] for r in self.query("SHOW GRANTS FOR %s@%s", user, host)]
            # an account may always set its own default role (to one it holds): a runner's is only its own
            grants[f"{user}@{host}"] = sorted(x for x in lines if not (x.startswith("SET DEFAULT ROLE ")
                                                                       and user.startswith(self.names.base)))
        for k in self.names.slots():  # a role's privileges change with every call; what it holds elsewhere may not
            lines = [r[0] for r in self.query(f"SHOW GRANTS FOR `{self.names.role(k)}`")]
            grants[self.names.role(k)] = sorted(x for x in lines if f" ON `{self.db}`." not in x)
        snap["grants"] = grants
        snap["global"] = self.query("SELECT @@global.sql_mode, @@global.general_log, @@global.read_only")
        snap["files"] = [self.query("SELECT LOAD_FILE(%s)", f"{self.tmp}_{n}")[0][0] for n in (1, 2, 3)]
        return snap

    def leaked(self, text: str) -> bool:
        return self.canary in text


def drop_setup(names: db_roles.Names, *, also: tuple[str, ...] = ()) -> None:
    """Remove a set-up's database, admin schema, accounts and roles (and the accounts `also` names)."""
    with _admin() as conn, conn.cursor() as cur:
        cur.execute(f"DROP DATABASE IF EXISTS `{names.db}`")
        agentctl_db.remove_setup(cur, names)
        for user in also:
            cur.execute("DROP USER IF EXISTS %s@'%%'", (user,))


def reachable() -> None:
    """Skip (or, under AGENT_TEST_REQUIRE=mariadb, fail) when MariaDB does not answer."""
    try:
        _admin().close()
    except pymysql.err.MySQLError as exc:
        needs.absent("mariadb", f"MariaDB is not reachable at {SERVER['host']}:{SERVER['port']} as {SERVER['user']} "
                                f"({exc}): install and start mariadb-server (.ci/run starts it), or set TEST_MYSQL_*")


def setup_args(config_dir: Path, *extra: str) -> list[str]:
    return ["--config-dir", str(config_dir), "db-setup", "--admin-user", SERVER["user"],
            "--admin-password", SERVER["password"], *extra]


def new_config(config_dir: Path, db: str) -> None:
    (config_dir / ".env").write_text(f"MYSQL_DB={db}\nMYSQL_HOST={SERVER['host']}\nMYSQL_PORT={SERVER['port']}\n"
                                     f"AGENT_DATA_DIR={config_dir / 'data'}\n")


@pytest.fixture(scope="module")
def fx(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fixture]:
    reachable()
    suffix = secrets.token_hex(4)
    config_dir = tmp_path_factory.mktemp("dbenforce")
    classic = f"dbenforce_all_{suffix}"
    db = f"dbenforce_{suffix}"
    fx = Fixture(db=db, names=db_roles.names_for(db), canary=f"CANARY{suffix}",
                 tmp=f"/tmp/dbenforce_{suffix}", config_dir=config_dir, accounts={},
                 classic=(classic, secrets.token_hex(12)))
    try:
        new_config(config_dir, db)
        assert agentctl.main(setup_args(config_dir)) == 0
        fx.accounts = read_accounts(config_dir / "data" / database.ACCOUNTS_FILE)
        with _admin() as conn, conn.cursor() as cur:
            cur.execute("CREATE USER %s@'%%' IDENTIFIED BY %s", fx.classic)
            cur.execute(f"GRANT ALL PRIVILEGES ON `{fx.db}`.* TO %s@'%%'", (classic,))
        fx.fill()
        yield fx
    finally:
        if fx.admin is not None:
            fx.admin.close()
        drop_setup(fx.names, also=(classic,))
        with _admin() as conn, conn.cursor() as cur:
            cur.execute("DROP DATABASE IF EXISTS dbenforce_evil")


@pytest.fixture(autouse=True)
def _no_mysql_env(monkeypatch: pytest.MonkeyPatch) -> None:
    isolate_env(monkeypatch)
    for name in ("MYSQL_HOST", "MYSQL_PORT", "MYSQL_DB", *database.ACCOUNT_VARS):
        monkeypatch.delenv(name, raising=False)


def _corpus(fx: Fixture) -> list[str]:
    statements = [s.format(db=fx.db, tmp=fx.tmp) for s in ATTACKS] + [sql for sql, _, _ in SQL_CORPUS]
    return [s for s in statements if s.strip()]


@dataclass
class Tally:
    statements: int = 0
    leaks: int = 0  # results holding a canary of a table outside the approval
    changed: int = 0  # statements after which something outside the approval differed
    ran: int = 0  # statements that ran without an error (the rest the gate or the database refused)
    examples: list[str] | None = None


async def _run_corpus(fx: Fixture, tmp: Path, gates: dict[str, Any], *, enforced: bool, skip: tuple[str, ...] = (),
                      per_statement: bool = False, until_both: bool = False) -> Tally:
    """Every corpus statement through db_query as a proxy client; counts leaks and changes outside `skip`
    (with `until_both`, only until the first of each is seen)."""
    tally = Tally(examples=[])
    fx.fill()
    before = fx.snapshot(skip=skip)
    tmp.mkdir()  # noqa: ASYNC240 - a test's own temporary directory
    async with plugin_runtime(tmp, {PLUGIN: {"timeout": 1}}, fx.env(enforced=enforced), gates=gates) as rt:
        rt.client_namespaces.update(SHIPPED_NAMESPACES)
        assert plugin(rt, PLUGIN).db.mode == (database.ENFORCED if enforced else database.CLASSIFIER_ONLY)
        # What the approval covers works (so the zeros below are not every call failing) ...
        assert "secrets" in await execute(rt, PROXY_CLIENT, "db_query", {"sql": "SHOW TABLES"})
        assert "\nname " in await execute(rt, PROXY_CLIENT, "db_query", {"sql": "DESCRIBE users"})
        users = await execute(rt, PROXY_CLIENT, "db_query", {"sql": "SELECT name FROM users ORDER BY id"})
        if enforced:
            assert ("ada" in users) == ("users" in gates["db"]), users
        for sql in _corpus(fx):
            text = await execute(rt, PROXY_CLIENT, "db_query", {"sql": sql})
            tally.statements += 1
            tally.ran += not text.startswith(("ERROR", "TOOL CALL REJECTED"))
            if fx.leaked(text):
                tally.leaks += 1
                tally.examples.append(sql)
            if per_statement and fx.snapshot(skip=skip) != before:
                tally.changed += 1
                fx.fill()
                before = fx.snapshot(skip=skip)
            if until_both and tally.leaks and tally.changed:
                break
    if not per_statement:
        after = fx.snapshot(skip=skip)
        tally.changed = int(after != before)
        if after != before:
            tally.examples.append(str({k: (before[k], after[k]) for k in before if before[k] != after[k]})[:2000])
    print(f"\n{'enforced' if enforced else 'classifier alone'} {gates['db']}: {tally.statements} statements, "
          f"{tally.ran} ran, {tally.leaks} leaked, {tally.changed} changed")
    return tally


def _no_classifier(read: str) -> Any:
    def classify(sql: Any, *, case_sensitive: bool = False) -> tuple[str, frozenset[str]]:
        return read, frozenset({gate.META})
    return classify


@pytest.mark.timeout(600)
async def test_with_the_classifier_disabled_no_canary_leaves_and_nothing_changes(
        fx: Fixture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every statement is a `__meta__` read for the gate (and for database.py's read-only wrap) ...
    monkeypatch.setattr(sql_module, "classify_sql", _no_classifier(gate.READ))
    tally = await _run_corpus(fx, tmp_path / "meta-read", SHIPPED, enforced=True)
    assert tally.statements >= 300
    assert (tally.leaks, tally.changed) == (0, 0), tally.examples
    # ... and a `__meta__` write (no read-only transaction): the roles alone hold.
    monkeypatch.setattr(sql_module, "classify_sql", _no_classifier(gate.WRITE))
    open_meta = {"db": {**SHIPPED["db"], "__meta__": {"read": True, "write": True}}, "tools": {}}
    tally = await _run_corpus(fx, tmp_path / "meta-write", open_meta, enforced=True)
    assert (tally.leaks, tally.changed) == (0, 0), tally.examples
    # The corpus has teeth: on an account the database does not limit, the same run leaks.
    bare = await _run_corpus(fx, tmp_path / "bare", open_meta, enforced=False, per_statement=True, until_both=True)
    assert bare.leaks > 0 and bare.changed > 0


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("policy", "skip"), [(SHIPPED, ()), (USERS_RW, ("users",))], ids=["shipped", "users-rw"])
async def test_the_real_classifier_under_both_policies(fx: Fixture, tmp_path: Path, policy: dict[str, Any],
                                                       skip: tuple[str, ...]) -> None:
    enforced = await _run_corpus(fx, tmp_path / "enforced", policy, enforced=True, skip=skip)
    assert (enforced.leaks, enforced.changed) == (0, 0), enforced.examples
    alone = await _run_corpus(fx, tmp_path / "alone", policy, enforced=False, skip=skip, per_statement=True)
    print(f"classifier alone let through: {alone.leaks} leaks, {alone.changed} changes: {alone.examples}")
    assert alone.statements == enforced.statements


def test_what_the_database_cannot_limit_is_asked_for() -> None:
    for sql in SELF_SERVICE:
        assert gate.ANY_TABLE in sql_module.classify_sql(sql)[1], sql


# ── Clean state per call ────────────────────────────────────────────────────────────────────

EVERYTHING = turns.DbAccess("approval", frozenset({(gate.ANY_TABLE, gate.WRITE)}))
USERS_ONLY = turns.DbAccess("approval", frozenset({("users", gate.WRITE)}))


async def test_nothing_carries_over_between_calls_on_one_connection(fx: Fixture) -> None:
    fx.fill()
    settings = DatabaseSettings.from_env(fx.env()).model_copy(update={"runners": 1, "timeout": 2})  # one runner
    db = Database(settings)
    try:
        assert await db.enforce() is None
        one = await query_text(db, "SELECT CONNECTION_ID()", EVERYTHING)
        # a user variable, a temporary table shadowing `users`, a prepared statement, session variables
        for sql in ("SET @v = (SELECT s FROM secrets LIMIT 1)", "CREATE TEMPORARY TABLE users AS SELECT * FROM secrets",
                    "PREPARE p FROM 'SELECT * FROM secrets'",
                    "SET SESSION sql_mode = 'NO_BACKSLASH_ESCAPES,ANSI_QUOTES', max_statement_time = 0"):
            assert not (await query_text(db, sql, EVERYTHING)).startswith("ERROR"), sql
        assert fx.canary in await query_text(db, "SET @w = (SELECT s FROM secrets LIMIT 1); SELECT @w", EVERYTHING)
        two = await query_text(db, "SELECT CONNECTION_ID()", USERS_ONLY)
        assert one == two  # the same server session: a reset, not a new connection, cleared it
        assert "NULL" in await query_text(db, "SELECT @v", USERS_ONLY)
        rows = await query_text(db, "SELECT * FROM users", USERS_ONLY)
        assert "ada" in rows and not fx.leaked(rows)
        assert "Unknown prepared statement" in await query_text(db, "EXECUTE p", USERS_ONLY)
        mode = await query_text(db, "SELECT @@session.sql_mode, @@max_statement_time, CURRENT_ROLE()", USERS_ONLY)
        assert database.PINNED_SQL_MODE in mode and "NO_BACKSLASH" not in mode and "| 2" in mode
        # the pin holds against the quoting trick: the server splits the string as the classifier does
        trick = await query_text(db, "SELECT * FROM users WHERE name = 'x\\' UNION SELECT id, s FROM secrets -- '",
                                 USERS_ONLY)
        assert not fx.leaked(trick)
        # the role of the earlier call is gone: with no decision, nothing
        assert "denied" in await query_text(db, f"SELECT * FROM {fx.db}.users", None)
        assert "denied" in await query_text(db, "SELECT * FROM secrets", USERS_ONLY)
        # a runner holds its own role only: another runner's (however wide it is now) cannot be switched to
        other = fx.names.role(2)
        switched = await query_text(db, f"SET ROLE `{other}`; SELECT * FROM secrets", USERS_ONLY)
        assert "Invalid role specification" in switched and not fx.leaked(switched)
        # a table lock or an open HANDLER ends with its call, not when the pooled connection is next used
        for sql in ("LOCK TABLES secrets WRITE", "HANDLER users OPEN"):
            assert not (await query_text(db, sql, EVERYTHING)).startswith("ERROR")
        with _admin() as conn, conn.cursor() as cur:
            cur.execute("SET SESSION lock_wait_timeout = 5")
            cur.execute(f"CHECKSUM TABLE `{fx.db}`.secrets, `{fx.db}`.users")  # not waiting on a lock
            cur.execute(f"ALTER TABLE `{fx.db}`.users COMMENT 'no HANDLER holds it open'")
    finally:
        await db.close()


async def test_user_variables_and_temporary_tables_do_not_cross_sessions_or_clients(
        fx: Fixture, tmp_path: Path) -> None:
    fx.fill()
    every = {"db": {"*": {"read": True, "write": True}, "__meta__": {"read": True, "write": True}}, "tools": {}}
    one_runner = {**fx.env(), "MYSQL_RUNNERS": "1"}  # every call on the same account and connection
    async with plugin_runtime(tmp_path, {PLUGIN: {"timeout": 2}}, one_runner, gates=every) as rt:
        rt.client_namespaces.update(SHIPPED_NAMESPACES)
        for sql in ("SET @v = (SELECT s FROM secrets LIMIT 1)",
                    "CREATE TEMPORARY TABLE users AS SELECT * FROM secrets"):
            assert not (await execute(rt, "api-one", "db_query", {"sql": sql})).startswith("ERROR")
        for client in ("api-two", "mcp-three", PROXY_CLIENT):
            assert not fx.leaked(await execute(rt, client, "db_query", {"sql": "SELECT @v"}))
            assert not fx.leaked(await execute(rt, client, "db_query", {"sql": "SELECT * FROM users"}))


async def test_show_processlist_shows_no_other_accounts_statement(fx: Fixture) -> None:
    fx.fill()
    db = Database(DatabaseSettings.from_env(fx.env()))
    with _admin() as holder, holder.cursor() as lock, _admin() as waiter:
        lock.execute("SELECT GET_LOCK(%s, 0)", (fx.names.base,))
        # A statement in flight on another account (sent, its answer read later), its text holding a canary.
        waiter._execute_command(pymysql.constants.COMMAND.COM_QUERY,
                                f"SELECT '{fx.canary}', GET_LOCK('{fx.names.base}', 30)")
        try:
            assert await db.enforce() is None
            meta = turns.DbAccess("policy", allows=lambda key, op: key == gate.META)
            for sql in ("SHOW FULL PROCESSLIST", "SELECT * FROM information_schema.processlist"):
                text = await query_text(db, sql, meta)
                assert not text.startswith("ERROR") and not fx.leaked(text), text
        finally:
            lock.execute("SELECT RELEASE_LOCK(%s)", (fx.names.base,))
            waiter._read_query_result()
            await db.close()


# ── Privilege sets ──────────────────────────────────────────────────────────────────────────


def test_privilege_sets_name_what_was_approved() -> None:
    grants = db_roles.privileges_for([("users", "write"), ("orders", "read"), ("mysql.user", "read")], db="app",
                                     tables=["users", "orders", "secrets"], case_sensitive=True)
    assert grants == {db_roles.TableGrant("app", "users", ("DELETE", "INSERT", "SELECT", "UPDATE")),
                      db_roles.TableGrant("app", "orders", ("SELECT",))}
    ddl = db_roles.privileges_for([("t", "ddl"), (gate.META, "read")], db="app", tables=["t", "secrets"],
                                  case_sensitive=True)
    assert ddl == {db_roles.TableGrant("app", "t", ("ALTER", "CREATE", "DELETE", "DROP", "INDEX", "INSERT", "SELECT",
                                                    "UPDATE"))}  # no REFERENCES beside CREATE: no FK oracle
    meta = db_roles.privileges_for([(gate.META, "read")], db="app", tables=["secrets"], case_sensitive=True)
    assert meta == {db_roles.TableGrant("app", "", ("REFERENCES",)), db_roles.TableGrant("app", "secrets",
                                                                                      ("REFERENCES",))}
    assert db_roles.privileges_for([("*", "write")], db="app", tables=[], case_sensitive=True) == {
        db_roles.TableGrant("app", "", tuple(sorted(db_roles.ANY_TABLE_WRITE)))}  # no stored objects, no EXECUTE
    assert db_roles.privileges_for([("other.t", "read"), ("mysql.user", "read")], db="app", tables=[],
                                   case_sensitive=True) == frozenset()  # nothing outside the agent database
    allows = {("users", "write"), ("users", "read"), (gate.META, "read")}
    pairs = db_roles.standing_pairs(lambda k, o: (k, o) in allows, ["users", "Users", "secrets"],
                                    operations=("read", "write"), case_sensitive=True)
    assert pairs == [("users", "write"), (gate.META, "read")]


# ── db-setup and the start-up line ──────────────────────────────────────────────────────────


def test_db_setup_makes_verifies_and_repairs_the_accounts(fx: Fixture, capsys: pytest.CaptureFixture[str]) -> None:
    path = fx.config_dir / "data" / database.ACCOUNTS_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    runner = fx.names.runner(1)
    with _admin() as conn, conn.cursor() as cur:
        cur.execute("SHOW GRANTS FOR %s@'%%'", (runner,))
        lines = sorted(db_roles.without_password(r[0]) for r in cur.fetchall())
        assert lines == sorted([f"GRANT `{fx.names.role(1)}` TO `{runner}`@`%`",
                                f"GRANT USAGE ON *.* TO `{runner}`@`%`"])
        # someone gives the runner more: the server would refuse to rely on it, db-setup repairs it
        cur.execute("GRANT FILE, PROCESS ON *.* TO %s@'%%'", (runner,))
        cur.execute(f"GRANT SELECT ON `{fx.db}`.* TO %s@'%%'", (runner,))
    problem, _ = agentctl_db.verify(fx.accounts, SERVER["host"], SERVER["port"])
    assert problem is not None and "cannot be limited" in problem
    capsys.readouterr()
    assert agentctl.main(["--config-dir", str(fx.config_dir), "db-status"]) == 3
    assert "classifier only" in capsys.readouterr().err
    assert agentctl.main(setup_args(fx.config_dir)) == 0
    out = capsys.readouterr().out
    assert "verified" in out and "repaired" in out and fx.accounts["MYSQL_PASS"] not in out
    assert read_accounts(path) == fx.accounts  # the same passwords: running it again keeps them
    assert agentctl_db.verify(fx.accounts, SERVER["host"], SERVER["port"])[0] is None
    assert agentctl.main(["--config-dir", str(fx.config_dir), "db-status"]) == 0
    assert "enforced" in capsys.readouterr().out


async def test_start_up_says_in_one_line_why_an_account_cannot_be_limited(
        fx: Fixture, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "classic").mkdir()
    (tmp_path / "runner").mkdir()
    with caplog.at_level(logging.INFO, logger="agent_mcp"):
        async with plugin_runtime(tmp_path / "classic", {PLUGIN: {}}, fx.env(enforced=False)) as rt:
            mysql = plugin(rt, PLUGIN)
            assert mysql.db.mode == database.CLASSIFIER_ONLY
            status = await mysql.cmd_db(ask(rt, "admin", "", {"interactive": True}).turn(), "")
            assert "classifier only" in status and "agentctl db-setup" in status
            sql = "SELECT COUNT(*) FROM information_schema.tables"
            text = await execute(rt, PROXY_CLIENT, "db_query", {"sql": sql})
            assert not text.startswith("ERROR")  # db_query still works, on the classifier alone
    lines = [r.getMessage() for r in caplog.records if "classifier only" in r.getMessage()]
    assert len(lines) == 1 and "agentctl db-setup" in lines[0] and "cannot be limited" in lines[0]
    assert "ALL PRIVILEGES" in lines[0] and fx.classic[1] not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="agent_mcp"):
        async with plugin_runtime(tmp_path / "runner", {PLUGIN: {}}, fx.env()) as rt:
            assert plugin(rt, PLUGIN).db.mode == database.ENFORCED
    assert any("enforced by the database" in r.getMessage() for r in caplog.records)
    assert fx.accounts["MYSQL_PASS"] not in caplog.text and fx.accounts["MYSQL_GRANTOR_PASS"] not in caplog.text


# ── What a person approved, and what a grant covers ─────────────────────────────────────────


def _misreads_secrets_as_users(real: Any) -> Any:
    """A classifier that takes any statement on `secrets` for a read of `users` (a misreading to survive)."""
    def classify(sql: Any, *, case_sensitive: bool = False) -> tuple[str, frozenset[str]]:
        return (gate.READ, frozenset({"users"})) if "secrets" in str(sql) else real(sql, case_sensitive=case_sensitive)
    return classify


@pytest.mark.parametrize("answer", ["allow", "allow_session"])
async def test_an_approval_or_a_grant_covers_exactly_what_was_shown(
        fx: Fixture, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, answer: str) -> None:
    fx.fill()
    monkeypatch.setattr(sql_module, "classify_sql", _misreads_secrets_as_users(sql_module.classify_sql))
    closed = {"db": {"*": {"read": False, "write": False}}, "tools": {}}
    async with plugin_runtime(tmp_path, {PLUGIN: {"timeout": 2}}, fx.env(), gates=closed) as rt:
        rt.client_namespaces.update(SHIPPED_NAMESPACES)
        await rt.sessions.get_or_create("dba", rt.config.default_model)

        async def ask(sql: str) -> str:
            work = execute(rt, "dba", "db_query", {"sql": sql})
            return (await with_events(rt, "dba", work, answer=answer))[0]

        # the person sees "read on users" and says yes: users is readable, secrets is not
        assert "ada" in await ask("SELECT name FROM users ORDER BY id")
        text = await ask("SELECT s FROM secrets")
        assert "denied" in text and not fx.leaked(text)
        assert "denied" in await ask("UPDATE users u JOIN secrets s ON u.id = s.id SET u.name = s.s")
        assert "denied" in await ask("DELETE FROM secrets")  # a read approval writes nothing
    assert fx.query("SELECT name FROM users WHERE id = 1") == [("ada",)]
    assert fx.query("SELECT COUNT(*) FROM secrets") == [(2,)]


# ── No privilege of another call, by construction ───────────────────────────────────────────

ADMIN_ALL = turns.DbAccess(turns.ADMIN)
META_ONLY = turns.DbAccess("policy", allows=lambda key, op: key == gate.META)


def _switches(fx: Fixture) -> list[str]:
    """Statements that switch role inside one statement, in every form MariaDB runs, for every runner's role."""
    out = []
    for k in fx.names.slots():
        role = fx.names.role(k)
        for body in (f"SET ROLE `{role}`; SELECT s FROM secrets LIMIT 1;",
                     f"SET ROLE `{role}`; UPDATE users SET name = (SELECT s FROM secrets LIMIT 1);",
                     f"EXECUTE IMMEDIATE 'SET ROLE `{role}`'; SELECT s FROM secrets LIMIT 1;",
                     f"SET DEFAULT ROLE `{role}`; SET ROLE DEFAULT; DELETE FROM secrets;",
                     f"PREPARE p FROM 'SET ROLE `{role}`'; EXECUTE p; INSERT INTO secrets VALUES (9, 'x');"):
            out += [f"/*!BEGIN NOT ATOMIC {body} END */", f"/*M!100000 BEGIN NOT ATOMIC {body} END */",
                    f"/*!50000 BEGIN NOT ATOMIC {body} END */", f"BEGIN NOT ATOMIC {body} END"]
        out += [f"SET ROLE `{role}`", f"SET DEFAULT ROLE `{role}`", f"EXECUTE IMMEDIATE 'SET ROLE `{role}`'"]
        out += [sql.format(role=f"`{role}`") for sql in ROLE_SWITCHES]
    out += ["SELECT * FROM v_secrets", "SELECT leak()", "CALL leak_proc()", "SET ROLE NONE",
            "SELECT s FROM secrets", "BEGIN NOT ATOMIC DECLARE x TEXT; SELECT s INTO x FROM secrets LIMIT 1; "
            "SELECT x; END"]
    return out


@pytest.mark.parametrize("read", [gate.READ, gate.WRITE], ids=["meta-read", "meta-write"])
async def test_no_role_switch_reaches_a_wide_role_live_at_the_same_moment(
        fx: Fixture, monkeypatch: pytest.MonkeyPatch, read: str) -> None:
    fx.fill()
    before = fx.snapshot()
    monkeypatch.setattr(sql_module, "classify_sql", _no_classifier(read))
    db = Database(DatabaseSettings.from_env(fx.env()).model_copy(update={"timeout": 5}))
    try:
        assert await db.enforce() is None
        # Another session's call with ALL on the database is running meanwhile, on a runner of its own.
        wide = asyncio.create_task(query_text(db, "SELECT SLEEP(30)", ADMIN_ALL))
        await until(lambda: any(s.busy for s in db.runners._slots.values()), what="the wide call to start")
        ran = 0
        for sql in _switches(fx):
            text = await query_text(db, sql, META_ONLY)
            assert not fx.leaked(text), (sql, text)
            ran += not text.startswith("ERROR")
        assert not wide.done()  # it was live for every statement above
        wide.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await wide
    finally:
        await db.close()
    assert fx.snapshot() == before
    print(f"\n{len(_switches(fx))} role switches with a wide role live: {ran} ran, 0 leaked, nothing changed")


async def test_db_setup_again_with_roles_in_use_keeps_db_query_working(
        fx: Fixture, capsys: pytest.CaptureFixture[str]) -> None:
    fx.fill()
    sets = [USERS_ONLY, EVERYTHING, META_ONLY, turns.DbAccess("approval", frozenset({("secrets", gate.READ)}))]
    db = Database(DatabaseSettings.from_env(fx.env()))
    try:
        assert await db.enforce() is None
        first = [await query_text(db, "SELECT * FROM users", access) for access in sets]
        running = asyncio.create_task(query_text(db, "SELECT SLEEP(1), name FROM users WHERE id = 1", USERS_ONLY))
        await until(lambda: any(s.busy for s in db.runners._slots.values()), what="a call to start")
        assert await asyncio.to_thread(agentctl.main, setup_args(fx.config_dir)) == 0
        assert "ada" in await running
        again = [await query_text(db, "SELECT * FROM users", access) for access in sets]
        assert again == first and "ada" in again[0] and "denied" in again[3]
        assert fx.canary in await query_text(db, "SELECT s FROM secrets", sets[3])
    finally:
        await db.close()
    roles = fx.query("SELECT User FROM mysql.user WHERE is_role = 'Y' AND User LIKE %s",
                     fx.names.base.replace("_", "\\_") + "\\_%")
    assert sorted(r[0] for r in roles) == sorted(fx.names.role(k) for k in fx.names.slots())  # none orphaned


async def test_two_instances_share_the_runners_and_outlive_each_others_restart(fx: Fixture) -> None:
    fx.fill()
    settings = DatabaseSettings.from_env(fx.env())
    a, b = Database(settings), Database(settings)
    try:
        assert await a.enforce() is None and await b.enforce() is None
        # Both at once, more calls than runners: never two on one runner, every call right.
        calls = [query_text(db, "SELECT SLEEP(0.2), name FROM users WHERE id = 1", USERS_ONLY)
                 for db in (a, b) for _ in range(3)]
        assert all("ada" in text for text in await asyncio.gather(*calls))
        assert not set(a.runners._slots) & set(b.runners._slots)
        for _ in range(2):  # A restarts while B keeps working; B's calls never fail
            await a.close()
            assert "ada" in await query_text(b, "SELECT name FROM users WHERE id = 1", USERS_ONLY)
            a = Database(settings)
            assert await a.enforce() is None
            assert "ada" in await query_text(a, "SELECT name FROM users WHERE id = 1", USERS_ONLY)
            assert "denied" in await query_text(b, "SELECT s FROM secrets", USERS_ONLY)
            a, b = b, a
    finally:
        await a.close()
        await b.close()


async def test_calls_reconnect_after_the_database_kills_every_account(fx: Fixture) -> None:
    fx.fill()
    db = Database(DatabaseSettings.from_env(fx.env()).model_copy(update={"timeout": 2}))
    try:
        assert await db.enforce() is None
        assert "ada" in await query_text(db, "SELECT name FROM users", USERS_ONLY)
        for account in [fx.names.grantor, *(fx.names.runner(k) for k in fx.names.slots())]:
            fx.query(f"KILL CONNECTION USER `{account}`")
            assert "ada" in await query_text(db, "SELECT name FROM users", USERS_ONLY), account
            assert "denied" in await query_text(db, "SELECT s FROM secrets", USERS_ONLY)
        # A call cut in the middle reports it and leaves no role behind.
        cut = asyncio.create_task(query_text(db, "SELECT SLEEP(20)", EVERYTHING))
        await until(lambda: any(s.busy for s in db.runners._slots.values()), what="the call to start")
        await until(lambda: bool(fx.query("SELECT ID FROM information_schema.PROCESSLIST WHERE INFO LIKE "
                                          "'SELECT SLEEP(20)%%'")), what="the statement on the server")
        for (thread,) in fx.query("SELECT ID FROM information_schema.PROCESSLIST WHERE INFO LIKE 'SELECT SLEEP(20)%%'"):
            fx.query(f"KILL {thread}")
        assert (await cut).startswith("ERROR")
        assert "denied" in await query_text(db, "SELECT s FROM secrets", USERS_ONLY)
    finally:
        await db.close()
    roles = fx.query("SELECT User FROM mysql.user WHERE is_role = 'Y' AND User LIKE %s",
                     fx.names.base.replace("_", "\\_") + "\\_%")
    assert len(roles) == fx.names.runners


def test_db_status_only_reads(fx: Fixture, capsys: pytest.CaptureFixture[str]) -> None:
    before = fx.snapshot()
    for _ in range(2):
        assert agentctl.main(["--config-dir", str(fx.config_dir), "db-status"]) == 0
    assert "4 runner account(s)" in capsys.readouterr().out
    assert fx.snapshot() == before
