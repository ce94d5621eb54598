"""A plugin reaches its own sessions, event streams, gates, values and signals only, vouches only for its own
client class and reads the tool registry without changing it; every session, the gate policy and more
privileges only when the operator granted it `all-sessions` in plugin-manifest.json (issue 30; plugin_scope.py)."""

from __future__ import annotations

import asyncio
import json
import shutil
import textwrap
from pathlib import Path
from typing import Any

import pytest

import approvals
import build
import gate_policy
import routes
import stores
from audit_chain import AuditRecord
from config import DEFAULTS_DIR, load_config
from plugin_api import CLASSES, PluginContext, Request, ScopeError, Turn, running
from plugins.plugin_client_api import ApiPlugin
from plugins.plugin_client_slack import SlackPlugin
from tests.conftest import ROOT, ConfigDir, openai_model
from tests.fakes.backend import text, tool_call
from tests.plugin_host import NO_GATES
from tests.runtime import ask, shell_payload
from tests.test_scale import two
from tests.waiting import until

CLIENT = textwrap.dedent('''
    from plugin_api import BasePlugin
    from starlette.routing import Route


    class {cls}(BasePlugin):
        PLUGIN_NAME = "{name}"
        PLUGIN_TYPE = "client_interface"
        CLIENT_NAMESPACES = {{"{prefix}": "{kind}"}}

        def init(self, config):
            return True

        def shutdown(self):
            pass

        def get_routes(self):
            return [Route("/", lambda request: None)]
''')

# A tool that tells its own turn's session something, then tries another's.
PEEK = textwrap.dedent('''
    from langchain_core.tools import StructuredTool
    from pydantic import BaseModel

    from plugin_api import BasePlugin, ScopeError, current_turn


    class _Other(BaseModel):
        other: str


    class PeekPlugin(BasePlugin):
        PLUGIN_NAME = "plugin_tool_peek"
        PLUGIN_TYPE = "data_tool"

        def init(self, config):
            self.turns = []
            return True

        def shutdown(self):
            pass

        def get_tools(self):
            async def peek(other: str) -> str:
                turn = current_turn()
                self.turns.append(turn)
                self.ctx.hub.publish(turn.client_id, "status", {"text": "peek: looking"})
                try:
                    self.ctx.hub.publish(other, "status", {"text": "peek was here"})
                except ScopeError as exc:
                    return f"refused: {exc}"
                return "published elsewhere"

            return {"lc": [StructuredTool.from_function(coroutine=peek, name="peek", description="Peek.",
                                                         args_schema=_Other)]}

        def get_gate_tools(self):
            return {"peek": {"type": "search", "operation": "read"}}
''')


@pytest.fixture
async def scoped(tmp_path: Path, fake_openai: Any):
    """A server with `plugin_client_tiny` (namespace `tiny-`, class api), `plugin_client_boss` (`boss-`, granted
    every session), `plugin_client_chat` (`chat-`, class slack: it answers for Slack approvers) and the data tool
    `plugin_tool_peek`; a shell session `c1` and a session of tiny and of boss."""
    cfg = ConfigDir(tmp_path)
    cfg.models = {"fake": openai_model(fake_openai)}
    cfg.gates = NO_GATES
    cfg.add_plugin("plugin_client_tiny", CLIENT.format(cls="Tiny", name="plugin_client_tiny", prefix="tiny-",
                                                       kind="api"), type_="client_interface")
    cfg.add_plugin("plugin_client_boss", CLIENT.format(cls="Boss", name="plugin_client_boss", prefix="boss-",
                                                       kind="api"), type_="client_interface", grants=["all-sessions"])
    cfg.add_plugin("plugin_client_chat", CLIENT.format(cls="Chat", name="plugin_client_chat", prefix="chat-",
                                                       kind="slack"), type_="client_interface")
    cfg.add_plugin("plugin_tool_peek", PEEK)
    cfg.write()
    shutil.copytree(DEFAULTS_DIR / ".system_prompt", tmp_path / ".system_prompt")
    rt = await build.build_runtime(load_config(tmp_path), store=stores.MemoryStore())
    assert rt.plugins is not None
    for name in ("plugin_client_tiny", "plugin_client_boss", "plugin_client_chat", "plugin_tool_peek"):
        report = await rt.plugins.load(name)
        assert report.status == "loaded", report.line()
    plugins = {p.PLUGIN_NAME.rsplit("_", 1)[1]: p for p in rt.plugins.loaded}
    await rt.sessions.get_or_create("c1", "fake")
    await plugins["tiny"].ctx.sessions.get_or_create("tiny-1", "fake")
    await plugins["boss"].ctx.sessions.get_or_create("boss-1", "fake")
    try:
        yield rt, plugins
    finally:
        await build.close_runtime(rt)


