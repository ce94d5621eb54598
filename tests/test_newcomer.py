"""What a new user trips on (issue 17), each through the real interface it concerns: a server
subprocess and shell.py's own client, agentctl as a subprocess, the fake backend's command line."""

from __future__ import annotations

import asyncio
import io
import os
import pty
import re
import select
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from rich.console import Console

from config import DEFAULTS_DIR
from shell_client import ShellClient, ShellEvent
from shell_ui import ShellUI
from tests.conftest import ROOT, AgentServer, ConfigDir, free_port, openai_model
from tests.fakes.backend import hang, text, tool_call
from tests.fakes.openai_backend import FakeOpenAI
from tests.waiting import DEADLINE, until, within_sync

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[AgentServer]:
    with FakeOpenAI() as gpt:
        cfg = ConfigDir(tmp_path_factory.mktemp("newcomer"))
        cfg.models = {"gpt": openai_model(gpt)}
        started = AgentServer(cfg.write(), {"SESSION_STORE": "memory"}).start()
        try:
            yield started
        finally:
            started.stop()


async def turn(client: ShellClient, ui: ShellUI, text: str) -> list[ShellEvent]:
    """One message through an open shell window (its client and UI): the events up to its `done`."""
    ui.begin_turn()
    await client.submit(text)
    events = []
    async for ev in client.events():
        events.append(ev)
        await ui.handle_event(ev)
        if ev.name == "done":
            break
    return events


async def say(server: AgentServer, client_id: str, text: str) -> tuple[list[ShellEvent], str]:
    """One message from a new shell window on `client_id`: its events and what the window showed."""
    out = io.StringIO()
    async with ShellClient(server.url, client_id, token=server.token) as client:
        await client.connect(max_wait=10)
        events = await turn(client, ShellUI(Console(file=out, width=160), client), text)
    return events, out.getvalue()


def history_length(server: AgentServer, client_id: str) -> int:
    rows = httpx.get(f"{server.url}/sessions", headers=server.auth, timeout=5).json()["sessions"]
    return next(r["history_length"] for r in rows if r["client_id"] == client_id)


async def test_a_session_deleted_in_another_window_is_said_and_started_anew(server) -> None:
    await say(server, "window-one", "hello")
    assert history_length(server, "window-one") == 2
    _, shown = await say(server, "window-two", "!session window-one delete")
    assert "deleted" in shown.lower()

    events, shown = await say(server, "window-one", "still there?")
    (notice,) = [e for e in events if e.name == "status" and e.data.get("session_gone")]
    assert notice.data["session_gone"] == "deleted"
    assert "this session was deleted" in shown and "starts a new, empty one" in shown
    assert history_length(server, "window-one") == 2  # the new session: this message and its answer
    # Said once: the next message continues the new session quietly.
    events, _ = await say(server, "window-one", "and now?")
    assert not [e for e in events if e.data.get("session_gone")] and history_length(server, "window-one") == 4


async def test_a_window_that_stays_open_sees_the_notice_and_its_answer(server) -> None:
    """The window whose session is deleted keeps its event stream open the whole time, as shell.py does."""
    out = io.StringIO()
    async with ShellClient(server.url, "window-three", token=server.token) as client:
        await client.connect(max_wait=10)
        ui = ShellUI(Console(file=out, width=160), client)
        await turn(client, ui, "first")
        await say(server, "window-four", "!session window-three delete")
        events = await turn(client, ui, "second")
    assert [e.data.get("session_gone") for e in events if e.data.get("session_gone")] == ["deleted"]
    assert "echo: second" in "".join(e.data.get("text", "") for e in events if e.name == "tok")
    assert "this session was deleted" in out.getvalue()


# ── Trying it without a model: the fake backend's script mode, from its command line ────────


