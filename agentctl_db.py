"""`agentctl db-setup` and `agentctl db-status`: the MariaDB accounts the database limits db_query with.

db-setup makes (or repairs) with an administrator's connection, or prints for a DBA
(`--print-sql`, which writes nothing), the accounts of db_roles.py, every name derived from the
agent database (and `--instance`): N runners, each with one role; a grantor holding only EXECUTE on
two procedures of an admin schema; a locked definer account those procedures run as. The admin
schema's `owner` row holds a digest of the setup id kept in the accounts file: an account or role of
these names that exists is changed only when that row proves it is this set-up's; anything else
stops db-setup with the names and what to do. It never touches any other account. Re-running it
keeps the passwords and the roles' current privileges (a running server keeps working) and
revokes only what the accounts were given by someone else.
The generated passwords go to `<data dir>/db-accounts.env` (mode 0600, the data dir 0700), which
the server reads, or with `--print-env` to stdout as .env lines; they are never logged.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pymysql

import db_roles
from agentctl_base import CommandBase
from agentctl_files import CtlError, InputError
from agentctl_term import ArgParser
from database import ACCOUNTS_FILE, Database, DatabaseSettings, read_accounts
from db_roles import Names, literal, quote

if TYPE_CHECKING:
    from agentctl_files import ConfigFiles
    from agentctl_term import Terminal


class NotEnforced(CtlError):
    """db-status: with these accounts the server would run db_query on the classifier alone."""

    exit_code = 3


def _account(user: str, host: str) -> str:
    return f"{literal(user)}@{literal(host)}"


def setup_sql(names: Names, *, host: str, runner_password: str, grantor_password: str, setup_id: str) -> list[str]:
    """The statements that make (or top up) every account, role and procedure of `names` (idempotent)."""
    adm, db = quote(names.admin_schema), quote(names.db)
    definer, grantor = _account(names.definer, host), _account(names.grantor, host)
    out = [f"CREATE DATABASE IF NOT EXISTS {db}",
           f"CREATE DATABASE IF NOT EXISTS {adm}",
           f"CREATE TABLE IF NOT EXISTS {adm}.`owner` (db VARCHAR(64) NOT NULL, instance VARCHAR(64) NOT NULL, "
           "setup CHAR(64) NOT NULL, made TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP, PRIMARY KEY (db, instance))",
           f"REPLACE INTO {adm}.`owner` (db, instance, setup) VALUES ({literal(names.db)}, {literal(names.instance)}, "
           f"{literal(db_roles.setup_digest(setup_id))})",
           f"CREATE USER IF NOT EXISTS {definer} ACCOUNT LOCK",
           f"ALTER USER {definer} ACCOUNT LOCK",
           f"GRANT ALL PRIVILEGES ON {db}.* TO {definer} WITH GRANT OPTION",
           f"GRANT SELECT ON `mysql`.`db` TO {definer}",
           f"GRANT SELECT ON `mysql`.`tables_priv` TO {definer}",
           f"GRANT EXECUTE ON {adm}.* TO {definer}"]
    for k in names.slots():
        runner = _account(names.runner(k), host)
        out += [f"CREATE ROLE IF NOT EXISTS {quote(names.role(k))}",
                f"CREATE USER IF NOT EXISTS {runner} IDENTIFIED BY {literal(runner_password)}",
                f"ALTER USER {runner} IDENTIFIED BY {literal(runner_password)}",
                f"GRANT {quote(names.role(k))} TO {runner}",
                f"SET DEFAULT ROLE NONE FOR {runner}"]
    out += [f"CREATE USER IF NOT EXISTS {grantor} IDENTIFIED BY {literal(grantor_password)}",
            f"ALTER USER {grantor} IDENTIFIED BY {literal(grantor_password)}"]
    return out


def _procedure_sql(names: Names, host: str) -> list[str]:
    """(Re)create the procedures and let the grantor execute them (replacing drops their grants)."""
    out = []
    for name, create in db_roles.procedures(names, host).items():
        out += [f"DROP PROCEDURE IF EXISTS {quote(names.admin_schema)}.{quote(name)}", create,
                f"GRANT EXECUTE ON PROCEDURE {quote(names.admin_schema)}.{quote(name)} TO "
                f"{_account(names.grantor, host)}"]
    return out


def _parser() -> ArgParser:
    parser = ArgParser(prog="agentctl db-setup", add_help=False)
    parser.add_argument("--admin-user", default=None)
    parser.add_argument("--admin-password", default=None)
    parser.add_argument("--db", default=None)
    parser.add_argument("--instance", default=None)
    parser.add_argument("--runners", type=int, default=None)
    parser.add_argument("--account-host", default="%")
    parser.add_argument("--print-sql", action="store_true")
    parser.add_argument("--print-env", action="store_true")
    return parser


def _write_accounts(path: Path, values: dict[str, str]) -> None:
    """Write the account lines with mode 0600 from the start, in a data dir only the owner can enter."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(_accounts_text(values))
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def _accounts_text(values: Mapping[str, str]) -> str:
    return ("# agentctl db-setup: the MariaDB accounts of db_query (keep this file private)\n"
            + "".join(f"{k}={literal(v)}\n" for k, v in values.items()))


