"""What a newcomer hit (issue 28), each reproduced and checked: error texts, the fake backend's scripts,
the API's stop, and the shell's windows."""

from __future__ import annotations

import asyncio
import io
import json
import shutil
import signal
import threading

import httpx
import pytest
from httpx_sse import aconnect_sse
from rich.console import Console

import shell_ui
from api_client import AgentCancelled, AgentClient
from config import DEFAULTS_DIR
from shell_client import ShellClient
from tests.conftest import AgentServer, ConfigDir, free_port, openai_model
from tests.fakes.backend import demo_reply, text
from tests.fakes.openai_backend import FakeOpenAI
from tests.runtime import runtime, turn
from tests.turns import answer, collect_turn


@pytest.fixture
def demo_backend():
    """The fake backend as a person runs it (`python -m tests.fakes.openai_backend`): scripted by messages."""
    with FakeOpenAI(default_reply=demo_reply) as backend:
        yield backend


def _rendered(text: str, plain: bool = False) -> str:
    """What shell.py puts on a terminal for an answer (Markdown unless `plain`)."""
    out = io.StringIO()
    Console(file=out, width=100, color_system=None).print(shell_ui._render_answer(text, plain))
    return out.getvalue()


async def test_hang_shorter_than_the_timeout_answers_and_a_longer_one_shows_the_timeout(tmp_path, demo_backend):
    models = {"fake": openai_model(demo_backend, llm_call_timeout=1)}
    async with runtime(tmp_path, models) as rt:
        out, events = await turn(rt, "HANG 0.2")
        assert "sent nothing for 0.2 s" in out and events[-1].name == "done"
        assert not [e for e in events if e.name == "error"]
        _, events = await turn(rt, "HANG 3")
        errors = [e.data for e in events if e.name == "error"]
        assert len(errors) == 1 and errors[0]["kind"] == "timeout" and "llm_call_timeout" in errors[0]["message"]
        out, _ = await turn(rt, "still there?")  # the fake did not crash
        assert out == "echo: still there?"


async def test_a_401_names_what_to_fix_never_none(tmp_path, demo_backend):
    models = {"fake": openai_model(demo_backend), "keyed": openai_model(demo_backend, env_key="FAKE_KEY_NEWCOMER")}
    async with runtime(tmp_path, models, env={"FAKE_KEY_NEWCOMER": "k"}) as rt:
        _, events = await turn(rt, "FAIL 401 no key")
        message = next(e.data["message"] for e in events if e.name == "error")
        assert "None" not in message and "HTTP 401" in message
        assert "sends none" in message and "env_key of 'fake' in llm-models.json" in message
        _, events = await turn(rt, "@keyed FAIL 401 bad key")
        message = next(e.data["message"] for e in events if e.name == "error")
        assert "refused the API key (HTTP 401); check FAKE_KEY_NEWCOMER in .env" in message


async def test_an_unknown_at_model_is_laid_out_on_lines_of_its_own(tmp_path, demo_backend):
    async with runtime(tmp_path, {"fake": openai_model(demo_backend), "other": openai_model(demo_backend)}) as rt:
        out, _ = await turn(rt, "@nosuch hello")
    lines = [line.strip() for line in _rendered(out).splitlines() if line.strip()]
    assert lines == ["ERROR: Unknown model '@nosuch'.", "Available models: fake, other",
                     "For example: @fake hello"]
    assert demo_backend.requests == []


def test_the_shell_endpoints_401_says_where_the_token_is(tmp_path, fake_openai, start_server):
    generated = ConfigDir(tmp_path / "generated")
    generated.path.mkdir()
    generated.models = {"fake": openai_model(fake_openai)}
    server = start_server(generated)
    refused = httpx.get(f"{server.url}/health", timeout=5)
    error = refused.json()["error"]
    assert refused.status_code == 401 and "Bearer $(cat data/shell-token)" in error and "AGENT_DATA_DIR" in error
    assert str(tmp_path) not in error  # no path for a reader nobody vouched for
    assert httpx.get(f"{server.url}/health", headers=server.auth, timeout=5).status_code == 200

    configured = ConfigDir(tmp_path / "configured")
    configured.path.mkdir()
    configured.models = {"fake": openai_model(fake_openai)}
    configured.env = {"AGENT_SHELL_TOKEN": "a-token-from-the-environment"}
    server = start_server(configured)
    error = httpx.get(f"{server.url}/health", headers={"Authorization": "Bearer wrong"}, timeout=5).json()["error"]
    assert "the token is the server's AGENT_SHELL_TOKEN setting" in error and "a-token-from" not in error


