"""MCP elicitation, agent-mcp as MCP server: a gate of a turn started by an MCP client that declared the
`elicitation` capability is asked as a form on that client's own call, and the form's answer decides it.

The module's agent-mcp (tests/test_mcp_server.py's fixture: MCP server, gated db_query, fake OpenAI) is
driven by the official SDK `mcp.Client` with an `elicitation_callback`, over real HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx2
import mcp_types as types
import pytest
from mcp import Client
from mcp.client.session import ClientRequestContext
from mcp.client.streamable_http import streamable_http_client

import audit_log
import grants
from shell_client import ShellClient
from tests.conftest import AgentServer, ConfigDir, free_port, openai_model
from tests.fakes.backend import text, tool_call
from tests.fakes.openai_backend import FakeOpenAI
from tests.test_gate_e2e import DB_PLUGIN, tool_results
from tests.test_mcp_client import stdio_server, write_config
from tests.test_mcp_server import (
    HUMAN,
    PENDING,
    TOKENS,
    WAIT,
    WORKER,
    McpServer,
    _first_pending,
    call_json,
    connect,
    mcp_server,
    read_json,
)
from tests.waiting import until

__all__ = ["mcp_server"]  # the module's server (a fixture)

Answer = Callable[[types.ElicitRequestFormParams], Awaitable[types.ElicitResult]]
ROWS = "id | name\n1  | ada"


@contextlib.asynccontextmanager
async def eliciting(url: str, token: str, answer: Answer, asked: list[types.ElicitRequestFormParams],
                    mode: str = "legacy") -> AsyncIterator[Client]:
    """A 2025-11-25 SDK client that declares elicitation: each form is recorded in `asked`, then answered."""

    async def on_elicit(ctx: ClientRequestContext, params: types.ElicitRequestParams
                        ) -> types.ElicitResult | types.ErrorData:
        assert isinstance(params, types.ElicitRequestFormParams)
        asked.append(params)
        return await answer(params)

    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"},
                                  timeout=httpx2.Timeout(30, read=120)) as http:
        async with Client(streamable_http_client(url, http_client=http), mode=mode, cache=None,
                          elicitation_callback=on_elicit) as client:
            yield client


def choose(decision: str, **more: Any) -> Answer:
    async def answer(params: types.ElicitRequestFormParams) -> types.ElicitResult:
        return types.ElicitResult(action="accept", content={"decision": decision, **more})
    return answer


def act(action: str) -> Answer:
    async def answer(params: types.ElicitRequestFormParams) -> types.ElicitResult:
        return types.ElicitResult(action=action)  # type: ignore[arg-type]
    return answer


async def test_a_gate_arrives_as_an_elicitation_form_and_allow_runs_the_call(mcp_server: McpServer) -> None:
    backend = mcp_server.backend
    backend.script(tool_call("db_query", {"sql": "SELECT name FROM users"}), text("The user is ada."))
    asked: list[types.ElicitRequestFormParams] = []
    async with eliciting(mcp_server.url, HUMAN, choose("allow_once"), asked) as client:
        out = call_json(await asyncio.wait_for(client.call_tool(
            "send_message", {"text": "who are the users?", "session": "elicit-allow"}), WAIT))
    assert out["status"] == "complete" and out["text"] == "The user is ada."
    assert tool_results(backend) == [ROWS]  # the tool ran and the model got its rows
    (form,) = asked
    assert "db_query" in form.message and "users" in form.message and "read" in form.message
    schema = form.requested_schema
    assert schema["required"] == ["decision"]
    offered = [c["const"] for c in schema["properties"]["decision"]["oneOf"]]
    assert offered == ["allow_once", "allow_for", "allow_session", "allow_pattern", "reject"]
    assert schema["properties"]["minutes"]["default"] == 15
    async with connect(mcp_server.url, HUMAN) as human:
        async def history() -> list[dict[str, Any]]:
            result = await human.read_resource("agentmcp://sessions/mcp-elicit-allow/approvals/history")
            return json.loads(result.contents[0].text)

        await until(history, "the decision is recorded")  # written after the turn goes on
        (record,) = await history()
        assert record["decision"] == "allow" and record["decided_by"] == "human:alice (elicitation: accept)"


async def test_allow_for_minutes_from_the_form_creates_a_timed_grant(mcp_server: McpServer) -> None:
    backend = mcp_server.backend
    backend.script(tool_call("db_query", {"sql": "SELECT name FROM users"}), text("ada"),
                   tool_call("db_query", {"sql": "SELECT name FROM users"}), text("ada again"))
    asked: list[types.ElicitRequestFormParams] = []
    async with eliciting(mcp_server.url, HUMAN, choose("allow_for", minutes=30), asked) as client:
        first = call_json(await client.call_tool("send_message", {"text": "users?", "session": "elicit-for"}))
        again = call_json(await client.call_tool("send_message", {"text": "again?", "session": "elicit-for"}))
    assert (first["text"], again["text"]) == ("ada", "ada again")
    assert len(asked) == 1  # the second call ran under the 30-minute grant, unasked
    async with connect(mcp_server.url, HUMAN) as human:
        result = await human.read_resource("agentmcp://sessions/mcp-elicit-for/grants")
        assert '"scope": "allow_for"' in result.contents[0].text and "mcp token 'alice'" in result.contents[0].text


async def test_decline_or_cancel_of_the_form_rejects_the_call(mcp_server: McpServer) -> None:
    backend = mcp_server.backend
    for action in ("decline", "cancel"):
        backend.script(tool_call("db_query", {"sql": "DELETE FROM users"}), text("It was not run."))
        asked: list[types.ElicitRequestFormParams] = []
        async with eliciting(mcp_server.url, HUMAN, act(action), asked) as client:
            out = call_json(await client.call_tool("send_message", {"text": "delete them",
                                                                    "session": f"elicit-{action}"}))
        assert out["text"] == "It was not run." and len(asked) == 1
        (result,) = tool_results(backend)
        assert result.startswith("TOOL CALL REJECTED: the user rejected"), result
    # An accepted form that says reject (or a choice the gate did not offer) rejects too.
    backend.script(tool_call("db_query", {"sql": "DELETE FROM users"}), text("No."))
    async with eliciting(mcp_server.url, HUMAN, choose("allow_everything"), []) as client:
        await client.call_tool("send_message", {"text": "delete them", "session": "elicit-odd"})
    assert tool_results(backend)[0].startswith("TOOL CALL REJECTED: the user rejected")


async def test_a_client_without_the_capability_waits_for_answer_approval_as_before(mcp_server: McpServer) -> None:
    backend = mcp_server.backend
    backend.script(tool_call("db_query", {"sql": "SELECT name FROM users"}), text("The user is ada."))
    async with connect(mcp_server.url, HUMAN) as plain, connect(mcp_server.url, HUMAN) as approver:
        call = asyncio.create_task(plain.call_tool("send_message", {"text": "users?", "session": "elicit-none"}))
        (pending,) = [p for p in await _first_pending(approver) if p["session"] == "mcp-elicit-none"]
        call_json(await approver.call_tool("answer_approval", {"gate_id": pending["gate_id"],
                                                                "decision": "allow_once"}))
        out = call_json(await asyncio.wait_for(call, WAIT))
    assert out["text"] == "The user is ada." and tool_results(backend) == [ROWS]


async def test_a_2026_client_is_not_asked_mid_call_and_waits_for_answer_approval(mcp_server: McpServer) -> None:
    """2026-07-28 has no server-to-client request during a call: its gates wait as before (docs/approvals.md)."""
    backend = mcp_server.backend
    backend.script(tool_call("db_query", {"sql": "SELECT name FROM users"}), text("ok"))
    asked: list[types.ElicitRequestFormParams] = []
    async with eliciting(mcp_server.url, HUMAN, choose("allow_once"), asked, mode="auto") as modern, \
            connect(mcp_server.url, HUMAN) as approver:
        assert modern.protocol_version == "2026-07-28"
        call = asyncio.create_task(modern.call_tool("send_message", {"text": "users?", "session": "elicit-2026"}))
        (pending,) = [p for p in await _first_pending(approver) if p["session"] == "mcp-elicit-2026"]
        call_json(await approver.call_tool("answer_approval", {"gate_id": pending["gate_id"],
                                                                "decision": "allow_once"}))
        out = call_json(await asyncio.wait_for(call, WAIT))
    assert out["text"] == "ok" and asked == [] and tool_results(backend) == [ROWS]


async def test_an_agent_token_is_never_asked_to_approve_its_own_gate(mcp_server: McpServer) -> None:
    backend = mcp_server.backend
    backend.script(tool_call("db_query", {"sql": "SELECT name FROM users"}), text("ok"))
    asked: list[types.ElicitRequestFormParams] = []
    async with eliciting(mcp_server.url, WORKER, choose("allow_once"), asked) as agent, \
            connect(mcp_server.url, HUMAN) as human:
        call = asyncio.create_task(agent.call_tool("send_message", {"text": "users?"}))
        (pending,) = [p for p in await _first_pending(human) if p["session"] == "mcp-worker"]
        call_json(await human.call_tool("answer_approval", {"gate_id": pending["gate_id"], "decision": "reject"}))
        call_json(await asyncio.wait_for(call, WAIT))
    assert asked == []
    assert tool_results(backend)[0].startswith("TOOL CALL REJECTED")


async def test_a_form_is_withdrawn_when_the_gate_is_answered_elsewhere(mcp_server: McpServer) -> None:
    backend = mcp_server.backend
    backend.script(tool_call("db_query", {"sql": "SELECT name FROM users"}), text("ada"))
    shown = asyncio.Event()
    never: asyncio.Future[types.ElicitResult] = asyncio.get_running_loop().create_future()

    async def hold(params: types.ElicitRequestFormParams) -> types.ElicitResult:
        shown.set()
        return await never  # the human never answers the form

    async with eliciting(mcp_server.url, HUMAN, hold, []) as client, connect(mcp_server.url, HUMAN) as other:
        call = asyncio.create_task(client.call_tool("send_message", {"text": "users?", "session": "elicit-else"}))
        await asyncio.wait_for(shown.wait(), WAIT)
        (pending,) = [p for p in await _first_pending(other) if p["session"] == "mcp-elicit-else"]
        call_json(await other.call_tool("answer_approval", {"gate_id": pending["gate_id"], "decision": "allow_once"}))
        out = call_json(await asyncio.wait_for(call, WAIT))
    assert out["text"] == "ada" and tool_results(backend) == [ROWS]


async def test_a_routed_gate_is_asked_only_of_the_mcp_tokens_it_names(tmp_path) -> None:
    """approvals routes the mcp class's gates to token alice: her form's answer decides (as mcp:alice through
    mcp-elicitation); bob, another human token, is not asked, and his session's gate waits for alice."""
    bob = "human-token-bob-for-tests-01"
    with FakeOpenAI() as backend:
        cfg = ConfigDir(tmp_path)
        cfg.models = {"fake": openai_model(backend)}
        cfg.add_plugin("plugin_test_db", DB_PLUGIN)
        port = free_port()
        cfg.plugins.append("plugin_client_mcp")
        cfg.plugin_config["plugin_client_mcp"] = {"port": port}
        cfg.gates = {"db": {}}
        cfg.enabled_extra = {"approvals": {"classes": {"mcp": {"mcp_tokens": ["alice"]}}}}
        (tmp_path / "mcp-tokens.json").write_text(json.dumps({"tokens": {
            "alice": {"role": "human", "token": HUMAN}, "bob": {"role": "human", "token": bob}}}))
        (tmp_path / "mcp-tokens.json").chmod(0o600)
        server = AgentServer(cfg.write(), {"SESSION_STORE": "memory"}).start()
        url = f"http://127.0.0.1:{port}/mcp"
        try:
            backend.script(tool_call("db_query", {"sql": "DELETE FROM users WHERE id = 3"}), text("Deleted."))
            asked: list[types.ElicitRequestFormParams] = []
            async with ShellClient(server.url, "mcp-routed", token=server.token) as watcher:
                await watcher.connect(max_wait=10)
                async with eliciting(url, HUMAN, choose("allow_once"), asked) as alice:
                    out = call_json(await alice.call_tool("send_message", {"text": "delete 3", "session": "routed"}))
                closing = None
                async for ev in watcher.events():
                    if ev.name == "status" and ev.data.get("decision"):
                        closing = ev.data
                    if ev.name == "done":
                        break
            assert out["text"] == "Deleted." and tool_results(backend) == [ROWS]
            assert "approvers: MCP token 'alice'" in asked[0].message
            assert closing is not None and (closing["by"], closing["channel"]) == ("mcp:alice", "mcp-elicitation")

            backend.script(tool_call("db_query", {"sql": "DELETE FROM users WHERE id = 4"}), text("Deleted too."))
            not_asked: list[types.ElicitRequestFormParams] = []
            async with eliciting(url, bob, choose("allow_once"), not_asked) as as_bob, connect(url, HUMAN) as lead:
                call = asyncio.create_task(as_bob.call_tool("send_message", {"text": "delete 4", "session": "bobs"}))
                (pending,) = [p for p in await _first_pending(lead) if p["session"] == "mcp-bobs"]
                assert pending["request"]["approvers"] == ["mcp:alice"]
                call_json(await lead.call_tool("answer_approval", {"gate_id": pending["gate_id"],
                                                                    "decision": "allow_once"}))
                out = call_json(await asyncio.wait_for(call, WAIT))
            assert out["text"] == "Deleted too." and not_asked == []
        finally:
            log = server.stop()
    assert HUMAN not in log and bob not in log


