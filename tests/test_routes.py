"""routes.py + agents.py in-process: commands, batches, @model, errors, cancellation, history."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
from starlette.responses import JSONResponse
from starlette.routing import Route

import build
import plugin_api
import plugin_loader
import routes
import sessions
import state
import stores
import turns
from config import load_config
from events import Event
from tests.conftest import ConfigDir, gemini_model, openai_model
from tests.fakes.backend import error, hang, malformed, text, tool_call
from tests.runtime import SHIPPED_NAMESPACES, ask, entry, shell_payload
from tests.waiting import until


@pytest.fixture
async def rt(tmp_path, fake_openai, fake_gemini):
    cfg = ConfigDir(tmp_path)
    cfg.models = {
        "fake": openai_model(fake_openai, max_context=6, llm_call_timeout=1),
        "gem": gemini_model(fake_gemini),
        "nokey": {"model_id": "x", "type": "OPENAI", "host": fake_openai.base_url, "env_key": "NOT_SET_ANYWHERE_KEY"},
    }
    cfg.env = {"FAKE_GEMINI_KEY": "k"}
    runtime = await build.build_runtime(load_config(cfg.write().path), store=stores.MemoryStore())
    runtime.client_namespaces.update(SHIPPED_NAMESPACES)
    yield runtime
    await build.close_runtime(runtime)


async def turn(rt: state.Runtime, text_: str, client_id: str = "c1") -> tuple[str, list[Event]]:
    """Submit and collect this client's events up to the turn's `done`: (answer text, events)."""
    sub = rt.hub.subscribe(client_id, rt.hub.last_id(client_id))
    await routes.submit(rt, ask(rt, client_id, text_, shell_payload(rt, client_id, None)))
    events = []
    async for ev in sub:
        events.append(ev)
        if ev.name == "done":
            break
    return "".join(e.data.get("text", "") for e in events if e.name == "tok"), events


async def test_unknown_command_never_reaches_the_model(rt, fake_openai):
    out, events = await turn(rt, "!frobnicate now")
    assert out.startswith("Unknown command: !frobnicate") and "!help" in out
    assert fake_openai.requests == [] and [e.name for e in events][-1] == "done"


async def test_model_command_and_reset(rt, fake_openai):
    out, _ = await turn(rt, "!model")
    assert "fake" in out and "(current)" in out
    out, _ = await turn(rt, "!model nope")
    assert "ERROR: Unknown model 'nope'" in out
    out, _ = await turn(rt, "!model gem")
    assert out == "Model set to 'gem'." and rt.sessions.get("c1").model == "gem"
    await turn(rt, "hello")
    out, _ = await turn(rt, "!reset")
    assert out == "Conversation history cleared (2 messages removed)."


async def test_batch_runs_each_command_then_sends_the_rest(rt, fake_openai):
    out, events = await turn(rt, "!tool_preview_length 7\n!model\nsay hi")
    assert "Tool preview length set to 7 chars." in out and "Available models:" in out
    assert out.endswith("echo: say hi")
    assert [e.name for e in events].count("done") == 1
    assert fake_openai.requests[0].last_user_text == "say hi"


async def test_session_commands(rt):
    await turn(rt, "!help", client_id="a")
    await turn(rt, "!help", client_id="b")
    out, _ = await turn(rt, "!session", client_id="a")
    assert "ID [101] a:" in out and "(current)" in out and "ID [102] b:" in out
    out, _ = await turn(rt, "!session 102 delete", client_id="a")
    assert out == "Deleted session ID [102]: b"
    out, _ = await turn(rt, "!session 102 delete", client_id="a")
    assert out.startswith("Session not found: 102")
    out, _ = await turn(rt, "!session b attach", client_id="a")
    assert "Session not found" in out


async def test_non_interactive_clients_see_and_delete_only_their_own_session(rt):
    for cid in ("shell-user", "llama-10.0.0.1", "slack-C1-1.0"):
        await turn(rt, "!help", client_id=cid)
    out, _ = await turn(rt, "!session", client_id="llama-10.0.0.1")
    assert "llama-10.0.0.1" in out and "shell-user" not in out and "slack-C1-1.0" not in out
    for probe in ("!session 101 delete", "!session shell-user delete", "!session 103"):
        out, _ = await turn(rt, probe, client_id="llama-10.0.0.1")
        assert out.startswith("Session not found")
    assert rt.sessions.get("shell-user") is not None and rt.sessions.get("slack-C1-1.0") is not None
    out, _ = await turn(rt, "!session", client_id="shell-user")  # the shell still sees everyone
    assert "llama-10.0.0.1" in out and "slack-C1-1.0" in out
    out, events = await turn(rt, "!session llama-10.0.0.1 delete", client_id="llama-10.0.0.1")
    # Its own session: the answer and `done` reach the client first, then the session goes.
    assert out.startswith("Deleted session ID [102]: llama-10.0.0.1 (the next message starts a new one)")
    assert events[-1].name == "done" and rt.sessions.get("llama-10.0.0.1") is None
    out, events = await turn(rt, "!session", client_id="llama-10.0.0.1")  # a new session, no "was deleted" notice
    assert "ID [104] llama-10.0.0.1" in out and not any(e.data.get("session_gone") for e in events)


async def test_at_model_switches_for_one_turn_and_restores(rt, fake_openai, fake_gemini):
    fake_gemini.script(text("from ", "gemini"))
    out, _ = await turn(rt, "@gem who are you")
    assert out == "from gemini" and fake_gemini.requests[-1].last_user_text == "who are you"
    session = rt.sessions.get("c1")
    assert session.model == "fake"
    out, _ = await turn(rt, "@nosuch hi")
    assert out.startswith("ERROR: Unknown model '@nosuch'")
    # Restored even when the turn fails.
    fake_gemini.script(error(500, "boom"))
    _, events = await turn(rt, "@gem fail please")
    assert any(e.name == "error" for e in events) and session.model == "fake"


@pytest.mark.parametrize(("reply", "expect"), [
    (error(500, "backend exploded"), "HTTP 500"),
    (hang(5), "no answer within 1"),
    (malformed(), "malformed response"),
])
async def test_backend_failures_become_error_events_and_history_survives(rt, fake_openai, reply, expect):
    await turn(rt, "first question")
    before = list(rt.sessions.get("c1").history)
    fake_openai.script(reply)
    _, events = await turn(rt, "second question")
    errors = [e.data["message"] for e in events if e.name == "error"]
    assert len(errors) == 1 and expect in errors[0] and "fake" in errors[0], errors
    assert [e.name for e in events][-1] == "done"
    assert rt.sessions.get("c1").history == before
    out, _ = await turn(rt, "third question")
    assert out == "echo: third question"
    sent = [m["content"] for m in fake_openai.requests[-1].json["messages"] if m["role"] == "user"]
    assert sent == ["first question", "third question"]


async def test_missing_api_key_names_the_variable(rt):
    await turn(rt, "!model nokey")
    _, events = await turn(rt, "hello")
    (msg,) = [e.data["message"] for e in events if e.name == "error"]
    assert "NOT_SET_ANYWHERE_KEY" in msg and ".env" in msg


async def test_tool_calls_and_results_are_kept_and_trimmed_together(rt, fake_openai):
    fake_openai.script(tool_call("read_system_prompt", {"section": "behavior"}), text("done reading"))
    out, events = await turn(rt, "read your prompt")
    assert out == "done reading"
    assert any(e.name == "status" and "read_system_prompt ▶" in e.data["text"] for e in events)
    roles = [m["role"] for m in rt.sessions.get("c1").history]
    assert roles == ["user", "assistant", "tool", "assistant"]
    # max_context is 6: the next turn's context drops the first turn whole, never half a tool exchange.
    await turn(rt, "two")
    await turn(rt, "three")
    sent = fake_openai.requests[-1].json["messages"]
    assert [m["role"] for m in sent] == ["system", "user", "assistant", "user"]
    assert all(m["role"] != "tool" for m in sent)


async def test_bad_tool_arguments_and_unknown_tools_are_results(rt, fake_openai):
    fake_openai.script(tool_call("read_system_prompt", {"section": 5}), tool_call("nonexistent", {}), text("ok"))
    out, _ = await turn(rt, "go")
    tool_results = [m["content"] for m in rt.sessions.get("c1").history if m["role"] == "tool"]
    assert tool_results[0].startswith("ERROR: invalid arguments for read_system_prompt: section")
    assert tool_results[1].startswith("ERROR: unknown tool 'nonexistent'")
    assert fake_openai.requests[1].json["messages"][-1]["content"] == tool_results[0]
    # A second round without a usable call: the loop gives up on calls and asks for the answer without tools.
    assert out == "ok" and "tools" not in fake_openai.requests[-1].json


async def test_new_submit_cancels_the_running_turn_cleanly(rt, fake_openai):
    hold = threading.Event()
    fake_openai.script(text("partial ", "never finished", hold=hold))
    sub = rt.hub.subscribe("c1", rt.hub.last_id("c1"))
    await routes.submit(rt, ask(rt, "c1", "slow question"))
    assert [(await anext(sub)).data["text"] for _ in range(2)] == ["slow question", "partial "]  # its echo first
    out, events = await turn(rt, "quick question")
    hold.set()
    assert out == "echo: quick question"
    # The replaced turn says so and sends no `done` of its own: exactly one `done`, the new turn's.
    assert events[0].name == "status" and events[0].data["text"] == "[cancelled]" and events[1].name == "user"
    assert [e.name for e in events].count("done") == 1
    history = rt.sessions.get("c1").history
    assert [m["content"] for m in history] == ["quick question", "echo: quick question"]


async def test_empty_message_gets_a_hint(rt, fake_openai):
    _, events = await turn(rt, "   ")
    assert "empty message" in events[1].data["message"] and fake_openai.requests == []


async def test_plugin_command_signature_and_conflicts(rt):
    async def hello(args: str) -> str:
        return f"hello {turns.current_turn().client_id} {args}"

    async def who(turn: turns.Turn, args: str) -> str:
        return f"{turn.client_id} asked {args}"

    class Commands(plugin_api.BasePlugin):
        PLUGIN_TYPE = "data_tool"

        def __init__(self, name: str, commands: dict) -> None:
            super().__init__()
            self.PLUGIN_NAME, self.commands = name, commands

        def init(self, config):
            return True

        def shutdown(self):
            pass

        def get_tools(self):
            return {"lc": []}

        def get_commands(self):
            return self.commands

    loader = plugin_loader.PluginLoader(rt)
    loader._register("plugin_x", Commands("plugin_x", {"!HELLO": hello, "who": who}))
    # Both signatures work, whatever the case of the name: (args) and (turn, args).
    assert (await turn(rt, "!hello there"))[0] == "hello c1 there"
    assert (await turn(rt, "!WHO me"))[0] == "c1 asked me"
    # A command that a core module or another plugin already provides is refused, naming the owner, and
    # none of the refused plugin's commands is registered (not even those that did not conflict).
    with pytest.raises(ValueError, match=r"!hello is already provided by plugin_x"):
        loader._register("plugin_y", Commands("plugin_y", {"fresh": hello, "hello": who}))
    with pytest.raises(ValueError, match=r"!reset is already provided by "):
        loader._register("plugin_z", Commands("plugin_z", {"reset": hello}))
    assert "fresh" not in rt.commands and rt.commands["hello"].owner == "plugin_x"
    assert rt.commands["reset"].owner != "plugin_z"
    with pytest.raises(TypeError, match="async handler"):
        loader._register("plugin_w", Commands("plugin_w", {"sync": lambda args: args}))


async def _collect(events) -> tuple[str, list[Event]]:
    got = [ev async for ev in events]
    return "".join(e.data.get("text", "") for e in got if e.name == "tok"), got


def _queued(session: stores.Session) -> int:
    """How many requests wait for `session`'s lock (asyncio keeps its waiters in `_waiters`)."""
    return len(session.lock._waiters or ()) if session.lock.locked() else 0