def test_the_fake_backend_can_be_scripted_by_hand(tmp_path) -> None:
    port = free_port()
    fake = subprocess.Popen([sys.executable, "-m", "tests.fakes.openai_backend", "--port", str(port)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert "CALL <tool> <json arguments>" in fake.stdout.readline() + fake.stdout.readline() + "".join(
            fake.stdout.readline() for _ in range(2))
        cfg = ConfigDir(tmp_path)
        cfg.models = {"fake": {"model_id": "demo", "type": "OPENAI", "host": f"http://127.0.0.1:{port}/v1",
                               "env_key": None, "max_retries": 0}}
        agent = AgentServer(cfg.write(), {"SESSION_STORE": "memory"}).start()
        try:
            events, shown = asyncio.run(say(agent, "demo", 'CALL get_system_info {}'))
            answer = "".join(e.data.get("text", "") for e in events if e.name == "tok")
            assert answer.startswith("The tool returned:") and "get_system_info" in shown
            events, _ = asyncio.run(say(agent, "demo", "SLOW one two three"))
            toks = [e for e in events if e.name == "tok"]
            assert "".join(e.data["text"] for e in toks) == "one two three" and len(toks) == 3
            events, _ = asyncio.run(say(agent, "demo", "FAIL 503 overloaded"))
            assert any(e.name == "error" and "503" in e.data["message"] for e in events)
        finally:
            agent.stop()
    finally:
        fake.terminate()
        fake.communicate(timeout=10)  # and close its pipe


# ── Logs an operator can read; start-up tells what is missing ──────────────────────────────


def test_the_log_has_one_line_per_failure_and_a_clean_stop(tmp_path) -> None:
    down = free_port()  # nothing listens there
    with FakeOpenAI() as gpt:
        cfg = ConfigDir(tmp_path)
        cfg.models = {"down": {"model_id": "qwen", "type": "OPENAI", "host": f"http://127.0.0.1:{down}/v1",
                               "env_key": None, "max_retries": 0},
                      "gpt": openai_model(gpt, llm_call_timeout=1)}
        cfg.plugins.append("plugin_proxy_llama")
        cfg.plugin_config["plugin_proxy_llama"] = {"port": free_port()}
        agent = AgentServer(cfg.write(), {"SESSION_STORE": "memory"}).start()

        async def scenario() -> None:
            await say(agent, "ops", "unreachable backend")  # the default model: down
            gpt.script(hang(5))
            await say(agent, "ops", "@gpt a backend that hangs")
            async with httpx.AsyncClient() as http:
                refused = await http.post(f"{agent.url}/submit", content=b"hi",
                                          headers={**agent.auth, "Content-Type": "text/plain"})
            assert refused.status_code == 415
            # Stop while a shell window follows its event stream.
            async with ShellClient(agent.url, "watching", token=agent.token) as client:
                await client.connect(max_wait=10)
                await client.submit("!help")
                async for ev in client.events():
                    if ev.name == "done":
                        break
                await asyncio.to_thread(agent.stop)

        asyncio.run(scenario())
    log = agent.output
    assert "Traceback" not in log and "Exception in ASGI application" not in log and "ERROR" not in log, log
    assert log.count("Started server process") == 1 and log.count("Finished server process") == 1
    assert f"the default model 'down' cannot answer yet: nothing answers at 127.0.0.1:{down}" in log
    assert log.count(f"turn of ops failed: model 'down' at http://127.0.0.1:{down}/v1: cannot connect") == 1
    assert log.count("turn of ops failed: model 'gpt'") == 1 and "no answer within 1 s" in log
    assert "refused POST /submit from 127.0.0.1: 415" in log and "agent-mcp stopped" in log


def test_unknown_plugin_settings_are_reported_at_start(tmp_path) -> None:
    cfg = ConfigDir(tmp_path)
    cfg.models = {"gpt": {"model_id": "x", "type": "OPENAI", "host": "https://api.example.com/v1", "env_key": None}}
    cfg.plugins += ["plugin_search_ddgs", "plugin_mcp_client"]
    cfg.plugin_config.update({
        "plugin_search_ddgs": {"max_resluts": 3},  # a typo in a plugin's settings: that plugin stops, named
        "plugin_mcp_client": {"servers": {}},  # settings of a plugin that takes none (they live in mcp-servers.json)
        "plugin_serach_google": {"enabled": True},  # a typo in a plugin's name
        "plugin_client_slack": {"enabled": True},  # a plugin that is not in enabled_plugins
    })
    log = AgentServer(cfg.write(), {"SESSION_STORE": "memory"}).start().stop()
    assert (
        "plugin_config.plugin_search_ddgs in plugins-enabled.json: max_resluts: Extra inputs are not permitted" in log
    )
    assert "plugin_config.plugin_mcp_client in plugins-enabled.json: servers: Extra inputs are not permitted" in log
    assert ("plugins-enabled.json: plugin_config.plugin_serach_google names no plugin of plugin-manifest.json "
            "(did you mean plugin_search_google?); its settings are not used") in log
    assert ("plugin_config.plugin_client_slack belongs to a plugin that is not in enabled_plugins; its settings are "
            "not used") in log


async def test_every_window_sees_the_whole_conversation(server) -> None:
    """Two shell windows on one session: each shows the other's question before its answer."""
    outs = [io.StringIO(), io.StringIO()]
    async with ShellClient(server.url, "shared", token=server.token) as one, \
            ShellClient(server.url, "shared", token=server.token) as two:
        for client in (one, two):
            await client.connect(max_wait=10)
        ui_one, ui_two = (ShellUI(Console(file=out, width=160), c) for out, c in zip(outs, (one, two), strict=True))

        async def watch(client: ShellClient, ui: ShellUI, count: int) -> None:
            """Draw events until `count` turns have ended (each window has seen the other's, too)."""
            async for ev in client.events():
                await ui.handle_event(ev)
                count -= ev.name == "done"
                if not count:
                    return

        ui_one.begin_turn(text="hello from one")
        await one.submit("hello from one")
        await asyncio.wait_for(asyncio.gather(watch(one, ui_one, 1), watch(two, ui_two, 1)), 10)
        ui_two.begin_turn(text="and from two")
        await two.submit("and from two")
        await asyncio.wait_for(asyncio.gather(watch(one, ui_one, 1), watch(two, ui_two, 1)), 10)
    shown_one, shown_two = (out.getvalue() for out in outs)
    assert "› hello from one  (sent from another window)" in shown_two
    assert "› and from two  (sent from another window)" in shown_one
    assert "(sent from another window)" not in shown_one.replace("› and from two  (sent from another window)", "")
    assert shown_two.index("› hello from one") < shown_two.index("echo: hello from one")


# ── A config dir is its own ─────────────────────────────────────────────────────────────────


def test_an_instance_edits_only_its_own_config_dir(tmp_path) -> None:
    """Two instances from one checkout, each with its own config dir and no prompt tree of its own:
    an approved prompt edit on one changes neither the other's prompt nor the checkout's."""
    leaf = Path(".system_prompt") / ".system_prompt_behavior"
    checkout_before = (DEFAULTS_DIR / leaf).read_bytes()
    with FakeOpenAI() as gpt:
        servers = []
        for name in ("a", "b"):
            (tmp_path / name).mkdir()
            cfg = ConfigDir(tmp_path / name)
            cfg.models = {"gpt": openai_model(gpt)}
            cfg.gates = {"db": {}, "tools": {"*": {"read": True, "write": True}}}  # the edit runs unasked
            servers.append(AgentServer(cfg.write(), {"SESSION_STORE": "memory"}).start())
        try:
            gpt.script(tool_call("update_system_prompt", {"section": "behavior", "operation": "append",
                                                          "content": "Always answer in haiku."}), text("Done."))
            asyncio.run(say(servers[0], "editor", "change your behaviour"))
        finally:
            logs = [s.stop() for s in servers]
    assert "Always answer in haiku." in (tmp_path / "a" / leaf).read_text()
    assert (tmp_path / "b" / leaf).read_bytes() == checkout_before == (DEFAULTS_DIR / leaf).read_bytes()
    for name, log in zip("ab", logs, strict=True):  # the files the test did not write were created, and said so
        assert f"created in {tmp_path / name} from the shipped defaults: .system_prompt/, mcp-servers.json" in log


def test_a_shell_waiting_for_a_turn_the_restart_killed_gets_its_prompt_back(tmp_path) -> None:
    """kill -9 in the middle of a turn, restart: the shell says the turn was interrupted and is idle again."""
    release = threading.Event()
    with FakeOpenAI() as gpt:
        cfg = ConfigDir(tmp_path)
        cfg.models = {"gpt": openai_model(gpt, llm_call_timeout=600)}  # the held answer never times out first
        agent = AgentServer(cfg.write()).start(wait=False)
        agent.wait_ready(DEADLINE)  # a loaded machine starts slowly, never this slowly
        gpt.script(text("half ", "of it", hold=release))
        out = io.StringIO()

        async def scenario() -> bool:
            async with ShellClient(agent.url, "restarted", token=agent.token) as client:
                assert await client.connect(max_wait=DEADLINE)
                ui = ShellUI(Console(file=out, width=160), client)
                client.on_state = ui.connection_changed
                ui.begin_turn(text="tell me")
                await client.submit("tell me")

                seen: list[str] = []

                async def draw() -> None:
                    async for ev in client.events():
                        seen.append(ev.name)
                        await ui.handle_event(ev)

                drawing = asyncio.ensure_future(draw())
                # The turn is under way: its first token reached the shell (the model holds the rest).
                await until(lambda: "tok" in seen, "the turn's first token at the shell")
                assert agent.proc is not None
                agent.proc.kill()  # kill -9
                await asyncio.to_thread(agent.stop)
                await asyncio.to_thread(agent.start, False)
                await asyncio.to_thread(agent.wait_ready, DEADLINE)
                try:
                    await asyncio.wait_for(ui.wait_idle(), DEADLINE)
                    return ui.busy
                finally:
                    drawing.cancel()

        try:
            assert asyncio.run(scenario()) is False
        finally:
            release.set()
            agent.stop()
    shown = out.getvalue()
    # The restarted server says so (and, were its word lost, the shell would find out by itself).
    assert "server back online" in shown and "the turn was interrupted" in shown


# ── The same, with shell.py itself under pseudo-terminals ───────────────────────────────────


class Window:
    """shell.py in a pseudo-terminal of its own: keys in, everything it draws collected."""

    def __init__(self, server: AgentServer, session_file: Path):
        self.master, slave = pty.openpty()
        env = {**os.environ, "TERM": "xterm", "COLUMNS": "120", "LINES": "40"}
        self.proc = subprocess.Popen(
            [sys.executable, "shell.py", "--url", server.url, f"--token={server.token}", "--session-file",
             str(session_file)], cwd=ROOT, stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True)
        os.close(slave)
        self.out = b""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                if select.select([self.master], [], [], 0.1)[0]:
                    data = os.read(self.master, 65536)
                    if not data:
                        return
                    self.out += data
            except OSError:  # the terminal closed
                return

    def type(self, text: str) -> None:
        os.write(self.master, text.encode())

    @property
    def text(self) -> str:
        """What the window shows, without the terminal's control sequences (colours, cursor moves)."""
        return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[=>]|\r", "", self.out.decode(errors="replace"))

    def shows(self, needle: str, timeout: float = 20) -> bool:
        return bool(within_sync(lambda: needle in self.text, timeout))

    def close(self) -> None:
        """Ends shell.py and its terminal; a second call does nothing."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        if self.master >= 0:
            os.close(self.master)
            self.master = -1
        self._reader.join(5)


@pytest.mark.timeout(180)  # shell.py under a terminal: its own waits (60 s) report what it showed
def test_shell_windows_under_terminals_share_the_transcript_hear_of_a_deletion_and_attach(server, tmp_path) -> None:
    shared, other = tmp_path / "shared", tmp_path / "other"
    shared.write_text("pty-shared")
    other.write_text("pty-other")
    one, two, three = Window(server, shared), Window(server, shared), Window(server, other)
    try:
        assert one.shows("›") and two.shows("›") and three.shows("›")
        one.type("hello from one\r")
        assert one.shows("echo: hello from one") and two.shows("› hello from one  (sent from another window)")
        assert two.shows("echo: hello from one")
        three.type("!session pty-shared delete\r")  # a window on another session deletes this one
        assert three.shows("Deleted session")
        one.type("still there?\r")
        assert one.shows("this session was deleted") and one.shows("echo: still there?")
        assert "(sent from another window)" not in one.text  # its own messages are not repeated
        two.type("!session pty-other\r")  # in shell.py, `!session <ID>` attaches (elsewhere it shows one)
        assert two.shows("attached to session pty-othe"), two.text[-800:]  # the id is shortened on screen
        three.type("!session pty-other delete\r")  # its own session: the answer arrives, then it goes
        assert three.shows("Deleted session ID") and three.shows("(the next message starts a new one)")
    finally:
        for window in (one, two, three):
            window.close()