async def test_a_servers_question_is_passed_on_to_the_mcp_client_whose_turn_called_the_tool(tmp_path) -> None:
    """Both ways at once: an MCP client's turn calls a tool of an MCP server agent-mcp uses, that server
    elicits, and the client that declared elicitation gets the server's own form; its values reach the
    server. A client without the capability answers through answer_approval with `content`."""
    with FakeOpenAI() as backend:
        cfg = ConfigDir(tmp_path)
        cfg.models = {"fake": openai_model(backend)}
        port = free_port()
        cfg.plugins.append("plugin_client_mcp")
        cfg.plugin_config["plugin_client_mcp"] = {"port": port}
        write_config(cfg, {"shows": stdio_server(protocol="legacy")})  # every tool open: only the question asks
        (tmp_path / "mcp-tokens.json").write_text(json.dumps(TOKENS))
        (tmp_path / "mcp-tokens.json").chmod(0o600)
        server = AgentServer(cfg.write(), {"SESSION_STORE": "memory"}).start()
        url = f"http://127.0.0.1:{port}/mcp"
        try:
            backend.script(tool_call("shows_book", {"title": "Hamlet"}), text("Booked."))
            asked: list[types.ElicitRequestFormParams] = []

            # Beyond the server's maximum (9) first: asked again with why, never sent on; then a value that fits.
            fill = answers({"seats": 50, "window": True}, {"seats": 5, "window": True})
            async with eliciting(url, HUMAN, fill, asked) as client:
                out = call_json(await asyncio.wait_for(client.call_tool("send_message", {"text": "book",
                                                                                         "session": "shows"}), WAIT))
            assert out["text"] == "Booked."
            assert tool_results(backend) == ['booked Hamlet: {"seats":5,"window":true,"meal":"veg"}']
            form, again = asked
            assert form.message == "MCP server 'shows' asks (during shows_book): How many seats for 'Hamlet'?"
            assert form.requested_schema["properties"]["seats"]["type"] == "integer"  # the server's own form
            assert again.message.startswith("Your answer was not taken: field 'seats' takes an integer from 1 to 9, "
                                            "not 50.") and again.message.endswith(form.message)

            backend.script(tool_call("shows_book", {"title": "Lear"}), text("Booked Lear."))
            async with connect(url, HUMAN) as plain, connect(url, HUMAN) as approver:
                call = asyncio.create_task(plain.call_tool("send_message", {"text": "book", "session": "lear"}))
                (pending,) = [p for p in await _first_pending(approver) if p["session"] == "mcp-lear"]
                assert pending["request"]["elicitation"]["server"] == "shows"
                for content in ({"seats": 50}, {"seats": "1"}, {"seats": 1, "meal": "fish"}, {"rows": 1}):
                    refused = await approver.call_tool("answer_approval", {
                        "gate_id": pending["gate_id"], "decision": "allow_once", "content": content})
                    assert refused.is_error, content
                    assert "the answer does not fit the form of MCP server 'shows': " in \
                        refused.content[0].text and "the gate still waits" in refused.content[0].text
                call_json(await approver.call_tool("answer_approval", {
                    "gate_id": pending["gate_id"], "decision": "allow_once", "content": {"seats": 1}}))
                out = call_json(await asyncio.wait_for(call, WAIT))
            assert out["text"] == "Booked Lear."
            assert tool_results(backend) == ['booked Lear: {"seats":1,"window":false,"meal":"veg"}']
        finally:
            log = server.stop()
    assert HUMAN not in log


