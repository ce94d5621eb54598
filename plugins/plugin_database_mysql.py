"""MySQL / MariaDB: the `db_query` tool and the `!db` command, both through `database.py`.

`db_query` is gated per table and read/write/ddl: the gate (type `db`) parses the SQL and asks a
person unless `gate-defaults.json` or the session opens that access. `!db <sql>` runs SQL
directly, without the model or a gate, and so only for the interactive shell or an API client
holding the admin token. The connection comes from MYSQL_HOST, MYSQL_PORT, MYSQL_USER,
MYSQL_PASS and MYSQL_DB (the accounts `agentctl db-setup` wrote to the data dir, db-accounts.env,
replace MYSQL_USER/MYSQL_PASS with its runners and add the grantor); `plugin_config`
sets `timeout` (seconds per statement) and `max_rows` (rows of a result shown). A server that is
down at start does not stop the plugin: every call connects again and says clearly what is wrong
until the server answers.

With accounts the database can limit, each `db_query` call runs with exactly what its gate
decision covers (database.py, db_roles.py); otherwise start-up says why in one line and calls run
on the classifier alone. `!db` runs with every privilege of the agent database (never global ones).
"""

from __future__ import annotations

import logging
from typing import Any

from langchain_core.tools import StructuredTool
from pydantic import BaseModel, Field

import plugin_api
from config import ConfigError
from database import (
    ACCOUNT_VARS,
    ACCOUNTS_FILE,
    Database,
    DatabaseSettings,
    query_text,
    read_accounts,
    run_query,
)
from db_results import format_outcome
from plugin_api import BasePlugin, PluginConfigError, PluginSettings, ToolError, parse_settings

logger = logging.getLogger("agent_mcp.mysql")

DB_USAGE = """Usage: !db <sql>   run SQL directly on {where} (no model, no gate)
Examples:
  !db SHOW TABLES
  !db DESCRIBE people
  !db SELECT * FROM people LIMIT 10
Statements are separated by ';' and run one at a time; reads run in a read-only transaction.
db_query mode: {mode}"""


#: `!db`: SQL an administrator typed is approved by typing it: the whole agent database, nothing global.
ADMIN_ACCESS = plugin_api.DbAccess(plugin_api.DB_ADMIN, frozenset({(plugin_api.ANY_TABLE, plugin_api.WRITE)}))


class MySQLSettings(PluginSettings):
    """`plugin_config.plugin_database_mysql` (the connection itself is in the environment)."""

    timeout: float = Field(30.0, gt=0, description="seconds one statement may run (the server's limit)")
    max_rows: int = Field(200, ge=1, description="rows of a result shown; the row count counts them all")


class DbQueryArgs(BaseModel):
    """Arguments of db_query."""

    sql: str = Field(description="MySQL SQL: one statement, or several separated by ';' (run in order, "
                                 "stopping at the first error). Use LIMIT on large tables.")


class MySQLPlugin(BasePlugin):
    """db_query and !db on one aiomysql pool."""

    PLUGIN_NAME = "plugin_database_mysql"
    PLUGIN_VERSION = "1.0.0"
    PLUGIN_TYPE = "data_tool"
    DESCRIPTION = "db_query: SQL on MySQL/MariaDB, gated per table and read/write"
    DEPENDENCIES = ["aiomysql", "sqlglot"]
    ENV_VARS = ["MYSQL_USER"]

    def __init__(self) -> None:
        super().__init__()
        self.db: Database | None = None

    async def init(self, config: dict[str, Any]) -> bool:
        assert self.context is not None
        limits = parse_settings(self.PLUGIN_NAME, MySQLSettings, config)
        env = dict(self.context.config.env)
        path = self.context.config.data_dir() / ACCOUNTS_FILE
        accounts = read_accounts(path)
        if accounts:  # made by `agentctl db-setup`: its runners and grantor replace MYSQL_USER/MYSQL_PASS
            named = env.get("MYSQL_DB", "").strip()
            if named and accounts.get("MYSQL_DB") and named != accounts["MYSQL_DB"]:
                raise PluginConfigError(f"{path} holds the accounts of database {accounts['MYSQL_DB']} but MYSQL_DB is "
                                        f"{named}: run `agentctl db-setup` for {named} (or set MYSQL_DB back)")
            env = {**{k: v for k, v in env.items() if k not in ACCOUNT_VARS}, **accounts}
        try:
            connection = DatabaseSettings.from_env(env)
        except ConfigError as exc:
            raise PluginConfigError(str(exc)) from None
        settings = connection.model_copy(update={"timeout": limits.timeout, "max_rows": limits.max_rows})
        self.db = Database(settings)  # its connections are made by the first call (the pool only without runners)
        enforced = await self.db.enforce() is None
        problem = await self.db.check()
        if problem:
            logger.warning("MySQL is not usable yet (%s); db_query stays registered and connects on every call",
                           problem)
            return True
        if enforced:
            logger.info("MySQL: connected as %s; %s", settings.where(), self.db.describe_mode())
            if self.db.warning:
                logger.warning("MySQL: %s", self.db.warning)
        else:
            logger.warning("MySQL (%s): %s", settings.where(), self.db.describe_mode())
        return True

    async def shutdown(self) -> None:
        if self.db is not None:
            await self.db.close()

    def _database(self) -> Database:
        if self.db is None:
            raise RuntimeError("plugin_database_mysql is not initialised")
        return self.db

    async def db_query(self, sql: str) -> str:
        """Run SQL; a result table with its row count or `OK — rows affected: N`; ToolError when a statement failed
        (with the results of those that ran)."""
        turn = plugin_api.current_turn()
        outcome = await run_query(self._database(), sql, turn.db_access if turn else None, self.ctx.metrics)
        if outcome.error is not None:
            raise ToolError(format_outcome(outcome, marker=""))
        return format_outcome(outcome)

    def get_tools(self) -> dict[str, Any]:
        tool = StructuredTool.from_function(
            coroutine=self.db_query, name="db_query", args_schema=DbQueryArgs,
            description=("Run SQL on the MySQL/MariaDB database. Returns result sets as text tables "
                         "with row counts, and rows affected for writes. Reads and writes of each table may need "
                         "a person's approval."),
        )
        return {"lc": [tool]}

    def get_gate_tools(self) -> dict[str, Any]:
        # case_sensitive: the gate keys tables by the server's `lower_case_table_names` (None until connected)
        return {"db_query": {"type": "db", "case_sensitive": self._case_sensitive}}

    def _case_sensitive(self) -> bool | None:
        return self.db.case_sensitive if self.db is not None else None

    def get_commands(self) -> dict[str, Any]:
        return {"db": self.cmd_db}

    def get_help(self) -> str:
        where = self.db.settings.where() if self.db else "MySQL"
        return (f"Database (plugin_database_mysql, {where}):\n"
                "  !db <sql>                   run SQL directly, without the model or a gate (shell / admin API only)")

    async def cmd_db(self, turn: plugin_api.Turn, args: str) -> str:
        """!db <sql> — run SQL directly (privileged: no gate)."""
        if not plugin_api.may_administer(turn):
            return plugin_api.refusal("!db", turn)
        db = self._database()
        if not args.strip():
            return DB_USAGE.format(where=db.settings.where(), mode=db.describe_mode())
        return await query_text(db, args, ADMIN_ACCESS) + "\n"
