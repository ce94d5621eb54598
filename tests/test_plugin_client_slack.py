"""The Slack plugin end to end in-process: real slack-sdk (Socket Mode + Web API) against the fake Slack."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import threading
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from langchain_core.tools import StructuredTool
from pydantic import BaseModel
from starlette.applications import Starlette

import build
import gate
import shared_store
import state
import stores
from config import DEFAULTS_DIR, GatePermission, load_config
from plugin_api import BasePlugin
from plugins._slack_text import split_message, to_mrkdwn
from tests.conftest import ConfigDir, free_port, openai_model
from tests.fakes.backend import error, text, tool_call
from tests.fakes.openai_backend import FakeOpenAI
from tests.fakes.slack import APP_TOKEN, BOT_ID, BOT_TOKEN, BOT_USER_ID, FakeSlack, Message

PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")
WORKING = "_⏳ working…_"


class NoArgs(BaseModel):
    pass


@pytest.fixture
def fake_slack(monkeypatch):
    # slack-sdk sends even 127.0.0.1 traffic through HTTPS_PROXY (it ignores NO_PROXY).
    for var in PROXY_VARS:
        monkeypatch.delenv(var, raising=False)
    with FakeSlack(echo_bot_messages=True) as fake:
        yield fake


@dataclass
class Harness:
    rt: state.Runtime
    plugin: Any
    slack: FakeSlack
    llm: FakeOpenAI
    _ts = itertools.count(1)

    def ts(self) -> str:
        """A new message timestamp (as Slack makes them: seconds.micro)."""
        return f"{1_600_000_000 + next(self._ts)}.000{next(self._ts):03d}"

    async def final(self, channel: str, thread_ts: str, count: int = 1, within: float = 15) -> list[Message]:
        """The bot's messages in a thread once `count` of them exist and none shows work in progress."""
        def done() -> list[Message] | None:
            msgs = self.slack.thread(channel, thread_ts)
            busy = any(m.text.endswith("…_") for m in msgs)  # previews end with a "working…" line
            return msgs if len(msgs) >= count and not busy else None

        return await self.slack.until(done, within)


def mention(text_: str, ts: str, *, channel: str = "C1", thread_ts: str | None = None, user: str = "U1") -> dict:
    return {"type": "app_mention", "user": user, "text": f"<@{BOT_USER_ID}> {text_}", "channel": channel, "ts": ts,
            "event_ts": ts, **({"thread_ts": thread_ts} if thread_ts else {})}


def message(text_: str, ts: str, *, channel: str = "C1", thread_ts: str | None = None, user: str = "U1",
            channel_type: str = "channel", **extra: Any) -> dict:
    return {"type": "message", "user": user, "text": text_, "channel": channel, "channel_type": channel_type,
            "ts": ts, "event_ts": ts, **({"thread_ts": thread_ts} if thread_ts else {}), **extra}


async def start_slack(tmp_path, llm: FakeOpenAI, slack: FakeSlack, env: dict[str, str] | None = None,
                      store: stores.SessionStore | None = None, **settings: Any) -> tuple[state.Runtime, Any]:
    cfg = ConfigDir(tmp_path)
    cfg.models = {"fake": openai_model(llm)}
    cfg.plugins.append("plugin_client_slack")
    cfg.plugin_config["plugin_client_slack"] = {
        "api_base_url": slack.base_url, "port": free_port(), "update_interval": 0.05, "ping_interval": 1, **settings,
    }
    cfg.env = env if env is not None else {"SLACK_BOT_TOKEN": BOT_TOKEN, "SLACK_APP_TOKEN": APP_TOKEN}
    rt = await build.build_runtime(load_config(cfg.write().path), store=store or stores.MemoryStore())
    assert rt.plugins is not None
    await rt.plugins.load("plugin_client_slack")
    # As agent-mcp.serve does before its ports listen: the first turn then waits for no model build, so turns
    # reach the fake model in the order their events came (the scripted replies are handed out in that order).
    await rt.agent.warm(rt.config.default_model)
    plugin = next((p for p in rt.plugins.loaded if p.PLUGIN_NAME == "plugin_client_slack"), None)
    return rt, plugin


async def stop_slack(rt: state.Runtime) -> None:
    await build.close_runtime(rt)