# ── A client that goes away mid-form ────────────────────────────────────────────────────────


@pytest.mark.parametrize("how", ["closes its session", "drops the connection"])
async def test_a_client_that_goes_away_mid_form_leaves_the_gate_open_audited_and_the_turn_kept(
        mcp_server: McpServer, how: str) -> None:
    """The form's client goes away (its SDK client closed: DELETE of its session; or only its connection cut):
    the gate stays open for the others, the leaving is audited, and once another client answers, the turn goes
    on and its message and answer are in the session's history."""
    backend = mcp_server.backend
    session = "gone-" + ("closed" if how == "closes its session" else "dropped")
    backend.script(tool_call("db_query", {"sql": "DELETE FROM users WHERE id = 9"}), text("Deleted 9."))
    shown = asyncio.Event()

    async def hold(ctx: ClientRequestContext, params: types.ElicitRequestParams) -> types.ElicitResult:
        shown.set()
        await asyncio.Event().wait()  # the human never answers: the client goes away first
        raise AssertionError("unreachable")

    async def leaving() -> None:
        async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {HUMAN}"}) as http:
            async with Client(streamable_http_client(mcp_server.url, http_client=http,
                                                     terminate_on_close=how == "closes its session"),
                              mode="legacy", cache=None, elicitation_callback=hold) as client:
                await client.call_tool("send_message", {"text": "delete user 9", "session": session})

    audit = mcp_server.server.data_dir / grants.AUDIT_FILE

    def records(event: str) -> list[dict[str, Any]]:
        return [r for r in audit_log.read_audit(audit) if r["event"] == event and r["session"] == f"mcp-{session}"]

    call = asyncio.create_task(leaving())
    await asyncio.wait_for(shown.wait(), WAIT)
    call.cancel()
    await asyncio.gather(call, return_exceptions=True)
    await until(lambda: bool(records("client_gone")), "the client's leaving in the audit log")
    (gone,) = records("client_gone")
    assert (gone["actor"], gone["tool"], gone["op"]) == ("mcp:alice", "db_query", "write")
    assert "went away mid-form" in gone["outcome"] and json.loads(gone["detail"])["form_shown"] is True
    async with connect(mcp_server.url, HUMAN) as other:
        (pending,) = [p for p in await read_json(other, PENDING) if p["session"] == f"mcp-{session}"]
        call_json(await other.call_tool("answer_approval", {"gate_id": pending["gate_id"], "decision": "allow_once"}))

        async def history() -> list[dict[str, Any]]:
            return await read_json(other, f"agentmcp://sessions/mcp-{session}/history")

        await until(lambda: _ends_with(history(), "Deleted 9."), "the turn's answer in the history")
        kept = await history()
    assert kept[0]["role"] == "user" and kept[0]["content"] == "delete user 9"
    (decided,) = records("decision")
    assert decided["outcome"] == "allowed once" and decided["tool"] == "db_query"
    assert tool_results(backend) == [ROWS]