async def test_a_plugin_without_the_grant_neither_reads_nor_runs_nor_follows_nor_deletes_another_session(
        scoped) -> None:
    rt, plugins = scoped
    ctx = plugins["tiny"].ctx
    assert [s.client_id for s in ctx.sessions.all()] == ["tiny-1"] and ctx.sessions.count() == 1
    shorthand = rt.sessions.get("c1").shorthand
    for other in ("c1", "boss-1"):
        assert ctx.sessions.get(other) is None and not await ctx.sessions.exists(other)
        assert ctx.sessions.resolve(other) is None
    assert ctx.sessions.resolve(str(shorthand)) is None  # a shorthand id is no way around it
    assert ctx.sessions.resolve(str(ctx.sessions.get("tiny-1").shorthand)) == "tiny-1"
    request, before = ctx.request("c1", "hello"), rt.hub.last_id("c1")
    refused = [ctx.submit(request), ctx.process_request(request), ctx.wait_turn(request, 5), ctx.stop("c1"),
               ctx.cancel("c1"), ctx.delete_session("c1"), ctx.sessions.save(rt.sessions.get("c1")),
               ctx.sessions.get_or_create("boss-2", "fake"), ctx.ask_gate("c1", {}, 1),
               ctx.execute_tool(request.turn(), "peek", {"other": "tiny-1"})]
    why = r"plugin_client_tiny may not reach session '(c1|boss-2)'.*\('tiny-'\).*all-sessions"
    for call in refused:
        with pytest.raises(ScopeError, match=why):
            await call
    for sync in (lambda: ctx.run_turn(request), lambda: ctx.hub.subscribe("c1"), lambda: ctx.hub.last_id("c1"),
                 lambda: ctx.hub.publish("c1", "status", {"text": "spoofed"}), lambda: ctx.busy("c1"),
                 lambda: ctx.sessions.get_or_add("boss-2", "fake"), lambda: ctx.link):
        with pytest.raises(ScopeError):
            sync()
    assert rt.sessions.get("c1") is not None and rt.hub.last_id("c1") == before and rt.sessions.get("boss-2") is None
    answer = await ctx.wait_turn(ctx.request("tiny-1", "!help"), 10)  # its own: as before
    assert answer["status"] == "complete"


async def test_a_plugin_hears_and_is_told_of_its_own_sessions_only(scoped) -> None:
    rt, plugins = scoped
    heard, gone = [], []
    stop = plugins["tiny"].ctx.hub.observe(lambda client_id, event: heard.append(client_id))
    plugins["tiny"].ctx.sessions.on_forgotten(gone.append)
    for client_id in ("c1", "tiny-1", "boss-1"):
        rt.hub.publish(client_id, "status", {"text": "hi"})
    for client_id in ("c1", "tiny-1"):
        await routes.delete_session(rt, client_id)
    stop()
    rt.hub.publish("tiny-2", "status", {"text": "unheard"})
    assert set(heard) == {"tiny-1"} and gone == ["tiny-1"]  # its status, the deletion, the channel dropped


