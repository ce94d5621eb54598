"""Bad input and failures get clear answers, never a 5xx for bad input and never a silent retry.

Deeply nested JSON on every JSON route, a model backend that hangs or is down (through the shell
endpoint and through the proxy, with the real openai and ollama clients at their default retry
settings), a start-up on a data dir that cannot be written. One agent-mcp subprocess serves the
module (shell endpoint, API, proxy, MCP server); its log must hold no traceback at the end.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import ollama
import openai
import pytest

from shell_client import ShellClient
from tests.conftest import ROOT, AgentServer, ConfigDir, free_port, gemini_model, openai_model
from tests.fakes.backend import error, hang
from tests.fakes.gemini_backend import FakeGemini
from tests.fakes.openai_backend import FakeOpenAI
from tests.runtime import runtime, turn
from tests.turns import collect_turn

pytestmark = pytest.mark.slow

MCP_TOKEN = "mcp-human-token-failures-01"
SHELL_TOKEN = "shell-token-failures-0001"
#: Long enough that only the model's llm_call_timeout (1 s here) can end the wait.
HANGS = 60


@dataclass
class Server:
    server: AgentServer
    backend: FakeOpenAI
    api: str
    proxy: str
    mcp: str


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    path = tmp_path_factory.mktemp("failures")
    with FakeOpenAI() as backend:
        cfg = ConfigDir(path)
        # max_retries stays at its default (2): a timeout must still cost one wait, not three.
        cfg.models = {"gpt": {**openai_model(backend, llm_call_timeout=1), "max_retries": 2},
                      "down": openai_model(backend, host=f"http://127.0.0.1:{free_port()}/v1")}
        ports = {name: free_port() for name in ("plugin_client_api", "plugin_proxy_llama", "plugin_client_mcp")}
        cfg.plugins += list(ports)
        cfg.plugin_config.update({name: {"port": port} for name, port in ports.items()})
        cfg.env = {"AGENT_SHELL_TOKEN": SHELL_TOKEN, "API_KEY": SHELL_TOKEN}  # one header reaches both
        (path / "mcp-tokens.json").write_text(json.dumps({"tokens": {"me": {"role": "human", "token": MCP_TOKEN}}}))
        (path / "mcp-tokens.json").chmod(0o600)  # it holds tokens: agent-mcp refuses it readable by others
        server = AgentServer(cfg.write(), {"SESSION_STORE": "memory"}).start()
        url = "http://127.0.0.1:{}".format
        try:
            yield Server(server, backend, url(ports["plugin_client_api"]), url(ports["plugin_proxy_llama"]),
                         url(ports["plugin_client_mcp"]) + "/mcp")
        finally:
            out = server.stop()
            assert "Traceback" not in out and " ERROR " not in out, out[-3000:]


@pytest.fixture(autouse=True)
def _fresh_backend(request: pytest.FixtureRequest) -> None:
    if "server" in request.fixturenames:
        request.getfixturevalue("server").backend.reset()


# ── Deep JSON ───────────────────────────────────────────────────────────────────────────────

DEEP = [b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 5000 + b"1" + b"}" * 5000,
        b'{"client_id": "c1", "text": ' + b"[" * 64 + b"]" * 64 + b"}"]  # 65 levels: one too many


def test_deeply_nested_json_is_a_400_on_every_json_route(server: Server) -> None:
    json_routes = [server.server.url + "/submit", server.server.url + "/gate_response", server.api + "/api/v1/submit",
                   server.api + "/api/v1/gate/g1", *(server.proxy + p for p in (
                       "/api/chat", "/api/generate", "/api/show", "/v1/chat/completions", "/v1/api/chat"))]
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {SHELL_TOKEN}"}
    for url in json_routes:
        for body in DEEP:
            got = httpx.post(url, content=body, headers=headers, timeout=30)
            assert got.status_code == 400, (url, got.status_code, got.text[:300])
            assert "nested too deeply: at most 64 levels" in got.text, (url, got.text[:300])
    # The MCP SDK parses its own body: a JSON-RPC parse error, not a crash.
    mcp_headers = {**headers, "Authorization": f"Bearer {MCP_TOKEN}", "Accept": "application/json, text/event-stream"}
    for body in DEEP[:2]:
        for era in ({}, {"MCP-Protocol-Version": "2026-07-28"}):
            got = httpx.post(server.mcp, content=body, headers={**mcp_headers, **era}, timeout=30)
            assert got.status_code == 400 and got.json()["error"]["code"] == -32700, (era, got.text[:300])
    # 64 levels are fine (the validation error is about the field, not the nesting).
    fine = httpx.post(server.server.url + "/submit", headers=headers,
                      content=b'{"client_id": "c1", "text": ' + b"[" * 63 + b"]" * 63 + b"}")
    assert fine.status_code == 400 and "text: Input should be a valid string" in fine.text, fine.text


# ── A model backend that hangs or is down ───────────────────────────────────────────────────


async def test_a_hanging_backend_costs_one_timeout_and_the_error_says_what_to_do(server: Server) -> None:
    server.backend.script(hang(HANGS))
    async with ShellClient(server.server.url, "hang", token=SHELL_TOKEN) as client:
        events = await collect_turn(client, "are you there?")
    errors = [e.text for e in events if e.name == "error"]
    assert len(server.backend.requests) == 1  # the SDK's own retries (max_retries=2) did not run
    assert len(errors) == 1 and "model 'gpt'" in errors[0] and "no answer within 1 s (llm_call_timeout)" in errors[0]
    assert "not retried" in errors[0] and "!llm_timeout gpt <seconds>" in errors[0]
    assert [e.name for e in events][-1] == "done"


async def test_a_hanging_gemini_backend_costs_one_timeout(tmp_path: Path) -> None:
    with FakeGemini() as backend:
        models = {"gem": {**gemini_model(backend, llm_call_timeout=1), "max_retries": 2}}
        async with runtime(tmp_path, models, env={"FAKE_GEMINI_KEY": "k"}) as rt:
            backend.script(hang(HANGS))
            _, events = await turn(rt, "are you there?")
            errors = [e.data for e in events if e.name == "error"]
            assert len(backend.requests) == 1
            assert errors == [{"message": errors[0]["message"], "kind": "timeout"}]
            assert "no answer within 1 s" in errors[0]["message"] and "!llm_timeout gem" in errors[0]["message"]


async def test_a_refused_or_overloaded_backend_is_retried_before_any_output(tmp_path: Path) -> None:
    with FakeOpenAI() as backend:
        models = {"gpt": {**openai_model(backend), "max_retries": 2}, "once": openai_model(backend)}
        async with runtime(tmp_path, models) as rt:
            backend.script(error(503, "loading"), error(429, "slow down"))
            out, _ = await turn(rt, "hello")
            assert out == "echo: hello" and len(backend.requests) == 3
            backend.reset()
            backend.script(error(503, "loading"))  # max_retries 0: one attempt, then the error
            _, events = await turn(rt, "@once hello", client_id="c2")
            assert [e.data["kind"] for e in events if e.name == "error"] == ["backend"]
            assert len(backend.requests) == 1


async def test_retries_wait_half_a_second_then_twice_as_long_each_time(tmp_path: Path, monkeypatch) -> None:
    """The first attempt runs outside tenacity; the waits before attempts 2, 3, 4 are still 0.5, 1 and 2 s."""
    waits: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(seconds: float, *args: Any) -> Any:  # (the server's own long waits go on as they are)
        if 0 < seconds < 10:
            waits.append(seconds)
            seconds = 0
        return await real_sleep(seconds, *args)

    monkeypatch.setattr(asyncio, "sleep", sleep)
    with FakeOpenAI() as backend:
        async with runtime(tmp_path, {"gpt": {**openai_model(backend), "max_retries": 3}}) as rt:
            backend.script(error(503, "loading"), error(503, "loading"), error(503, "loading"), error(503, "loading"))
            _, events = await turn(rt, "hello")
    assert [e.data["kind"] for e in events if e.name == "error"] == ["backend"]
    assert len(backend.requests) == 4 and waits[:3] == [0.5, 1.0, 2.0]  # (then the runtime's own short waits)


# ── The proxy: 502 / 504, and SDKs are told not to retry ────────────────────────────────────


def _counting_openai(url: str) -> tuple[openai.OpenAI, list[str]]:
    """The openai SDK at its default retry settings (max_retries=2), counting the requests it sends."""
    sent: list[str] = []
    http = httpx.Client(event_hooks={"request": [lambda r: sent.append(r.url.path)]}, timeout=30)
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", http_client=http), sent


def test_the_proxy_answers_504_when_the_model_hangs_and_sdks_do_not_retry(server: Server) -> None:
    client, sent = _counting_openai(server.proxy)
    assert client.max_retries == 2
    with client:
        for stream in (False, True):
            server.backend.reset()
            server.backend.script(hang(HANGS))
            with pytest.raises(openai.APIStatusError) as err:
                client.chat.completions.create(model="gpt", messages=[{"role": "user", "content": "hi"}], stream=stream)
            assert err.value.status_code == 504 and err.value.response.headers["x-should-retry"] == "false"
            assert "no answer within 1 s" in err.value.message and err.value.code == "backend_timeout"
            assert len(sent) == 1 and len(server.backend.requests) == 1
            sent.clear()
    server.backend.reset()
    server.backend.script(hang(HANGS))
    with ollama.Client(host=server.proxy, timeout=30) as oll, pytest.raises(ollama.ResponseError) as oerr:
        oll.chat(model="gpt", messages=[{"role": "user", "content": "hi"}])
    assert oerr.value.status_code == 504 and "no answer within 1 s" in oerr.value.error
    assert len(server.backend.requests) == 1


def test_the_proxy_answers_502_when_the_model_is_down(server: Server) -> None:
    client, sent = _counting_openai(server.proxy)
    with client, pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(model="down", messages=[{"role": "user", "content": "hi"}])
    assert err.value.status_code == 502 and err.value.response.headers["x-should-retry"] == "false"
    assert "cannot connect" in err.value.message and err.value.code == "backend_error" and len(sent) == 1
    # Proxy users learn what failed, not where the backends live.
    assert "127.0.0.1" not in err.value.message
    with ollama.Client(host=server.proxy, timeout=30) as oll, pytest.raises(ollama.ResponseError) as oerr:
        list(oll.generate(model="down", prompt="hi", stream=True))
    assert oerr.value.status_code == 502 and "cannot connect" in oerr.value.error
    # Unsupported endpoints are a 404, not a 5xx an SDK would retry.
    embed = httpx.post(server.proxy + "/v1/embeddings", json={"model": "gpt", "input": "x"})
    assert embed.status_code == 404 and embed.headers["x-should-retry"] == "false"


# ── Start-up on a data dir that cannot be written ───────────────────────────────────────────


def test_an_unwritable_data_dir_stops_start_up_with_one_line(tmp_path: Path) -> None:
    cfg = ConfigDir(tmp_path)
    cfg.models = {"m": {"model_id": "m", "type": "OPENAI", "host": "http://127.0.0.1:9/v1", "env_key": None}}
    cfg.write()
    # Tests run as root, and root writes anywhere whatever the mode bits say; nobody, root included,
    # can create a directory inside a regular file.
    (tmp_path / "file").write_text("a regular file")
    data = tmp_path / "file" / "data"
    done = subprocess.run([sys.executable, str(ROOT / "agent-mcp.py"), "--config-dir", str(tmp_path)],
                          env={"PATH": "/usr/bin:/bin", "AGENT_DATA_DIR": str(data)}, cwd=ROOT,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.splitlines() == [
        f"agent-mcp: cannot start: data directory {data} is not writable (Not a directory): set AGENT_DATA_DIR "
        "to a writable directory or fix its permissions"]