@pytest.fixture
async def bot(tmp_path, fake_openai, fake_slack):
    rt, plugin = await start_slack(tmp_path, fake_openai, fake_slack)
    assert plugin is not None, rt.plugins.reports["plugin_client_slack"].reasons
    await fake_slack.until(lambda: fake_slack.connections >= 1)
    yield Harness(rt, plugin, fake_slack, fake_openai)
    await stop_slack(rt)


# ── conversation ────────────────────────────────────────────────────────────────────────────


async def test_mention_is_answered_in_its_thread_and_the_thread_continues_the_session(bot):
    root = bot.ts()
    env = bot.slack.push_event(mention("what is 2+2?", root))
    [reply] = await bot.final("C1", root)
    assert reply.text == "echo: what is 2+2?" and reply.texts[0] == WORKING  # placeholder first, then edited
    assert bot.slack.acked(env)
    post = bot.slack.calls_of("chat.postMessage")[0]
    assert post.args["thread_ts"] == root and post.token == BOT_TOKEN
    # A follow-up in the thread, without a mention: same session, so the model sees the first exchange.
    bot.slack.push_event(message("and times 3?", bot.ts(), thread_ts=root))
    replies = await bot.final("C1", root, count=2)
    assert replies[1].text == "echo: and times 3?"
    history = bot.llm.requests[-1].json["messages"]
    assert [m["content"] for m in history if m["role"] != "system"] == [
        "what is 2+2?", "echo: what is 2+2?", "and times 3?"]
    session = bot.rt.sessions.get(f"slack-C1-{root}")
    assert session is not None and len(session.history) == 4


async def test_direct_message_is_answered(bot):
    ts = bot.ts()
    bot.slack.push_event(message("hello in private", ts, channel="D42", channel_type="im"))
    [reply] = await bot.final("D42", ts)
    assert reply.text == "echo: hello in private"
    assert bot.rt.sessions.get(f"slack-D42-{ts}") is not None


async def test_channel_chatter_outside_the_bots_threads_is_ignored(bot):
    bot.slack.push_event(message("just chatting", bot.ts()))
    bot.slack.push_event(message("a reply in someone else's thread", bot.ts(), thread_ts=bot.ts()))
    root = bot.ts()
    bot.slack.push_event(mention("now you", root))
    await bot.final("C1", root)
    assert [r.last_user_text for r in bot.llm.requests] == ["now you"]
    assert bot.plugin.ignored["channel message outside the bot's threads"] == 2


async def test_messages_in_one_thread_are_answered_in_order(bot):
    root = bot.ts()
    bot.slack.push_event(mention("one", root))
    bot.slack.push_event(message("two", bot.ts(), thread_ts=root))
    bot.slack.push_event(message("three", bot.ts(), thread_ts=root))
    replies = await bot.final("C1", root, count=3)
    assert [m.text for m in replies] == ["echo: one", "echo: two", "echo: three"]
    assert [r.last_user_text for r in bot.llm.requests] == ["one", "two", "three"]


# ── acks, retries, duplicates, self-filtering ────────────────────────────────────────────────


async def test_every_envelope_is_acked_within_3_seconds_while_the_model_is_slow(bot):
    hold = threading.Event()
    bot.llm.script(text("Thinking ", "hard.", hold=hold))
    root = bot.ts()
    first = bot.slack.push_event(mention("slow one", root))
    await bot.slack.until(lambda: bot.slack.acked(first), within=3)
    # The model has not finished (it waits for `hold`); the ack did not wait for it.
    other = bot.slack.push_event(message("meanwhile, in private", bot.ts(), channel="D1", channel_type="im"))
    await bot.slack.until(lambda: bot.slack.acked(other), within=3)
    # The first words stream into the placeholder while the model is still working.
    await bot.slack.until(lambda: any(m.text.startswith("Thinking") for m in bot.slack.thread("C1", root)))
    assert not hold.is_set()
    hold.set()
    [reply] = await bot.final("C1", root)
    assert reply.text == "Thinking hard."
    for env in bot.slack.envelopes:
        await bot.slack.until(lambda env=env: bot.slack.acked(env), within=3)
        assert env.acked is not None and env.acked - env.sent < 3
        assert env.ack == {"envelope_id": env.envelope_id}


