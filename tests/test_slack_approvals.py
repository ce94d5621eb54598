"""Slack buttons for gates routed to approvers (issue 29): real slack-sdk (Socket Mode + Web API) against the
fake Slack, which sends button presses as Slack does (`interactive` envelopes, `block_actions` payloads).

In process: a gate from a thread is posted with its buttons; an approver's click runs the tool and the message
is edited in place; a non-approver's click is refused with an ephemeral message and the gate stays open; a late
click is told who answered; a timeout edits the message; a proxy gate goes to the approver channel (anyone
there may answer) or to each approver's DM; two instances on one Redis post a gate once and either takes the
click. Over a real server: a gated `db_query` on MariaDB from a Slack thread, approved with a click.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pymysql
import pytest
from pydantic import BaseModel

import audit_log
import build
import decisions
import grants
import shared_store
import state
import stores
from approvals import MCP, Approver
from config import load_config
from tests import needs
from tests.conftest import ConfigDir, free_port, openai_model
from tests.fakes.backend import text, tool_call
from tests.fakes.openai_backend import FakeOpenAI
from tests.fakes.slack import APP_TOKEN, BOT_TOKEN, FakeSlack, Message
from tests.runtime import ALL_GATED, SHIPPED_NAMESPACES, Recorder, add_plugin_tools, as_request, execute
from tests.test_plugin_client_slack import PROXY_VARS, mention

LEAD, OTHER, NOBODY = "U0LEAD", "U0LEAD2", "U0NOBODY"
APPROVE_CHANNEL = "C0APPROVE"
PROXY_ID = "llama-10.0.0.9"
APPROVALS = {"timeout_seconds": 60, "classes": {
    "slack": {"slack_users": [LEAD], "tools": {"file_edit": {"slack_users": [LEAD], "timeout_seconds": 1},
                                               "web_search": {"slack_channel": APPROVE_CHANNEL}}},
    "proxy": {"slack_channel": APPROVE_CHANNEL,
              "tools": {"web_search": {"slack_users": [LEAD, OTHER]},
                        "file_edit": {"slack_channel": APPROVE_CHANNEL, "mcp_tokens": ["owner"]}}}}}
ALLOW, ALLOW_FOR, SESSION, PATTERN, REJECT = (f"agent-gate:{w}" for w in decisions.DECISIONS)


class _Args(BaseModel):
    sql: str = ""
    query: str = ""
    path: str = ""


@pytest.fixture
def fake_slack(monkeypatch):
    for var in PROXY_VARS:  # slack-sdk sends even 127.0.0.1 traffic through HTTPS_PROXY
        monkeypatch.delenv(var, raising=False)
    with FakeSlack() as fake:
        yield fake


@dataclass
class Bot:
    rt: state.Runtime
    plugin: Any
    slack: FakeSlack
    llm: FakeOpenAI
    recorder: Recorder


async def start(path: Path, llm: FakeOpenAI, slack: FakeSlack, store: stores.SessionStore | None = None,
                approvals_section: dict[str, Any] | None = APPROVALS) -> Bot:
    cfg = ConfigDir(path)
    cfg.models = {"fake": openai_model(llm)}
    cfg.gates = ALL_GATED
    cfg.plugins.append("plugin_client_slack")
    cfg.plugin_config["plugin_client_slack"] = {"api_base_url": slack.base_url, "port": free_port(),
                                                "update_interval": 0.05, "ping_interval": 1}
    if approvals_section is not None:
        cfg.enabled_extra = {"approvals": approvals_section}
    cfg.env = {"SLACK_BOT_TOKEN": BOT_TOKEN, "SLACK_APP_TOKEN": APP_TOKEN}
    rt = await build.build_runtime(load_config(cfg.write().path), store=store or stores.MemoryStore())
    rt.client_namespaces.update(SHIPPED_NAMESPACES)
    recorder = Recorder()
    tools = [recorder.tool(n, _Args) for n in ("db_query", "web_search", "file_edit")]
    add_plugin_tools(rt, "plugin_test_gates", tools, {"db_query": {"type": "db"}, "web_search": {"type": "search"},
                      "file_edit": {"type": "drive", "operation": "write"}})
    assert rt.plugins is not None
    report = await rt.plugins.load("plugin_client_slack")
    assert report.status == "loaded", report.line()
    plugin = next(p for p in rt.plugins.loaded if p.PLUGIN_NAME == "plugin_client_slack")
    return Bot(rt, plugin, slack, llm, recorder)


async def stop(bot: Bot) -> None:
    await build.close_runtime(bot.rt)


@pytest.fixture
async def bot(tmp_path, fake_openai, fake_slack):
    b = await start(tmp_path, fake_openai, fake_slack)
    await fake_slack.until(lambda: fake_slack.connections >= 1)
    yield b
    await stop(b)


def gate_message(slack: FakeSlack, channel: str, thread_ts: str | None = None) -> Message | None:
    """The first gate message (one with buttons, or once edited: with the 🔐 headline) in a channel/thread."""
    found = slack.thread(channel, thread_ts) if thread_ts else slack.in_channel(channel)
    return next((m for m in found if m.versions and m.versions[0] and "Approval needed" in m.block_text()), None)


async def posted(slack: FakeSlack, channel: str, thread_ts: str | None = None) -> Message:
    return await slack.until(lambda: gate_message(slack, channel, thread_ts))


async def closed(slack: FakeSlack, message: Message) -> Message:
    await slack.until(lambda: len(message.versions) > 1 and not message.buttons())
    return message


async def test_a_gate_from_a_thread_gets_buttons_and_an_approvers_click_runs_it(bot: Bot) -> None:
    bot.llm.script(tool_call("db_query", {"sql": "UPDATE users SET name = 'ada' WHERE id = 7"}), text("Renamed."))
    root = "1600000000.000001"
    bot.slack.push_event(mention("rename user 7 to ada", root))
    msg = await posted(bot.slack, "C1", root)
    # What the tool will do, who may answer (mentioned: their phone rings), until when, one button per answer.
    assert msg.thread_ts == root and msg.text.startswith("🔐 Approval needed: db_query (UPDATE users SET name = ?s")
    shown = msg.block_text()
    assert "`db_query` wants to *write* on *users*, asked from this thread" in shown
    assert "```UPDATE users SET name = ?s WHERE id = ?n```" in shown
    assert f"May answer: Slack user <@{LEAD}>" in shown and "<!date^" in shown
    assert list(msg.buttons()) == [ALLOW, ALLOW_FOR, SESSION, PATTERN, REJECT]
    assert [b["text"]["text"] for b in msg.buttons().values()] == [
        "Allow once", "Allow 15 min", "Allow for the session", "Allow this statement shape", "Reject"]
    assert bot.recorder.calls == []
    # The requester's placeholder says what it waits for.
    await bot.slack.until(lambda: [m for m in bot.slack.thread("C1", root)
                                   if m.text == "_🔐 waiting for approval of `db_query`…_"])
    click = bot.slack.click(msg, ALLOW, LEAD)
    await bot.slack.until(lambda: bot.slack.acked(click), within=3)
    await closed(bot.slack, msg)
    answer = await bot.slack.until(lambda: [m for m in bot.slack.thread("C1", root) if m.text == "Renamed."])
    assert [(n, a["sql"]) for n, a in bot.recorder.calls] == [
        ("db_query", "UPDATE users SET name = 'ada' WHERE id = 7")]
    assert f"✅ Allowed once by <@{LEAD}> at <!date^" in msg.block_text()
    assert "```UPDATE users SET name = ?s WHERE id = ?n```" in msg.block_text()  # what was decided stays readable
    assert f"✅ Allowed once by <@{LEAD}> at" in msg.text and msg.texts[0].endswith(f" · <@{LEAD}>")  # rings
    assert answer and bot.slack.ephemerals == []


async def test_a_non_approvers_click_is_refused_the_gate_stays_open_and_a_late_click_is_told(bot: Bot) -> None:
    bot.llm.script(tool_call("db_query", {"sql": "DELETE FROM users WHERE id = 3"}), text("Not deleted."))
    root = "1600000000.000002"
    bot.slack.push_event(mention("delete user 3", root))
    msg = await posted(bot.slack, "C1", root)
    click = bot.slack.click(msg, ALLOW, NOBODY)
    [told] = await bot.slack.until(lambda: bot.slack.told(NOBODY))
    assert bot.slack.acked(click)
    assert told.channel == "C1" and told.thread_ts == root
    assert told.text.startswith("⛔ You are not an approver of this gate; nothing was changed")
    assert f"<@{LEAD}>" in told.text
    # Nothing changed: the message still has its buttons, the gate is still open, the tool did not run.
    [gate] = await bot.rt.gate.desk.pending()
    assert len(msg.versions) == 1 and msg.buttons() and bot.recorder.calls == []
    bot.slack.click(msg, REJECT, LEAD)
    await closed(bot.slack, msg)
    assert f"⛔ Rejected by <@{LEAD}>" in msg.block_text()
    await bot.slack.until(lambda: [m for m in bot.slack.thread("C1", root) if m.text == "Not deleted."])
    note = next(m.text for m in bot.slack.thread("C1", root) if m.text.startswith("⛔ Not run"))
    assert f"rejected by slack:{LEAD}" in note and "shell.py" not in note  # no "Slack cannot approve" hint
    assert bot.recorder.calls == []
    # A click on the old message (a phone that had not refreshed) is told who answered; nothing changes.
    bot.slack.click(msg, ALLOW, LEAD, version=0)
    [late] = await bot.slack.until(lambda: bot.slack.told(LEAD))
    assert late.text.startswith(f"Already answered: ⛔ Rejected by <@{LEAD}>")
    _, closing = await bot.rt.gate.desk.get(gate.gate_id)
    assert closing is not None and closing.decision == "reject" and closing.by == f"slack:{LEAD}"
    assert bot.recorder.calls == [] and bot.plugin.approvals.stats["refused"] == 1
    # Both refusals are audited: the non-approver's (by the gate keeper) and the stale click (by the plugin).
    refused = [r for r in await audit(bot) if r["event"] == "approval_refused"]
    assert [(r["actor"], r["outcome"].split(" (")[0]) for r in refused] == [
        (f"slack:{NOBODY}", "not an approver of this gate"),
        (f"slack:{LEAD}", "refused: stale: the gate was closed already")]


async def test_malformed_clicks_change_nothing_and_the_real_one_still_counts(bot: Bot) -> None:
    await bot.rt.sessions.get_or_create(PROXY_ID, "fake")
    with as_request(bot.rt, PROXY_ID):
        call = asyncio.ensure_future(execute(bot.rt, PROXY_ID, "db_query", {"sql": "DELETE FROM t"}))
    msg = await posted(bot.slack, APPROVE_CHANNEL)
    gate_id = msg.buttons()[ALLOW]["value"]
    button = {"type": "button", "action_id": ALLOW, "value": gate_id}
    hostile = [{"type": "block_actions", "actions": "nope"}, {"type": "block_actions", "actions": ["x"]},
               {"type": "block_actions", "user": "U0X", "actions": [button]},
               {"type": "block_actions", "user": {"id": LEAD}, "channel": [1], "actions": [
                   {**button, "action_id": "agent-gate:allow_forever"}]},
               {"type": "block_actions", "user": {"id": LEAD}, "actions": [{**button, "value": "g" * 5000}]},
               {"type": "view_submission", "user": {"id": LEAD}, "actions": [button]}]
    sent = [bot.slack.send_raw({"envelope_id": f"e{i}", "type": "interactive", "payload": p}) for i, p in
            enumerate(hostile)]
    assert sent == [None] * len(hostile)
    bot.slack.click(msg, REJECT, NOBODY)  # a real click after them still counts
    await closed(bot.slack, msg)
    assert (await bot.rt.gate.desk.get(gate_id))[1].by == f"slack:{NOBODY}"
    async with asyncio.timeout(10):
        assert "REJECTED" in await call
    assert bot.recorder.calls == [] and bot.slack.ephemerals == []  # none said who and where: nobody to tell
    # Each of them is audited (the app's only interactive elements are gate buttons).
    refused = [r for r in await audit(bot) if r["event"] == "approval_refused"]
    assert [r["outcome"].split(":")[0:2] for r in refused] == [["refused", " malformed"]] * len(hostile)
    assert refused[2]["actor"] == "slack:?" and refused[3]["actor"] == f"slack:{LEAD}"
    assert refused[3]["session"] == PROXY_ID and refused[3]["tool"] == "db_query"  # the gate it named
    assert "'view_submission' payload is no button click" in refused[5]["outcome"]
    assert bot.plugin.approvals.stats["forged"] == len(hostile)


async def audit(bot: Bot) -> list[dict[str, Any]]:
    await bot.rt.gate.grants.flush()
    return list(audit_log.read_audit(bot.rt.config.data_dir() / grants.AUDIT_FILE))


async def test_a_forged_click_naming_another_sessions_gate_is_refused_quietly_audited_and_told(
        bot: Bot, caplog: pytest.LogCaptureFixture) -> None:
    """A click whose button names the gate of a shell session (not routed to Slack): refused with a WARNING line
    and no traceback, audited, the clicker told; the gate still waits for its own session."""
    victim = "shell-victim"
    await bot.rt.sessions.get_or_create(victim, "fake")
    with as_request(bot.rt, victim):
        call = asyncio.ensure_future(execute(bot.rt, victim, "db_query", {"sql": "DELETE FROM t"}))
    await bot.slack.until(lambda: any(c == victim for c, _ in bot.rt.gate.pending.values()))
    gate_id = next(g for g, (c, _) in bot.rt.gate.pending.items() if c == victim)
    root = "1600000000.000077"
    forged = {"type": "block_actions", "user": {"id": LEAD}, "channel": {"id": "C1"},
              "container": {"type": "message", "channel_id": "C1", "thread_ts": root},
              "actions": [{"type": "button", "action_id": ALLOW, "value": gate_id}]}
    bot.slack.send_raw({"envelope_id": "forged-1", "type": "interactive", "payload": forged})
    [told] = await bot.slack.until(lambda: bot.slack.told(LEAD))
    assert (told.channel, told.thread_ts) == ("C1", root)
    assert told.text == "⛔ That button does not belong to a gate you can answer here; nothing was changed."
    (record,) = [r for r in await audit(bot) if r["event"] == "approval_refused"]
    assert (record["actor"], record["session"]) == (f"slack:{LEAD}", victim)
    assert record["outcome"].startswith("refused: the gate is of another session")
    assert json.loads(record["detail"])["plugin"] == "plugin_client_slack"
    assert gate_id in bot.rt.gate.pending and not call.done()  # nothing changed
    slack_lines = [r for r in caplog.records if r.name.startswith("agent_mcp.slack")]
    assert [r.levelname for r in slack_lines if "click" in r.getMessage()] == ["WARNING"]
    assert not any(r.exc_info or r.levelname == "ERROR" for r in slack_lines)
    assert await bot.rt.gate.resolve(gate_id, "reject", by="shell")
    async with asyncio.timeout(10):
        assert "REJECTED" in await call


async def test_a_gate_nobody_answers_times_out_and_its_message_says_so(bot: Bot) -> None:
    bot.llm.script(tool_call("file_edit", {"path": "notes.txt"}), text("It was not approved in time."))
    root = "1600000000.000003"
    bot.slack.push_event(mention("edit my notes", root))
    msg = await posted(bot.slack, "C1", root)
    [gate] = await bot.rt.gate.desk.pending()
    assert list(msg.buttons()) == [ALLOW, *(f"agent-gate:{s}" for s in gate.scopes), REJECT]
    await closed(bot.slack, msg)
    assert "⌛ No answer within 1 s: rejected" in msg.block_text()
    await bot.slack.until(lambda: [m for m in bot.slack.thread("C1", root) if m.text == "It was not approved in time."])
    assert bot.recorder.calls == []


async def test_a_thread_whose_gate_goes_to_an_approver_channel_says_so_and_the_channel_answers(bot: Bot) -> None:
    bot.llm.script(tool_call("web_search", {"query": "competitor prices"}), text("Searched."))
    root = "1600000000.000004"
    bot.slack.push_event(mention("look up competitor prices", root))
    in_thread, in_channel = await posted(bot.slack, "C1", root), await posted(bot.slack, APPROVE_CHANNEL)
    # Nobody may answer in the thread (the route names a channel, no users): no buttons there, it says where.
    assert in_thread.buttons() == {} and f"May answer: Slack channel <#{APPROVE_CHANNEL}>" in in_thread.block_text()
    assert "asked from a thread in <#C1>" in in_channel.block_text() and ALLOW in in_channel.buttons()
    bot.slack.click(in_channel, REJECT, NOBODY)
    for msg in (in_thread, in_channel):
        await bot.slack.until(lambda msg=msg: len(msg.versions) > 1)
        assert f"⛔ Rejected by <@{NOBODY}>" in msg.block_text() and msg.buttons() == {}
    await bot.slack.until(lambda: [m for m in bot.slack.thread("C1", root) if m.text == "Searched."])
    assert bot.recorder.calls == []


async def test_a_proxy_gate_goes_to_the_approver_channel_where_any_member_may_answer(bot: Bot) -> None:
    await bot.rt.sessions.get_or_create(PROXY_ID, "fake")
    with as_request(bot.rt, PROXY_ID):
        call = asyncio.ensure_future(execute(bot.rt, PROXY_ID, "db_query", {"sql": "INSERT INTO t VALUES (1)"}))
    msg = await posted(bot.slack, APPROVE_CHANNEL)
    assert msg.thread_ts is None and f"asked from the chat proxy session `{PROXY_ID}`" in msg.block_text()
    assert f"May answer: Slack channel <#{APPROVE_CHANNEL}>" in msg.block_text()
    bot.slack.click(msg, ALLOW_FOR, NOBODY)  # no slack_users listed: anyone in the channel answers
    await closed(bot.slack, msg)
    async with asyncio.timeout(10):
        assert (await call).startswith("ok:")
    assert f"✅ Allowed for 15 min by <@{NOBODY}>" in msg.block_text()
    gate_id = msg.versions[0][-1]["elements"][0]["value"]  # the buttons' value is the gate id
    _, closing = await bot.rt.gate.desk.get(gate_id)
    assert closing is not None and closing.channel == f"slack-channel:{APPROVE_CHANNEL}" and closing.minutes == 15


async def test_a_gate_for_named_users_without_a_channel_goes_to_each_of_them_privately(bot: Bot) -> None:
    await bot.rt.sessions.get_or_create(PROXY_ID, "fake")
    with as_request(bot.rt, PROXY_ID):
        call = asyncio.ensure_future(execute(bot.rt, PROXY_ID, "web_search", {"query": "salaries 2026"}))
    first, second = await posted(bot.slack, f"D{LEAD}"), await posted(bot.slack, f"D{OTHER}")
    assert gate_message(bot.slack, APPROVE_CHANNEL) is None
    assert '"query": "salaries 2026"' in first.block_text()  # the arguments, as the gate's summary
    bot.slack.click(second, ALLOW, OTHER)
    async with asyncio.timeout(10):
        assert (await call).startswith("ok:")
    for msg in (first, second):  # both approvers' DMs say who decided
        await closed(bot.slack, msg)
        assert f"✅ Allowed once by <@{OTHER}>" in msg.block_text()


async def test_a_gate_answered_elsewhere_is_closed_on_slack_too(bot: Bot) -> None:
    await bot.rt.sessions.get_or_create(PROXY_ID, "fake")
    with as_request(bot.rt, PROXY_ID):
        call = asyncio.ensure_future(execute(bot.rt, PROXY_ID, "file_edit", {"path": "plan.md"}))
    msg = await posted(bot.slack, APPROVE_CHANNEL)
    [gate] = await bot.rt.gate.desk.pending()
    result = await bot.rt.gate.answer(gate.gate_id, "reject", answerer=Approver(MCP, "owner"), channel="mcp")
    assert result.answered
    await closed(bot.slack, msg)
    assert "⛔ Rejected by MCP token 'owner' at" in msg.block_text()
    async with asyncio.timeout(10):
        assert "REJECTED" in await call
    bot.slack.click(msg, ALLOW, NOBODY, version=0)  # from a screen that still shows the buttons
    [late] = await bot.slack.until(lambda: bot.slack.told(NOBODY))
    assert late.text.startswith("Already answered: ⛔ Rejected by MCP token 'owner'")
    assert bot.recorder.calls == []


async def test_without_approvals_slack_posts_no_buttons_and_refuses_as_before(tmp_path, fake_openai,
                                                                              fake_slack) -> None:
    bot = await start(tmp_path, fake_openai, fake_slack, approvals_section=None)
    try:
        assert bot.plugin.approvals is None and bot.rt.gate.desk is None
        await fake_slack.until(lambda: fake_slack.connections >= 1)
        fake_openai.script(tool_call("db_query", {"sql": "DELETE FROM users"}), text("Could not."))
        root = "1600000000.000009"
        fake_slack.push_event(mention("delete everyone", root))
        await fake_slack.until(lambda: len(fake_slack.thread("C1", root)) == 2
                               and not fake_slack.thread("C1", root)[0].text.endswith("…_"))
        note = fake_slack.thread("C1", root)[1].text
        assert note.startswith("⛔ Not run: db_query (write on users) needs approval, which Slack cannot give")
        assert "shell.py" in note and all(m.blocks == [] for m in fake_slack.thread("C1", root))
        assert bot.recorder.calls == []
    finally:
        await stop(bot)


async def test_two_instances_on_one_redis_post_a_gate_once_and_either_takes_the_click(tmp_path, fake_openai,
                                                                                        fake_slack, redis_store):
    pair = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        pair.append(await start(tmp_path / name, fake_openai, fake_slack,
                                store=shared_store.open_store(redis_store, tmp_path / name)))
    try:
        await fake_slack.until(lambda: fake_slack.connections >= 2)
        await pair[0].rt.sessions.get_or_create(PROXY_ID, "fake")
        with as_request(pair[0].rt, PROXY_ID):
            call = asyncio.ensure_future(execute(pair[0].rt, PROXY_ID, "db_query", {"sql": "UPDATE t SET a = 1"}))
        msg = await posted(fake_slack, APPROVE_CHANNEL)
        # Both instances saw the gate on the feed; one posted it.
        await fake_slack.until(lambda: sum(b.plugin.approvals.stats["posted"] for b in pair) == 1)
        poster = next(i for i, b in enumerate(pair) if b.plugin.approvals.stats["posted"])
        other = 1 - poster
        # The click reaches the instance that did not post the gate (its own Socket Mode connection).
        fake_slack.click(msg, ALLOW, LEAD, socket=other)
        async with asyncio.timeout(15):
            assert (await call).startswith("ok:")
        await closed(fake_slack, msg)
        assert f"✅ Allowed once by <@{LEAD}>" in msg.block_text()
        assert pair[other].plugin.approvals.stats["answered"] == 1
        assert len(fake_slack.in_channel(APPROVE_CHANNEL)) == 1
    finally:
        for b in pair:
            await stop(b)


# ── over a real server, with MariaDB ────────────────────────────────────────────────────────

MYSQL = {"host": os.environ.get("TEST_MYSQL_HOST", "127.0.0.1"), "port": int(os.environ.get("TEST_MYSQL_PORT", "3306")),
         "user": os.environ.get("TEST_MYSQL_USER", "root"), "password": os.environ.get("TEST_MYSQL_PASS", "")}


@pytest.fixture
def people() -> Any:
    try:
        admin = pymysql.connect(**MYSQL, autocommit=True, connect_timeout=5)
    except pymysql.err.MySQLError as exc:
        needs.absent("mariadb", f"MariaDB is not reachable at {MYSQL['host']}:{MYSQL['port']} as {MYSQL['user']} "
                                f"({exc}): start mariadb-server")
    name, user, password = (f"amcp_slackappr_{secrets.token_hex(4)}", f"amcp_sa_{secrets.token_hex(4)}",
                            secrets.token_hex(12))
    try:
        with admin.cursor() as cur:
            cur.execute(f"CREATE DATABASE `{name}`")
            cur.execute("CREATE USER %s@'%%' IDENTIFIED BY %s", (user, password))
            cur.execute(f"GRANT ALL PRIVILEGES ON `{name}`.* TO %s@'%%'", (user,))
            cur.execute(f"CREATE TABLE `{name}`.people (id INT PRIMARY KEY, name VARCHAR(40))")
            cur.execute(f"INSERT INTO `{name}`.people VALUES (7, 'bob')")
        yield name, {"MYSQL_HOST": MYSQL["host"], "MYSQL_PORT": str(MYSQL["port"]), "MYSQL_USER": user,
                     "MYSQL_PASS": password, "MYSQL_DB": name}, admin
    finally:
        with admin.cursor() as cur:
            cur.execute(f"DROP DATABASE IF EXISTS `{name}`")
            cur.execute("DROP USER IF EXISTS %s@'%%'", (user,))
        admin.close()


def test_the_server_posts_a_db_query_gate_in_the_thread_and_an_approvers_click_runs_it_on_mariadb(
        people, config_dir, fake_openai, fake_slack, start_server) -> None:
    name, env, admin = people
    config_dir.models = {"gpt": openai_model(fake_openai)}
    config_dir.gates = ALL_GATED
    config_dir.plugins += ["plugin_client_slack", "plugin_database_mysql"]
    config_dir.plugin_config["plugin_client_slack"] = {"api_base_url": fake_slack.base_url, "port": free_port()}
    config_dir.enabled_extra = {"approvals": {"classes": {"slack": {"slack_users": [LEAD]}}}}
    config_dir.env = {"SLACK_BOT_TOKEN": BOT_TOKEN, "SLACK_APP_TOKEN": APP_TOKEN, **env}
    server = start_server(config_dir)
    fake_slack.wait_for(lambda: fake_slack.connections >= 1, 20)
    fake_openai.script(tool_call("db_query", {"sql": "UPDATE people SET name = 'ada' WHERE id = 7"}),
                       text("Renamed."))
    root = "1600000000.000100"
    fake_slack.push_event(mention("rename person 7 to ada", root))
    msg = fake_slack.wait_for(lambda: gate_message(fake_slack, "C1", root), 20)
    assert "```UPDATE people SET name = ?s WHERE id = ?n```" in msg.block_text()
    fake_slack.click(msg, ALLOW, NOBODY)
    fake_slack.wait_for(lambda: fake_slack.told(NOBODY), 20)
    with admin.cursor() as cur:
        cur.execute(f"SELECT name FROM `{name}`.people WHERE id = 7")
        assert cur.fetchone() == ("bob",)  # refused: not run
    fake_slack.click(msg, ALLOW, LEAD)
    fake_slack.wait_for(lambda: [m for m in fake_slack.thread("C1", root) if m.text == "Renamed."], 20)
    fake_slack.wait_for(lambda: len(msg.versions) > 1 and not msg.buttons(), 20)
    assert f"✅ Allowed once by <@{LEAD}>" in msg.block_text()
    with admin.cursor() as cur:
        cur.execute(f"SELECT name FROM `{name}`.people WHERE id = 7")
        assert cur.fetchone() == ("ada",)
    out = server.stop()
    assert BOT_TOKEN not in out and APP_TOKEN not in out and "Traceback" not in out
    records = [r for r in audit_log.read_audit(server.data_dir / grants.AUDIT_FILE) if r["event"] == "decision"]
    assert records and records[-1]["actor"] == f"slack:{LEAD}"
    assert json.loads(records[-1]["detail"])["channel"] == "slack"
    assert any(r["event"] == "approval_refused" and r["actor"] == f"slack:{NOBODY}"
               for r in audit_log.read_audit(server.data_dir / grants.AUDIT_FILE))
