"""The whole request path over real HTTP: server subprocess, shell.py client code, fake backends."""

from __future__ import annotations

import asyncio
import threading

import httpx

from shell_client import ShellClient
from tests.conftest import AgentServer, gemini_model, openai_model
from tests.fakes.backend import text, tool_call
from tests.turns import answer, collect_turn, run_turn


async def _first_token_before_backend_finishes(server: AgentServer, backend, hold: threading.Event) -> list:
    async with ShellClient(server.url, "streamer", token=server.token) as client:
        await client.connect(max_wait=10)
        await client.submit("tell me a story")
        events = client.events()
        echo, first = await asyncio.wait_for(anext(events), 10), await asyncio.wait_for(anext(events), 10)
        assert echo.name == "user" and echo.text == "tell me a story"  # every window sees the question first
        # The backend is still holding the rest of its stream: the token came through live.
        assert first.name == "tok" and first.text == "Once " and not hold.is_set()
        hold.set()
        rest = []
        async for ev in events:
            rest.append(ev)
            if ev.name == "done":
                break
        return [first, *rest]


def test_shell_client_streams_openai_tokens_live_and_in_order(config_dir, fake_openai, start_server):
    config_dir.models = {"gpt": openai_model(fake_openai)}
    server = start_server(config_dir)
    hold = threading.Event()
    fake_openai.script(text("Once ", "upon ", "a ", "time.", hold=hold))
    events = asyncio.run(_first_token_before_backend_finishes(server, fake_openai, hold))
    assert [e.text for e in events if e.name == "tok"] == ["Once ", "upon ", "a ", "time."]
    assert [e.name for e in events][-1] == "done" and [e.name for e in events].count("done") == 1
    ids = [e.id for e in events]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    req = fake_openai.requests[-1]
    assert req.json["stream"] is True and req.json["messages"][0]["role"] == "system"
    assert {t["function"]["name"] for t in req.json["tools"]} >= {"get_system_info", "read_system_prompt"}


def test_shell_client_streams_gemini_tokens_live_with_tools(config_dir, fake_gemini, start_server):
    config_dir.models = {"gem": gemini_model(fake_gemini)}
    config_dir.env = {"FAKE_GEMINI_KEY": "gem-key"}
    server = start_server(config_dir)
    hold = threading.Event()
    fake_gemini.script(text("Once ", "upon ", "a ", "time.", hold=hold))
    events = asyncio.run(_first_token_before_backend_finishes(server, fake_gemini, hold))
    assert answer(events) == "Once upon a time."
    assert fake_gemini.requests[-1].headers["x-goog-api-key"] == "gem-key"
    assert "streamGenerateContent" in fake_gemini.requests[-1].path
    # A tool round trip on Gemini: functionCall → our tool → functionResponse → text.
    fake_gemini.script(tool_call("read_system_prompt", {"section": "behavior"}), text("Read ", "it."))
    events = run_turn(server, "streamer", "read your behavior section")
    assert answer(events) == "Read it."
    last = fake_gemini.requests[-1].json["contents"][-1]
    assert last["parts"][0]["functionResponse"]["name"] == "read_system_prompt"
    assert "Answer directly" in str(last["parts"][0]["functionResponse"]["response"])


def test_sessions_histories_and_ids_survive_a_restart(config_dir, fake_openai, start_server):
    config_dir.models = {"gpt": openai_model(fake_openai)}
    server = start_server(config_dir)
    assert answer(run_turn(server, "alice", "my name is Alice")) == "echo: my name is Alice"
    assert answer(run_turn(server, "bob", "I am Bob")) == "echo: I am Bob"
    listing = answer(run_turn(server, "alice", "!session"))
    server.stop()

    server = start_server(config_dir)
    assert answer(run_turn(server, "alice", "!session")) == listing
    assert "ID [101] alice:" in listing and "ID [102] bob:" in listing and "history=2 messages" in listing
    run_turn(server, "alice", "what is my name?")
    sent = fake_openai.requests[-1].json["messages"]
    assert [(m["role"], m["content"]) for m in sent[1:]] == [
        ("user", "my name is Alice"), ("assistant", "echo: my name is Alice"), ("user", "what is my name?"),
    ]
    # New sessions continue the shorthand sequence instead of reusing ids.
    run_turn(server, "carol", "hi")
    assert "ID [103] carol:" in answer(run_turn(server, "carol", "!session"))


