"""MySQL / MariaDB: the `db_query` tool and the `!db` command, both through `database.py`.

`db_query` is gated per table and read/write/ddl: the gate (type `db`) parses the SQL and asks a
person unless `gate-defaults.json` or the session opens that access. `!db <sql>` runs SQL
directly, without the model or a gate, and so only for the interactive shell or an API client
holding the admin token. The connection comes from MYSQL_HOST, MYSQL_PORT, MYSQL_USER,
MYSQL_PASS and MYSQL_DB; `plugin_config` sets `timeout` (seconds per statement) and `max_rows`
(rows of a result shown). A server that is down at start does not stop the plugin: every call
connects again and says clearly what is wrong until the server answers.
"""

from __future__ import annotations

import logging
from typing import Any

from langchain_core.tools import StructuredTool
from pydantic import BaseModel, Field

import gate
import state
from config import ConfigError
from database import Database, DatabaseSettings, query_text
from plugin_loader import BasePlugin, PluginConfigError, PluginSettings, parse_settings

logger = logging.getLogger("agent_mcp.mysql")

DB_USAGE = """Usage: !db <sql>   run SQL directly on {where} (no model, no gate)
Examples:
  !db SHOW TABLES
  !db DESCRIBE people
  !db SELECT * FROM people LIMIT 10
Statements are separated by ';' and run one at a time; reads run in a read-only transaction."""


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
        assert self.runtime is not None
        limits = parse_settings(self.PLUGIN_NAME, MySQLSettings, config)
        try:
            connection = DatabaseSettings.from_env(self.runtime.config.env)
        except ConfigError as exc:
            raise PluginConfigError(str(exc)) from None
        settings = connection.model_copy(update={"timeout": limits.timeout, "max_rows": limits.max_rows})
        self.db = Database(settings)
        await self.db.open()
        problem = await self.db.check()
        if problem:
            logger.warning("MySQL is not usable yet (%s); db_query stays registered and connects on every call",
                           problem)
        else:
            logger.info("MySQL: connected as %s", settings.where())
        return True

    async def shutdown(self) -> None:
        if self.db is not None:
            await self.db.close()

    def _database(self) -> Database:
        if self.db is None:
            raise RuntimeError("plugin_database_mysql is not initialised")
        return self.db

    async def db_query(self, sql: str) -> str:
        """Run SQL; a result table with its row count, `OK — rows affected: N`, or an ERROR line."""
        return await query_text(self._database(), sql)

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

    async def cmd_db(self, turn: state.Turn, args: str) -> str:
        """!db <sql> — run SQL directly (privileged: no gate)."""
        if not gate.may_administer(turn):
            return gate.refusal("!db", turn)
        db = self._database()
        if not args.strip():
            return DB_USAGE.format(where=db.settings.where())
        return await query_text(db, args) + "\n"
