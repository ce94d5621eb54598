"""A gate round trip over real HTTP: server subprocess, fake LLM backend, shell.py's own client and UI."""

from __future__ import annotations

import io

from rich.console import Console

from shell_client import ShellClient, ShellEvent
from shell_ui import ShellUI
from tests.conftest import AgentServer, one_tool_plugin, openai_model
from tests.fakes.backend import text, tool_call

DB_PLUGIN = one_tool_plugin("plugin_test_db", "db_query", "sql", r'"id | name\n1  | ada"', {"type": "db"}, "Run SQL.")


async def gated_turn(server: AgentServer, client_id: str, key: str | None) -> tuple[list[ShellEvent], str, ShellUI]:
    """One turn through ShellClient + ShellUI; `key` is pressed when the gate appears (None: no answer)."""
    out = io.StringIO()
    async with ShellClient(server.url, client_id, token=server.token) as client:
        await client.connect(max_wait=10)
        ui = ShellUI(Console(file=out, width=140), client)
        ui.begin_turn()
        await client.submit("who are the users?")
        events = []
        async for ev in client.events():
            events.append(ev)
            await ui.handle_event(ev)
            if ev.name == "gate" and key is not None:
                await ui.handle_key(key)
            if ev.name == "done":
                break
    return events, out.getvalue(), ui


def tool_results(backend) -> list[str]:
    return [m["content"] for m in backend.requests[-1].json["messages"] if m["role"] == "tool"]


async def test_gate_round_trip_allow_reject_timeout_and_session(config_dir, fake_openai, start_server) -> None:
    cfg = config_dir
    cfg.models = {"fake": openai_model(fake_openai)}
    cfg.add_plugin("plugin_test_db", DB_PLUGIN)
    cfg.env = {"GATE_TIMEOUT": "1.5"}
    server = start_server(cfg)
    ask = tool_call("db_query", {"sql": "SELECT name FROM `users`"})

    # Allow once: the tool runs and the model gets its result.
    fake_openai.script(ask, text("The user is ", "ada."))
    events, screen, ui = await gated_turn(server, "shell-a", "a")
    (gate_event,) = [e for e in events if e.name == "gate"]
    assert gate_event.data["tool_name"] == "db_query" and gate_event.data["tables"] == ["users"]
    assert gate_event.data["tool_args"] == {"sql": "SELECT name FROM `users`", "operation_type": "read"}
    assert gate_event.data["timeout_seconds"] == 1.5
    assert "db_query" in screen and "users" in screen and "allowed once" in screen
    assert tool_results(fake_openai) == ["id | name\n1  | ada"]
    assert "".join(e.text for e in events if e.name == "tok") == "The user is ada." and not ui.pending_gates

    # Reject: the model is told, the tool never runs.
    fake_openai.script(ask, text("It was rejected."))
    events, screen, ui = await gated_turn(server, "shell-b", "r")
    assert tool_results(fake_openai)[0].startswith("TOOL CALL REJECTED: the user rejected your db_query request")
    assert "rejected" in screen and not ui.pending_gates

    # No answer: after GATE_TIMEOUT the server rejects, and the shell drops its prompt.
    fake_openai.script(ask, text("Nobody answered."))
    events, screen, ui = await gated_turn(server, "shell-c", None)
    assert "within 1.5 s" in tool_results(fake_openai)[0]
    assert any(e.data.get("decision") == "timeout" for e in events if e.name == "status") and not ui.pending_gates

    # Allow for this session: the next identical request runs without asking.
    fake_openai.script(ask, text("ok"))
    events, _, _ = await gated_turn(server, "shell-d", "s")
    assert [e.name for e in events].count("gate") == 1
    fake_openai.script(ask, text("again"))
    events, _, _ = await gated_turn(server, "shell-d", None)
    assert "gate" not in [e.name for e in events] and tool_results(fake_openai)[-1].startswith("id | name")

    # The endpoint decides who answers, not the id: a session named like a Slack thread, driven from
    # the token-authenticated shell, is asked of the human at the shell (Slack's own requests are
    # rejected at once: tests/test_gate.py).
    fake_openai.script(ask, text("Asked."))
    events, _, _ = await gated_turn(server, "slack-C1-1.2", "a")
    assert [e.name for e in events].count("gate") == 1 and tool_results(fake_openai)[0].startswith("id | name")

    assert server.stop().count("db_query ran:") == 4
