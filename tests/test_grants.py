"""Grants: each scope allows exactly what it names; revocation, restarts and the audit chain."""

from __future__ import annotations

import io
import sqlite3
import subprocess
import sys
import threading

import pytest
from pydantic import BaseModel
from rich.console import Console

import audit_log
import build
import grants
from config import load_config
from shell_client import ShellClient
from shell_ui import ShellUI
from tests.conftest import ROOT, AgentServer, one_tool_plugin, openai_model
from tests.fakes.backend import text, tool_call
from tests.runtime import ALL_GATED, Recorder, add_plugin_tools, execute, runtime, turn, with_events
from tests.waiting import within_sync

BASE = "UPDATE users SET name = 'ada' WHERE id = 1"


class _Args(BaseModel):
    sql: str = ""
    query: str = ""


@pytest.fixture
async def gr(tmp_path, fake_openai):
    async with runtime(tmp_path, {"fake": openai_model(fake_openai)}, gates=ALL_GATED,
                       env={"GATE_TIMEOUT": "5"}) as rt:
        recorder = Recorder()
        tools = [recorder.tool("db_query", _Args), recorder.tool("web_search", _Args)]
        add_plugin_tools(rt, "plugin_test_grants", tools,
                         {"db_query": {"type": "db"}, "web_search": {"type": "search", "defining": ["query"]}})
        await rt.sessions.get_or_create("c1", "fake")
        await rt.sessions.get_or_create("c2", "fake")
        yield rt


async def call(rt, tool: str, args: dict, answer: str | None = "reject", client_id: str = "c1") -> bool:
    """Whether the call ran without asking (a gate is answered with `answer`)."""
    result, events = await with_events(rt, client_id, execute(rt, client_id, tool, args), answer)
    asked = any(e.name == "gate" for e in events)
    assert result.startswith("ok") != (asked and answer == "reject"), result
    return not asked


#: (scope, the call the grant answers, calls that it allows, near misses it must not allow)
SCOPES = [
    ("allow_for", ("db_query", {"sql": BASE}),
     [("db_query", {"sql": "DELETE FROM users WHERE id = 7"}), ("db_query", {"sql": "UPDATE `users` SET x = 1"})],
     [("db_query", {"sql": "UPDATE orders SET name = 'ada' WHERE id = 1"}),  # another table
      ("db_query", {"sql": "SELECT * FROM users"}),  # another permission
      ("db_query", {"sql": "UPDATE users, orders SET users.a = orders.b"}),  # a table beyond the grant
      ("db_query", {"sql": "CALL reset_users()"})]),  # cannot be analysed: never granted
    ("allow_session", ("db_query", {"sql": BASE}),
     [("db_query", {"sql": "INSERT INTO users VALUES (2, 'bob')"})],
     [("db_query", {"sql": "DROP TABLE orders"}), ("db_query", {"sql": "SELECT 1 FROM users"})]),
    ("allow_pattern", ("db_query", {"sql": BASE}),
     [("db_query", {"sql": "update users set name = 'bob' where id = 2"})],
     [("db_query", {"sql": "UPDATE users SET name = 'bob' WHERE id = 2 OR 1 = 1"}),  # another statement shape
      ("db_query", {"sql": "UPDATE users SET name = 'bob', admin = 1 WHERE id = 2"}),
      ("db_query", {"sql": "DELETE FROM users WHERE id = 1"}),
      ("db_query", {"sql": BASE + "; DROP TABLE users"})]),
    ("allow_pattern", ("web_search", {"query": "agent-mcp"}),
     [("web_search", {"query": "agent-mcp"})],
     [("web_search", {"query": "agent-mcp grants"})]),  # another value of a defining argument
    ("allow_for", ("web_search", {"query": "a"}),
     [("web_search", {"query": "anything else"})],
     [("db_query", {"sql": "SELECT 1 FROM users"})]),  # another tool
]


@pytest.mark.parametrize(("scope", "granted", "allowed", "refused"), SCOPES)
async def test_each_scope_allows_exactly_what_it_names(gr, scope, granted, allowed, refused) -> None:
    assert not await call(gr, *granted, answer=scope)  # asked once, answered with the grant
    (grant,) = gr.gate.grants.active("c1")
    assert grant.scope == scope and grant.granted_by == "" and grant.uses == 0
    for tool, args in allowed:
        assert await call(gr, tool, args), (scope, args)
    for tool, args in refused:
        assert not await call(gr, tool, args), (scope, args)
    assert not await call(gr, *granted, client_id="c2")  # another session: asked
    assert gr.gate.grants.active("c1")[0].uses == len(allowed)


