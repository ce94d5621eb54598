"""What non-admins see (issue 13, item 7): no file paths, DSNs or hostnames.

A database plugin is configured with a planted address (`app@127.0.0.1:<port>/shop`, nothing
listening) in a config dir whose path is known. Readers nobody vouched for (an API client
without the admin token, and the model itself) get `!help`, command output, tool descriptions
and tool errors without any of it; the shell and the log keep the whole text.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

import guard
from tests.conftest import free_port, openai_model
from tests.fakes.backend import text, tool_call
from tests.runtime import ALL_OPEN, runtime, turn


@pytest.fixture
async def planted(tmp_path: Path, fake_openai: Any):
    port = free_port()  # nothing listens there: every db_query fails to connect
    env = {"MYSQL_HOST": "127.0.0.1", "MYSQL_PORT": str(port), "MYSQL_USER": "app", "MYSQL_PASS": "pw",
           "MYSQL_DB": "shop"}
    async with runtime(tmp_path, {"fake": openai_model(fake_openai)}, env=env, gates=ALL_OPEN,
                       plugins=("plugin_database_mysql",)) as rt:
        yield rt, f"app@127.0.0.1:{port}/shop", str(tmp_path)


def leaks(text: str, dsn: str, config_dir: str) -> list[str]:
    return [s for s in (dsn, "127.0.0.1", dsn.split(":")[1].split("/")[0], config_dir, str(Path.home())) if s in text]


async def test_help_shows_where_things_are_to_the_shell_only(planted) -> None:
    rt, dsn, config_dir = planted
    shell_help, _ = await turn(rt, "!help", "c1")
    assert dsn in shell_help

    api_help, _ = await turn(rt, "!help", "api-stranger")
    assert leaks(api_help, dsn, config_dir) == []
    # The rest of the help is still there: commands, routes, resource names.
    assert "!model" in api_help and "!db <sql>" in api_help and "Database (plugin_database_mysql, <hidden>)" in api_help


async def test_the_model_never_learns_where_the_database_is(planted, fake_openai: Any, caplog) -> None:
    rt, dsn, config_dir = planted
    fake_openai.script(tool_call("db_query", {"sql": "SELECT 1"}), text("It failed."))
    with caplog.at_level(logging.WARNING):
        answer, _ = await turn(rt, "try the database", "c1")
    assert answer == "It failed."

    first, second = (json.dumps(r.json) for r in fake_openai.requests[-2:])
    assert "Run SQL on the MySQL/MariaDB database" in first and leaks(first, dsn, config_dir) == []
    (result,) = [m["content"] for m in fake_openai.requests[-1].json["messages"] if m["role"] == "tool"]
    assert result.startswith("ERROR: cannot connect to MySQL as <hidden>") and leaks(second, dsn, config_dir) == []
    # The administrator still finds the address in the log.
    assert any(dsn in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        (
            "MCP server on http://127.0.0.1:8766/mcp (bearer tokens from /home/u/.cfg/mcp-tokens.json)",
            "MCP server on <hidden> (bearer tokens from <hidden>)",
        ),
        (
            "cannot connect to MySQL as app@db.internal:3306/shop: refused",
            "cannot connect to MySQL as <hidden>: refused",
        ),
        ("redis at cache.lan:6379 and 10.1.2.3 and [::1]:8765", "redis at <hidden> and <hidden> and <hidden>"),
        ("cannot read C:\\Users\\ada\\agent\\.env", "cannot read <hidden>"),
        ("see /srv/agent/data/sessions.db", "see <data dir>/sessions.db"),
        # Names, routes, versions, table names and resource URIs are not locations.
        (
            "POST /api/v1/submit; agentmcp://sessions; Table 'shop.users' doesn't exist; v1.2.3; ada@example.org",
            "POST /api/v1/submit; agentmcp://sessions; Table 'shop.users' doesn't exist; v1.2.3; ada@example.org",
        ),
        # The sentence's punctuation after a location stays.
        (
            "model 'local' at http://127.0.0.1:11434/v1: the backend answered HTTP 500",
            "model 'local' at <hidden>: the backend answered HTTP 500",
        ),
        ("read /home/u/x.json: bad field; see https://h.example/docs.", "read <hidden>: bad field; see <hidden>."),
        (
            "session llama-10.0.0.1 active at 12:30, mysql:3306 down",
            "session llama-10.0.0.1 active at 12:30, <hidden> down",
        ),
    ],
)
def test_hide_locations(text: str, shown: str) -> None:
    assert guard.hide_locations(text, {"<data dir>": "/srv/agent/data"}) == shown