# ── What exists already, and whose it is ────────────────────────────────────────────────────


def _existing(cur: Any, names: Names) -> list[str]:
    """Accounts and roles with this set-up's names (any host, any number of runners), and its admin schema."""
    like = names.base.replace("_", "\\_") + "\\_%"
    cur.execute("SELECT User, Host, is_role FROM mysql.user WHERE User LIKE %s", (like,))
    found = [f"role {u}" if r == "Y" else f"{u}@{h}" for u, h, r in cur.fetchall()]
    cur.execute("SELECT SCHEMA_NAME FROM information_schema.SCHEMATA WHERE SCHEMA_NAME = %s", (names.admin_schema,))
    return found + [f"database {s}" for (s,) in cur.fetchall()]


def _proven(cur: Any, names: Names, setup_id: str | None) -> bool:
    """Whether the admin schema's owner row was written by the set-up whose accounts file holds `setup_id`."""
    if not setup_id:
        return False
    try:
        cur.execute(f"SELECT setup FROM {quote(names.admin_schema)}.`owner` WHERE db = %s AND instance = %s",
                    (names.db, names.instance))
    except pymysql.err.MySQLError:
        return False
    row = cur.fetchone()
    return row is not None and secrets.compare_digest(str(row[0]), db_roles.setup_digest(setup_id))


def drops(found: list[str]) -> list[str]:
    """The statements that remove what `_existing` found (its accounts, roles and admin schema)."""
    accounts = [f for f in found if not f.startswith(("role ", "database "))]
    out = [f"DROP USER {_account(*a.rsplit('@', 1))}" for a in accounts]
    out += [f"DROP ROLE {quote(f[5:])}" for f in found if f.startswith("role ")]
    return out + [f"DROP DATABASE {quote(f[9:])}" for f in found if f.startswith("database ")]


def remove_setup(cur: Any, names: Names) -> None:
    """Drop a set-up's accounts, roles and admin schema (not the agent database): for tests and benchmarks."""
    for statement in drops(_existing(cur, names)):
        cur.execute(statement)


def _not_ours(names: Names, found: list[str], path: Path) -> InputError:
    return InputError(
        f"MariaDB already has accounts of agent database {names.db}"
        f"{f' (instance {names.instance})' if names.instance else ''}: {', '.join(found)}. {path} does not prove "
        "they are this set-up's, so nothing was changed. To share them with the agent-mcp that made them, copy its "
        f"data/{ACCOUNTS_FILE} here (mode 0600); to give this agent accounts of its own on the same database, run "
        "db-setup again with --instance NAME; if they are left from a set-up that is gone, an administrator can "
        "remove them: " + " ".join(f"{d};" for d in drops(found)))