async def _ends_with(history: Awaitable[list[dict[str, Any]]], answer: str) -> bool:
    rows = await history
    return bool(rows) and rows[-1].get("content") == answer


# ── Strict answers ──────────────────────────────────────────────────────────────────────────


def answers(*contents: dict[str, Any]) -> Answer:
    """Accept the forms with these contents, one after another."""
    left = list(contents)

    async def answer(params: types.ElicitRequestFormParams) -> types.ElicitResult:
        return types.ElicitResult(action="accept", content=left.pop(0))
    return answer


async def test_a_form_answer_that_does_not_fit_is_asked_again_saying_why(mcp_server: McpServer) -> None:
    """minutes "15" and minutes true are not 15 minutes: the form comes again with the reason, and the answer
    that fits decides (a 30-minute grant)."""
    backend = mcp_server.backend
    backend.script(tool_call("db_query", {"sql": "SELECT name FROM users"}), text("ada"))
    asked: list[types.ElicitRequestFormParams] = []
    given = answers({"decision": "allow_for", "minutes": "15"}, {"decision": "allow_for", "minutes": True},
                    {"decision": "allow_for", "minutes": 30})
    async with eliciting(mcp_server.url, HUMAN, given, asked) as client:
        out = call_json(await asyncio.wait_for(client.call_tool(
            "send_message", {"text": "users?", "session": "elicit-strict"}), WAIT))
    assert out["text"] == "ada" and tool_results(backend) == [ROWS]
    assert len(asked) == 3
    assert asked[1].message.startswith("Your answer was not taken: field 'minutes' takes an integer from 1 to 1440, "
                                       'not "15". Answer again (2 more tries')
    assert asked[2].message.startswith("Your answer was not taken: field 'minutes' takes an integer from 1 to 1440, "
                                       "not true. Answer again (1 more try")
    assert asked[2].message.endswith(asked[0].message) and asked[2].requested_schema == asked[0].requested_schema
    async with connect(mcp_server.url, HUMAN) as human:
        (grant,) = await read_json(human, "agentmcp://sessions/mcp-elicit-strict/grants")
    assert grant["scope"] == "allow_for" and 29 * 60 < grant["expires"] - grant["created"] <= 30 * 60


