"""`agentctl db-setup` and `agentctl db-status`: the MariaDB accounts the database limits db_query with.

db-setup makes (or repairs) two accounts with an administrator's connection, or prints the
exact SQL for a DBA to run (`--print-sql`):
- the RUNNER (every db_query statement runs on it): nothing but USAGE, no default role; it gets
  one role per approved privilege set at run time (db_roles.py);
- the GRANTOR (agent-mcp's own code only, never model SQL): CREATE USER globally (MariaDB's
  condition for CREATE ROLE / DROP ROLE; the alternative, INSERT/DELETE on the `mysql` schema, is
  wider) and ALL on the agent database WITH GRANT OPTION (to grant its tables to the roles).
The generated passwords go to `<data dir>/db-accounts.env` (mode 0600), which the server reads,
or with `--print-env` to stdout as .env lines; they are never logged. Running it again keeps the
passwords of that file, removes anything else the two accounts were given, and verifies the
result the way the server does at start (database.Database.enforce).
"""

from __future__ import annotations

import asyncio
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pymysql

import db_roles
from agentctl_base import CommandBase
from agentctl_files import InputError
from agentctl_term import ArgParser
from database import ACCOUNTS_FILE, Database, DatabaseSettings, read_accounts

if TYPE_CHECKING:
    from agentctl_files import ConfigFiles
    from agentctl_term import Terminal

DEFAULT_RUNNER, DEFAULT_GRANTOR = "amcp_runner", "amcp_grantor"


def _literal(value: str) -> str:
    """A SQL string literal (for the printed SQL and account names)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _account(user: str, host: str) -> str:
    return f"{_literal(user)}@{_literal(host)}"


def setup_sql(*, db: str, runner: str, grantor: str, host: str, runner_password: str, grantor_password: str,
              extra_roles: Mapping[str, list[str]] | None = None) -> list[str]:
    """The statements that make (or repair) the runner and the grantor of agent database `db`.

    `extra_roles`: account → roles it holds that are none of ours, to be revoked (repair).
    """
    r, g = _account(runner, host), _account(grantor, host)
    statements = []
    for account, password in ((r, runner_password), (g, grantor_password)):
        statements += [f"CREATE USER IF NOT EXISTS {account} IDENTIFIED BY {_literal(password)}",
                       f"ALTER USER {account} IDENTIFIED BY {_literal(password)}",
                       f"REVOKE ALL PRIVILEGES, GRANT OPTION FROM {account}"]
    for account, roles in (extra_roles or {}).items():
        statements += [f"REVOKE {db_roles.quote(role)} FROM {account}" for role in roles]
    statements += [f"SET DEFAULT ROLE NONE FOR {r}",
                   f"GRANT CREATE USER ON *.* TO {g}",
                   f"GRANT ALL PRIVILEGES ON {db_roles.quote(db)}.* TO {g} WITH GRANT OPTION"]
    return statements


def _parser() -> ArgParser:
    parser = ArgParser(prog="agentctl db-setup", add_help=False)
    parser.add_argument("--admin-user", default=None)
    parser.add_argument("--admin-password", default=None)
    parser.add_argument("--db", default=None)
    parser.add_argument("--runner", default=DEFAULT_RUNNER)
    parser.add_argument("--grantor", default=DEFAULT_GRANTOR)
    parser.add_argument("--account-host", default="%")
    parser.add_argument("--role-prefix", default=db_roles.DEFAULT_PREFIX)
    parser.add_argument("--print-sql", action="store_true")
    parser.add_argument("--print-env", action="store_true")
    return parser


def _write_accounts(path: Path, values: dict[str, str]) -> None:
    """Write the account lines with mode 0600 from the start (never readable by others, not even briefly)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write("# agentctl db-setup: the MariaDB accounts of db_query (keep this file private)\n")
        out.writelines(f"{k}={_literal(v)}\n" for k, v in values.items())
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def _others(cur: Any, user: str, host: str, prefix: str) -> list[str]:
    """Roles `user@host` holds that are not ours (db_roles makes `<prefix>…` only)."""
    cur.execute("SELECT Role FROM mysql.roles_mapping WHERE User = %s AND Host = %s", (user, host))
    return [str(r[0]) for r in cur.fetchall() if not str(r[0]).startswith(prefix)]