async def test_run_turn_queues_requests_on_one_session_each_with_its_own_answer(rt, fake_openai):
    hold = threading.Event()
    fake_openai.script(text("first ", "answer", hold=hold))
    first = asyncio.create_task(_collect(routes.run_turn(rt, ask(rt, "c1", "one"))))
    second = asyncio.create_task(_collect(routes.run_turn(rt, ask(rt, "c1", "two"))))
    await until(lambda: bool(fake_openai.requests), "the first request at the model")  # its client is built first
    session = rt.sessions.get("c1")
    assert session is not None
    await until(lambda: _queued(session) == 1, "the second request waiting for the session")
    # The second waits for the session: it neither reached the model nor cancelled the first.
    assert len(fake_openai.requests) == 1 and not first.done() and session.running is not None
    hold.set()
    (out1, ev1), (out2, ev2) = await asyncio.gather(first, second)
    assert (out1, out2) == ("first answer", "echo: two")
    assert len({e.turn for e in ev1}) == 1 and len({e.turn for e in ev2}) == 1 and ev1[0].turn != ev2[0].turn
    assert ev1[-1].name == ev2[-1].name == "done"
    assert [m["content"] for m in rt.sessions.get("c1").history] == ["one", "first answer", "two", "echo: two"]


async def test_run_turn_cancels_its_request_when_the_caller_leaves(rt, fake_openai):
    hold = threading.Event()
    fake_openai.script(text("partial ", "rest", hold=hold))
    events = routes.run_turn(rt, ask(rt, "c1", "slow"))
    assert [(await anext(events)).data["text"] for _ in range(2)] == ["slow", "partial "]
    (task,) = rt.active_tasks["c1"]
    await events.aclose()  # cancels the request, which the held model answer cannot outrun
    hold.set()
    await asyncio.wait([task], timeout=60)
    assert task.cancelled()
    assert "c1" not in rt.active_tasks and rt.sessions.get("c1").history == []
    out, _ = await turn(rt, "next")
    assert out == "echo: next"