async def test_the_operator_grant_reaches_every_session(scoped) -> None:
    rt, plugins = scoped
    ctx = plugins["boss"].ctx
    assert {s.client_id for s in ctx.sessions.all()} == {"c1", "tiny-1", "boss-1"} and ctx.link is None
    subscription = ctx.hub.subscribe("tiny-1", ctx.hub.last_id("tiny-1"))
    ctx.hub.publish("tiny-1", "status", {"text": "from the admin view"})
    assert (await anext(subscription)).data["text"] == "from the admin view"
    await subscription.aclose()
    answer = await ctx.wait_turn(ctx.request("c1", "!help", kind="shell", interactive=True), 10)
    assert answer["status"] == "complete"
    assert await ctx.delete_session("tiny-1") is not None and rt.sessions.get("tiny-1") is None


async def test_a_tool_reaches_the_session_of_the_turn_it_serves_and_no_other(scoped, fake_openai) -> None:
    rt, plugins = scoped
    peek = plugins["peek"]
    fake_openai.script(tool_call("peek", {"other": "tiny-1"}), text("done"))
    sub, before = rt.hub.subscribe("c1", rt.hub.last_id("c1")), rt.hub.last_id("tiny-1")
    answer = await routes.wait_turn(rt, ask(rt, "c1", "peek please", shell_payload(rt, "c1", None)), 30)
    assert answer["status"] == "complete"
    tool_msg = [m for m in fake_openai.requests[-1].json["messages"] if m["role"] == "tool"][-1]["content"]
    assert tool_msg.startswith("refused: plugin plugin_tool_peek may not reach session 'tiny-1'")
    said = []
    async for ev in sub:
        said.append(ev.data.get("text", ""))
        if ev.name == "done":
            break
    await sub.aclose()
    assert "peek: looking" in said and rt.hub.last_id("tiny-1") == before
    # The turn is over: holding on to it (or building one) reaches nothing.
    for turn in (peek.turns[0], peek.ctx.request("c1").turn()):
        with running(turn), pytest.raises(ScopeError):
            peek.ctx.hub.publish("c1", "status", {"text": "late"})


async def _raised(rt: Any, client_id: str, routed_to: list[str] | None = None) -> tuple[str, asyncio.Task[Any]]:
    """A gate pending on `client_id` (routed to the approvers `routed_to`): its id, and the task waiting for it."""
    routed = None
    if routed_to is not None:
        if rt.gate.desk is None:
            rt.gate.desk = approvals.ApprovalDesk(approvals.ApprovalRules(rt.config.enabled.approvals, CLASSES), rt.hub)
        routed = approvals.RoutedGate("", client_id, "proxy", "the chat proxy", "db_query", "write", ["t"],
                                      "UPDATE t SET a = ?", {}, [], 0.0, 0.0, routed_to, "them")
    before = set(rt.gate.pending)
    task = asyncio.create_task(rt.gate.ask(client_id, {"tool_name": "db_query"}, 30, routed))
    await until(lambda: bool(set(rt.gate.pending) - before), f"a gate on {client_id}")
    (gate_id,) = set(rt.gate.pending) - before
    return gate_id, task