async def test_a_retried_event_and_a_mention_that_is_also_a_message_are_processed_once(bot):
    root = bot.ts()
    first = bot.slack.push_event(mention("first", root))
    retry = bot.slack.push_event(mention("first", root), event_id=first.event_id, retry_attempt=1,
                                 retry_reason="timeout")
    await bot.final("C1", root)
    # In the bot's thread a mention arrives twice: as app_mention and as message (one post, one ts).
    ts = bot.ts()
    bot.slack.push_event(message(f"<@{BOT_USER_ID}> second", ts, thread_ts=root))
    bot.slack.push_event(mention("second", ts, thread_ts=root))
    # Answers in a thread come in order, so once this one is there any duplicate would be too.
    bot.slack.push_event(message("third", bot.ts(), thread_ts=root))
    replies = await bot.final("C1", root, count=3)
    assert [m.text for m in replies] == ["echo: first", "echo: second", "echo: third"]
    assert [r.last_user_text for r in bot.llm.requests] == ["first", "second", "third"]
    assert bot.slack.acked(retry)  # duplicates are acknowledged too, or Slack keeps retrying
    assert bot.plugin.ignored["repeated delivery of an event"] == 1
    assert bot.plugin.ignored["message already handled (mention and message of one post)"] == 1


async def test_two_instances_on_one_redis_answer_each_message_once_and_share_threads(tmp_path, fake_openai,
                                                                                      fake_slack, redis_store):
    """Slack spreads an app's events over its connections, and redelivers on any of them."""
    pair = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        pair.append(await start_slack(tmp_path / name, fake_openai, fake_slack,
                                      store=shared_store.open_store(redis_store, tmp_path / name)))
    try:
        await fake_slack.until(lambda: fake_slack.connections >= 2)
        harness = Harness(pair[0][0], pair[0][1], fake_slack, fake_openai)
        root = harness.ts()
        first = fake_slack.push_event(mention("first", root), socket=0)
        fake_slack.push_event(mention("first", root), event_id=first.event_id, retry_attempt=1, socket=1)
        await harness.final("C1", root)
        # A reply in that thread reaching the other instance continues the same session there.
        fake_slack.push_event(message("second", harness.ts(), thread_ts=root), socket=1)
        replies = await harness.final("C1", root, count=2)
        assert [m.text for m in replies] == ["echo: first", "echo: second"]
        assert [r.last_user_text for r in fake_openai.requests] == ["first", "second"]
        assert [m["content"] for m in fake_openai.requests[-1].json["messages"][1:]] == \
            ["first", "echo: first", "second"]
        ignored = pair[0][1].ignored + pair[1][1].ignored
        assert ignored["repeated delivery of an event (handled by another instance)"] == 1
    finally:
        for rt, _ in pair:
            await stop_slack(rt)


async def test_the_bots_own_messages_and_edits_are_ignored(bot):
    root = bot.ts()
    bot.slack.push_event(mention("hi", root))
    await bot.final("C1", root)
    # The fake echoed the bot's placeholder post and its edits back, as Slack does.
    echoed = [e for e in bot.slack.envelopes if e.body["payload"]["event"].get("bot_id") == BOT_ID
              or e.body["payload"]["event"].get("subtype") == "message_changed"]
    assert echoed
    # And explicitly: the bot's own message in its own thread, and in a DM.
    bot.slack.push_event(message("echo: hi", bot.ts(), thread_ts=root, user=BOT_USER_ID, bot_id=BOT_ID))
    bot.slack.push_event(message("from me", bot.ts(), channel="D1", channel_type="im", user=BOT_USER_ID))
    bot.slack.push_event(message("another bot", bot.ts(), thread_ts=root, user="U9", bot_id="B9"))
    bot.slack.push_event(message("old", bot.ts(), thread_ts=root, subtype="message_deleted"))
    bot.slack.push_event(message("sentinel", bot.ts(), thread_ts=root))
    replies = await bot.final("C1", root, count=2)
    assert [m.text for m in replies] == ["echo: hi", "echo: sentinel"]
    assert [r.last_user_text for r in bot.llm.requests] == ["hi", "sentinel"]
    assert bot.plugin.ignored["a bot's message"] >= 3
    assert bot.plugin.ignored["message subtype 'message_changed'"] >= 1


# ── connection ──────────────────────────────────────────────────────────────────────────────


async def test_disconnect_makes_the_client_reconnect_and_the_next_message_is_answered(bot):
    bot.slack.send_disconnect("refresh_requested")
    # The client opens a new connection, then closes the old one.
    await bot.slack.until(lambda: bot.slack.connections == 2 and bot.slack.opens == 2 and bot.slack.live == 1)
    root = bot.ts()
    bot.slack.push_event(mention("after the refresh", root))
    [reply] = await bot.final("C1", root)
    assert reply.text == "echo: after the refresh"