_GRANT = re.compile(r"^GRANT (?P<what>.+?) ON (?P<obj>.+?) TO (?P<to>`[^`]*`(?:@`[^`]*`)?)(?P<rest>.*)$")
_ROLE = re.compile(r"^GRANT (?P<role>`[^`]+`) TO (?P<to>`[^`]*`(?:@`[^`]*`)?)")


def _revoke(line: str) -> str | None:
    """The REVOKE undoing one SHOW GRANTS line (None for USAGE and default-role lines)."""
    text = db_roles.without_password(line)
    if text.startswith(("GRANT USAGE ON *.* TO ", "SET DEFAULT ROLE ")):
        return None
    if (m := _ROLE.match(text)) is not None:
        return f"REVOKE {m['role']} FROM {m['to']}"
    if (m := _GRANT.match(text)) is not None:
        what = m["what"] + (", GRANT OPTION" if "WITH GRANT OPTION" in m["rest"] else "")
        return f"REVOKE {what} ON {m['obj']} FROM {m['to']}"
    return None


def _repairs(cur: Any, names: Names, host: str) -> list[str]:
    """REVOKEs of whatever this set-up's accounts and roles hold beyond what db-setup gives them."""
    adm, db, g_host = quote(names.admin_schema), quote(names.db), quote(host)
    expected = {
        f"{quote(names.definer)}@{g_host}": {
            f"GRANT ALL PRIVILEGES ON {db}.* TO {quote(names.definer)}@{g_host} WITH GRANT OPTION",
            f"GRANT SELECT ON `mysql`.`db` TO {quote(names.definer)}@{g_host}",
            f"GRANT SELECT ON `mysql`.`tables_priv` TO {quote(names.definer)}@{g_host}",
            f"GRANT EXECUTE ON {adm}.* TO {quote(names.definer)}@{g_host}"},
        f"{quote(names.grantor)}@{g_host}": {
            f"GRANT EXECUTE ON PROCEDURE {adm}.`{p}` TO {quote(names.grantor)}@{g_host}" for p in ("refill", "tables")},
    }
    for k in names.slots():
        expected[f"{quote(names.runner(k))}@{g_host}"] = {f"GRANT {quote(names.role(k))} TO "
                                                          f"{quote(names.runner(k))}@{g_host}"}
    out = []
    for account, keep in expected.items():
        try:
            cur.execute(f"SHOW GRANTS FOR {account}")
        except pymysql.err.MySQLError:
            continue  # not made yet
        for (line,) in cur.fetchall():
            revoke = _revoke(str(line)) if db_roles.without_password(str(line)) not in keep else None
            if revoke:
                out.append(revoke)
    for k in names.slots():
        try:
            cur.execute(f"SHOW GRANTS FOR {quote(names.role(k))}")
        except pymysql.err.MySQLError:
            continue
        for (line,) in cur.fetchall():
            # what the role holds on the agent database is a running call's: kept
            if f" ON {db}." not in str(line) and (revoke := _revoke(str(line))):
                out.append(revoke)
    return out


def _retired(cur: Any, kept: Mapping[str, str], names: Names, server: tuple[str, int]) -> list[str]:
    """DROPs of an earlier version's two accounts (and the digest-named roles its runner held), when the old
    accounts file's passwords still log in to them (proof they are this set-up's)."""
    if kept.get("MYSQL_SETUP_ID") or not kept.get("MYSQL_GRANTOR_USER"):
        return []
    old = [(kept.get("MYSQL_USER", ""), kept.get("MYSQL_PASS", "")),
           (kept["MYSQL_GRANTOR_USER"], kept.get("MYSQL_GRANTOR_PASS", ""))]
    out = []
    for user, password in old:
        if not user or user in names.accounts():
            continue
        try:
            pymysql.connect(host=server[0], port=server[1], user=user, password=password, connect_timeout=5).close()
        except pymysql.err.MySQLError:
            continue  # not provably ours: left alone
        cur.execute("SELECT Role FROM mysql.roles_mapping WHERE User = %s", (user,))
        out += [f"DROP ROLE IF EXISTS {quote(str(r))}" for (r,) in cur.fetchall()
                if re.fullmatch(r"amcp_[0-9a-f]{12}", str(r))]
        cur.execute("SELECT Host FROM mysql.user WHERE User = %s AND is_role = 'N'", (user,))
        out += [f"DROP USER {_account(user, str(h))}" for (h,) in cur.fetchall()]
    return out