async def test_a_plugin_answers_the_gates_of_its_sessions_and_those_routed_to_the_approvers_it_answers_for(
        scoped) -> None:
    rt, plugins = scoped
    tiny, chat, boss = (plugins[name].ctx for name in ("tiny", "chat", "boss"))
    shell_gate, shell_wait = await _raised(rt, "c1")
    own_gate, own_wait = await _raised(rt, "tiny-1")
    assert await tiny.gate.owner(shell_gate) is None and await tiny.gate.owner(own_gate) == "tiny-1"
    with pytest.raises(ScopeError, match=r"plugin_client_tiny may not answer gate '.+' of session 'c1'.*"
                                         r"\('tiny-'\), and the gate is not routed to the approvers it answers for "
                                         r"\(api\).*all-sessions"):
        await tiny.gate.answer(shell_gate, "allow", answerer=approvals.Approver("api", "admin"), by="tiny")
    with pytest.raises(ScopeError, match="may not reach session 'c1'"):
        await tiny.gate.resolve(shell_gate, "allow")
    assert shell_gate in rt.gate.pending and not hasattr(tiny.gate, "hub") and not hasattr(tiny.gate, "ask")
    assert (await tiny.gate.answer(own_gate, "allow", by="tiny")).answered and (await own_wait)[0].word == "allow"
    assert await boss.gate.resolve(shell_gate, "reject", by="boss") and (await shell_wait)[0].word == "reject"
    # Routed to a Slack user: the plugin of the Slack class sees and answers it, as that user only.
    slack_gate, slack_wait = await _raised(rt, "c1", ["slack:U1"])
    mcp_gate, mcp_wait = await _raised(rt, "c1", ["mcp:ops"])
    assert [g.gate_id for g in await chat.gate.desk.pending()] == [slack_gate]
    assert await tiny.gate.desk.pending() == [] and await tiny.gate.desk.get(slack_gate) == (None, None)
    assert {g.gate_id for g in await boss.gate.desk.pending()} == {slack_gate, mcp_gate}
    feed = chat.gate.desk.watch()
    assert (await anext(feed)).gate.gate_id == slack_gate  # the MCP token's gate is not on its feed
    with pytest.raises(ScopeError, match=r"not routed to the approvers it answers for \(slack, slack-channel\)"):
        await chat.gate.answer(mcp_gate, "allow", answerer=approvals.Approver("slack", "U1"), channel="slack")
    with pytest.raises(ScopeError):
        await tiny.gate.answer(slack_gate, "allow", answerer=approvals.Approver("api", "admin"), channel="api")
    not_them = await chat.gate.answer(slack_gate, "allow", answerer=approvals.Approver("slack", "U2"), channel="slack")
    assert not_them.outcome == approvals.NOT_APPROVER  # the keeper's own check still decides who may answer
    one = approvals.Approver("slack", "U1")
    assert (await chat.gate.answer(slack_gate, "allow", answerer=one, channel="slack")).answered
    assert (await slack_wait)[0].word == "allow" and (await anext(feed)).closing.gate_id == slack_gate
    late = await chat.gate.answer(slack_gate, "reject", answerer=one, channel="slack")
    assert late.outcome == approvals.DECIDED and late.first.by == "slack:U1"
    with pytest.raises(ScopeError, match="shell approver windows"):
        await tiny.gate.desk.set_window("w1", True)
    await feed.aclose()
    mcp_wait.cancel()


async def test_gate_policy_every_session_s_grants_and_the_audit_log_need_the_grant(scoped) -> None:
    rt, plugins = scoped
    tiny, boss = plugins["tiny"].ctx, plugins["boss"].ctx
    change = gate_policy.PolicyChange.parse("tools", "peek", "read", True, "tiny")
    why = r"plugin_client_tiny may not .*: that needs \"grants\": \[\"all-sessions\"\]"
    with pytest.raises(ScopeError, match=why):
        await tiny.gate.set_policy(change)
    with pytest.raises(ScopeError, match=why):
        tiny.gate.replace_policy(rt.gate.defaults, "tiny")
    with pytest.raises(ScopeError, match=why):
        assert tiny.gate.grants is not None
    with pytest.raises(ScopeError, match="may not reach session 'c1'"):
        await tiny.gate.active_grants("c1")
    with pytest.raises(ScopeError, match="may not reach session 'c1'"):
        tiny.gate.audit(AuditRecord.call("c1", "peek", "read").decision("tiny", "allowed"))
    copy = tiny.gate.defaults
    copy.tools.clear()
    assert "peek" not in rt.gate.defaults.tools and rt.gate.defaults.tools  # a copy: the policy is unchanged
    assert await tiny.gate.active_grants("tiny-1") == []
    entry, _ = await boss.gate.set_policy(change)
    assert entry.read and rt.gate.defaults.tools["peek"].read and boss.gate.grants is rt.gate.grants