async def test_run_turn_ends_when_a_newer_submit_cancels_it(rt, fake_openai):
    hold = threading.Event()
    fake_openai.script(text("partial ", "rest", hold=hold))
    events = routes.run_turn(rt, ask(rt, "c1", "slow"))
    assert [(await anext(events)).data["text"] for _ in range(2)] == ["slow", "partial "]
    await routes.submit(rt, ask(rt, "c1", "replacement"))
    last = [ev async for ev in events][-1]
    hold.set()
    assert last.name == "status" and last.data == {"text": "[cancelled]", "cancelled": True}


async def test_a_stopping_server_ends_the_running_and_the_waiting_turns_with_error_and_done(rt, fake_openai):
    hold = threading.Event()
    fake_openai.script(text("partial ", "rest", hold=hold))
    first = routes.run_turn(rt, ask(rt, "c1", "slow"))  # as the proxy, Slack and MCP send: queued
    assert [(await anext(first)).data["text"] for _ in range(2)] == ["slow", "partial "]
    second = asyncio.create_task(_collect(routes.run_turn(rt, ask(rt, "c1", "waiting"))))
    session = rt.sessions.get("c1")
    assert session is not None
    await until(lambda: _queued(session) == 1, "the second request waiting for the session")
    await routes.end_all(rt)
    hold.set()
    _, rest = await _collect(first)
    _, waited = await second
    assert [e.name for e in rest] == [e.name for e in waited] == ["error", "done"]
    assert rest[0].data == {"message": routes.INTERRUPTED, "kind": "interrupted"}
    assert waited[0].data == {"message": routes.NOT_STARTED, "kind": "interrupted"}
    # As after kill -9: the question that was being answered is kept, the partial answer is not.
    assert [m["content"] for m in rt.sessions.get("c1").history] == ["slow"]
    assert rt.sessions.get("c1").running is None