API_KEY = "newcomer-api-key-0123456789"


@pytest.fixture
def api_server(tmp_path, fake_openai, start_server):
    """A server with the JSON/SSE API on a free port (no key: loopback)."""
    cfg = ConfigDir(tmp_path)
    cfg.models = {"fake": openai_model(fake_openai)}
    cfg.plugins.append("plugin_client_api")
    cfg.plugin_config["plugin_client_api"] = {"port": free_port()}
    cfg.env = {"API_KEY": API_KEY}
    start_server(cfg, {"SESSION_STORE": "memory"})
    return f"http://127.0.0.1:{cfg.plugin_config['plugin_client_api']['port']}"


async def test_stop_ends_a_turn_id_stream_with_done_and_closes_it(api_server, fake_openai):
    release = threading.Event()
    fake_openai.script(text("never ", "finished", hold=release))
    names, stopped = [], None
    try:
        async with httpx.AsyncClient(base_url=api_server, timeout=10,
                                     headers={"Authorization": f"Bearer {API_KEY}"}) as http:
            sub = (await http.post("/api/v1/submit", json={"text": "a long story", "client_id": "stopper"})).json()
            params = {"turn_id": sub["turn_id"]}
            async with asyncio.timeout(20), aconnect_sse(http, "GET", "/api/v1/stream/api-stopper", params=params) as s:
                async for ev in s.aiter_sse():  # ends only when the server closes the stream
                    names.append((ev.event, json.loads(ev.data).get("text")))
                    if ev.event == "tok":  # the model is under way: stop it
                        stopped = (await http.post("/api/v1/stop", json={"client_id": "stopper"})).json()
    finally:
        release.set()
    assert stopped == {"status": "OK", "cancelled": True, "client_id": "api-stopper"}
    assert names == [("user", "a long story"), ("tok", "never "), ("status", "[stopped]"), ("done", None)]


async def test_agent_client_stop_stops_its_running_turn(api_server, fake_openai):
    release = threading.Event()
    fake_openai.script(text("never ", "finished", hold=release))
    client = AgentClient(api_server, "stop-me", api_key=API_KEY)
    assert await client.stop() is False  # nothing runs yet
    pieces = client.stream("a long story")
    try:
        assert await asyncio.wait_for(anext(pieces), 20) == "never "
        assert await client.stop() is True
        with pytest.raises(AgentCancelled, match="stopped") as raised:
            await asyncio.wait_for(anext(pieces), 20)
        assert raised.value.partial == "never "
    finally:
        release.set()
        await pieces.aclose()
    fake_openai.script(text("fine ", "again"))
    assert await client.send("and now?") == "fine again"  # the session goes on


async def test_every_window_on_a_deleted_session_is_told_at_once(config_dir, fake_openai, start_server):
    config_dir.models = {"fake": openai_model(fake_openai)}
    server = start_server(config_dir)
    async with ShellClient(server.url, "doomed", token=server.token) as first, \
            ShellClient(server.url, "doomed", token=server.token) as second, \
            ShellClient(server.url, "admin", token=server.token) as admin:
        await collect_turn(first, "hello")
        await second.connect(max_wait=10)
        deleted = answer(await collect_turn(admin, "!session doomed delete"))
        assert deleted.startswith("Deleted session ID [101]: doomed")
        async with asyncio.timeout(10):
            notices = [ev async for ev in _until(second.events(), lambda ev: ev.data.get("session_deleted"))]
    assert notices[-1].name == "status" and "this session (101) was deleted" in notices[-1].text


async def _until(events, last):
    async for ev in events:
        yield ev
        if last(ev):
            return


