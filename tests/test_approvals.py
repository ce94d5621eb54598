"""approvals.py: gates of classes that cannot answer them, routed to the approvers the operator names (issue 29).

In one process: the rules (who answers which gate), the feed, who may answer, the first answer wins, the
audit record, and two instances on one Redis. The front-ends (shell windows, the proxy's wait line, the API's
admin key) are driven over HTTP in test_approvals_e2e.py.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

import approvals
import audit_log
import client_classes
import decisions
import events
import grants
import metrics
import shared_gates
from approvals import ADMIN, API, MCP, SHELL, SLACK, SLACK_CHANNEL, Approver
from config import ApprovalsConfig, ConfigError, load_config
from plugins import _proxy_wire
from tests.conftest import openai_model
from tests.runtime import ALL_GATED, Recorder, add_plugin_tools, as_request, execute, runtime
from tests.test_scale import two

PROXY_ID, SLACK_ID = "llama-10.0.0.9", "slack-C1-1.2"


class _Args(BaseModel):
    sql: str = ""
    query: str = ""


def rules(section: dict[str, Any]) -> approvals.ApprovalRules:
    return approvals.ApprovalRules(ApprovalsConfig.model_validate(section), client_classes.CLASSES,
                                   [client_classes.SHELL])


# ── The rules ───────────────────────────────────────────────────────────────────────────────


def test_a_table_entry_beats_the_tool_entry_which_beats_the_class() -> None:
    r = rules({"timeout_seconds": 60, "classes": {"proxy": {
        "api_admin": True,
        "tools": {"db_query": {"slack_users": ["U0AAA"], "shell": True, "timeout_seconds": 30}},
        "tables": {"salaries": {"mcp_tokens": ["hr"]}, "users": {"shell": True, "slack_users": ["U0BBB"]}}}}})
    assert r.route("proxy", "web_search", "tools", ["web_search"]) == approvals.Route((Approver(API, ADMIN),), 60)
    route = r.route("proxy", "db_query", "db", ["orders"])
    assert route is not None and set(route.approvers) == {Approver(SLACK, "U0AAA"), Approver(SHELL, "*")}
    assert route.timeout == 30
    assert r.route("proxy", "db_query", "db", ["Salaries"]).approvers == (Approver(MCP, "hr"),)
    # A statement on several tables goes only to approvers of every one of them; none in common: not routed.
    assert r.route("proxy", "db_query", "db", ["orders", "users"]).approvers == (Approver(SHELL, "*"),)
    assert r.route("proxy", "db_query", "db", ["salaries", "users"]) is None
    assert r.route("slack", "db_query", "db", ["orders"]) is None  # a class without approvers


def test_who_may_answer() -> None:
    route = approvals.Route((Approver(SLACK_CHANNEL, "C0OPS"), Approver(SHELL, "*")), 10)
    assert route.admits(Approver(SLACK, "U0ANY"), "slack-channel:C0OPS")  # anyone in the approver channel
    assert not route.admits(Approver(SLACK, "U0ANY"), "slack")  # … but not in a thread elsewhere
    assert not route.admits(Approver(SLACK, "U0ANY"), "slack-channel:C0OTHER")
    assert route.admits(Approver(SHELL, "window-1"), "shell") and not route.admits(Approver(MCP, "owner"), "mcp")
    named = approvals.Route((Approver(SLACK_CHANNEL, "C0OPS"), Approver(SLACK, "U0LEAD")), 10)
    assert named.admits(Approver(SLACK, "U0LEAD"), "slack-channel:C0OPS")
    assert not named.admits(Approver(SLACK, "U0ANY"), "slack-channel:C0OPS")  # listed users only
    assert str(Approver.parse("slack:U0LEAD")) == "slack:U0LEAD"
    with pytest.raises(approvals.ApprovalError, match="kind:id"):
        Approver.parse("U0LEAD")
    with pytest.raises(approvals.ApprovalError, match="kind must be one of"):
        Approver("email", "x@y")


@pytest.mark.parametrize(("section", "says"), [
    ({"classes": {"proxy": {"slack_user": ["U0AAA"]}}}, "unknown field(s) 'slack_user'"),
    ({"classes": {"proxy": {"slack_users": ["alice"]}}}, "not a Slack user id: use the member id"),
    ({"classes": {"proxy": {"slack_channel": "#ops"}}}, "not a Slack channel id"),
    ({"classes": {"proxy": {"mcp_tokens": ["has space"]}}}, "not an MCP token name"),
    ({"timeout_seconds": 7200, "classes": {}}, "approvals.timeout_seconds"),
    ({"classes": {"proxy": {"tools": {"db_query": {"timeout_seconds": 0}}}}}, "timeout_seconds"),
])
def test_a_bad_section_is_refused_naming_the_field(tmp_path: Path, section: dict[str, Any], says: str) -> None:
    (tmp_path / "plugins-enabled.json").write_text(json.dumps({"default_model": "m", "approvals": section}))
    (tmp_path / "llm-models.json").write_text(json.dumps({"models": {"m": {"model_id": "m", "type": "OPENAI"}}}))
    with pytest.raises(ConfigError, match=r"plugins-enabled\.json") as err:
        load_config(tmp_path)
    assert says in str(err.value) and "approvals" in str(err.value)


@pytest.mark.parametrize(("kind", "says"), [("robots", "not a client class; the classes are api"),
                                            ("shell", "answered by their own user")])
def test_a_class_that_does_not_exist_or_the_shell_is_refused(kind: str, says: str) -> None:
    with pytest.raises(ConfigError, match=r"approvals\.classes\.") as err:
        rules({"classes": {kind: {"shell": True}}})
    assert says in str(err.value)


# ── Routed gates in a runtime ───────────────────────────────────────────────────────────────

APPROVALS = {"timeout_seconds": 5, "classes": {
    "proxy": {"api_admin": True, "mcp_tokens": ["lead"], "shell": True},
    "slack": {"slack_users": ["U0LEAD"], "tables": {"payroll": {}}}}}


@pytest.fixture
async def art(tmp_path, fake_openai):
    async with runtime(tmp_path, {"fake": openai_model(fake_openai)}, gates=ALL_GATED, approvals=APPROVALS) as rt:
        recorder = Recorder()
        add_plugin_tools(rt, "plugin_test_gates", [recorder.tool("db_query", _Args),
                                                   recorder.tool("web_search", _Args)],
                         {"db_query": {"type": "db"}, "web_search": {"type": "search"}})
        rt.recorder = recorder  # type: ignore[attr-defined]
        yield rt


async def next_feed(feed: Any) -> approvals.FeedEvent:
    async with asyncio.timeout(10):
        return await anext(feed)


async def test_a_routed_gate_waits_for_an_approver_and_the_first_answer_wins(art) -> None:
    art.metrics = art.gate.metrics = metrics.Metrics("test")  # counted like every gate, and as routed
    await art.sessions.get_or_create(PROXY_ID, "fake")
    feed = art.gate.desk.watch()
    session = art.hub.subscribe(PROXY_ID, art.hub.last_id(PROXY_ID))
    with as_request(art, PROXY_ID):
        call = asyncio.ensure_future(execute(art, PROXY_ID, "db_query",
                                             {"sql": "UPDATE users SET name = 'x' WHERE id = 7"}))
    opened = await next_feed(feed)
    gate = opened.gate
    assert opened.name == approvals.OPENED and gate is not None
    assert (gate.session, gate.client_class, gate.client_label, gate.tool, gate.op, gate.tables) == (
        PROXY_ID, "proxy", "the chat proxy", "db_query", "write", ["users"])
    assert gate.summary.startswith("UPDATE users SET name = ?") and gate.scopes == list(decisions.GRANT_SCOPES)
    assert gate.approvers == ["api:admin", "mcp:lead", "shell:*"] and gate.deadline - gate.raised_at == 5
    async with asyncio.timeout(10):  # the requester is told whom it waits for
        async for ev in session:
            if ev.name == "status" and "waiting for approval" in ev.data["text"]:
                break
    assert ev.data["text"].startswith("[gate ⏳] db_query (UPDATE users SET name = ?")
    assert "the API admin key, MCP token 'lead', shell approvers" in ev.data["text"]

    # Somebody who is not an approver: refused, nothing changes (and it is audited).
    refused = await art.gate.answer(gate.gate_id, "allow", answerer=Approver(MCP, "intern"), channel="mcp")
    assert refused.outcome == approvals.NOT_APPROVER and refused.approvers == ("api:admin", "mcp:lead", "shell:*")
    assert not await art.gate.resolve(gate.gate_id, "allow", by="shell")  # no identity: not an approver either
    shell = await art.gate.answer(gate.gate_id, "allow", answerer=Approver(SHELL, "w1"), channel="shell")
    assert shell.outcome == approvals.NOT_APPROVER  # a window that has not opted in
    assert not call.done() and art.recorder.calls == []

    won = await art.gate.answer(gate.gate_id, "allow", answerer=Approver(MCP, "lead"), channel="mcp")
    late = await art.gate.answer(gate.gate_id, "reject", answerer=Approver(API, ADMIN), channel="api")
    assert won.outcome == approvals.ANSWERED
    assert late.outcome == approvals.DECIDED and late.first is not None
    assert (late.first.decision, late.first.by, late.first.channel) == ("allow", "mcp:lead", "mcp")
    assert (await call).startswith("ok")
    assert [art.metrics.own.get_sample_value(f"agent_mcp_gates_{n}_total") for n in ("raised", "routed")] == [1, 1]
    closed = await next_feed(feed)
    assert closed.name == approvals.CLOSED and closed.closing is not None
    assert (closed.closing.gate_id, closed.closing.decision, closed.closing.by) == (gate.gate_id, "allow", "mcp:lead")
    assert art.recorder.calls == [("db_query", {"sql": "UPDATE users SET name = 'x' WHERE id = 7", "query": ""})]
    await art.gate.grants.flush()
    records = list(audit_log.read_audit(art.config.data_dir() / grants.AUDIT_FILE))
    refusal = next(r for r in records if r["event"] == "approval_refused")
    assert refusal["actor"] == "mcp:intern" and refusal["session"] == PROXY_ID
    decision = next(r for r in records if r["event"] == "decision")
    assert decision["actor"] == "mcp:lead" and decision["outcome"] == "allowed once"
    detail = json.loads(decision["detail"])
    assert detail["asked"] == ["api:admin", "mcp:lead", "shell:*"] and detail["by"] == "mcp:lead"
    assert detail["channel"] == "mcp" and detail["client"] == "proxy" and detail["waited_s"] >= 0
    await session.aclose()
    await feed.aclose()


async def test_a_shell_window_that_opted_in_may_answer_and_a_grant_is_offered(art) -> None:
    await art.sessions.get_or_create(PROXY_ID, "fake")
    await art.gate.desk.set_window("w1", True)
    feed = art.gate.desk.watch()
    with as_request(art, PROXY_ID):
        call = asyncio.ensure_future(execute(art, PROXY_ID, "web_search", {"query": "q"}))
    gate = (await next_feed(feed)).gate
    assert [g.gate_id for g in await art.gate.desk.pending()] == [gate.gate_id]
    answer = await art.gate.answer(gate.gate_id, "allow_for", answerer=Approver(SHELL, "w1"), channel="shell",
                                   minutes=15)
    assert answer.answered and (await call).startswith("ok")
    assert [g.scope for g in art.gate.grants.active(PROXY_ID)] == ["allow_for"]
    assert await art.gate.desk.pending() == []
    await art.gate.desk.set_window("w1", False)
    assert not await art.gate.desk.is_window("w1")
    await feed.aclose()


async def test_no_answer_rejects_after_the_approval_timeout(tmp_path, fake_openai) -> None:
    section = {"timeout_seconds": 0.3, "classes": {"slack": {"slack_users": ["U0LEAD"]}}}
    async with runtime(tmp_path, {"fake": openai_model(fake_openai)}, gates=ALL_GATED, approvals=section) as rt:
        add_plugin_tools(rt, "plugin_test_gates", [Recorder().tool("web_search", _Args)],
                         {"web_search": {"type": "search"}})
        await rt.sessions.get_or_create(SLACK_ID, "fake")
        feed = rt.gate.desk.watch()
        with as_request(rt, SLACK_ID):
            result = await execute(rt, SLACK_ID, "web_search", {"query": "q"})
        assert "within 0.3 s" in result
        opened, closed = await next_feed(feed), await next_feed(feed)
        assert closed.closing.decision == approvals.TIMEOUT and closed.closing.gate_id == opened.gate.gate_id
        late = await rt.gate.answer(opened.gate.gate_id, "allow", answerer=Approver(SLACK, "U0LEAD"), channel="slack")
        assert late.outcome == approvals.DECIDED and late.first.decision == approvals.TIMEOUT
        await feed.aclose()


async def test_without_approvers_each_class_behaves_as_before(art) -> None:
    # Slack has approvers, but not for the payroll table: refused at once as without approvals.
    result = await execute(art, SLACK_ID, "db_query", {"sql": "SELECT * FROM payroll"})
    assert "cannot give it" in result
    # Swarm calls have no approvers: refused at once; the API keeps its window.
    assert "cannot give it" in await execute(art, "api-swarm-00000001", "web_search", {"query": "q"})
    assert "within 2 s" in await execute(art, "api-00000001", "web_search", {"query": "q"})
    assert art.recorder.calls == [] and await art.gate.desk.pending() == []


async def test_unrouted_gates_are_answered_as_before(art) -> None:
    await art.sessions.get_or_create("c1", "fake")
    session = art.hub.subscribe("c1", art.hub.last_id("c1"))
    with as_request(art, "c1"):
        call = asyncio.ensure_future(execute(art, "c1", "web_search", {"query": "q"}))
    async with asyncio.timeout(10):
        async for ev in session:
            if ev.name == "gate":
                gate_id = ev.data["gate_id"]
                break
    await session.aclose()
    result = await art.gate.answer(gate_id, "allow", by="shell")
    assert result.outcome == approvals.ANSWERED and (await call).startswith("ok")
    assert (await art.gate.answer(gate_id, "allow", by="shell")).outcome == approvals.UNKNOWN


async def test_a_routed_gate_raised_on_one_instance_is_answered_through_the_other(tmp_path, fake_openai,
                                                                                  redis_store) -> None:
    recorder = Recorder()
    async with two(tmp_path, redis_store, {"fake": openai_model(fake_openai)}, gates=ALL_GATED,
                   approvals=APPROVALS) as (a, b):
        assert isinstance(b.gate.desk.store, shared_gates.SharedApprovals)
        for rt in (a, b):
            add_plugin_tools(rt, "plugin_test", [recorder.tool("web_search", _Args)],
                             {"web_search": {"type": "search"}})
        await a.sessions.get_or_create(PROXY_ID, "fake")
        await b.gate.desk.set_window("w-b", True)
        feed_b = b.gate.desk.watch()
        with as_request(a, PROXY_ID):
            call = asyncio.ensure_future(execute(a, PROXY_ID, "web_search", {"query": "redis"}))
        gate = (await next_feed(feed_b)).gate
        assert gate.session == PROXY_ID and [g.gate_id for g in await b.gate.desk.pending()] == [gate.gate_id]
        assert (await b.gate.answer(gate.gate_id, "allow", answerer=Approver(MCP, "nobody"))).outcome == \
            approvals.NOT_APPROVER
        assert (await b.gate.answer(gate.gate_id, "allow", answerer=Approver(SHELL, "w-b"), channel="shell")).answered
        late = await a.gate.answer(gate.gate_id, "reject", answerer=Approver(API, ADMIN), channel="api")
        assert late.outcome == approvals.DECIDED and late.first.by == "shell:w-b"
        assert (await call).startswith("ok") and recorder.calls == [("web_search", {"sql": "", "query": "redis"})]
        closed = await next_feed(feed_b)
        assert closed.closing.by == "shell:w-b" and closed.closing.channel == "shell"
        assert await b.gate.desk.pending() == []
        await feed_b.aclose()


async def test_a_turn_cancelled_while_its_gate_waits_closes_the_gate_as_abandoned(art) -> None:
    await art.sessions.get_or_create(PROXY_ID, "fake")
    feed = art.gate.desk.watch()
    with as_request(art, PROXY_ID):
        call = asyncio.ensure_future(execute(art, PROXY_ID, "web_search", {"query": "q"}))
    gate = (await next_feed(feed)).gate
    call.cancel()
    closed = await next_feed(feed)
    assert (closed.closing.gate_id, closed.closing.decision) == (gate.gate_id, approvals.ABANDONED)
    late = await art.gate.answer(gate.gate_id, "allow", answerer=Approver(API, ADMIN), channel="api")
    assert late.outcome == approvals.DECIDED and "its turn ended" in approvals.explain(late)
    await art.gate.grants.flush()
    records = audit_log.read_audit(art.config.data_dir() / grants.AUDIT_FILE)
    (record,) = [r for r in records if r["actor"] == "abandoned"]
    assert record["tool"] == "web_search" and json.loads(record["detail"])["asked"] == gate.approvers
    assert art.recorder.calls == [] and await art.gate.desk.pending() == []
    await feed.aclose()


# ── The proxy while a gate waits (plugins/_proxy_wire.py) ───────────────────────────────────


def _event(n: int, name: str, **data: Any) -> events.Event:
    return events.Event(n, name, data, "t1")


async def _turn_events(release: asyncio.Event, ended: list[str]) -> Any:
    try:
        yield _event(1, "gate", gate_id="g1", tool_name="db_query", headline="db_query (UPDATE users …)",
                     waiting_for="shell approvers", approvers=["shell:*"])
        await release.wait()
        yield _event(2, "status", text="[gate ✓] db_query: allowed once by shell:w1", gate_id="g1", decision="allow")
        yield _event(3, "tok", text="Done.")
        yield _event(4, "done")
        ended.append("finished")
    finally:
        ended.append("closed")


async def test_the_proxy_stream_keeps_alive_while_a_gate_waits_then_goes_on(monkeypatch) -> None:
    monkeypatch.setattr(_proxy_wire, "KEEPALIVE_SECONDS", 0.01)
    release, ended, keep = asyncio.Event(), [], set()
    out = _proxy_wire.Output("off", "rename")  # status lines off: the wait line is still said
    pump = _proxy_wire.TurnPump(_turn_events(release, ended), out, keep)
    first = out.feed(await _proxy_wire.first_output(pump))
    assert first == ("> ⏳ waiting for approval of db_query (UPDATE users …) by shell approvers\n\n", "")
    written, keepalives = [], 0
    async for content, _ in _proxy_wire.pieces(out, first, pump):
        written.append(content)
        keepalives += content == ""
        if keepalives == 3:
            release.set()  # the approver answers after three empty pieces kept the stream alive
    assert "".join(written).endswith("Done.") and out.finished and ended == ["finished", "closed"] and not keep


async def test_the_proxy_stream_keeps_alive_while_the_model_is_silent(monkeypatch) -> None:
    """No gate: a model that says nothing for a while (a long prompt on a slow local model) gets the same empty
    pieces, so clients and reverse proxies do not drop the response meanwhile."""
    monkeypatch.setattr(_proxy_wire, "KEEPALIVE_SECONDS", 0.01)
    release, keep = asyncio.Event(), set()

    async def events() -> Any:
        yield _event(1, "tok", text="Thinking")
        await release.wait()
        yield _event(2, "tok", text=" done.")
        yield _event(3, "done")

    out = _proxy_wire.Output("off", "slow")
    pump = _proxy_wire.TurnPump(events(), out, keep)
    first = out.feed(await _proxy_wire.first_output(pump))
    written = []
    async for content, _ in _proxy_wire.pieces(out, first, pump):
        written.append(content)
        if written.count("") == 2:
            release.set()
    assert "".join(written) == "Thinking done." and written.count("") >= 2 and out.finished


async def test_a_client_leaving_while_a_gate_waits_leaves_the_turn_running(monkeypatch) -> None:
    release, ended, keep = asyncio.Event(), [], set()
    out = _proxy_wire.Output("quote", "rename")
    pump = _proxy_wire.TurnPump(_turn_events(release, ended), out, keep)
    out.feed(await anext(pump))
    await pump.aclose()  # the client went away while the gate waits
    assert ended == [] and len(keep) == 1
    release.set()
    await asyncio.wait(list(keep))
    assert ended == ["finished", "closed"]
    # Without a waiting gate, a client leaving ends the turn as before.
    release, ended = asyncio.Event(), []
    out = _proxy_wire.Output("quote", "rename")
    pump = _proxy_wire.TurnPump(_turn_events(release, ended), out, keep)
    await anext(pump)  # (not fed to `out`: nothing waits)
    await pump.aclose()
    assert ended == ["closed"] and not keep