async def test_a_timed_grant_ends_one_second_after_its_expiry(gr) -> None:
    now = [1_000_000.0]
    gr.gate.grants.clock = lambda: now[0]
    assert not await call(gr, "db_query", {"sql": BASE}, answer="allow_for")
    (grant,) = gr.gate.grants.active("c1")
    assert grant.expires is not None
    now[0] = grant.expires - 1
    assert await call(gr, "db_query", {"sql": BASE})
    now[0] = grant.expires + 1
    assert not await call(gr, "db_query", {"sql": BASE}) and gr.gate.grants.active("c1") == []


async def test_grants_are_listed_revoked_and_refused_to_clients_that_cannot_grant(gr) -> None:
    assert not await call(gr, "db_query", {"sql": BASE}, answer="allow_session")
    out, _ = await turn(gr, "!grants")
    (grant,) = gr.gate.grants.active("c1")
    assert f"[{grant.id}] write on users — until the session ends" in out and "used 0×" in out
    out, _ = await turn(gr, "!grants revoke nosuch")
    assert out.startswith("No active grant nosuch")
    out, _ = await turn(gr, f"!grants revoke {grant.id}")
    assert out.startswith(f"Revoked {grant.id}") and gr.gate.grants.active("c1") == []
    assert not await call(gr, "db_query", {"sql": BASE})
    # A client that may only allow once or reject cannot create a grant, and bad minutes are refused.
    with pytest.raises(grants.GrantError, match="only the shell, an admin API client or a human MCP token"):
        grants.Decision.parse("allow_for", may_grant=False)
    with pytest.raises(grants.GrantError, match="minutes must be a whole number"):
        grants.Decision.parse("allow_for", minutes=0)


async def test_grants_survive_a_restart_until_they_expire(tmp_path, fake_openai) -> None:
    async with runtime(tmp_path, {"fake": openai_model(fake_openai)}, gates=ALL_GATED) as rt:
        add_plugin_tools(rt, "plugin_test_grants", [Recorder().tool("db_query", _Args)], {"db_query": {"type": "db"}})
        await rt.sessions.get_or_create("c1", "fake")
        assert not await call(rt, "db_query", {"sql": BASE}, answer="allow_pattern")
        config = rt.config
    rt = await build.build_runtime(load_config(config.config_dir))
    try:
        add_plugin_tools(rt, "plugin_test_grants", [Recorder().tool("db_query", _Args)], {"db_query": {"type": "db"}})
        await rt.sessions.get_or_create("c1", "fake")
        (grant,) = rt.gate.grants.active("c1")
        assert grant.scope == "allow_pattern" and await call(rt, "db_query", {"sql": BASE.replace("1", "9")})
    finally:
        await build.close_runtime(rt)
    # With the server stopped, agentctl lists and revokes it (audited as agentctl); the chain stays whole.
    listed = _agentctl(config.config_dir, "grants")
    assert listed.returncode == 0 and f"c1: [{grant.id}] write on users" in listed.stdout and "used 1×" in listed.stdout
    revoked = _agentctl(config.config_dir, "grants", "revoke", "all")
    assert revoked.returncode == 0 and f"revoked {grant.id}" in revoked.stdout
    assert "No active grants." in _agentctl(config.config_dir, "grants").stdout
    path = config.data_dir() / grants.AUDIT_FILE
    assert [r["actor"] for r in audit_log.read_audit(path) if r["event"] == "revoke"] == ["agentctl"]
    assert audit_log.verify_file(path).head.count == len(list(audit_log.read_audit(path)))


def _agentctl(config_dir, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "agentctl.py"), "--config-dir", str(config_dir), *args],
                          capture_output=True, text=True, timeout=60)


async def test_the_audit_chain_names_a_changed_or_missing_record(gr) -> None:
    assert not await call(gr, "db_query", {"sql": BASE}, answer="allow_for")
    assert await call(gr, "db_query", {"sql": BASE})
    assert not await call(gr, "db_query", {"sql": "DROP TABLE orders"})
    await turn(gr, "!autogate search true")
    path = gr.config.data_dir() / grants.AUDIT_FILE
    await gr.gate.grants.flush()
    records = list(audit_log.read_audit(path))
    assert [r["event"] for r in records] == ["grant", "grant_used", "decision", "policy"]
    assert records[0]["actor"] == "" and records[2]["outcome"] == "rejected"
    assert all(BASE not in str(r) and "DROP" not in str(r) for r in records)  # a digest, never the arguments
    ok = _agentctl(gr.config.config_dir, "audit-verify")
    assert ok.returncode == 0 and "4 records, chain intact" in ok.stdout
    with sqlite3.connect(path) as db:  # one byte of an earlier record changed
        db.execute("UPDATE audit SET outcome = 'allowed' WHERE seq = 3")
    bad = _agentctl(gr.config.config_dir, "audit-verify")
    assert bad.returncode == 2 and "record 3 does not match its MAC" in bad.stderr + bad.stdout
    with sqlite3.connect(path) as db:
        db.execute("UPDATE audit SET outcome = 'rejected' WHERE seq = 3")
        db.execute("DELETE FROM audit WHERE seq = 2")
    with pytest.raises(grants.AuditError, match="record 2 is missing"):
        audit_log.verify_file(path)
    listed = _agentctl(gr.config.config_dir, "--json", "audit", "--session", "c1")
    assert listed.returncode == 0 and '"event": "grant"' in listed.stdout