async def test_a_plugin_vouches_only_for_its_own_class_without_admin_or_interactive_rights(scoped) -> None:
    rt, plugins = scoped
    ctx = plugins["tiny"].ctx
    claims = {"admin": ctx.request("tiny-1", "!help", admin=True),
              "interactive": ctx.request("tiny-1", "!help", interactive=True),
              "kind='shell'": ctx.request("tiny-1", "!help", kind="shell"),
              "kind='mcp'": Request("tiny-1", "mcp", "!help")}  # built without the context: the same
    before = rt.hub.last_id("tiny-1")
    for claim, request in claims.items():
        for call in (ctx.submit(request), ctx.process_request(request), ctx.wait_turn(request, 5)):
            with pytest.raises(ScopeError, match=rf"plugin_client_tiny may not vouch for {claim} on session 'tiny-1'"
                                                 r".*\('api'\).*all-sessions"):
                await call
        with pytest.raises(ScopeError):
            ctx.run_turn(request)
    with pytest.raises(ScopeError, match="may not vouch for bypass_gates on session 'tiny-1'"):
        await ctx.execute_tool(Turn("tiny-1", "t1", "api", bypass_gates=True), "peek", {"other": "c1"})
    assert rt.hub.last_id("tiny-1") == before
    assert (await ctx.wait_turn(ctx.request("tiny-1", "!help", kind="api"), 10))["status"] == "complete"


async def test_the_tool_registry_is_read_only_for_plugins(scoped) -> None:
    rt, plugins = scoped
    tiny, peek = plugins["tiny"].ctx, plugins["peek"].ctx
    entry, tool = tiny.tools.entry("peek"), tiny.tools.get("peek")
    entry.gate["operation"], entry.owner, tool.coroutine = "write", "plugin_client_tiny", None
    assert rt.tools.entry("peek").gate["operation"] == "read" and rt.tools.entry("peek").owner == "plugin_tool_peek"
    assert rt.tools.get("peek").coroutine is not None and "peek" in tiny.tools.names()
    assert not hasattr(tiny.tools, "register") and not hasattr(tiny.tools, "replace_plugin_tools")
    with pytest.raises(ScopeError, match="only a data_tool plugin registers tools"):
        tiny.tools.reload()
    assert peek.tools.reload() == ["peek"] and rt.tools.entry("peek").gate["operation"] == "read"


def test_an_unknown_grant_keeps_the_plugin_from_loading(tmp_path: Path, fake_openai: Any) -> None:
    async def load() -> str:
        cfg = ConfigDir(tmp_path)
        cfg.models = {"fake": openai_model(fake_openai)}
        cfg.add_plugin("plugin_client_tiny", CLIENT.format(cls="Tiny", name="plugin_client_tiny", prefix="tiny-",
                                                           kind="api"), type_="client_interface", grants=["everything"])
        cfg.write()
        rt = await build.build_runtime(load_config(tmp_path), store=stores.MemoryStore())
        try:
            assert rt.plugins is not None
            return (await rt.plugins.load("plugin_client_tiny")).line()
        finally:
            await build.close_runtime(rt)

    line = asyncio.run(load())
    assert line == ("plugin_client_tiny [invalid]: plugin-manifest.json grants 'everything' is no grant; "
                    "the known ones: all-sessions")


def test_a_manifest_copy_from_before_grants_keeps_the_shipped_grants(tmp_path: Path, fake_openai: Any) -> None:
    cfg = ConfigDir(tmp_path)
    cfg.models = {"fake": openai_model(fake_openai)}
    cfg.write()
    shipped = json.loads((ROOT / "plugin-manifest.json").read_text())
    for entry in shipped["plugins"].values():
        entry.pop("grants", None)  # a copy made before the field existed
    shipped["plugins"]["plugin_client_api"]["grants"] = []  # an operator who takes the API's reach away
    shipped["plugins"]["plugin_client_mcp"]["file"] = "my_mcp.py"  # another file: not the shipped plugin
    (tmp_path / "plugin-manifest.json").write_text(json.dumps(shipped))
    plugins = load_config(tmp_path).manifest.plugins
    assert plugins["plugin_client_shellpy"].grants == ["all-sessions"]
    assert plugins["plugin_client_api"].grants == [] and plugins["plugin_client_mcp"].grants == []
    assert plugins["plugin_proxy_llama"].grants == []


