"""MCP elicitation, agent-mcp as MCP client: a server's question during a tool call reaches the human of
the turn that called the tool as a gate, and the answer goes back to the server.

The server is tests/fakes/mcp_server.py (the SDK's `MCPServer`), whose `book` tool elicits a form
{seats: integer 1..9 (required), window: boolean = false, meal: veg|meat = veg} and returns what came
back. Both protocol eras: a standalone `elicitation/create` (2025-11-25, "legacy") and the 2026-07-28
`InputRequiredResult` rounds ("auto").
"""

from __future__ import annotations

import asyncio
import io
import json
import re
from typing import Any

import mcp_types as types
import pytest
from rich.console import Console

import approvals
import audit_log
import build
import grants
import routes
import stores
import turns
from approvals import SHELL, Approver
from config import load_config
from shell_client import ShellClient
from shell_ui import gate_panel
from tests.conftest import ConfigDir, openai_model
from tests.fakes.backend import text, tool_call
from tests.runtime import ask
from tests.test_gate_e2e import tool_results
from tests.test_mcp_client import (
    make_rt,  # noqa: F401  (a fixture)
    plugin,
    stdio_server,
    write_config,
)
from tests.test_scale import two

WAIT = 30  # a guard: a broken server fails the test instead of hanging it
ERAS = ["legacy", "auto"]


async def answer_from_shell(server: Any, client_id: str, decision: str, content: dict[str, Any] | None
                            ) -> list[Any]:
    """One turn from a shell window whose gates are answered with `decision` (and `content`): its events."""
    events: list[Any] = []
    async with ShellClient(server.url, client_id, token=server.token) as client:
        await client.connect(max_wait=10)
        await client.submit("book Hamlet")

        async def follow() -> None:
            async for ev in client.events():
                events.append(ev)
                if ev.name == "gate":
                    await client.gate_response(ev.data["gate_id"], decision, content=content)
                if ev.name == "done":
                    return

        await asyncio.wait_for(follow(), WAIT)
    return events


@pytest.mark.parametrize("era", ERAS)
def test_a_servers_question_is_answered_from_a_shell_window(config_dir, fake_openai, start_server, era) -> None:
    config_dir.models = {"gpt": openai_model(fake_openai)}
    write_config(config_dir, {"local": stdio_server(protocol=era)})
    server = start_server(config_dir)

    # A JSON object: accepted with those values over the form's defaults.
    fake_openai.script(tool_call("local_book", {"title": "Hamlet"}), text("Booked."))
    events = asyncio.run(answer_from_shell(server, "shell-ask1", "allow", {"seats": 2, "window": True}))
    (gate,) = [e for e in events if e.name == "gate"]
    asked = gate.data["elicitation"]
    assert asked["server"] == "local" and asked["message"] == "How many seats for 'Hamlet'?"
    assert [(f["name"], f["type"], f["required"]) for f in asked["fields"]] == [
        ("seats", "integer", True), ("window", "boolean", False), ("meal", "string", False)]
    assert next(f for f in asked["fields"] if f["name"] == "meal")["choices"] == ["veg", "meat"]
    assert gate.data["tool_name"] == "local_book" and gate.data["grants"] == []
    screen = io.StringIO()  # shell.py's panel for it: the server's question, yes / no keys
    Console(file=screen, width=140).print(gate_panel(gate.data, 400))
    assert "MCP server 'local' asks" in screen.getvalue() and "How many seats for 'Hamlet'?" in screen.getvalue()
    assert "[a] yes (the form's defaults)" in screen.getvalue() and "[r] no (decline)" in screen.getvalue()
    assert tool_results(fake_openai) == ['booked Hamlet: {"seats":2,"window":true,"meal":"veg"}']
    assert any(e.name == "status" and "[ask ✓] local_book: answered" in e.text for e in events)

    # A no: the server hears decline.
    fake_openai.script(tool_call("local_book", {"title": "Hamlet"}), text("Not booked."))
    asyncio.run(answer_from_shell(server, "shell-ask2", "reject", None))
    assert tool_results(fake_openai) == ["not booked: decline"]

    # A plain yes to a form with a required field and no default cannot be accepted: declined, and told why.
    fake_openai.script(tool_call("local_book", {"title": "Hamlet"}), text("Not booked."))
    events = asyncio.run(answer_from_shell(server, "shell-ask3", "allow", None))
    assert tool_results(fake_openai) == ["not booked: decline"]
    assert any(e.name == "status" and "needs a value for seats" in e.text for e in events)

    # Values that do not fit the server's form (a choice it does not offer, beyond its maximum of 9, the text
    # "2" for its integer, true for it): declined, told why, never sent on to the server.
    for n, (given, why) in enumerate([({"seats": 2, "meal": "fish"}, "meal' takes one of: veg, meat"),
                                      ({"seats": 50}, "seats' takes an integer from 1 to 9, not 50"),
                                      ({"seats": "2"}, "seats' takes an integer from 1 to 9, not \"2\""),
                                      ({"seats": True}, "seats' takes an integer from 1 to 9, not true")]):
        fake_openai.script(tool_call("local_book", {"title": "Hamlet"}), text("Not booked."))
        events = asyncio.run(answer_from_shell(server, f"shell-ask4{n}", "allow", given))
        assert tool_results(fake_openai) == ["not booked: decline"], given
        assert any(e.name == "status" and why in e.text for e in events), (given, [e.text for e in events])