async def test_a_dropped_socket_is_replaced(bot):
    bot.slack.drop_socket()
    await bot.slack.until(lambda: bot.slack.connections == 2 and bot.slack.live == 1)
    root = bot.ts()
    bot.slack.push_event(mention("still there?", root))
    [reply] = await bot.final("C1", root)
    assert reply.text == "echo: still there?"
    assert bot.plugin.stats["connections"] >= 2


# ── what is posted ──────────────────────────────────────────────────────────────────────────


async def test_a_long_answer_with_a_code_block_is_split_without_breaking_the_code(bot):
    bot.plugin.settings = bot.plugin.settings.model_copy(update={"max_message_chars": 400})
    code = [f"    print('line {i}')  # a < b & c" for i in range(40)]
    answer = ("## Result\n\nHere is **the** script:\n\n```python\ndef main():\n" + "\n".join(code)
              + "\n```\n\n" + "Closing words. " * 40)
    bot.llm.script(text(*[answer[i:i + 50] for i in range(0, len(answer), 50)]))
    root = bot.ts()
    bot.slack.push_event(mention("write a script", root))
    expected = len(split_message(to_mrkdwn(answer), 400))
    assert expected >= 5
    replies = await bot.final("C1", root, count=expected)
    texts = [m.text for m in replies]
    assert len(texts) == expected
    assert all(len(t) <= 400 for t in texts)
    assert all(t.count("```") % 2 == 0 for t in texts)  # every message opens and closes its code
    assert texts[0].startswith("*Result*\n\nHere is *the* script:")
    code_lines = [line for t in texts for line in t.split("\n") if line.startswith("    print")]
    assert code_lines == [c.replace("&", "&amp;").replace("<", "&lt;") for c in code]
    assert " ".join(texts).count("words.") == 40
    assert all(c.args["thread_ts"] == root for c in bot.slack.calls_of("chat.postMessage"))


async def test_rate_limited_slack_calls_are_retried_after_retry_after(bot):
    bot.slack.fail_next("chat.update", "ratelimited", status=429, retry_after=0)
    root = bot.ts()
    bot.slack.push_event(mention("busy workspace", root))
    [reply] = await bot.final("C1", root)
    assert reply.text == "echo: busy workspace"
    assert len(bot.slack.calls_of("chat.update")) >= 2  # the refused edit was sent again


async def test_an_answer_cut_short_by_a_server_stop_says_so(tmp_path, fake_openai, fake_slack):
    rt, _ = await start_slack(tmp_path, fake_openai, fake_slack)
    hold = threading.Event()
    try:
        await fake_slack.until(lambda: fake_slack.connections >= 1)
        fake_openai.script(text("Half ", "an answer.", hold=hold))
        root = "1600000002.000001"
        fake_slack.push_event(mention("tell me", root))
        await fake_slack.until(lambda: any(m.text.startswith("Half") for m in fake_slack.thread("C1", root)))
    finally:
        await stop_slack(rt)
        hold.set()
    reply, note = fake_slack.thread("C1", root)
    assert reply.text == "Half"
    assert note.text.startswith("⚠️ the turn was interrupted: the server running it stopped before it finished.")
    assert "send it again" in note.text


async def test_a_backend_error_is_reported_in_the_thread(bot):
    bot.llm.script(error(500, "the GPU caught fire"))
    root = bot.ts()
    bot.slack.push_event(mention("hello?", root))
    [reply] = await bot.final("C1", root)
    assert reply.text.startswith("⚠️") and "HTTP 500" in reply.text and "the GPU caught fire" in reply.text
    # The session still works afterwards.
    bot.slack.push_event(message("again", bot.ts(), thread_ts=root))
    replies = await bot.final("C1", root, count=2)
    assert replies[1].text == "echo: again"


async def test_a_refused_tool_call_gets_one_clear_note_and_the_answer_still_comes(bot):
    async def refuse(turn, entry, args):  # what gate.py does for Slack clients
        bot.rt.hub.status(turn.client_id, f"[gate ✗] {entry.tool.name} (read) needs approval, which Slack cannot "
                                          "give — rejected")
        return gate.Refusal("denied", f"TOOL CALL REJECTED: {entry.tool.name} needs human approval")

    bot.rt.pipeline.checks.append(refuse)
    bot.llm.script(tool_call("get_system_info", {}), tool_call("get_system_info", {}), text("I could not look."))
    root = bot.ts()
    bot.slack.push_event(mention("what machine is this?", root))
    replies = await bot.final("C1", root, count=2)
    assert replies[0].text == "I could not look."
    note = replies[1].text
    assert note.startswith("⛔ Not run: get_system_info (read) needs approval, which Slack cannot give")
    assert "shell.py" in note
    assert len(bot.slack.thread("C1", root)) == 2  # the retried call did not add a second note