def _surplus(cur: Any, names: Names, host: str) -> list[str]:
    """DROPs of runners and roles beyond `names.runners` (an earlier set-up with more)."""
    like = names.base.replace("_", "\\_") + "\\_%"
    cur.execute("SELECT User, Host, is_role FROM mysql.user WHERE User LIKE %s", (like,))
    wanted = {names.runner(k) for k in names.slots()} | {names.role(k) for k in names.slots()}
    out = []
    for user, user_host, is_role in cur.fetchall():
        if re.fullmatch(re.escape(names.base) + r"_(r|role)\d+", user) and user not in wanted:
            out.append(f"DROP ROLE {quote(user)}" if is_role == "Y" else f"DROP USER {_account(user, user_host)}")
    return out


# ── The commands ────────────────────────────────────────────────────────────────────────────


def db_setup(files: ConfigFiles, term: Terminal, args: list[str]) -> None:
    """Make or repair the accounts, save their passwords, and verify them."""
    opts = _parser().parse_args(args)
    config = files.app_config()
    env = config.env
    db = opts.db or env.get("MYSQL_DB", "").strip()
    if not db:
        raise InputError("which database does the agent use? give --db NAME or set MYSQL_DB in .env")
    path = config.data_dir() / ACCOUNTS_FILE
    kept = read_accounts(path)
    instance = opts.instance if opts.instance is not None else kept.get("MYSQL_INSTANCE") or \
        env.get("MYSQL_INSTANCE", "")
    runners = opts.runners if opts.runners is not None else int(kept.get("MYSQL_RUNNERS") or db_roles.DEFAULT_RUNNERS)
    if not 1 <= runners <= db_roles.MAX_RUNNERS:
        raise InputError(f"--runners must be 1 to {db_roles.MAX_RUNNERS} (calls that may run at once)")
    names = db_roles.names_for(db, instance, runners)
    same = kept.get("MYSQL_DB") == db and kept.get("MYSQL_INSTANCE", "") == instance and kept.get("MYSQL_SETUP_ID")
    setup_id = kept["MYSQL_SETUP_ID"] if same else secrets.token_urlsafe(24)
    runner_pw = (same and kept.get("MYSQL_PASS")) or secrets.token_urlsafe(24)
    grantor_pw = (same and kept.get("MYSQL_GRANTOR_PASS")) or secrets.token_urlsafe(24)
    values = {"MYSQL_DB": db, "MYSQL_INSTANCE": instance, "MYSQL_RUNNERS": str(runners),
              "MYSQL_USER": names.runner(1).removesuffix("1"), "MYSQL_PASS": runner_pw,
              "MYSQL_GRANTOR_USER": names.grantor, "MYSQL_GRANTOR_PASS": grantor_pw, "MYSQL_SETUP_ID": setup_id}
    host, port = env.get("MYSQL_HOST", "127.0.0.1"), int(env.get("MYSQL_PORT", "3306") or 3306)
    statements = setup_sql(names, host=opts.account_host, runner_password=runner_pw, grantor_password=grantor_pw,
                           setup_id=setup_id)
    if opts.print_sql:
        _print_sql(term, names, statements + _procedure_sql(names, opts.account_host), path, values)
        return
    admin_user = opts.admin_user or env.get("MYSQL_ADMIN_USER") or "root"
    admin_password = opts.admin_password if opts.admin_password is not None else env.get("MYSQL_ADMIN_PASS", "")
    try:
        with pymysql.connect(host=host, port=port, user=admin_user, password=admin_password, autocommit=True,
                             connect_timeout=10) as conn, conn.cursor() as cur:
            cur.execute("SELECT VERSION()")
            row = cur.fetchone()  # SELECT VERSION() has one row
            version = db_roles.mariadb_version(str(row[0])) if row is not None else None
            if version is None or version < db_roles.MIN_VERSION:
                raise InputError(f"db-setup needs MariaDB ≥ {'.'.join(map(str, db_roles.MIN_VERSION))} (roles, "
                                 "locked accounts, COM_RESET_CONNECTION); db_query keeps running on the classifier "
                                 "alone")
            found = _existing(cur, names)
            if found and not _proven(cur, names, setup_id if same else None):
                raise _not_ours(names, found, path)
            repairs = _repairs(cur, names, opts.account_host) + _surplus(cur, names, opts.account_host)
            retired = _retired(cur, kept, names, (host, port))
            for statement in statements:
                cur.execute(statement)
            if _procedures_differ(cur, names, opts.account_host):
                for statement in _procedure_sql(names, opts.account_host):
                    cur.execute(statement)
            for statement in repairs + retired:
                cur.execute(statement)
    except pymysql.err.MySQLError as exc:
        raise InputError(f"db-setup as {admin_user}@{host}:{port} failed: {exc.args[-1] if exc.args else exc} — "
                         "give an administrator account with --admin-user/--admin-password (or MYSQL_ADMIN_USER/"
                         "MYSQL_ADMIN_PASS), or use --print-sql and let a DBA run it") from None
    _save(term, path, values, opts.print_env)
    if repairs:
        term.say(f"repaired: {len(repairs)} privilege(s) the accounts had been given by someone else were revoked")
    if retired:
        term.say(f"removed the accounts of the earlier set-up ({kept.get('MYSQL_USER')}, "
                 f"{kept.get('MYSQL_GRANTOR_USER')}: its grantor could administer every account on the server) "
                 "and their roles")
    problem, _ = verify(values, host, port)
    if problem:
        raise InputError(f"the accounts were made but cannot be limited: {problem}")
    term.say(f"✓ verified: {runners} runner account(s) ({names.runner(1)}…) hold nothing but their own role; "
             f"{names.grantor} can only fill those roles with privileges on {db}. db_query will run with exactly what "
             "each gate decision covers. Restart agent-mcp.py.")