@pytest.mark.parametrize("era", ERAS)
async def test_with_nobody_to_ask_the_question_is_declined(make_rt, fake_openai, era) -> None:  # noqa: F811
    rt = await make_rt({"local": stdio_server(protocol=era)})
    assert plugin(rt).servers["local"].status == "connected"
    fake_openai.script(tool_call("local_book", {"title": "Hamlet"}), text("Not booked."))
    client_id = "nobody-1"  # no plugin vouches for this id: its class cannot answer gates
    sub = rt.hub.subscribe(client_id, rt.hub.last_id(client_id))
    await routes.submit(rt, ask(rt, client_id, "book Hamlet", {}))
    statuses: list[str] = []
    async with asyncio.timeout(WAIT):
        async for ev in sub:
            if ev.name == "status":
                statuses.append(str(ev.data.get("text")))
            assert ev.name != "gate"
            if ev.name == "done":
                break
    assert tool_results(fake_openai) == ["not booked: decline"]
    assert any("MCP server 'local' asked “How many seats for 'Hamlet'?” during local_book" in s
               and "cannot answer — declined" in s for s in statuses), statuses


def test_forms_beyond_flat_primitive_fields_are_refused_with_the_reason() -> None:
    from plugins._mcp_forms import FormError, content_for, fields_of

    with pytest.raises(FormError, match="field 'where' is not a string, number, integer or boolean"):
        fields_of({"type": "object", "properties": {"where": {"type": "object"}}})
    fields = fields_of({"type": "object", "required": ["ok"], "properties": {"ok": {"type": "boolean"}}})
    assert content_for(fields, None) == {"ok": True}  # a yes to one yes/no question
    assert content_for(fields, {"ok": False}) == {"ok": False}
    for wrong in ("no", "false", 0, 1, None):  # a boolean is true or false, nothing read as one
        with pytest.raises(FormError, match="field 'ok' takes true or false"):
            content_for(fields, {"ok": wrong})
    with pytest.raises(FormError, match="the form has no field other"):
        content_for(fields, {"other": 1})
    with pytest.raises(FormError, match="not an object of field values"):
        content_for(fields, ["ok"])
    assert types.ElicitResult(action="accept", content=content_for(fields, {"ok": True})).content == {"ok": True}
    assert json.dumps(fields)  # the gate event carries them as they are