async def test_values_are_each_plugin_s_own_and_the_old_layout_is_honoured_until_it_expires(
        tmp_path: Path, fake_openai: Any, redis_store: str) -> None:
    async with two(tmp_path, redis_store, {"fake": openai_model(fake_openai)}) as (a, b):
        slack, api = PluginContext(a, SlackPlugin(), {}).values, PluginContext(a, ApiPlugin(), {}).values
        assert slack is not None and api is not None and a.values is not None
        link = a.values.link

        def keys(name: str) -> tuple[str, str]:
            return link.key("plugin-value", "plugin_client_slack", name), link.key("value", name)

        assert await slack.put("seen", "1", 60, only_new=True)
        assert await api.get("seen") is None and await api.put("seen", "2", 60, only_new=True)  # not the same name
        assert await link.client.get(keys("seen")[0]) == "1"
        assert await PluginContext(b, SlackPlugin(), {}).values.get("seen") == "1"  # its own on every instance
        # Keys an instance of the version before wrote, during a rolling upgrade:
        await link.client.set(keys("slack-event:E1")[1], "1", px=50_000)
        assert not await slack.put("slack-event:E1", "1", 60, only_new=True)  # taken: the event is not handled twice
        await link.client.set(keys("fingerprint:m")[1], "llama-1", px=40_000)
        assert await slack.get("fingerprint:m") == "llama-1"
        assert 30_000 < await link.client.pttl(keys("fingerprint:m")[0]) <= 40_000  # copied with its time left
        assert await slack.take("fingerprint:m") == "llama-1" and await link.client.exists(*keys("fingerprint:m")) == 0
        assert await slack.take("fingerprint:m") is None
        await link.client.set(keys("x")[1], "old", px=50_000)
        assert await slack.put("x", "new", 60) and await slack.get("x") == "new"
        await slack.drop("x")
        assert await link.client.exists(*keys("x")) == 0 and await slack.get("x") is None
        # The old layout's fallback is no way into another plugin's values or the core's: a name that spells
        # another plugin's key (or the core's) reaches nothing but the plugin's own.
        assert await api.put("ticket", "api's", 60)
        spelled = "plugin_client_api:ticket"
        assert await slack.get(spelled) is None and await slack.take(spelled) is None
        await slack.drop(spelled)
        assert await api.get("ticket") == "api's"
        await a.values.put("system-prompt", "core's", 60)
        assert await slack.take("system-prompt") is None and await a.values.get("system-prompt") == "core's"


async def test_signals_are_each_plugin_s_own(tmp_path: Path, fake_openai: Any, redis_store: str) -> None:
    async with two(tmp_path, redis_store, {"fake": openai_model(fake_openai)}) as (a, b):
        heard: asyncio.Queue[tuple[str, str]] = asyncio.Queue()

        def hear(who: str) -> Any:
            async def handler(subject: str) -> None:
                heard.put_nowait((who, subject))
            return handler

        slack_a, slack_b, api_b = (PluginContext(rt, plugin, {}).signals
                                   for rt, plugin in ((a, SlackPlugin()), (b, SlackPlugin()), (b, ApiPlugin())))
        assert slack_a is not None and slack_b is not None and api_b is not None and a.signals is not None
        slack_b.on("ping", hear("slack"))
        api_b.on("ping", hear("api"))
        api_b.on("cancel", hear("api-cancel"))  # the core's signal: the plugin does not take it over
        async with asyncio.timeout(10):
            async def b_listens() -> bool:
                await slack_a.send("ping", "hello")
                return not heard.empty()

            await until(b_listens, "B to listen", 10, step=0.05)
            await a.signals.send("cancel", "c1")
            await slack_a.send("ping", "thread")
            got = [await heard.get()]
            while got[-1] != ("slack", "thread"):
                got.append(await heard.get())
        assert {who for who, _ in got} == {"slack"}  # neither the API plugin's ping nor the core's cancel
