"""Several agent-mcp processes on one Redis act as one server (issue 15): real processes, real Redis,
kill -9, a Redis stopped and started under a running instance, nginx round-robin in front."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
from pathlib import Path

import httpx
import ollama
import openai
import pytest

from api_client import AgentClient
from shell_client import ShellClient
from tests import needs
from tests.conftest import AgentServer, ConfigDir, free_port, openai_model
from tests.fakes.backend import hang, text, tool_call
from tests.redis_help import OwnRedis
from tests.runtime import ALL_GATED
from tests.test_mcp_server import PENDING, call_json, connect, next_note, read_json, subscribe
from tests.turns import answer, collect_turn, run_turn
from tests.waiting import succeeds, until, until_sync

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "scale-test-token-0123456789abcdef"
API_KEY = "scale-test-api-key-0123456789"
MCP_HUMAN = "scale-test-mcp-human-token-0001"
#: The listeners besides the shell endpoint, by the name the nginx tests give them.
DOORS = {"api": "plugin_client_api", "proxy": "plugin_proxy_llama", "mcp": "plugin_client_mcp"}


def instances(tmp_path: Path, fake_openai, store: str, count: int = 2, gates=None, every_door: bool = False
              ) -> list[AgentServer]:
    """`count` servers on one store, each with its own config dir and port, one shell token; with
    `every_door`, the API, the proxy and the MCP server too (their ports in `cfg.plugin_config`), with
    one human MCP token (MCP_HUMAN)."""
    servers = []
    for n in range(count):
        path = tmp_path / f"instance{n}"
        path.mkdir()
        cfg = ConfigDir(path)
        cfg.models = {"fake": openai_model(fake_openai)}
        cfg.gates = gates
        if every_door:
            for plugin in DOORS.values():
                cfg.plugins.append(plugin)
                cfg.plugin_config[plugin] = {"port": free_port()}
            (path / "mcp-tokens.json").write_text(json.dumps({"tokens": {"alice": {"role": "human",
                                                                                      "token": MCP_HUMAN}}}))
            (path / "mcp-tokens.json").chmod(0o600)  # it holds tokens: agent-mcp refuses it readable by others
        # One API key for every instance (behind a balancer a client must not care which one answers), and
        # one audit key: each instance honours the others' grants.
        env = {"SESSION_STORE": store, "AGENT_SHELL_TOKEN": TOKEN, "API_KEY": API_KEY,
               "AGENT_AUDIT_KEY_FILE": str(tmp_path / "audit-key")}
        servers.append(AgentServer(cfg.write(), env))
    return servers


@pytest.fixture
def pair(tmp_path, fake_openai, redis_store):
    started = [s.start(wait=False)
               for s in instances(tmp_path, fake_openai, redis_store, gates=ALL_GATED, every_door=True)]
    try:
        for s in started:
            s.wait_ready(60)
        yield started
    finally:
        for s in started:
            s.stop()


async def _until(events, names: tuple[str, ...] = ("done",), seconds: float = 30) -> list:
    got = []
    async with asyncio.timeout(seconds):
        async for ev in events:
            got.append(ev)
            if ev.name in names:
                return got
    return got


def test_two_instances_share_history_sessions_streams_and_gates(pair, fake_openai) -> None:
    a, b = pair
    assert [s.health()["instances"] for s in pair] == [2, 2]
    assert answer(run_turn(a, "alice", "my name is Alice")) == "echo: my name is Alice"
    assert answer(run_turn(b, "alice", "what is my name?")) == "echo: what is my name?"
    sent = [m["content"] for m in fake_openai.requests[-1].json["messages"][1:]]
    assert sent == ["my name is Alice", "echo: my name is Alice", "what is my name?"]  # A's history, read on B
    run_turn(b, "bob", "hi")
    rows = [httpx.get(f"{s.url}/sessions", headers=s.auth, timeout=10).json()["sessions"] for s in (a, b)]
    assert [(r["shorthand_id"], r["client_id"], r["history_length"]) for r in rows[0]] == \
        [(r["shorthand_id"], r["client_id"], r["history_length"]) for r in rows[1]] == \
        [(101, "alice", 4), (102, "bob", 2)]

    async def gate_on_a_answered_on_b() -> list:
        fake_openai.script(tool_call("read_system_prompt", {"section": "behavior"}), text("Read it."))
        async with ShellClient(a.url, "carol", token=TOKEN) as on_a, ShellClient(b.url, "carol", token=TOKEN) as on_b:
            await on_a.connect(max_wait=10)
            await on_b.connect(max_wait=10)
            await on_a.submit("read your behaviour")
            seen = await _until(on_b.events(), ("gate",))
            await on_b.gate_response(seen[-1].data["gate_id"], "allow")
            return seen + await _until(on_b.events())

    events = asyncio.run(gate_on_a_answered_on_b())
    assert [e.name for e in events][:2] == ["user", "gate"] and answer(events) == "Read it."
    assert any("[gate ✓] read_system_prompt: allowed once" in (e.text or "") for e in events)

    async def reconnect_to_the_other_instance() -> tuple[list, list]:
        fake_openai.script(text("one ", "two ", "three ", "four", delay=0.3))
        async with ShellClient(a.url, "dave", token=TOKEN) as on_a:
            await on_a.connect(max_wait=10)
            await on_a.submit("count")
            first = await _until(on_a.events(), ("tok",))
        # The stream on A is gone; a client of B resumes after the last event it saw.
        async with ShellClient(b.url, "dave", token=TOKEN) as on_b:
            on_b.last_event_id = first[-1].id
            rest = await _until(on_b.events())
        return first, rest

    first, rest = asyncio.run(reconnect_to_the_other_instance())
    assert answer(first) + answer(rest) == "one two three four"
    ids = [e.id for e in first + rest]
    assert ids == sorted(ids) and len(set(ids)) == len(ids) and [e.name for e in rest][-1] == "done"

    async def gate_on_a_answered_over_mcp_on_b() -> tuple[list, dict, list]:
        fake_openai.script(tool_call("read_system_prompt", {"section": "behavior"}), text("Read again."))
        async with ShellClient(a.url, "erin", token=TOKEN) as on_a, connect(mcp_url(b), MCP_HUMAN) as human:
            await on_a.connect(max_wait=10)
            await on_a.submit("read it again")
            await _until(on_a.events(), ("gate",))
            (pending,) = await read_json(human, "agentmcp://approvals/pending")  # recorded by A, listed on B
            answer = call_json(await human.call_tool("answer_approval", {"gate_id": pending["gate_id"],
                                                                          "decision": "allow_once"}))
            events = await _until(on_a.events())

            async def both_gates() -> list[dict] | None:
                history = await read_json(human, "agentmcp://approvals/history")
                return history if len(history) >= 2 else None

            history = await until(both_gates, "both gates in the history", 10, step=0.1)
            return events, {**pending, **answer}, history

    events, pending, history = asyncio.run(gate_on_a_answered_over_mcp_on_b())
    assert pending["session"] == "erin" and pending["decided_by"] == "human:alice" and answer(events) == "Read again."
    # Both gates so far (carol's, answered from B's shell, and this one), newest first, from either instance.
    assert [(h["session"], h["decision"]) for h in history] == [("erin", "allow"), ("carol", "allow")]
    assert history[0]["gate_id"] == pending["gate_id"]


def _mcp_port(server: AgentServer) -> int:
    return server.cfg.plugin_config["plugin_client_mcp"]["port"]


def mcp_url(server: AgentServer) -> str:
    return f"http://127.0.0.1:{_mcp_port(server)}/mcp"


def test_simultaneous_messages_on_two_instances_are_answered_one_after_the_other(pair, fake_openai) -> None:
    a, b = pair
    fake_openai.script(text("first ", "answer", delay=0.2), text("second ", "answer", delay=0.2))

    async def both() -> tuple[list, list]:
        # MCP send_message queues (a shell message would replace the running turn, on any instance).
        async with ShellClient(a.url, "mcp-same", token=TOKEN) as watcher, \
                connect(mcp_url(a), MCP_HUMAN) as on_a, connect(mcp_url(b), MCP_HUMAN) as on_b:
            await watcher.connect(max_wait=10)
            answers = await asyncio.gather(
                on_a.call_tool("send_message", {"text": "from A", "session": "mcp-same"}),
                on_b.call_tool("send_message", {"text": "from B", "session": "mcp-same"}))
            events = await _until(watcher.events())
            return [call_json(x)["text"] for x in answers], events + await _until(watcher.events())

    answers, events = asyncio.run(both())
    said = [(e.name, e.text) for e in events if e.name in ("user", "tok", "done")]
    # One turn at a time: each question, then its whole answer, then the other (an answer's pieces that reach the
    # server together are one `tok`).
    names = [n for n, _ in said]
    assert [n for i, n in enumerate(names) if n != "tok" or names[i - 1] != "tok"] == [
        "user", "tok", "done", "user", "tok", "done"]
    assert answer(events) == "first answersecond answer" and sorted(answers) == ["first answer", "second answer"]
    history = httpx.get(f"{b.url}/sessions", params={"client_id": "mcp-same"}, headers=b.auth, timeout=10).json()
    assert history["sessions"][0]["history_length"] == 4


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["kill -9", "SIGTERM"])
def test_the_instance_running_a_turn_killed_or_stopped_ends_it_on_the_other(pair, fake_openai, how) -> None:
    """kill -9: the turn's lease lapses and the other instance ends it; a stop that does not wait (SIGTERM
    twice: the second ends the drain the first began): the stopping instance ends it itself, at once."""
    a, b = pair
    fake_openai.script(hang(60))

    async def scenario() -> tuple[list, float]:
        async with ShellClient(b.url, "victim", token=TOKEN) as on_b:
            await on_b.connect(max_wait=10)
            async with ShellClient(a.url, "victim", token=TOKEN) as on_a:
                await on_a.submit("a question nobody will answer")
            await _until(on_b.events(), ("user",))
            await until(lambda: any(r.last_user_text == "a question nobody will answer" for r in fake_openai.requests),
                        "the model call under way on A")
            assert a.proc is not None
            a.proc.send_signal(how)
            if how == signal.SIGTERM:  # once A drains (it logs so), stop waiting for the turn: it would never end
                await until(lambda: any("stopping: waiting up to" in line for line in a._lines), "A's drain")
                a.proc.send_signal(how)
            killed = time.monotonic()
            events = await _until(on_b.events(), seconds=20)
            return events, time.monotonic() - killed

    events, seconds = asyncio.run(scenario())
    assert [e.name for e in events] == ["error", "done"], events
    assert "the turn was interrupted" in events[0].data["message"] and seconds < (10 if how == signal.SIGKILL else 2)
    rows = httpx.get(f"{b.url}/sessions", params={"client_id": "victim"}, headers=b.auth, timeout=10).json()
    assert rows["sessions"][0]["history_length"] == 1 and rows["sessions"][0]["running"] is False
    # The dead instance drops out of the count (a stopped one left at once).
    until_sync(lambda: b.health()["instances"] == 1, "B counting one instance")
    run_turn(b, "victim", "are you there?")
    sent = [m["content"] for m in fake_openai.requests[-1].json["messages"][1:]]
    assert sent == ["a question nobody will answer", "are you there?"]


def test_redis_stopped_and_started_under_a_running_instance(tmp_path, fake_openai) -> None:
    own = OwnRedis(tmp_path).start()
    (server,) = instances(tmp_path, fake_openai, f"{own.url}?prefix=own:", count=1)
    try:
        server.start()
        assert answer(run_turn(server, "keeper", "remember this")) == "echo: remember this"
        own.stop()
        down = httpx.get(f"{server.url}/sessions", headers=server.auth, timeout=10)
        assert down.status_code == 503 and "the session store (Redis) is unreachable" in down.json()["error"]
        assert "recovers by itself" in down.json()["error"] and str(own.port) not in down.text  # the log says where
        assert httpx.get(f"{server.url}/health", headers=server.auth, timeout=10).status_code == 503
        own.start()
        until_sync(lambda: httpx.get(f"{server.url}/sessions", headers=server.auth, timeout=10).status_code == 200,
                   "recovery after Redis came back", 15, step=0.2)
        after = run_turn(server, "keeper", "and this")
        assert answer(after) == "echo: and this", after
        sent = [m["content"] for m in fake_openai.requests[-1].json["messages"][1:]]
        assert sent == ["remember this", "echo: remember this", "and this"]  # nothing lost
    finally:
        log = server.stop()
        own.stop()
    assert log.count("is unreachable") >= 1 and "answers again" in log


def test_a_drain_setting_that_is_not_seconds_stops_start_up_with_one_clear_line(tmp_path, fake_openai) -> None:
    (server,) = instances(tmp_path, fake_openai, "sqlite", count=1)
    server.env["AGENT_DRAIN_SECONDS"] = "a minute"
    server.start(wait=False)
    assert server.proc is not None and server.proc.wait(60) == 1
    lines = [line for line in server.stop().splitlines() if "AGENT_DRAIN_SECONDS" in line]
    assert lines == ["agent-mcp: cannot start: environment variable AGENT_DRAIN_SECONDS='a minute': must be a number "
                     "of seconds from 0 (end running turns at once) to 3600 (default 0)"]


def test_start_up_with_an_unreachable_redis_stops_with_one_clear_line(tmp_path, fake_openai) -> None:
    (server,) = instances(tmp_path, fake_openai, f"redis://127.0.0.1:{free_port()}/0", count=1)
    server.start(wait=False)
    assert server.proc is not None and server.proc.wait(60) != 0
    lines = [line for line in server.stop().splitlines() if "Redis" in line]
    assert len(lines) == 1 and "cannot reach Redis at 127.0.0.1:" in lines[0] and "unset SESSION_STORE" in lines[0]


# ── nginx in front ──────────────────────────────────────────────────────────────────────────

NGINX_SITE = ROOT / "deploy" / "nginx-agent-mcp.conf"


def _nginx(tmp_path: Path, pair: list[AgentServer]) -> tuple[subprocess.Popen[bytes], dict[str, int]]:
    """Debian's nginx with the documented site file, its upstreams pointed at the two instances, and the API
    and the proxy behind copies of its shell block, as docs/architecture.md says: (nginx, its port for each of
    "shell", "mcp", "api", "proxy")."""
    binary = needs.program("nginx", "nginx", "nginx-light")
    shipped = NGINX_SITE.read_text()
    shell_part = shipped[:shipped.index("# The MCP server")]
    listen = {door: free_port() for door in ("shell", *DOORS)}
    site = ""
    for door, part, backends in (("shell", shell_part, (8765, 8865)), ("mcp", shipped[len(shell_part):], (8768, 8868)),
                                 ("api", shell_part, (8765, 8865)), ("proxy", shell_part, (8765, 8865))):
        mine = [s.cfg.port if door == "shell" else s.cfg.plugin_config[DOORS[door]]["port"] for s in pair]
        for old, new in ((8081 if door == "mcp" else 8080, listen[door]), (backends[0], mine[0]),
                         (backends[1], mine[1])):
            assert f"127.0.0.1:{old}" in part
            part = part.replace(f"127.0.0.1:{old}", f"127.0.0.1:{new}")
        site += part.replace("agent_mcp_shell", f"agent_mcp_{door}") if door in ("api", "proxy") else part
    conf = tmp_path / "nginx.conf"
    conf.write_text(f"""daemon off;