def test_every_value_is_checked_against_its_fields_schema_without_coercion() -> None:
    """Types, ranges, lengths, formats and choices of the MCP spec's primitive fields, as the asking server
    wrote them; nothing converted ("15" is not 15, true is not 1, 2.5 is not an integer)."""
    from plugins._mcp_forms import FormError, content_for, describe, fields_of

    fields = fields_of({"type": "object", "required": ["n"], "properties": {
        "n": {"type": "integer", "minimum": 1, "maximum": 100},
        "x": {"type": "number", "minimum": 0.5},
        "name": {"type": "string", "minLength": 2, "maxLength": 5},
        "mail": {"type": "string", "format": "email"},
        "day": {"type": "string", "format": "date"},
        "size": {"type": "string", "oneOf": [{"const": "s", "title": "Small"}, {"const": "l", "title": "Large"}]}}})
    assert content_for(fields, {"n": 100, "x": 0.5, "name": "ab", "mail": "a@b.org", "day": "2026-12-08",
                                "size": "l"}) == {"n": 100, "x": 0.5, "name": "ab", "mail": "a@b.org",
                                                  "day": "2026-12-08", "size": "l"}
    assert content_for(fields, {"n": 7.0}) == {"n": 7}  # JSON's 7.0 is the integer 7
    for given, why in [({"n": "15"}, 'n\' takes an integer from 1 to 100, not "15"'),
                       ({"n": True}, "n' takes an integer from 1 to 100, not true"),
                       ({"n": 101}, "not 101"), ({"n": 0}, "not 0"), ({"n": 2.5}, "not 2.5"),
                       ({"n": 1, "x": 0.1}, "x' takes a number of at least 0.5, not 0.1"),
                       ({"n": 1, "x": float("nan")}, "x' takes a number"),
                       ({"n": 1, "name": "a"}, "name' takes text of 2 to 5 characters, not 1"),
                       ({"n": 1, "name": "abcdef"}, "not 6"), ({"n": 1, "name": 12}, "name' takes text"),
                       ({"n": 1, "mail": "nobody"}, "mail' takes text (email)"),
                       ({"n": 1, "day": "tomorrow"}, "day' takes text (date)"),
                       ({"n": 1, "size": "m"}, "size' takes one of: s, l"), ({}, "needs a value for n")]:
        with pytest.raises(FormError, match=re.escape(why)):
            content_for(fields, given)
    assert describe(fields).startswith("n (an integer from 1 to 100, required); x (a number of at least 0.5)")