def _procedures_differ(cur: Any, names: Names, host: str) -> bool:
    """Whether the admin schema's procedures are missing or not the ones this version makes."""
    cur.execute("SELECT ROUTINE_NAME, ROUTINE_DEFINITION, DEFINER FROM information_schema.ROUTINES "
                "WHERE ROUTINE_SCHEMA = %s", (names.admin_schema,))
    have = {name: (body, definer) for name, body, definer in cur.fetchall()}
    for name, create in db_roles.procedures(names, host).items():
        body = create[create.index("\nBEGIN") + 1:] if "\nBEGIN" in create else create[create.index("\nSELECT") + 1:]
        if have.get(name) != (body, f"{names.definer}@{host}"):
            return True
    return False


def _print_sql(term: Terminal, names: Names, statements: list[str], path: Path, values: dict[str, str]) -> None:
    term.say(f"-- Run as a MariaDB administrator (the procedures need DELIMITER // … // in the mariadb client); "
             f"then save the accounts block below as {path} (mode 0600). Nothing was written.")
    term.say("DELIMITER //")
    for statement in statements:
        term.say(statement + "//")
    term.say("DELIMITER ;")
    term.say(f"-- {path}:")
    for line in _accounts_text(values).splitlines():
        term.say(f"-- {line}")