async def test_a_turn_asked_of_a_stopping_server_is_refused_with_503(rt):
    """Once running turns are ended, a request still on its way starts none (it would be cut at once)."""
    class Submitting:
        PLUGIN_NAME = "plugin_test_submit"

        @staticmethod
        def get_routes() -> list[Route]:
            async def submit(request):
                await routes.submit(rt, ask(rt, "c1", (await request.json())["text"]))
                return JSONResponse({"status": "OK"})
            return [Route("/submit", submit, methods=["POST"])]

    await routes.end_all(rt)
    with pytest.raises(sessions.Stopping):
        await routes.submit(rt, ask(rt, "c1", "too late"))
    app = entry().build_app(rt, Submitting(), {"port": 8765})
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1:8765") as http:
        answer = await http.post("/submit", json={"text": "too late"})
    assert answer.status_code == 503 and answer.json() == {"error": routes.STOPPING}
    assert "c1" not in rt.active_tasks


async def test_payload_model_answers_one_turn_and_keeps_the_session_model(rt, fake_openai, fake_gemini):
    fake_gemini.script(text("from ", "gemini"))
    out, events = await _collect(routes.run_turn(rt, ask(rt, "c1", "hi", {"model": "gem"})))
    assert out == "from gemini" and fake_gemini.requests[-1].last_user_text == "hi" and fake_openai.requests == []
    session = rt.sessions.get("c1")
    assert session.model == "fake"
    # Commands still act on the session itself, and the next turn is back on the session's model.
    out, _ = await _collect(routes.run_turn(rt, ask(rt, "c1", "!model", {"model": "gem"})))
    assert [line.split()[0] for line in out.splitlines() if "(current)" in line] == ["fake"]
    out, _ = await _collect(routes.run_turn(rt, ask(rt, "c1", "again")))
    assert out == "echo: again" and [m["content"] for m in session.history][:2] == ["hi", "from gemini"]
    out, events = await _collect(routes.run_turn(rt, ask(rt, "c1", "hi", {"model": "nosuch"})))
    assert [e.name for e in events] == ["user", "error", "done"] and "unknown model 'nosuch'" in events[1].data[
        "message"
    ]