async def _two_windows_and_a_reconnect(server: AgentServer, hold: threading.Event) -> None:
    url, token = server.url, server.token
    async with ShellClient(url, "shared", token=token) as one, ShellClient(url, "shared", token=token) as two:
        await one.connect(max_wait=10)
        await two.connect(max_wait=10)

        async def until_done(c: ShellClient) -> list:
            got = []
            async for ev in c.events():
                got.append(ev)
                if ev.name == "done":
                    return got
            return got

        waiters = [asyncio.create_task(until_done(one)), asyncio.create_task(until_done(two))]
        await one.submit("count to four")
        hold.set()
        first, second = await asyncio.wait_for(asyncio.gather(*waiters), 20)
        assert [e.text for e in first if e.name == "tok"] == ["one ", "two ", "three ", "four"]
        assert [(e.id, e.name, e.data) for e in first] == [(e.id, e.name, e.data) for e in second]

    # A client that reconnects with Last-Event-ID receives exactly the events it missed.
    cut = first[1].id
    async with httpx.AsyncClient(timeout=10, headers=server.auth) as http:
        async with http.stream("GET", f"{url}/stream", params={"client_id": "shared"},
                               headers={"Last-Event-ID": str(cut)}) as resp:
            ids = []
            async for line in resp.aiter_lines():
                if line.startswith("id:"):
                    ids.append(int(line[3:]))
                if line.startswith("event: done"):
                    break
    assert ids == [e.id for e in first if e.id > cut]


def test_two_subscribers_get_every_token_and_replay_is_exact(config_dir, fake_openai, start_server):
    config_dir.models = {"gpt": openai_model(fake_openai)}
    server = start_server(config_dir)
    hold = threading.Event()
    fake_openai.script(text("one ", "two ", "three ", "four", hold=hold))
    asyncio.run(_two_windows_and_a_reconnect(server, hold))


def test_backend_failures_reach_the_client_and_the_next_turn_works(config_dir, fake_openai, start_server):
    from tests.fakes.backend import error, hang, malformed

    config_dir.models = {"gpt": openai_model(fake_openai, llm_call_timeout=1)}
    server = start_server(config_dir)
    run_turn(server, "c", "hello")
    for reply, cause in [(error(500, "overloaded"), "HTTP 500"), (hang(4), "no answer within 1"),
                         (malformed(), "malformed response")]:
        fake_openai.script(reply)
        events = run_turn(server, "c", "break please")
        errors = [e.text for e in events if e.name == "error"]
        assert len(errors) == 1 and cause in errors[0], errors
    assert answer(run_turn(server, "c", "and now?")) == "echo: and now?"
    sent = fake_openai.requests[-1].json["messages"]
    assert [m["content"] for m in sent if m["role"] == "user"] == ["hello", "and now?"]


async def _attach(server: AgentServer) -> None:
    async with ShellClient(server.url, "first", token=server.token) as c:
        await collect_turn(c, "!help")
        other = await c.attach("102")  # created below by another client
        assert other["client_id"] == "second" and c.client_id == "second"
        await c.submit("hello from the attached terminal")
        async for ev in c.events():
            if ev.name == "done":
                break
    async with ShellClient(server.url, "second", token=server.token) as c:
        shown = answer(await collect_turn(c, "!session second"))
    # The message typed after attaching, and its answer, are in session 102 ("second"), not in "first".
    assert "[102]: second" in shown and "history: 2 messages" in shown


def test_attach_switches_sessions_at_once(config_dir, fake_openai, start_server):
    config_dir.models = {"gpt": openai_model(fake_openai)}
    server = start_server(config_dir)
    run_turn(server, "first", "!help")
    run_turn(server, "second", "!help")
    asyncio.run(_attach(server))
    assert fake_openai.requests[-1].last_user_text == "hello from the attached terminal"
    sessions = httpx.get(f"{server.url}/sessions", params={"client_id": "102"}, headers=server.auth).json()["sessions"]
    assert sessions[0]["client_id"] == "second" and sessions[0]["history_length"] == 2


def test_http_endpoints_reject_bad_input_clearly(config_dir, fake_openai, start_server):
    config_dir.models = {"gpt": openai_model(fake_openai)}
    server = start_server(config_dir)
    http = httpx.Client(base_url=server.url, headers=server.auth)
    r = http.post("/submit", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]
    r = http.post("/submit", json={"client_id": "a b", "text": "x"})
    assert r.status_code == 400 and "client_id" in r.json()["error"]
    r = http.post("/submit", json={"client_id": "a", "text": 5})
    assert r.status_code == 400 and "text" in r.json()["error"]
    r = http.post("/submit", json={"client_id": "a", "text": "x" * 200_001})
    assert r.status_code == 400
    assert http.get("/stream").status_code == 400
    r = http.post("/gate_response", json={"gate_id": "nope", "decision": "allow"})
    assert r.status_code == 404 and "nope" in r.json()["error"]
    r = http.post("/gate_response", json={"gate_id": "nope", "decision": "maybe"})
    assert r.status_code == 400
    assert http.delete("/session/999").status_code == 404
    assert http.get("/sessions").json() == {"sessions": []}
    http.close()