async def test_answers_that_never_fit_reject_the_gate(mcp_server: McpServer) -> None:
    backend = mcp_server.backend
    backend.script(tool_call("db_query", {"sql": "DELETE FROM users"}), text("Not run."))
    asked: list[types.ElicitRequestFormParams] = []
    given = answers({"decision": "allow_for", "minutes": 5000}, {"decision": "allow_everything"},
                    {"decision": "allow_once", "extra": 1})
    async with eliciting(mcp_server.url, HUMAN, given, asked) as client:
        await asyncio.wait_for(client.call_tool("send_message", {"text": "delete", "session": "elicit-never"}), WAIT)
    assert len(asked) == 3 and "not 5000" in asked[1].message and "allow_everything" in asked[2].message
    assert tool_results(backend)[0].startswith("TOOL CALL REJECTED: the user rejected")
    async with connect(mcp_server.url, HUMAN) as human:
        async def history() -> list[dict[str, Any]]:
            return await read_json(human, "agentmcp://sessions/mcp-elicit-never/approvals/history")

        await until(history, "the decision is recorded")
        (record,) = await history()
    assert record["decision"] == "reject"
    assert record["decided_by"] == "human:alice (elicitation: answers did not fit the form: the form has no field " \
                                   "extra (its fields: decision, minutes))"