async def test_a_question_routed_to_approvers_is_answered_by_a_shell_approver_window(tmp_path, fake_openai) -> None:
    """`approvals` names shell approvers for the tool local_book of a class that cannot answer: the server's
    question goes on the approver feed, a window that did not opt in is refused, one that did answers it."""
    cfg = ConfigDir(tmp_path)
    cfg.models = {"fake": openai_model(fake_openai)}
    cfg.enabled_extra = {"approvals": {"classes": {"unknown": {"tools": {"local_book": {"shell": True}}}}}}
    rt = await build.build_runtime(load_config(write_config(cfg, {"local": stdio_server()}).path),
                                   store=stores.MemoryStore())
    try:
        assert rt.plugins is not None
        await rt.plugins.load_all()
        desk = rt.gate.desk
        assert desk is not None
        feed = desk.watch()
        fake_openai.script(tool_call("local_book", {"title": "Hamlet"}), text("Booked."))
        client_id = "nobody-2"
        sub = rt.hub.subscribe(client_id, rt.hub.last_id(client_id))
        await routes.submit(rt, ask(rt, client_id, "book Hamlet", {}))
        async with asyncio.timeout(WAIT):
            opened = await anext(aiter(feed))
        asked = opened.gate
        assert opened.name == approvals.OPENED and asked is not None
        assert (asked.tool, asked.op, asked.approvers) == ("local_book", "elicitation", ["shell:*"])
        assert asked.summary == "MCP server 'local' asks: How many seats for 'Hamlet'?"
        stranger = await rt.gate.answer(asked.gate_id, "allow", answerer=Approver(SHELL, "w-stranger"),
                                        channel="shell", content={"seats": 9})
        assert stranger.outcome == approvals.NOT_APPROVER
        await desk.set_window("w-lead", True)
        result = await rt.gate.answer(asked.gate_id, "allow", answerer=Approver(SHELL, "w-lead"), channel="shell",
                                      content={"seats": 3, "meal": "meat"})
        assert result.answered
        statuses = []
        async with asyncio.timeout(WAIT):
            async for ev in sub:
                if ev.name == "status":
                    statuses.append(ev.data)
                if ev.name == "done":
                    break
        assert tool_results(fake_openai) == ['booked Hamlet: {"seats":3,"window":false,"meal":"meat"}']
        closing = next(s for s in statuses if s.get("gate_id") == asked.gate_id and s.get("decision"))
        assert (closing["by"], closing["channel"]) == ("shell:w-lead", "shell")
        await rt.gate.grants.flush()
        records = list(audit_log.read_audit(rt.config.data_dir() / grants.AUDIT_FILE))
        (refused,) = [r for r in records if r["event"] == "approval_refused"]
        assert (refused["actor"], refused["tool"]) == ("shell:w-stranger", "local_book")
        (record,) = [r for r in records if r["event"] == "decision" and r["tool"] == "local_book"]
        assert (record["actor"], record["op"], record["outcome"]) == ("shell:w-lead", "elicitation",
                                                                      "elicitation accepted")
        assert json.loads(record["detail"])["channel"] == "shell"
    finally:
        await build.close_runtime(rt)


async def test_values_answered_on_another_instance_reach_the_waiting_question(tmp_path, fake_openai,
                                                                                redis_store) -> None:
    """Two instances on one Redis: a question's gate raised on A, answered with values through B (a shell
    window's /gate_response lands on B) — the values reach A's waiting call."""
    async with two(tmp_path, redis_store, {"fake": openai_model(fake_openai)}) as (a, b):
        client_id = "shell-two"
        await a.sessions.get_or_create(client_id, "fake")
        sub = a.hub.subscribe(client_id, a.hub.last_id(client_id))
        asking = asyncio.ensure_future(a.gate.ask(client_id, {"tool_name": "x_book", "grants": []}, WAIT))
        gate_id = ""
        async with asyncio.timeout(WAIT):
            async for ev in sub:
                if ev.name == "gate":
                    gate_id = ev.data["gate_id"]
                    break
        assert (await b.gate.answer(gate_id, "allow", by="shell", channel="shell", content={"seats": 7})).answered
        try:
            decision, asked_id = await asyncio.wait_for(asking, WAIT)
        finally:
            asking.cancel()
        assert (asked_id, decision.word, decision.content) == (gate_id, "allow", {"seats": 7})


def test_a_question_belongs_to_the_one_session_calling_else_to_nobody(tmp_path) -> None:
    """Which turn a server's question is asked of: the current turn's call; else the only session with calls
    in flight on that connection; with calls of several sessions and no context, nobody (declined)."""
    from plugins._mcp_connection import Connection
    from plugins._mcp_servers import StdioServer

    conn = Connection("s", StdioServer(command="true"), {}, tmp_path, lambda c: None)
    a1, a2, b = (turns.Turn("shell-a", "t1", "shell"), turns.Turn("shell-a", "t2", "shell"),
                 turns.Turn("shell-b", "t3", "shell"))
    conn._calls = {1: ("s_book", a1), 2: ("s_book", a2)}
    assert conn._caller() == ("s_book", a1)  # one session: its (first) call
    conn._calls[3] = ("s_other", b)
    assert conn._caller() == ("", None)  # two sessions, no context: nobody
    with turns.running(b):
        assert conn._caller() == ("s_other", b)  # the SDK ran the callback in the calling task