async def test_ctrl_c_cancels_the_turn_and_nothing_of_it_prints_later(config_dir, fake_openai, start_server):
    config_dir.models = {"fake": openai_model(fake_openai)}
    server = start_server(config_dir)
    hold = threading.Event()
    fake_openai.script(text("first ", "never shown", hold=hold), text("second answer"))
    out = io.StringIO()
    try:
        async with ShellClient(server.url, "cc", token=server.token) as client:
            ui = shell_ui.ShellUI(Console(file=out, width=100, color_system=None), client)
            await client.connect(max_wait=10)
            first_token = asyncio.Event()

            async def draw() -> None:
                async for ev in client.events():
                    await ui.handle_event(ev)
                    if ev.name == "tok":
                        first_token.set()

            drawing = asyncio.create_task(draw())
            ui.begin_turn(text="tell me")
            await client.submit("tell me")
            await asyncio.wait_for(first_token.wait(), 20)
            await ui.handle_key("c-c")
            assert not ui.busy
            hold.set()  # the backend may send the rest now: the turn that wanted it is gone
            ui.begin_turn(text="next")
            await client.submit("next")
            await asyncio.wait_for(ui.wait_idle(), 20)
            drawing.cancel()
            rows = await client.sessions("cc")
    finally:
        hold.set()
    shown = out.getvalue()
    assert "first" in shown and "never shown" not in shown
    assert shown.index("stopped: the turn was cancelled (Ctrl-C)") < shown.index("second answer")
    assert rows[0]["running"] is False and [r.last_user_text for r in fake_openai.requests] == ["tell me", "next"]


@pytest.mark.timeout(240)  # three instances start one after another
def test_an_instance_whose_system_prompt_differs_on_one_redis_says_so(tmp_path, fake_openai, redis_store):
    logs = []
    for name, extra in (("a", ""), ("b", ""), ("c", "Answer in haiku.")):
        cfg = ConfigDir(tmp_path / name)
        cfg.path.mkdir()
        cfg.models = {"fake": openai_model(fake_openai)}
        cfg.env = {"AGENT_SHELL_TOKEN": "same-token-on-every-instance"}
        shutil.copytree(DEFAULTS_DIR / ".system_prompt", cfg.path / ".system_prompt")
        leaf = cfg.path / ".system_prompt" / ".system_prompt_behavior"
        leaf.write_text(leaf.read_text() + extra)
        server = AgentServer(cfg.write(), {"SESSION_STORE": redis_store, "AGENT_DRAIN_SECONDS": "0"}).start()
        logs.append(server.stop())
    warning = "system prompt"
    assert not [line for line in logs[0].splitlines() + logs[1].splitlines() if warning in line and "differs" in line]
    said = [line for line in logs[2].splitlines() if warning in line and "differs" in line]
    assert len(said) == 1 and "WARNING" in said[0] and "same .system_prompt/ tree" in said[0]


@pytest.mark.timeout(120)
def test_ctrl_c_of_an_instance_on_redis_with_a_shell_attached_stops_cleanly(config_dir, fake_openai, redis_store):
    """The drain lets the running turn finish while the window stays attached; then its stream ends with a
    complete response: no uvicorn ERROR, and "Finished server process" comes after the drain."""
    config_dir.models = {"fake": openai_model(fake_openai)}
    server = AgentServer(config_dir.write(), {"SESSION_STORE": redis_store}).start()
    hold = threading.Event()
    fake_openai.script(text("a ", "b", hold=hold))
    names = []

    async def attached() -> None:
        async with ShellClient(server.url, "attached", token=server.token) as client:
            await client.connect(max_wait=10)
            await client.submit("hi")
            events = client.events()
            async for ev in events:
                names.append(ev.name)
                if ev.name == "tok":
                    break
            assert server.proc is not None
            server.proc.send_signal(signal.SIGINT)  # Ctrl-C: the instance drains
            hold.set()
            async with asyncio.timeout(30):
                async for ev in events:
                    names.append(ev.name)
                    if ev.name == "done":
                        break
            assert server.proc.wait(30) == 0  # the window is still attached while the server finishes

    try:
        asyncio.run(attached())
    finally:
        hold.set()
    log = server.stop()
    assert names[-1] == "done" and "ERROR" not in log and "Traceback" not in log
    assert log.index("waiting up to 30 s for 1 running request(s)") < log.index("Finished server process")