async def test_answer_approval_takes_only_values_that_fit(mcp_server: McpServer) -> None:
    """answer_approval's minutes is a JSON integer in range; content for a server's question must fit its form
    (else the answerer is told why and the gate still waits); a gate that is no question takes no content."""
    backend = mcp_server.backend
    backend.script(tool_call("db_query", {"sql": "SELECT name FROM users"}), text("ada"))
    async with connect(mcp_server.url, HUMAN) as plain, connect(mcp_server.url, HUMAN) as approver:
        call = asyncio.create_task(plain.call_tool("send_message", {"text": "users?", "session": "strict-answer"}))
        (pending,) = [p for p in await _first_pending(approver) if p["session"] == "mcp-strict-answer"]
        gate_id = pending["gate_id"]
        for minutes in ("15", True, 0, 1441):
            refused = await approver.call_tool("answer_approval", {"gate_id": gate_id, "decision": "allow_for",
                                                                    "minutes": minutes})
            assert refused.is_error and "minutes" in refused.content[0].text, (minutes, refused.content)
        refused = await approver.call_tool("answer_approval", {"gate_id": gate_id, "decision": "allow_once",
                                                                "content": {"seats": 1}})
        assert refused.is_error and "is not a question of an MCP server" in refused.content[0].text
        assert [p["gate_id"] for p in await read_json(approver, PENDING)
                if p["session"] == "mcp-strict-answer"] == [gate_id]  # nothing changed
        call_json(await approver.call_tool("answer_approval", {"gate_id": gate_id, "decision": "allow_once"}))
        out = call_json(await asyncio.wait_for(call, WAIT))
    assert out["text"] == "ada"


