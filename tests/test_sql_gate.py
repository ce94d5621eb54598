"""The db gate with sql.py: DDL is its own permission, shape grants tell literal types apart, keys follow the
server's case rule. Through the real GateKeeper (gate-defaults, !autoAIdb, grants) and a recording db tool."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
from pydantic import BaseModel

from config import GateDefaults
from tests.conftest import openai_model
from tests.runtime import Recorder, add_plugin_tools, execute, runtime, turn, with_events

WRITE_OPEN: dict[str, Any] = {"db": {"*": {"read": True, "write": True}, "__meta__": {"read": True}}, "tools": {}}
DDL = ["DROP TABLE users", "TRUNCATE users", "ALTER TABLE users ADD b INT", "RENAME TABLE users TO u2",
       "CREATE TABLE users2 LIKE users", "CREATE INDEX ix ON users (a)", "DROP INDEX ix ON users",
       "CREATE OR REPLACE TABLE users (a INT)", "CREATE TABLE copy AS SELECT * FROM users"]


class _Args(BaseModel):
    sql: str = ""


@pytest.fixture
async def make(tmp_path, fake_openai):
    """make(gates, case) → a runtime with those gate defaults and a recording `db_query` whose gate has
    `case_sensitive=case` (left out when None)."""
    made: list[Any] = []
    async with contextlib.AsyncExitStack() as stack:
        async def _make(gates: dict[str, Any], case: Any = None) -> Any:
            path = tmp_path / f"rt{len(made)}"
            path.mkdir()
            rt = await stack.enter_async_context(runtime(path, {"fake": openai_model(fake_openai)}, gates=gates,
                                                         env={"GATE_TIMEOUT": "5"}))
            spec: dict[str, Any] = {"type": "db"}
            if case is not None:
                spec["case_sensitive"] = case
            add_plugin_tools(rt, "plugin_test_sql_gate", [Recorder().tool("db_query", _Args)], {"db_query": spec})
            await rt.sessions.get_or_create("c1", "fake")
            made.append(rt)
            return rt

        yield _make


async def ran(rt: Any, sql: str, answer: str | None = "reject") -> bool:
    """Whether `sql` ran without asking (a gate is answered with `answer`)."""
    result, events = await with_events(rt, "c1", execute(rt, "c1", "db_query", {"sql": sql}), answer)
    asked = [e for e in events if e.name == "gate"]
    if asked:
        return False
    assert result.startswith("ok"), result
    return True


async def asked_op(rt: Any, sql: str) -> str:
    """The operation a gate asks about (the call is rejected)."""
    _, events = await with_events(rt, "c1", execute(rt, "c1", "db_query", {"sql": sql}), "reject")
    (gate,) = [e for e in events if e.name == "gate"]
    return str(gate.data["tool_args"]["operation_type"])


@pytest.mark.parametrize("statement", DDL)
async def test_ddl_asks_when_every_table_may_be_read_and_written(make, statement: str) -> None:
    rt = await make(WRITE_OPEN)
    assert await ran(rt, "UPDATE users SET a = 1")
    assert not await ran(rt, statement)
    assert await asked_op(rt, statement) == "ddl"


async def test_ddl_asks_under_a_write_grant_and_runs_under_a_ddl_grant(make) -> None:
    rt = await make({"db": {}, "tools": {}})
    assert not await ran(rt, "UPDATE users SET a = 1", answer="allow_session")  # asked once: a write grant
    assert await ran(rt, "DELETE FROM users WHERE a = 2")
    for statement in ("DROP TABLE users", "TRUNCATE users", "ALTER TABLE users ADD b INT"):
        assert not await ran(rt, statement), statement
    assert not await ran(rt, "TRUNCATE users", answer="allow_session")  # asked once: a ddl grant on users
    assert await ran(rt, "DROP TABLE users") and await ran(rt, "TRUNCATE users")
    assert not await ran(rt, "DROP TABLE orders")  # another table
    assert sorted(g.op for g in rt.gate.grants.active("c1")) == ["ddl", "write"]


async def test_autoaidb_write_never_opens_ddl_and_ddl_must_be_named(make) -> None:
    rt = await make({"db": {}, "tools": {}})
    out, _ = await turn(rt, "!autoAIdb users write true")
    assert "users write: auto-allow" in out
    out, _ = await turn(rt, "!autoAIdb users true")  # read and write, not ddl
    assert "users read+write: auto-allow" in out
    assert await ran(rt, "UPDATE users SET a = 1") and not await ran(rt, "DROP TABLE users")
    out, _ = await turn(rt, "!autoAIdb users ddl true")
    assert "users ddl: auto-allow" in out
    assert await ran(rt, "DROP TABLE users") and not await ran(rt, "DROP TABLE orders")
    out, _ = await turn(rt, "!autoAIdb status")
    assert ("users: read=auto-allow (this session), write=auto-allow (this session), "
            "ddl=auto-allow (this session)") in out
    out, _ = await turn(rt, "!autoAIdb write true")  # every table: still no ddl
    assert await ran(rt, "UPDATE orders SET a = 1") and not await ran(rt, "TRUNCATE orders")
    assert not await ran(rt, "CALL anything()")  # cannot be analysed: ddl on any table


async def test_gate_defaults_without_ddl_load_and_keep_ddl_gated(make) -> None:
    old = {"db": {"*": {"read": True, "write": True}, "users": {"read": True, "write": True}}, "tools": {}}
    assert GateDefaults.model_validate(old).db["users"].ddl is False
    rt = await make(old)
    rt.sessions.get("c1").settings["gates"] = {"db": {"orders": {"write": True}}}  # a stored override, no ddl
    assert await ran(rt, "UPDATE orders SET a = 1") and not await ran(rt, "DROP TABLE orders")
    assert not await ran(rt, "DROP TABLE users")


@pytest.mark.parametrize("other", ["DELETE FROM users WHERE name = 0", "DELETE FROM users WHERE name = NULL",
                                   "DELETE FROM users WHERE name = 0x6e", "DELETE FROM users WHERE name = TRUE",
                                   "DELETE FROM users WHERE name = name", "DELETE FROM users WHERE name = @v",
                                   "DELETE FROM users WHERE name LIKE '%'"])
async def test_name_0_under_a_string_shape_grant_asks(make, other: str) -> None:
    rt = await make({"db": {}, "tools": {}})
    assert not await ran(rt, "DELETE FROM users WHERE name = 'nobody'", answer="allow_pattern")
    (grant,) = rt.gate.grants.active("c1")
    assert grant.shape == "DELETE FROM users WHERE name = ?s"
    assert await ran(rt, "delete from users where name = 'somebody'")  # the same shape: a string
    assert not await ran(rt, other)


CaseRule = bool | Callable[[], bool | None] | None


@pytest.mark.parametrize(("case", "opened"), [
    (True, {"SELECT * FROM users"}),
    (False, {"SELECT * FROM users", "SELECT * FROM Users", "SELECT * FROM USERS"}),
    (lambda: None, {"SELECT * FROM users"}),  # not known (not connected yet): only what both rules allow
    (None, {"SELECT * FROM users"}),
])
async def test_an_allowed_table_opens_other_cases_only_where_the_server_ignores_case(
        make, case: CaseRule, opened: set[str]) -> None:
    rt = await make({"db": {"users": {"read": True}}, "tools": {}}, case)
    for statement in ("SELECT * FROM users", "SELECT * FROM Users", "SELECT * FROM USERS"):
        assert await ran(rt, statement) == (statement in opened), (case, statement)


@pytest.mark.parametrize(("case", "refused"), [(True, False), (False, True), (None, True)])
async def test_a_gated_table_stays_gated_in_any_case_where_the_server_ignores_case(
        make, case: CaseRule, refused: bool) -> None:
    rt = await make({"db": {"*": {"read": True}, "Secrets": {"read": False}}, "tools": {}}, case)
    assert not await ran(rt, "SELECT * FROM Secrets")
    # On a case-sensitive server `secrets` is another table (the `*` entry opens it); elsewhere it is Secrets.
    assert (not await ran(rt, "SELECT * FROM secrets")) == refused


async def test_a_grant_on_users_never_opens_Users_on_a_case_sensitive_server(make) -> None:
    rt = await make({"db": {}, "tools": {}}, lambda: True)
    assert not await ran(rt, "SELECT * FROM users", answer="allow_session")
    assert await ran(rt, "SELECT * FROM users")
    assert not await ran(rt, "SELECT * FROM Users")


async def test_a_case_rule_that_fails_counts_as_unknown(make) -> None:
    def broken() -> bool:
        raise RuntimeError("no connection")

    rt = await make({"db": {"users": {"read": True}}, "tools": {}}, broken)
    assert await ran(rt, "SELECT * FROM users") and not await ran(rt, "SELECT * FROM USERS")
