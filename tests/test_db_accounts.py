"""db-setup as an operator meets it: the README's recipe end to end, a shared server, the stored grantor's power.

Real MariaDB (tests/test_db_enforcement.py's SERVER; skipped with its reason when absent). Every
database and set-up has a random name; bystanders are an account of nobody's and another agent's
set-up, checked by their grants and password hashes.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pymysql
import pytest

import agentctl
import db_roles
from database import ACCOUNTS_FILE, read_accounts
from tests.conftest import ROOT, AgentServer, ConfigDir, free_port, openai_model
from tests.test_db_enforcement import SERVER, _admin, drop_setup, new_config, reachable, setup_args
from tests.test_readme_recipes import recipes
from tests.waiting import until_sync


@pytest.fixture
def db_name() -> Iterator[str]:
    reachable()
    name = f"dbacct_{secrets.token_hex(4)}"
    yield name
    drop_setup(db_roles.names_for(name))
    drop_setup(db_roles.names_for(name, "second"))


def _state(accounts: list[tuple[str, str]]) -> dict[str, Any]:
    """Grants and password hashes of accounts (user, host) and roles (user, "")."""
    out: dict[str, Any] = {}
    with _admin() as conn, conn.cursor() as cur:
        for user, host in accounts:
            cur.execute("SELECT authentication_string FROM mysql.user WHERE User = %s AND Host = %s", (user, host))
            hashes = cur.fetchall()
            cur.execute("SHOW GRANTS FOR %s@%s" if host else "SHOW GRANTS FOR %s", (user, host) if host else (user,))
            out[f"{user}@{host}"] = (hashes, sorted(r[0] for r in cur.fetchall()))
    return out


def _setup_accounts(names: db_roles.Names) -> list[tuple[str, str]]:
    return [*((a, "%") for a in names.accounts()), *((names.role(k), "") for k in names.slots())]


# ── The README's recipe ─────────────────────────────────────────────────────────────────────


def _recipe(name: str, where: Path, replace: dict[str, str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    _kind, body = recipes()[name]
    for old, new in replace.items():
        body = body.replace(old, new)
    body = body.replace(".venv/bin/python agentctl.py", f"{sys.executable} {ROOT / 'agentctl.py'} --config-dir .")
    return subprocess.run(["bash", "-euo", "pipefail", "-c", body], cwd=where, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT), **env})


def test_the_readme_mysql_recipe_then_a_restart_is_enforced(db_name: str, tmp_path: Path) -> None:
    from tests.fakes.openai_backend import FakeOpenAI

    admin = "--admin-user root" + (f" --admin-password '{SERVER['password']}'" if SERVER["password"] else "")
    with FakeOpenAI() as backend:
        cfg = ConfigDir(tmp_path)
        cfg.models = {"fake": openai_model(backend)}
        api = free_port()
        cfg.plugins.append("plugin_client_api")
        cfg.plugin_config["plugin_client_api"] = {"port": api}
        cfg.env = {"MYSQL_HOST": SERVER["host"], "MYSQL_PORT": str(SERVER["port"])}
        cfg.write()
        done = _recipe("mysql", tmp_path, {"MYSQL_DB=shop": f"MYSQL_DB={db_name}", "--admin-user root": admin}, {})
        assert done.returncode == 0, done.stdout + done.stderr
        assert "✓ verified" in done.stdout and "db_query: enforced by the database" in done.stdout
        assert "plugin_database_mysql" in done.stdout + done.stderr
        key = secrets.token_urlsafe(16)
        server = AgentServer(cfg, {"API_ADMIN_KEY": key}).start()
        try:
            until_sync(lambda: "enforced by the database" in "".join(server._lines), what="the start-up line")
            assert "[invalid]" not in "".join(server._lines)
            shown = _recipe("mysql-db", tmp_path, {"127.0.0.1:8767": f"127.0.0.1:{api}"}, {"API_ADMIN_KEY": key})
            assert shown.returncode == 0 and '"one' in shown.stdout and "1" in shown.stdout, shown.stdout
            status = httpx.post(f"http://127.0.0.1:{api}/api/v1/submit", json={"text": "!db", "client_id": "dba",
                                                                                "wait": True},
                                headers={**server.api_auth, "X-Admin-Key": key}, timeout=30).json()
            assert "enforced by the database" in str(status)
        finally:
            log = server.stop()
    status = subprocess.run([sys.executable, str(ROOT / "agentctl.py"), "--config-dir", str(tmp_path), "db-status"],
                            capture_output=True, text=True, timeout=60)
    assert status.returncode == 0 and "enforced by the database" in status.stdout
    accounts = read_accounts(tmp_path / "data" / ACCOUNTS_FILE)
    assert accounts["MYSQL_PASS"] not in log and accounts["MYSQL_GRANTOR_PASS"] not in log


# ── A shared server ─────────────────────────────────────────────────────────────────────────


def test_db_setup_twice_leaves_a_bystander_and_another_agents_setup_untouched(
        db_name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bystander = (f"dbacct_by_{secrets.token_hex(3)}", "%")
    other_db = f"{db_name}_other"
    other = db_roles.names_for(other_db)
    try:
        with _admin() as conn, conn.cursor() as cur:
            cur.execute("CREATE USER %s@%s IDENTIFIED BY 'bystander-pw'", bystander)
            cur.execute(f"GRANT SELECT ON `{other_db}`.* TO %s@%s", bystander)
        (tmp_path / "other").mkdir()
        new_config(tmp_path / "other", other_db)
        assert agentctl.main(setup_args(tmp_path / "other")) == 0
        watched = [bystander, *_setup_accounts(other)]
        before = _state(watched)
        (tmp_path / "mine").mkdir()
        new_config(tmp_path / "mine", db_name)
        for _ in range(2):
            assert agentctl.main(setup_args(tmp_path / "mine")) == 0
        assert _state(watched) == before
        mine = db_roles.names_for(db_name)
        assert not {a for a in other.accounts()} & set(mine.accounts())

        # Another config dir, same database, no accounts file: it proves nothing, so it changes nothing.
        mine_before = _state(_setup_accounts(mine))
        (tmp_path / "stranger").mkdir()
        new_config(tmp_path / "stranger", db_name)
        capsys.readouterr()
        assert agentctl.main(setup_args(tmp_path / "stranger")) == 1
        err = capsys.readouterr().err
        assert "nothing was changed" in err and mine.runner(1) in err and "--instance" in err
        assert not (tmp_path / "stranger" / "data" / ACCOUNTS_FILE).exists()
        assert _state(_setup_accounts(mine)) == mine_before
        # ... with an instance name of its own it gets accounts of its own on the same database
        assert agentctl.main(setup_args(tmp_path / "stranger", "--instance", "second")) == 0
        assert read_accounts(tmp_path / "stranger" / "data" / ACCOUNTS_FILE)["MYSQL_GRANTOR_USER"] == \
            db_roles.names_for(db_name, "second").grantor
        assert _state(_setup_accounts(mine)) == mine_before and _state(watched) == before

        # --print-sql is for a DBA: it writes nothing here
        (tmp_path / "dba").mkdir()
        new_config(tmp_path / "dba", f"{db_name}_dba")
        capsys.readouterr()
        assert agentctl.main(["--config-dir", str(tmp_path / "dba"), "db-setup", "--print-sql"]) == 0
        printed = capsys.readouterr().out
        assert "CREATE USER IF NOT EXISTS" in printed and "Nothing was written" in printed
        assert not (tmp_path / "dba" / "data").exists()
    finally:
        with _admin() as conn, conn.cursor() as cur:
            cur.execute("DROP USER IF EXISTS %s@%s", bystander)
        drop_setup(other)


def test_the_stored_grantor_has_no_power_over_any_account(db_name: str, tmp_path: Path) -> None:
    bystander = (f"dbacct_by_{secrets.token_hex(3)}", "%")
    role = f"dbacct_role_{secrets.token_hex(3)}"
    new_config(tmp_path, db_name)
    assert agentctl.main(setup_args(tmp_path)) == 0
    names = db_roles.names_for(db_name)
    accounts = read_accounts(tmp_path / "data" / ACCOUNTS_FILE)
    adm = f"`{names.admin_schema}`"
    try:
        with _admin() as conn, conn.cursor() as cur:
            cur.execute("CREATE USER %s@%s IDENTIFIED BY 'bystander-pw'", bystander)
            cur.execute(f"CREATE ROLE `{role}`")
            cur.execute(f"CREATE TABLE `{db_name}`.t (a INT)")
        watched = [bystander, (role, ""), *_setup_accounts(names)]
        before = _state(watched)
        b, r, own = f"'{bystander[0]}'@'%'", f"`{role}`", f"`{names.role(1)}`"
        attempts = [
            "CREATE USER 'dbacct_new'@'%'", f"CREATE ROLE `{names.base}_x`", f"DROP USER {b}", f"DROP ROLE {r}",
            f"DROP ROLE {own}", f"RENAME USER {b} TO 'dbacct_renamed'@'%'", f"ALTER USER {b} IDENTIFIED BY 'x'",
            f"ALTER USER {b} ACCOUNT LOCK", f"SET PASSWORD FOR {b} = PASSWORD('x')",
            f"REVOKE ALL PRIVILEGES, GRANT OPTION FROM {b}", f"GRANT {r} TO {b}", f"GRANT {own} TO {b}",
            f"GRANT {own} TO `{names.grantor}`@'%'", f"SET DEFAULT ROLE {r} FOR {b}",
            f"GRANT SELECT ON `{db_name}`.* TO {b}", f"GRANT SELECT ON `{db_name}`.* TO {r}",
            f"GRANT SELECT ON `{db_name}`.* TO {own}", f"GRANT ALL ON *.* TO {b}",
            f"GRANT SELECT ON mysql.user TO {own}", f"ALTER USER `{names.runner(1)}`@'%' IDENTIFIED BY 'x'",
            f"ALTER USER `{names.definer}`@'%' ACCOUNT UNLOCK", f"SELECT * FROM `{db_name}`.t",
            f"SELECT * FROM {adm}.`owner`", f"DROP PROCEDURE {adm}.`refill`",
            f"CREATE PROCEDURE {adm}.p() SELECT 1", "SELECT * FROM mysql.user",
            f"CALL {adm}.`refill`(0, '[]')", f"CALL {adm}.`refill`({names.runners + 1}, '[]')",
            f"CALL {adm}.`refill`(1, '[[\"SELECT ON *.* TO x --\", \"\"]]')",
            f"CALL {adm}.`refill`(1, '[[\"SELECT\", \"t` ON `mysql`.`user\"]]')",
        ]
        with pymysql.connect(host=SERVER["host"], port=SERVER["port"], user=accounts["MYSQL_GRANTOR_USER"],
                             password=accounts["MYSQL_GRANTOR_PASS"], autocommit=True) as grantor, \
                grantor.cursor() as cur:
            allowed = []
            for sql in attempts:
                try:
                    cur.execute(sql)
                    while cur.nextset():
                        pass
                    allowed.append(sql)
                except pymysql.err.MySQLError:
                    pass
        # the last one names a table that does not exist: the procedure quotes it and grants nothing
        assert allowed == [attempts[-1]], allowed
        assert _state(watched) == before
    finally:
        with _admin() as conn, conn.cursor() as cur:
            cur.execute("DROP USER IF EXISTS %s@%s", bystander)
            cur.execute(f"DROP ROLE IF EXISTS `{role}`")
            cur.execute("DROP USER IF EXISTS 'dbacct_new'@'%'")


# ── Without MariaDB ─────────────────────────────────────────────────────────────────────────


@pytest.mark.timeout(300)
@pytest.mark.parametrize("require", ["", "mariadb"])
def test_without_mariadb_the_database_tests_skip_with_their_reason(require: str) -> None:
    files = ["tests/test_db_enforcement.py", "tests/test_db_accounts.py", "tests/test_database_mysql.py",
             "tests/test_sql_mariadb.py", "tests/test_slack_approvals.py"]  # every file that uses the MariaDB server
    env = {**os.environ, "TEST_MYSQL_PORT": str(free_port()), "AGENT_TEST_REQUIRE": require}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *files,
                           "-k", "not without_mariadb"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=280)
    tail, summary = done.stdout[-3000:], done.stdout.strip().splitlines()[-1]
    skipped = [line for line in done.stdout.splitlines() if line.startswith("SKIPPED")]
    if require:  # CI: a missing MariaDB is a failure of every such test, never a skip
        assert done.returncode == 1 and "AGENT_TEST_REQUIRE names mariadb" in done.stdout, tail
        assert not [line for line in skipped if "MariaDB" in line], skipped
    else:  # a newcomer's machine: every database test skips and says why, none errors
        assert done.returncode == 0 and "error" not in summary and "failed" not in summary, tail
        assert skipped and all("MariaDB is not reachable" in line for line in skipped), skipped
    uses = {p.name for p in (ROOT / "tests").glob("test_*.py") if "TEST_MYSQL_PORT" in p.read_text()}
    assert uses == {Path(f).name for f in files}, "a new MariaDB test file belongs in this list"


# ── Two server processes on one database ────────────────────────────────────────────────────


def _db_server(where: Path, db: str, backend: Any, key: str) -> tuple[AgentServer, int]:
    cfg = ConfigDir(where)
    cfg.models = {"fake": openai_model(backend)}
    api = free_port()
    cfg.plugins += ["plugin_client_api", "plugin_database_mysql"]
    cfg.plugin_config["plugin_client_api"] = {"port": api}
    cfg.env = {"MYSQL_HOST": SERVER["host"], "MYSQL_PORT": str(SERVER["port"]), "MYSQL_DB": db}
    cfg.write()
    return AgentServer(cfg, {"API_ADMIN_KEY": key}), api


def _admin_db(server: AgentServer, api: int, key: str, sql: str) -> str:
    reply = httpx.post(f"http://127.0.0.1:{api}/api/v1/submit", timeout=30,
                       json={"text": f"!db {sql}", "client_id": "dba", "wait": True},
                       headers={**server.api_auth, "X-Admin-Key": key})
    return str(reply.json())


@pytest.mark.timeout(180)
def test_two_server_processes_share_a_database_and_outlive_each_others_restart(db_name: str, tmp_path: Path) -> None:
    from tests.fakes.openai_backend import FakeOpenAI

    key = secrets.token_urlsafe(16)
    with FakeOpenAI() as backend:
        (tmp_path / "a").mkdir()
        (tmp_path / "b" / "data").mkdir(parents=True)
        a, api_a = _db_server(tmp_path / "a", db_name, backend, key)
        b, api_b = _db_server(tmp_path / "b", db_name, backend, key)
        assert agentctl.main(setup_args(tmp_path / "a")) == 0
        shared = tmp_path / "b" / "data" / ACCOUNTS_FILE  # the second instance shares the first one's accounts
        shared.write_bytes((tmp_path / "a" / "data" / ACCOUNTS_FILE).read_bytes())
        shared.chmod(0o600)
        with _admin() as conn, conn.cursor() as cur:
            cur.execute(f"CREATE TABLE `{db_name}`.hits (who VARCHAR(8))")
        a.start()
        b.start()
        try:
            for name, server in (("a", a), ("b", b)):
                until_sync(lambda s=server: "enforced by the database" in "".join(s._lines), what=f"{name} enforced")
            for _ in range(2):
                for (name, server, api), (other, o_server, o_api) in ((("a", a, api_a), ("b", b, api_b)),
                                                                       (("b", b, api_b), ("a", a, api_a))):
                    server.stop()
                    for _ in range(3):  # the other one keeps working while this one is down and coming back
                        assert "rows affected: 1" in _admin_db(o_server, o_api, key,
                                                               f"INSERT INTO hits VALUES ('{other}')")
                    server.start()
                    until_sync(lambda s=server: "enforced by the database" in "".join(s._lines),
                               what=f"{name} enforced again")
                    assert "rows affected: 1" in _admin_db(server, api, key, f"INSERT INTO hits VALUES ('{name}')")
        finally:
            log = a.stop() + b.stop()
    with _admin() as conn, conn.cursor() as cur:
        cur.execute(f"SELECT who, COUNT(*) FROM `{db_name}`.hits GROUP BY who ORDER BY who")
        assert cur.fetchall() == (("a", 8), ("b", 8))
    assert "dropped" not in log and "Traceback" not in log


def test_db_setup_retires_an_earlier_versions_accounts_it_can_prove_its_own(
        db_name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    suffix = secrets.token_hex(3)
    runner, grantor, role = f"dbacct_oldr_{suffix}", f"dbacct_oldg_{suffix}", f"amcp_{secrets.token_hex(6)}"
    stranger = f"dbacct_olds_{suffix}"  # a bystander named like them: untouched
    try:
        with _admin() as conn, conn.cursor() as cur:
            cur.execute("CREATE USER %s@'%%' IDENTIFIED BY 'old-runner-pw'", (runner,))
            cur.execute("CREATE USER %s@'%%' IDENTIFIED BY 'old-grantor-pw'", (grantor,))
            cur.execute("GRANT CREATE USER ON *.* TO %s@'%%'", (grantor,))
            cur.execute(f"CREATE ROLE `{role}`")
            cur.execute(f"GRANT `{role}` TO %s@'%%'", (runner,))
            cur.execute("CREATE USER %s@'%%' IDENTIFIED BY 'someone-elses'", (stranger,))
        new_config(tmp_path, db_name)
        (tmp_path / "data").mkdir(mode=0o700)
        (tmp_path / "data" / ACCOUNTS_FILE).write_text(
            f"MYSQL_DB={db_name}\nMYSQL_USER={runner}\nMYSQL_PASS=old-runner-pw\nMYSQL_GRANTOR_USER={grantor}\n"
            "MYSQL_GRANTOR_PASS=old-grantor-pw\n")
        capsys.readouterr()
        assert agentctl.main(setup_args(tmp_path)) == 0
        assert "removed the accounts of the earlier set-up" in capsys.readouterr().out
        with _admin() as conn, conn.cursor() as cur:
            cur.execute("SELECT User FROM mysql.user WHERE User IN (%s, %s, %s, %s)", (runner, grantor, role, stranger))
            assert [r[0] for r in cur.fetchall()] == [stranger]
        assert read_accounts(tmp_path / "data" / ACCOUNTS_FILE)["MYSQL_GRANTOR_USER"] == \
            db_roles.names_for(db_name).grantor
    finally:
        with _admin() as conn, conn.cursor() as cur:
            for user in (runner, grantor, stranger):
                cur.execute("DROP USER IF EXISTS %s@'%%'", (user,))
            cur.execute(f"DROP ROLE IF EXISTS `{role}`")