async def test_a_rate_limited_tool_call_gets_a_note(bot):
    async def limit(turn, entry, args):  # what the rate limiter does
        bot.rt.hub.status(turn.client_id,
                          f"[RATE LIMITED] {entry.tool.name} (system): 5 calls per 10 s; try again in 4 s")
        return gate.Refusal("rate_limited", "RATE LIMITED")

    bot.rt.pipeline.checks.append(limit)
    bot.llm.script(tool_call("get_system_info", {}), text("Later, then."))
    root = bot.ts()
    bot.slack.push_event(mention("what machine is this?", root))
    replies = await bot.final("C1", root, count=2)
    assert [m.text for m in replies] == [
        "Later, then.", "⏳ Not run: get_system_info (system): 5 calls per 10 s; try again in 4 s"]


async def test_tool_progress_is_shown_in_the_placeholder_not_as_new_messages(bot):
    release = asyncio.Event()

    async def slow_lookup() -> str:
        await release.wait()
        return "Linux"

    bot.rt.tools.register(StructuredTool.from_function(
        coroutine=slow_lookup, name="slow_lookup", description="Looks something up, slowly.", args_schema=NoArgs))
    bot.rt.config.gates.tools["slow_lookup"] = GatePermission(read=True)  # runs without asking
    bot.llm.script(tool_call("slow_lookup", {}), text("Linux ", "it is."))
    root = bot.ts()
    bot.slack.push_event(mention("what machine is this?", root))
    [busy] = await bot.slack.until(lambda: [m for m in bot.slack.thread("C1", root)
                                            if m.text == "_⚙️ running `slow_lookup`…_"])
    release.set()
    [reply] = await bot.final("C1", root)
    assert reply is busy and reply.text == "Linux it is."


async def test_slack_markdown_and_escaping_in_the_final_text(bot):
    bot.llm.script(text("**Done**: see [the docs](https://example.com) — a <b> & c, `x<y`"))
    root = bot.ts()
    bot.slack.push_event(mention("format", root))
    [reply] = await bot.final("C1", root)
    assert reply.text == "*Done*: see <https://example.com|the docs> — a &lt;b&gt; &amp; c, `x&lt;y`"


async def test_commands_work_from_slack(bot):
    root = bot.ts()
    bot.slack.push_event(mention("!model", root))
    [reply] = await bot.final("C1", root)
    assert "Available models:" in reply.text and bot.llm.requests == []


# ── status endpoints, secrets, configuration ────────────────────────────────────────────────


async def test_health_and_status_endpoints(bot):
    root = bot.ts()
    bot.slack.push_event(mention("hi", root, user="U7"))
    await bot.final("C1", root)
    app = Starlette(routes=bot.plugin.get_routes())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://slack") as client:
        health = (await client.get("/slack/health")).json()
        status = (await client.get("/slack/status")).json()
    assert health == {"status": "healthy", "plugin": "plugin_client_slack", "version": "1.0.0", "enabled": True,
                      "connected": True, "active_sessions": 1}
    assert status["connected"] is True and status["bot_user_id"] == BOT_USER_ID and status["messages"] == 1
    assert status["sessions"] == [{"session_id": f"slack-C1-{root}", "shorthand_id": 101, "channel_id": "C1",
                                   "thread_ts": root, "user_id": "U7", "history_length": 2}]
    assert bot.plugin.get_config()["port"] > 0 and bot.plugin.get_config()["host"] == "127.0.0.1"


async def test_tokens_never_reach_the_logs(tmp_path, fake_openai, fake_slack, caplog):
    caplog.set_level(logging.DEBUG)
    rt, _plugin = await start_slack(tmp_path, fake_openai, fake_slack)
    try:
        await fake_slack.until(lambda: fake_slack.connections >= 1)
        root = "1600000001.000001"
        fake_slack.push_event(mention("hi", root))
        await fake_slack.until(lambda: [m.text for m in fake_slack.thread("C1", root)] == ["echo: hi"])
        fake_slack.send_disconnect()
        await fake_slack.until(lambda: fake_slack.connections == 2 and fake_slack.live == 1)
    finally:
        await stop_slack(rt)
    assert "apps.connections.open" in caplog.text or "chat.postMessage" in caplog.text  # the SDK did log
    assert BOT_TOKEN not in caplog.text and APP_TOKEN not in caplog.text