DB_PLUGIN = one_tool_plugin("plugin_test_db", "db_query", "sql", r'"1 row changed"', {"type": "db"}, "Run SQL.")


async def test_revoking_from_another_window_stops_the_next_call_of_a_running_turn(
        config_dir, fake_openai, start_server) -> None:
    config_dir.models = {"fake": openai_model(fake_openai)}
    config_dir.add_plugin("plugin_test_db", DB_PLUGIN)
    server: AgentServer = start_server(config_dir)
    held = threading.Event()
    fake_openai.script(*(tool_call("db_query", {"sql": BASE.replace("1", str(n))}, hold=held if n == 3 else None)
                         for n in (1, 2, 3)), text("Stopped."))
    out = io.StringIO()
    async with ShellClient(server.url, "shell-a", token=server.token) as a, \
            ShellClient(server.url, "shell-b", token=server.token) as b:
        await a.connect(max_wait=10)
        await b.connect(max_wait=10)
        ui = ShellUI(Console(file=out, width=140), a)
        ui.begin_turn()
        await a.submit("rename the user")
        gates, grant_id = 0, None
        async for ev in a.events():
            await ui.handle_event(ev)
            if ev.name == "gate":
                gates += 1
                await ui.handle_key("t" if gates == 1 else "r")  # first: allow for 15 min; then: reject
            grant_id = ev.data.get("grant", grant_id)
            if ev.name == "status" and "allowed by grant" in ev.data.get("text", ""):
                await b.submit(f"!grants revoke {grant_id}")  # the shell may revoke any session's grant
                async for other in b.events():
                    if other.name == "tok":
                        assert other.text.startswith(f"Revoked {grant_id}")
                    if other.name == "done":
                        break
                held.set()
            if ev.name == "done":
                break
    assert gates == 2 and "allowed for 15 min" in out.getvalue()
    results = [m["content"] for m in fake_openai.requests[-1].json["messages"] if m["role"] == "tool"]
    assert results[:2] == ["1 row changed", "1 row changed"] and results[2].startswith("TOOL CALL REJECTED")


def _prompt_back(window, timeout: float = 20) -> bool:
    """Whether shell.py's prompt is waiting again (the last thing on the screen)."""
    return bool(within_sync(lambda: window.text.rstrip().endswith("›"), timeout))


@pytest.mark.timeout(180)  # shell.py under a terminal: its own waits (60 s) report what it showed
def test_shell_py_under_a_terminal_grants_with_one_key(config_dir, fake_openai, start_server, tmp_path) -> None:
    from tests.test_newcomer import Window

    config_dir.models = {"fake": openai_model(fake_openai)}
    config_dir.add_plugin("plugin_test_db", DB_PLUGIN)
    server: AgentServer = start_server(config_dir)
    fake_openai.script(tool_call("db_query", {"sql": BASE}), text("renamed"),
                       tool_call("db_query", {"sql": "DELETE FROM users WHERE id = 2"}), text("deleted"))
    session = tmp_path / "session"
    session.write_text("pty-grants")
    window = Window(server, session)
    try:
        assert window.shows("›", timeout=60), window.text[-800:]  # shell.py starts slowly on a busy machine
        window.type("rename ada\r")
        assert window.shows("[t] allow for 15 min") and window.shows("[p] allow this shape"), window.text[-1500:]
        assert "UPDATE users SET name = ?s WHERE id = ?n" in window.text  # what p would allow
        window.type("t")
        assert window.shows("allowed for 15 min") and window.shows("renamed") and _prompt_back(window)
        window.type("!grants\r")
        assert window.shows("Grants of this session") and _prompt_back(window), window.text[-800:]
        assert "write on users — 15 min left; granted by shell, used 0×" in window.text.split("Grants of this")[-1]
        window.type("now delete bob\r")  # another statement on the same table: the grant answers, no panel
        assert window.shows("deleted") and window.shows("allowed by grant"), window.text[-1500:]
        assert window.text.count("the agent asks to run a tool") == 1
    finally:
        window.close()