async def test_a_routed_gate_left_mid_form_goes_to_its_other_approvers_or_times_out(tmp_path) -> None:
    """approvals routes the mcp class's gates on `users` to tokens alice and bob, those on `logs` to alice alone
    (2 s): alice's client goes away mid-form; bob answers the first, nobody the second, which times out. Both
    turns go on, every step is audited, and both messages and answers are kept."""
    bob = "human-token-bob-for-tests-01"
    with FakeOpenAI() as backend:
        cfg = ConfigDir(tmp_path)
        cfg.models = {"fake": openai_model(backend)}
        cfg.add_plugin("plugin_test_db", DB_PLUGIN)
        port = free_port()
        cfg.plugins.append("plugin_client_mcp")
        cfg.plugin_config["plugin_client_mcp"] = {"port": port}
        cfg.gates = {"db": {}}
        cfg.enabled_extra = {"approvals": {"classes": {"mcp": {
            "mcp_tokens": ["alice", "bob"], "tables": {"logs": {"mcp_tokens": ["alice"], "timeout_seconds": 2}}}}}}
        (tmp_path / "mcp-tokens.json").write_text(json.dumps({"tokens": {
            "alice": {"role": "human", "token": HUMAN}, "bob": {"role": "human", "token": bob}}}))
        (tmp_path / "mcp-tokens.json").chmod(0o600)
        server = AgentServer(cfg.write(), {"SESSION_STORE": "memory"}).start()
        url = f"http://127.0.0.1:{port}/mcp"
        audit = server.data_dir / grants.AUDIT_FILE

        def records(session: str) -> list[dict[str, Any]]:
            return [r for r in audit_log.read_audit(audit) if r["session"] == f"mcp-{session}"]

        async def leave_mid_form(session: str, text_: str) -> None:
            shown = asyncio.Event()

            async def hold(params: types.ElicitRequestFormParams) -> types.ElicitResult:
                shown.set()
                await asyncio.Event().wait()
                raise AssertionError("unreachable")

            async def run() -> None:
                async with eliciting(url, HUMAN, hold, []) as alice:
                    await alice.call_tool("send_message", {"text": text_, "session": session})

            call = asyncio.create_task(run())
            await asyncio.wait_for(shown.wait(), WAIT)
            call.cancel()
            await asyncio.gather(call, return_exceptions=True)
            await until(lambda: any(r["event"] == "client_gone" for r in records(session)), "the leaving audited")

        async def kept(session: str, answer: str) -> list[dict[str, Any]]:
            async with connect(url, bob) as reader:
                async def history() -> list[dict[str, Any]]:
                    return await read_json(reader, f"agentmcp://sessions/mcp-{session}/history")

                await until(lambda: _ends_with(history(), answer), f"the answer of {session} in its history")
                return await history()

        try:
            backend.script(tool_call("db_query", {"sql": "DELETE FROM users WHERE id = 3"}), text("Deleted 3."))
            await leave_mid_form("left-users", "delete user 3")
            async with connect(url, bob) as as_bob:
                (pending,) = [p for p in await read_json(as_bob, PENDING) if p["session"] == "mcp-left-users"]
                assert pending["request"]["approvers"] == ["mcp:alice", "mcp:bob"]
                call_json(await as_bob.call_tool("answer_approval", {"gate_id": pending["gate_id"],
                                                                      "decision": "allow_once"}))
            assert (await kept("left-users", "Deleted 3."))[0]["content"] == "delete user 3"
            assert tool_results(backend) == [ROWS]
            events = [(r["event"], r["actor"]) for r in records("left-users")]
            assert events == [("client_gone", "mcp:alice"), ("decision", "mcp:bob")]

            backend.script(tool_call("db_query", {"sql": "DELETE FROM logs"}), text("Nobody approved it."))
            await leave_mid_form("left-logs", "clear the logs")
            history = await kept("left-logs", "Nobody approved it.")
            assert history[0]["content"] == "clear the logs"
            assert tool_results(backend)[0].startswith("TOOL CALL REJECTED: nobody approved")
            (gone, expired) = records("left-logs")
            assert gone["event"] == "client_gone" and json.loads(gone["detail"])["waiting_for"] == "MCP token 'alice'"
            assert (expired["event"], expired["outcome"]) == ("decision", "no answer: rejected")
        finally:
            log = server.stop()
    assert HUMAN not in log and bob not in log and "Traceback" not in log