@pytest.mark.parametrize(
    ("env", "expect"),
    [
        (
            {"SLACK_BOT_TOKEN": "xoxb-not-the-right-one", "SLACK_APP_TOKEN": APP_TOKEN},
            "Slack refused the tokens (invalid_auth)",
        ),
        ({"SLACK_BOT_TOKEN": BOT_TOKEN, "SLACK_APP_TOKEN": "xapp-wrong"}, "Slack refused the tokens (invalid_auth)"),
        ({"SLACK_BOT_TOKEN": APP_TOKEN, "SLACK_APP_TOKEN": BOT_TOKEN}, "SLACK_BOT_TOKEN must be the app's bot token"),
    ],
)
async def test_bad_tokens_stop_the_plugin_with_a_clear_reason(tmp_path, fake_openai, fake_slack, caplog, env, expect):
    rt, plugin = await start_slack(tmp_path, fake_openai, fake_slack, env=env)
    try:
        assert plugin is None and rt.plugins.reports["plugin_client_slack"].status == "failed"
        assert expect in caplog.text
        assert not any(token in caplog.text for token in env.values())
    finally:
        await stop_slack(rt)


async def test_an_unknown_setting_is_named(tmp_path, fake_openai, fake_slack):
    rt, plugin = await start_slack(tmp_path, fake_openai, fake_slack, update_intervall=2)
    try:
        reasons = rt.plugins.reports["plugin_client_slack"].reasons
        assert plugin is None and reasons == [
            "plugin_config.plugin_client_slack in plugins-enabled.json: update_intervall: "
            "Extra inputs are not permitted"
        ]
    finally:
        await stop_slack(rt)


async def test_unreachable_slack_at_start_is_retried_in_the_background(tmp_path, fake_openai, fake_slack):
    port = free_port()
    rt, plugin = await start_slack(tmp_path, fake_openai, fake_slack, api_base_url=f"http://127.0.0.1:{port}/api/")
    try:
        assert isinstance(plugin, BasePlugin) and "cannot reach Slack" in plugin.problem
        app = Starlette(routes=plugin.get_routes())
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://slack") as client:
            health = await client.get("/slack/health")
        assert health.status_code == 503 and health.json()["status"] == "disconnected"
        assert "cannot reach Slack" in health.json()["detail"]
    finally:
        await stop_slack(rt)


# ── the real server ─────────────────────────────────────────────────────────────────────────


def test_the_server_answers_slack_and_serves_health_on_the_plugin_port(config_dir, fake_openai, fake_slack,
                                                                        start_server):
    port = free_port()
    config_dir.models = {"gpt": openai_model(fake_openai)}
    config_dir.plugins.append("plugin_client_slack")
    config_dir.plugin_config["plugin_client_slack"] = {"api_base_url": fake_slack.base_url, "port": port}
    config_dir.env = {"SLACK_BOT_TOKEN": BOT_TOKEN, "SLACK_APP_TOKEN": APP_TOKEN}
    server = start_server(config_dir)
    assert server.health()["plugins"]["plugin_client_slack"]["status"] == "loaded"
    fake_slack.wait_for(lambda: fake_slack.connections >= 1, 20)
    root = "1600000000.000001"
    fake_slack.push_event(mention("hello server", root))
    fake_slack.wait_for(lambda: [m.text for m in fake_slack.thread("C1", root)] == ["echo: hello server"], 20)
    health = httpx.get(f"http://127.0.0.1:{port}/slack/health", timeout=5)
    assert health.status_code == 200 and health.json()["status"] == "healthy"
    assert health.json()["active_sessions"] == 1
    # Only the plugin's own routes are on its port.
    assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 404
    out = server.stop()
    assert BOT_TOKEN not in out and APP_TOKEN not in out


def test_the_shipped_configuration_has_the_slack_bot_switched_off():
    shipped = json.loads((DEFAULTS_DIR / "plugins-enabled.json").read_text())
    assert "plugin_client_slack" in shipped["enabled_plugins"]
    assert shipped["plugin_config"]["plugin_client_slack"]["enabled"] is False