def _save(term: Terminal, path: Path, values: dict[str, str], print_env: bool) -> None:
    if print_env:
        term.say("# .env lines for agent-mcp (secret: keep them out of logs and version control)")
        for key, value in values.items():
            term.say(f"{key}={literal(value)}")
        return
    _write_accounts(path, values)
    term.say(f"accounts saved to {path} (mode 0600); the server reads them at start")


def verify(values: Mapping[str, str], host: str, port: int) -> tuple[str | None, dict[str, Any]]:
    """(None when the server would run enforced with these accounts, else why not; what db-status shows).
    Only reads: it changes and drops nothing."""
    settings = DatabaseSettings.from_env({**values, "MYSQL_HOST": host, "MYSQL_PORT": str(port)})

    async def check() -> tuple[str | None, dict[str, Any]]:
        db = Database(settings)
        try:
            problem = await db.enforce()
            shown: dict[str, Any] = {"warning": db.warning}
            if db.runners is not None:
                shown["runners"] = settings.runners
                shown["in_use"] = await db.runners.claimed_elsewhere()
            return problem, shown
        finally:
            await db.close()

    return asyncio.run(check())


def db_status(files: ConfigFiles, term: Terminal) -> None:
    """How db_query calls are limited with the configured accounts (the server's own check, read-only)."""
    config = files.app_config()
    accounts = read_accounts(config.data_dir() / ACCOUNTS_FILE)
    values = {**config.env, **accounts}
    if not values.get("MYSQL_USER"):
        raise NotEnforced("no MySQL account is configured (MYSQL_USER); agentctl db-setup makes the accounts")
    host, port = values.get("MYSQL_HOST", "127.0.0.1"), int(values.get("MYSQL_PORT", "3306") or 3306)
    problem, shown = verify(values, host, port)
    where = f"{host}:{port}/{values.get('MYSQL_DB', '')}"
    if term.json_output:
        term.json({"database": where, "mode": "enforced" if problem is None else "classifier only", "reason": problem,
                   **shown})
    elif problem is None:
        term.say(f"db_query: enforced by the database ({where}): {shown['runners']} runner account(s), "
                 f"{shown['in_use']} claimed by running instances; each call's role holds what its gate decision "
                 "covers")
        if shown.get("warning"):
            term.say(f"warning: {shown['warning']}")
    if problem is not None:
        raise NotEnforced(f"db_query: classifier only ({where}): {problem} — fix: agentctl db-setup")


class DbCommands(CommandBase):
    """db-setup, db-status."""

    def cmd_db_setup(self, args: list[str]) -> None:
        """db-setup [--admin-user U] [--db NAME] [--instance NAME] [--runners N] [--print-sql] [--print-env]: accounts
        that let MariaDB limit db_query.

        Makes (or repairs, keeping their passwords and live roles) N runner accounts (default 4: the
        calls that may run at once) each holding one role, a grantor that can only fill those roles
        with privileges on the agent database (MYSQL_DB or --db), and a locked definer, all named
        after the database (and --instance), with an administrator account (--admin-user/
        --admin-password, or MYSQL_ADMIN_USER/MYSQL_ADMIN_PASS; default root without password); then
        verifies them as the server does. It stops, changing nothing, when accounts of those names
        exist that this config dir's accounts file does not prove its own. The passwords go to
        <data dir>/db-accounts.env (0600), or to stdout with --print-env. --print-sql prints the SQL
        and the accounts file for a DBA and writes nothing. --account-host HOST (default %).
        """
        db_setup(self.files, self.term, args)

    def cmd_db_status(self, args: list[str]) -> None:
        """db-status: whether db_query calls are limited by the database (exit 3 when not), why, and the runners.

        Only reads: it changes nothing on the server.
        """
        if args:
            raise InputError("usage: agentctl db-status")
        db_status(self.files, self.term)