def db_setup(files: ConfigFiles, term: Terminal, args: list[str]) -> None:
    """Make or repair the runner and grantor accounts, save their passwords, and verify them."""
    opts = _parser().parse_args(args)
    config = files.app_config()
    env = config.env
    db = opts.db or env.get("MYSQL_DB", "").strip()
    if not db:
        raise InputError("which database does the agent use? give --db NAME or set MYSQL_DB in .env")
    path = config.data_dir() / ACCOUNTS_FILE
    kept = read_accounts(path)
    same = kept.get("MYSQL_USER") == opts.runner and kept.get("MYSQL_GRANTOR_USER") == opts.grantor
    runner_pw = (same and kept.get("MYSQL_PASS")) or secrets.token_urlsafe(24)
    grantor_pw = (same and kept.get("MYSQL_GRANTOR_PASS")) or secrets.token_urlsafe(24)
    values = {"MYSQL_DB": db, "MYSQL_USER": opts.runner, "MYSQL_PASS": runner_pw,
              "MYSQL_GRANTOR_USER": opts.grantor, "MYSQL_GRANTOR_PASS": grantor_pw}
    host, port = env.get("MYSQL_HOST", "127.0.0.1"), int(env.get("MYSQL_PORT", "3306") or 3306)
    if opts.print_sql:
        term.say("-- Run as a MariaDB administrator; then put these accounts into the server's .env "
                 f"(or keep {path}, written now).")
        for statement in setup_sql(db=db, runner=opts.runner, grantor=opts.grantor, host=opts.account_host,
                                   runner_password=runner_pw, grantor_password=grantor_pw):
            term.say(statement + ";")
        _save(term, path, values, opts.print_env)
        return
    admin_user = opts.admin_user or env.get("MYSQL_ADMIN_USER") or "root"
    admin_password = opts.admin_password if opts.admin_password is not None else env.get("MYSQL_ADMIN_PASS", "")
    try:
        with pymysql.connect(host=host, port=port, user=admin_user, password=admin_password, autocommit=True,
                             connect_timeout=10) as conn, conn.cursor() as cur:
            cur.execute("SELECT VERSION()")
            version = db_roles.mariadb_version(str(cur.fetchone()[0]))
            if version is None or version < (10, 2, 4):
                raise InputError("db-setup needs MariaDB ≥ 10.2.4 (roles and COM_RESET_CONNECTION); "
                                 "db_query keeps running on the classifier alone")
            cur.execute(f"CREATE DATABASE IF NOT EXISTS {db_roles.quote(db)}")
            extra = {_account(u, opts.account_host): _others(cur, u, opts.account_host, opts.role_prefix)
                     for u in (opts.runner, opts.grantor)}
            for statement in setup_sql(db=db, runner=opts.runner, grantor=opts.grantor, host=opts.account_host,
                                       runner_password=runner_pw, grantor_password=grantor_pw, extra_roles=extra):
                cur.execute(statement)
    except pymysql.err.MySQLError as exc:
        raise InputError(f"db-setup as {admin_user}@{host}:{port} failed: {exc.args[-1] if exc.args else exc} — "
                         "give an administrator account with --admin-user/--admin-password (or MYSQL_ADMIN_USER/"
                         "MYSQL_ADMIN_PASS), or use --print-sql and let a DBA run it") from None
    _save(term, path, values, opts.print_env)
    problem = verify(values, host, port, opts.role_prefix)
    if problem:
        raise InputError(f"the accounts were made but cannot be limited: {problem}")
    term.say(f"✓ verified: {opts.runner} holds nothing but USAGE; {opts.grantor} can make roles for {db}. "
             "db_query will run with exactly what each gate decision covers. Restart agent-mcp.py.")


def _save(term: Terminal, path: Path, values: dict[str, str], print_env: bool) -> None:
    if print_env:
        term.say("# .env lines for agent-mcp (secret: keep them out of logs and version control)")
        for key, value in values.items():
            term.say(f"{key}={_literal(value)}")
        return
    _write_accounts(path, values)
    term.say(f"accounts saved to {path} (mode 0600); the server reads them at start")


def verify(values: Mapping[str, str], host: str, port: int, prefix: str = db_roles.DEFAULT_PREFIX) -> str | None:
    """None when the server would run enforced with these accounts, else why not (as it would log it)."""
    settings = DatabaseSettings.from_env({**values, "MYSQL_HOST": host, "MYSQL_PORT": str(port)})
    settings = settings.model_copy(update={"role_prefix": prefix})

    async def check() -> str | None:
        db = Database(settings)
        try:
            return await db.enforce()
        finally:
            await db.close()

    return asyncio.run(check())


def db_status(files: ConfigFiles, term: Terminal) -> None:
    """How db_query calls are limited with the configured accounts (the server's own check)."""
    config = files.app_config()
    env = dict(config.env)
    accounts = read_accounts(config.data_dir() / ACCOUNTS_FILE)
    values = {**env, **accounts} if accounts else env
    if not values.get("MYSQL_USER"):
        raise InputError("no MySQL account is configured (MYSQL_USER); agentctl db-setup makes one")
    problem = verify(values, values.get("MYSQL_HOST", "127.0.0.1"), int(values.get("MYSQL_PORT", "3306") or 3306))
    where = f"{values['MYSQL_USER']}@{values.get('MYSQL_HOST', '127.0.0.1')}/{values.get('MYSQL_DB', '')}"
    if term.json_output:
        term.json({"account": where, "mode": "enforced" if problem is None else "classifier only", "reason": problem})
    elif problem is None:
        term.say(f"db_query: enforced by the database ({where}: runner with roles, grantor can make them)")
    else:
        term.say(f"db_query: classifier only ({where}): {problem} — fix: agentctl db-setup")


class DbCommands(CommandBase):
    """db-setup, db-status."""

    def cmd_db_setup(self, args: list[str]) -> None:
        """db-setup [--admin-user U] [--db NAME] [--print-sql] [--print-env]: accounts that let MariaDB limit db_query.

        Makes (or repairs, keeping their passwords) a runner account that holds nothing but
        USAGE, and a grantor that can make roles for the agent database (MYSQL_DB or --db), with
        an administrator account (--admin-user/--admin-password, or MYSQL_ADMIN_USER/
        MYSQL_ADMIN_PASS; default root without password), then verifies them as the server does.
        The passwords go to <data dir>/db-accounts.env (0600), or to stdout with --print-env.
        --print-sql prints the SQL for a DBA instead of running it. Other options: --runner NAME,
        --grantor NAME, --account-host HOST (default %), --role-prefix P (default amcp_).
        """
        db_setup(self.files, self.term, args)

    def cmd_db_status(self, args: list[str]) -> None:
        """db-status: whether db_query calls are limited by the database, and if not why and what fixes it."""
        if args:
            raise InputError("usage: agentctl db-status")
        db_status(self.files, self.term)