pid {tmp_path}/nginx.pid;
error_log {tmp_path}/nginx-error.log;
events {{ worker_connections 256; }}
http {{
    log_format upstream '$request -> $upstream_addr';
    access_log {tmp_path}/nginx-access.log upstream;
    client_body_temp_path {tmp_path}/body; proxy_temp_path {tmp_path}/proxy;
    fastcgi_temp_path {tmp_path}/fcgi; uwsgi_temp_path {tmp_path}/uwsgi; scgi_temp_path {tmp_path}/scgi;
{site}
}}
""")
    with (tmp_path / "nginx-stderr.log").open("wb") as errors:
        proc = subprocess.Popen([binary, "-c", str(conf), "-p", str(tmp_path)], stdout=subprocess.DEVNULL,
                                stderr=errors)

    def listening() -> bool:
        assert proc.poll() is None, (tmp_path / "nginx-stderr.log").read_text()
        return succeeds(lambda: httpx.get(f"http://127.0.0.1:{listen['shell']}/health", timeout=1),
                       httpx.TransportError)

    until_sync(listening, "nginx to listen", 10)
    return proc, listen


def test_a_shell_session_and_an_sse_stream_through_nginx_round_robin(tmp_path, pair, fake_openai) -> None:
    a, b = pair
    proc, ports = _nginx(tmp_path, pair)
    url = f"http://127.0.0.1:{ports['shell']}"
    try:
        async def shell_session() -> list[list]:
            turns = []
            async with ShellClient(url, "balanced", token=TOKEN) as client:
                for n in range(4):
                    turns.append(await asyncio.wait_for(collect_turn(client, f"message {n}"), 30))
            return turns

        turns = asyncio.run(shell_session())
        assert [answer(t) for t in turns] == [f"echo: message {n}" for n in range(4)]
        # The four turns and their streams were spread over both instances.
        access = (tmp_path / "nginx-access.log").read_text()
        assert access.count("POST /submit") == 4
        served = [httpx.get(f"{s.url}/sessions", params={"client_id": "balanced"}, headers=s.auth,
                            timeout=10).json()["sessions"][0]["history_length"] for s in (a, b)]
        assert served == [8, 8]

        # A raw SSE stream through nginx: events arrive one by one as they happen (no buffering).
        fake_openai.script(text("slow ", "and ", "steady", delay=0.4))
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as http:
            with http.stream("GET", "/stream", params={"client_id": "raw"}) as stream:
                http.post("/submit", json={"client_id": "raw", "text": "go"})
                arrivals, names = [], []
                for line in stream.iter_lines():
                    if line.startswith("event: "):
                        names.append(line.removeprefix("event: "))
                        arrivals.append(time.monotonic())
                        if names[-1] == "done":
                            break
        assert names == ["user", "tok", "tok", "tok", "done"]
        assert arrivals[3] - arrivals[1] > 0.5  # each token when it was produced, not all at the end
    finally:
        proc.send_signal(signal.SIGQUIT)
        proc.wait(10)


def test_mcp_clients_through_nginx_hear_answer_and_set_policy_for_both_instances(tmp_path, pair, fake_openai
                                                                                ) -> None:
    a, b = pair
    proc, ports = _nginx(tmp_path, pair)
    url = f"http://127.0.0.1:{ports['mcp']}/mcp"

    async def scenario() -> tuple[list[str], list[dict], dict]:
        legacy_notes: asyncio.Queue[str] = asyncio.Queue()
        modern_notes: asyncio.Queue[str] = asyncio.Queue()
        async with connect(url, MCP_HUMAN, notes=legacy_notes) as legacy, \
                connect(url, MCP_HUMAN, mode="auto") as modern:
            await subscribe(legacy, PENDING)  # a 2025-11-25 session: every request must reach its instance
            async with modern.listen(resource_subscriptions=[PENDING]) as listener:
                async def heard() -> None:
                    async for event in listener:
                        modern_notes.put_nowait(getattr(event, "uri", ""))
                hearing = asyncio.create_task(heard())

                async def hears_the_gate(notes: asyncio.Queue[str], session: str) -> None:
                    """A note on PENDING after which it lists this session's gate: one left over from the gate
                    before (its answer) is passed over, however late it comes."""
                    while True:
                        await next_note(notes, PENDING)
                        if any(p["session"] == session for p in await read_json(legacy, PENDING)):
                            return

                answers, seen = [], []
                for n, server in enumerate((a, b)):  # a gate raised on each instance
                    fake_openai.script(tool_call("read_system_prompt", {"section": "behavior"}), text(f"Read {n}."))
                    async with ShellClient(server.url, f"through-nginx-{n}", token=TOKEN) as shell:
                        turn = asyncio.create_task(collect_turn(shell, "read your behaviour"))
                        await hears_the_gate(legacy_notes, f"through-nginx-{n}")
                        await hears_the_gate(modern_notes, f"through-nginx-{n}")
                        (pending,) = await read_json(legacy, PENDING)
                        seen.append(pending)
                        call_json(await legacy.call_tool("answer_approval", {"gate_id": pending["gate_id"],
                                                                              "decision": "allow_once"}))
                        answers.append(answer(await asyncio.wait_for(turn, 30)))
                hearing.cancel()
            policy = call_json(await legacy.call_tool("set_gate_default", {
                "section": "tools", "key": "read_system_prompt", "operation": "both", "allowed": True}))
        return answers, seen, policy

    try:
        answers, seen, policy = asyncio.run(scenario())
    finally:
        proc.send_signal(signal.SIGQUIT)
        proc.wait(10)
    assert answers == ["Read 0.", "Read 1."]
    assert [p["session"] for p in seen] == ["through-nginx-0", "through-nginx-1"]
    assert "in force on every instance" in policy["note"]
    # The new default reached both instances: in memory (no gate) and in each one's gate-defaults.json.
    for n, server in enumerate((a, b)):
        saved = server.cfg.path / "gate-defaults.json"
        # (The tool's key may be absent until the change reaches the file.)
        until_sync(lambda saved=saved: json.loads(saved.read_text()).get("tools", {})
                   .get("read_system_prompt", {}).get("read"), f"instance {n} to save the new default", 10, step=0.1)
        fake_openai.script(tool_call("read_system_prompt", {"section": "behavior"}), text("No gate."))
        events = run_turn(server, f"after-policy-{n}", "read it")
        assert "gate" not in [e.name for e in events] and answer(events) == "No gate."


def test_the_api_and_the_proxy_through_nginx_round_robin(tmp_path, pair, fake_openai) -> None:
    proc, ports = _nginx(tmp_path, pair)
    try:
        async def api_turns() -> list[str]:
            client = AgentClient(f"http://127.0.0.1:{ports['api']}", "balanced-app", api_key=API_KEY)  # then its stream
            return [await client.send(f"api message {n}") for n in range(4)]

        assert asyncio.run(api_turns()) == [f"echo: api message {n}" for n in range(4)]
        assert _sent(fake_openai) == ["api message 0", "echo: api message 0", "api message 1",
                                      "echo: api message 1", "api message 2", "echo: api message 2", "api message 3"]
        # open-webui's way: the whole conversation in every request, no chat id (the proxy's fingerprints).
        proxy = f"http://127.0.0.1:{ports['proxy']}"
        with openai.OpenAI(base_url=proxy + "/v1", api_key="unused", max_retries=0, timeout=30) as sdk:
            said: list[dict[str, str]] = []
            for n in range(3):
                said.append({"role": "user", "content": f"sdk {n}"})
                stream = sdk.chat.completions.create(model="fake", messages=said, stream=True)  # type: ignore[arg-type]
                said.append({"role": "assistant",
                             "content": "".join(c.choices[0].delta.content or "" for c in stream if c.choices)})
        assert [m["content"] for m in said[1::2]] == ["echo: sdk 0", "echo: sdk 1", "echo: sdk 2"]
        assert _sent(fake_openai) == ["sdk 0", "echo: sdk 0", "sdk 1", "echo: sdk 1", "sdk 2"]  # one session
        with ollama.Client(host=proxy, timeout=30) as local:
            said = []
            for n in range(3):
                said.append({"role": "user", "content": f"ollama {n}"})
                said.append({"role": "assistant", "content": "".join(
                    c.message.content or "" for c in local.chat(model="fake", messages=said, stream=True))})
        assert _sent(fake_openai) == ["ollama 0", "echo: ollama 0", "ollama 1", "echo: ollama 1", "ollama 2"]
    finally:
        proc.send_signal(signal.SIGQUIT)
        proc.wait(10)
    served = (tmp_path / "nginx-access.log").read_text()
    # Each door's requests reached both instances (an API turn's submit and its stream alternate).
    for door, request in (("api", " /api/v1/"), ("proxy", "POST /v1/chat/completions "), ("proxy", "POST /api/chat ")):
        upstreams = {line.rsplit(" ", 1)[1] for line in served.splitlines() if request in line}
        assert upstreams == {f"127.0.0.1:{s.cfg.plugin_config[DOORS[door]]['port']}" for s in pair}, served


def _sent(backend) -> list[str]:
    """What the last model request carried after the system prompt."""
    return [m["content"] for m in backend.requests[-1].json["messages"][1:]]


def test_a_stopped_instance_lets_its_running_turn_finish_while_the_other_takes_new_requests(pair, fake_openai
                                                                                          ) -> None:
    a, b = pair
    fake_openai.script(text("one ", "two ", "three ", "four", delay=0.4))

    async def scenario() -> tuple[list, list]:
        async with ShellClient(b.url, "drained", token=TOKEN) as on_b, \
                ShellClient(a.url, "drained", token=TOKEN, retry_max=0.5) as on_a:
            await on_b.connect(max_wait=10)
            await on_a.connect(max_wait=10)
            await on_a.submit("count slowly")
            await _until(on_b.events(), ("tok",))
            assert a.proc is not None
            a.proc.send_signal(signal.SIGTERM)  # while the turn runs on A
            async with httpx.AsyncClient(timeout=2) as http:  # A soon takes no new connection: a balancer uses B
                async def refused() -> bool:
                    try:
                        await http.get(f"{a.url}/health", headers={"Connection": "close"})
                    except httpx.ConnectError:
                        return True
                    except (httpx.ReadError, httpx.RemoteProtocolError):
                        return False  # accepted just before A closed its listener, then dropped: try again
                    return False

                await until(refused, "A to refuse new connections", 10, step=0.05)
            assert a.proc.poll() is None  # refused while A still runs (its turn drains)
            rest_b, rest_a = await asyncio.gather(_until(on_b.events()), _until(on_a.events()))
            return rest_b, rest_a

    rest_b, rest_a = asyncio.run(scenario())
    for rest in (rest_b, rest_a):  # both windows, the one on the stopping instance too, see the whole answer
        assert [e.name for e in rest][-1] == "done" and "error" not in [e.name for e in rest], rest
        assert answer(rest).endswith("three four")
    assert a.proc is not None and a.proc.wait(30) == 0
    assert "stopping: waiting up to 30 s for 1 running request(s) to finish" in a.stop()
    sent = [m["content"] for m in fake_openai.requests[-1].json["messages"][1:]]
    assert sent == ["count slowly"]
    assert answer(run_turn(b, "drained", "and now?")) == "echo: and now?"
    assert [m["content"] for m in fake_openai.requests[-1].json["messages"][1:]] == \
        ["count slowly", "one two three four", "and now?"]  # the drained turn's answer was saved


def test_a_rolling_restart_behind_nginx_answers_every_message(tmp_path, pair, fake_openai) -> None:
    """Restart A, wait until it is ready, restart B, while one client keeps talking through nginx."""
    a, b = pair
    proc, ports = _nginx(tmp_path, pair)
    fake_openai.script(*[text("slow ", "answer", delay=0.15) for _ in range(24)])
    answers: list[str] = []

    async def talk() -> None:
        async with ShellClient(f"http://127.0.0.1:{ports['shell']}", "rolling", token=TOKEN) as client:
            for n in range(24):
                events = await asyncio.wait_for(collect_turn(client, f"message {n}"), 60)
                answers.append(answer(events))
                if answers[-1] != "slow answer":
                    print("TURN", n, [(e.id, e.name, e.data) for e in events])

    async def restart() -> None:
        for server in (a, b):  # each once the conversation is under way through the instances still up
            await until(lambda heard=len(answers): len(answers) >= min(heard + 2, 24), "two more answers")
            assert server.proc is not None
            server.proc.send_signal(signal.SIGTERM)
            await asyncio.to_thread(server.proc.wait, 60)
            server.stop()
            await asyncio.to_thread(server.start)  # returns once it is ready

    async def both() -> None:
        await asyncio.gather(talk(), restart())

    try:
        asyncio.run(both())
    finally:
        proc.send_signal(signal.SIGQUIT)
        proc.wait(10)
    assert answers == ["slow answer"] * 24


def test_nginx_site_file_is_what_the_architecture_doc_shows() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    assert NGINX_SITE.read_text().strip() in doc


# ── One instance on SQLite ──────────────────────────────────────────────────────────────────


@pytest.mark.timeout(180)  # shell.py under a terminal: its own waits (60 s) report what it showed
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["kill -9", "SIGTERM"])
def test_one_instance_stopped_mid_turn_gives_the_terminal_its_prompt_back(tmp_path, fake_openai, how) -> None:
    """kill -9: the restarted server ends the turn it finds unfinished; SIGTERM: the stopping server ends it."""
    from tests.test_grants import _prompt_back
    from tests.test_newcomer import Window

    cfg = ConfigDir(tmp_path)
    cfg.models = {"fake": openai_model(fake_openai)}
    server = AgentServer(cfg.write())  # the embedded default store: SQLite in the data dir
    fake_openai.script(hang(60))
    session = tmp_path / "session"
    session.write_text("pty-restart")
    server.start()
    window = Window(server, session)
    try:
        assert window.shows("›", timeout=60), window.text[-800:]
        window.type("what were we saying\r")
        until_sync(lambda: fake_openai.requests, "the turn to ask the model", 30)  # the turn is running
        assert server.proc is not None
        server.proc.send_signal(how)
        if how == signal.SIGTERM:  # said before the server goes
            assert window.shows("the turn was interrupted", timeout=60), window.text[-1500:]
            assert _prompt_back(window), window.text[-800:]
            assert server.proc.wait(30) == 0
        server.stop()
        server.start()
        assert window.shows("the turn was interrupted", timeout=60), window.text[-1500:]
        assert _prompt_back(window), window.text[-800:]
        assert window.shows("server back online", timeout=60), window.text[-800:]
        assert window.text.count("the turn was interrupted") == 1  # told once, by whichever server ended it
        window.close()
        run_turn(server, "pty-restart", "are you back?")
        sent = [m["content"] for m in fake_openai.requests[-1].json["messages"][1:]]
        assert sent == ["what were we saying", "are you back?"]  # the interrupted message was kept
    finally:
        window.close()
        server.stop()  # also when an assertion failed: no server process outlives its test