async def test_the_first_requests_of_a_new_session_keep_their_order(rt, fake_openai, monkeypatch):
    save = rt.sessions.store.save

    async def slow_save(*args, **kwargs):  # a store that really waits, as SQLite does
        await asyncio.sleep(0.05)
        return await save(*args, **kwargs)

    monkeypatch.setattr(rt.sessions.store, "save", slow_save)
    first = asyncio.create_task(_collect(routes.run_turn(rt, ask(rt, "brand-new", "one"))))
    second = asyncio.create_task(_collect(routes.run_turn(rt, ask(rt, "brand-new", "two"))))
    (out1, _), (out2, _) = await asyncio.gather(first, second)
    assert (out1, out2) == ("echo: one", "echo: two")
    assert [r.last_user_text for r in fake_openai.requests] == ["one", "two"]


async def test_backend_address_is_shown_to_the_shell_but_not_to_remote_users(rt, fake_openai):
    host = rt.config.models["fake"].host
    port = str(httpx.URL(host).port)
    fake_openai.script(error(500, "boom"))
    _, events = await turn(rt, "hi", client_id="shell-user")
    assert host in events[-2].data["message"]
    for remote in ("llama-10.0.0.1", "slack-C1-1.0", "api-abcdef12"):
        fake_openai.script(error(500, "boom"))
        _, events = await turn(rt, "hi", client_id=remote)
        message = events[-2].data["message"]
        assert "HTTP 500" in message and "<hidden>" in message and port not in message
