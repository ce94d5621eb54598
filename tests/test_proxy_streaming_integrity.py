"""The proxy never lies: a reader that falls behind the event buffer gets an error and no end
marker (never an answer with a hole that looks whole); invalid Unicode anywhere is a 400; a
backend's error body reaches clients only as its status and a cleaned first line; a client that
goes away mid-body and a Redis outage mid-turn leave one log line, never a traceback.

Driven over real sockets with the real openai and ollama clients and raw httpx. The server keeps
AGENT_EVENT_BUFFER=100 events per session, so a reader that reads nothing falls behind after a
few megabytes (the kernel's socket buffers hold the rest).
"""

from __future__ import annotations

import json
import socket
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import ollama
import openai
import pytest

from plugins._proxy_identity import key_digest
from tests.conftest import AgentServer, ConfigDir, free_port, openai_model
from tests.fakes.backend import error, text
from tests.fakes.openai_backend import FakeOpenAI
from tests.redis_help import OwnRedis
from tests.waiting import until_sync

pytestmark = pytest.mark.slow

AGENT = "agent-mcp:latest"
OWUI = "owui-key-streaming-integrity"
API_KEY = "api-key-streaming-integrity"
BUFFER = 100
#: An answer of PIECES numbered words of PIECE_SIZE characters: far more than BUFFER events, and more
#: bytes than the socket buffers between the server and a reader that reads nothing.
PIECES, PIECE_SIZE = 500, 16_000
#: A small receive buffer keeps the reader's own kernel from swallowing the answer.
SMALL_RECEIVE = [(socket.SOL_SOCKET, socket.SO_RCVBUF, 256 * 1024)]


@dataclass
class Server:
    server: AgentServer
    gpt: FakeOpenAI
    proxy: str
    api: str

    def history(self, client_id: str) -> int | None:
        rows = httpx.get(f"{self.server.url}/sessions", headers=self.server.auth, timeout=5).json()["sessions"]
        return next((r["history_length"] for r in rows if r["client_id"] == client_id), None)

    def until_overrun(self, client_id: str, length: int = 2, seconds: float = 120) -> None:
        """Wait until the answer has overrun the buffer of a reader that reads nothing: the server stored the
        whole turn, or it saw the reader fall behind first (the model can outpace the reader's writes) and
        ended the turn."""
        until_sync(lambda: self.history(client_id) == length or f"a reader of {client_id} fell more than" in self.log(),
                   f"{client_id} to reach {length} messages", seconds, step=0.1)

    def log(self) -> str:
        return "".join(self.server._lines)


@pytest.fixture(scope="module")
def srv(tmp_path_factory) -> Iterator[Server]:
    with FakeOpenAI() as gpt:
        cfg = ConfigDir(tmp_path_factory.mktemp("integrity"))
        cfg.models = {"gpt": openai_model(gpt)}
        ports = {"plugin_proxy_llama": free_port(), "plugin_client_api": free_port()}
        cfg.plugins += list(ports)
        cfg.plugin_config["plugin_proxy_llama"] = {
            "port": ports["plugin_proxy_llama"], "user_keys": {key_digest(OWUI): "open-webui"},
            "forwarders": ["open-webui"], "trusted_proxies": ["127.0.0.1"]}
        cfg.plugin_config["plugin_client_api"] = {"port": ports["plugin_client_api"]}
        cfg.env = {"API_KEY": API_KEY}
        server = AgentServer(cfg.write(), {"SESSION_STORE": "memory", "AGENT_EVENT_BUFFER": str(BUFFER)}).start()
        try:
            yield Server(server, gpt, f"http://127.0.0.1:{ports['plugin_proxy_llama']}",
                         f"http://127.0.0.1:{ports['plugin_client_api']}")
        finally:
            out = server.stop()
            assert "Traceback" not in out and "Exception in ASGI application" not in out, out[-4000:]


@pytest.fixture(autouse=True)
def _fresh(request) -> None:
    if "srv" in request.fixturenames:
        request.getfixturevalue("srv").gpt.reset()


def _chat() -> tuple[str, dict[str, str]]:
    chat = uuid.uuid4().hex
    return f"llama-open-webui-chat-{chat}", {"Authorization": f"Bearer {OWUI}", "X-OpenWebUI-Chat-Id": chat}


def _numbered(delay: float = 0.0) -> Any:
    return text(*[f"w{i}" + "." * PIECE_SIZE + " " for i in range(PIECES)], delay=delay)


def _numbers(pieces: list[str]) -> list[int]:
    return [int(w.rstrip(".")[1:]) for w in "".join(pieces).split()]


# ── A reader that falls behind ──────────────────────────────────────────────────────────────


def test_a_slow_openai_reader_gets_an_error_and_never_a_gapped_answer(srv):
    client_id, headers = _chat()
    srv.gpt.script(_numbered())
    http = httpx.Client(transport=httpx.HTTPTransport(socket_options=SMALL_RECEIVE), timeout=120)
    with openai.OpenAI(base_url=srv.proxy + "/v1", api_key="unused", http_client=http, max_retries=0,
                       default_headers=headers) as client:
        stream = client.chat.completions.create(model=AGENT, messages=[{"role": "user", "content": "go"}],
                                                stream=True)
        srv.until_overrun(client_id)  # the answer overran the buffer while this reader read nothing
        pieces, finish = [], None
        with pytest.raises(openai.APIError, match="the answer is incomplete: this client read it more slowly"):
            for chunk in stream:
                if chunk.choices:
                    pieces.append(chunk.choices[0].delta.content or "")
                    finish = chunk.choices[0].finish_reason or finish
    got = _numbers(pieces)
    assert 0 < len(got) < PIECES and got == list(range(len(got)))  # what came is whole, up to where it stops
    assert finish is None  # no `stop`, and the SDK saw no [DONE]


def test_a_slow_ollama_reader_gets_an_error_and_never_done(srv):
    client_id, headers = _chat()
    srv.gpt.script(_numbered())
    with ollama.Client(host=srv.proxy, timeout=120, headers=headers,
                       transport=httpx.HTTPTransport(socket_options=SMALL_RECEIVE)) as client:
        stream = client.chat(model=AGENT, messages=[{"role": "user", "content": "go"}], stream=True)
        first = next(stream)  # ollama-python sends the request when the stream is first read
        srv.until_overrun(client_id)
        parts = [first]
        with pytest.raises(ollama.ResponseError, match="the answer is incomplete"):
            parts.extend(stream)
    got = _numbers([p.message.content for p in parts])
    assert 0 < len(got) < PIECES and got == list(range(len(got)))
    assert not any(p.done for p in parts)


def test_a_reader_that_keeps_up_gets_every_piece_and_the_end(srv):
    """The same answer, read as it comes: all of it, then the end (the error above is no false alarm). The model
    is paced (8 MB/s): from the instant fake the server's model stream outruns the server's own writes of 16 KB
    events to this reader, and a reader the model outruns by BUFFER events falls behind however fast it reads."""
    _, headers = _chat()
    srv.gpt.script(_numbered(delay=0.002))
    with openai.OpenAI(base_url=srv.proxy + "/v1", api_key="unused", max_retries=0, timeout=120,
                       default_headers=headers) as client:
        chunks = list(client.chat.completions.create(model=AGENT, messages=[{"role": "user", "content": "go"}],
                                                     stream=True))
    assert _numbers([c.choices[0].delta.content or "" for c in chunks if c.choices]) == list(range(PIECES))
    assert chunks[-1].choices[0].finish_reason == "stop"


# ── Invalid Unicode ─────────────────────────────────────────────────────────────────────────


def test_invalid_unicode_anywhere_is_a_400_never_a_500(srv):
    proxy_auth = {"Authorization": f"Bearer {OWUI}", "Content-Type": "application/json"}
    shell_auth = {**srv.server.auth, "Content-Type": "application/json"}
    api_auth = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    bodies = {
        srv.proxy + "/api/chat": b'{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}',
        srv.proxy + "/api/generate": b'{"model": "agent-mcp", "prompt": "a \\udfff b"}',
        srv.proxy + "/api/show": b'{"name": "\\udc00"}',
        srv.proxy + "/v1/chat/completions": b'{"model": "agent-mcp", "messages": [{"role": "\\ud83d", "content": 1}]}',
        srv.server.url + "/submit": b'{"client_id": "c1", "text": "\\ud800"}',
        srv.api + "/api/v1/submit": b'{"text": "hi \\udbff", "wait": true}',
    }
    raw_surrogate = b'{"model": "agent-mcp", "messages": [{"role": "user", "content": "\xed\xa0\x80"}]}'
    for url, body in [*bodies.items(), (srv.proxy + "/api/chat", raw_surrogate)]:
        headers = api_auth if "/api/v1/" in url else shell_auth if url.startswith(srv.server.url) else proxy_auth
        got = httpx.post(url, content=body, headers=headers, timeout=10)
        assert got.status_code == 400, (url, got.status_code, got.text)
        assert "invalid Unicode: a lone surrogate" in got.text, got.text
    # A pair of surrogates is one character: fine.
    srv.gpt.script(text("ok"))
    fine = httpx.post(srv.proxy + "/api/chat", headers=proxy_auth, timeout=30, content=json.dumps(
        {"model": AGENT, "stream": False, "messages": [{"role": "user", "content": "\U0001f600"}]}).encode())
    assert fine.status_code == 200, fine.text
    # Bytes that are no UTF-8 in a path, a query and headers.
    for url in (srv.proxy + "/v1/models/%ED%A0%80", srv.proxy + "/api/tags?q=%FF%ED%A0%80",
                srv.api + "/api/v1/stream/%ED%A0%80", srv.api + "/api/v1/session/%FF"):
        auth = api_auth if "/api/v1/" in url else proxy_auth
        assert httpx.get(url, headers=auth, timeout=10).status_code < 500, url
    for name in ("x-openwebui-chat-id", "x-openwebui-user-id", "x-forwarded-for", "user-agent"):
        got = httpx.post(srv.proxy + "/api/show", json={"name": "gpt"}, timeout=10,
                         headers={**proxy_auth, name.encode(): b"\xff\xed\xa0\x80"})
        assert got.status_code < 500, (name, got.text)


# ── Backend error bodies ────────────────────────────────────────────────────────────────────

LEAKY = ("upstream exploded for key=sk-live-0123456789abcdef (Authorization: Bearer tok_0123456789abcdef, "
         "api_key=hunter2hunter2)\nTraceback (most recent call last):\n  File \"/srv/internal/app.py\", line 1")


def _summarised(message: str) -> None:
    assert "HTTP 500" in message and "upstream exploded" in message, message
    for secret in ("sk-live-0123456789abcdef", "tok_0123456789abcdef", "hunter2", "Traceback", "/srv/internal"):
        assert secret not in message, (secret, message)


def test_backend_error_bodies_reach_clients_only_summarised(srv):
    _, headers = _chat()
    srv.gpt.script(error(500, LEAKY))
    with openai.OpenAI(base_url=srv.proxy + "/v1", api_key="unused", max_retries=0, timeout=30,
                       default_headers=headers) as client, pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model=AGENT, messages=[{"role": "user", "content": "hi"}])
    _summarised(caught.value.message)
    srv.gpt.script(error(500, LEAKY))
    with ollama.Client(host=srv.proxy, timeout=30, headers=headers) as oc, pytest.raises(ollama.ResponseError) as oerr:
        list(oc.chat(model=AGENT, messages=[{"role": "user", "content": "hi"}], stream=True))
    _summarised(oerr.value.error)
    srv.gpt.script(error(500, LEAKY))
    answer = httpx.post(srv.api + "/api/v1/submit", json={"text": "hi", "wait": True},
                        headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30).json()
    assert answer["status"] == "error"
    _summarised(answer["error"])
    assert "sk-live-0123456789abcdef" not in srv.log()  # nor in the server's own log line


# ── Clients that go away, dependencies that go down ─────────────────────────────────────────


def _short_body(url: str, headers: dict[str, str]) -> None:
    """A request that promises 1000 bytes of body, sends 12 and closes the connection."""
    host, port = url.removeprefix("http://").split("/")[0].split(":")
    path = "/" + url.removeprefix("http://").partition("/")[2]
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
                     f"{head}Content-Length: 1000\r\n\r\n".encode() + b'{"text": "tr')
        sock.shutdown(socket.SHUT_WR)
        while sock.recv(4096):
            pass


def test_a_body_shorter_than_its_content_length_is_one_log_line(srv):
    targets = [(srv.proxy + "/api/chat", {"Authorization": f"Bearer {OWUI}"}),
               (srv.proxy + "/v1/chat/completions", {"Authorization": f"Bearer {OWUI}"}),
               (srv.server.url + "/submit", srv.server.auth),
               (srv.api + "/api/v1/submit", {"Authorization": f"Bearer {API_KEY}"})]
    for url, headers in targets:
        _short_body(url, headers)
    marker = uuid.uuid4().hex
    httpx.get(f"{srv.server.url}/mark-{marker}", timeout=5)  # refused (no token): the guard logs its line
    until_sync(lambda: marker in srv.log(), "the guard's line for the marker request", 10)
    lines = [ln for ln in srv.log().splitlines() if "went away before its body was complete" in ln]
    assert len(lines) >= len(targets), lines
    assert "Traceback" not in srv.log() and "ClientDisconnect" not in srv.log()


def test_redis_going_down_mid_turn_ends_the_stream_with_an_error_and_one_line(tmp_path):
    own = OwnRedis(tmp_path).start()
    with FakeOpenAI() as gpt:
        cfg = ConfigDir(tmp_path / "cfg")
        cfg.path.mkdir()
        cfg.models = {"gpt": openai_model(gpt)}
        port = free_port()
        cfg.plugins.append("plugin_proxy_llama")
        cfg.plugin_config["plugin_proxy_llama"] = {"port": port}
        server = AgentServer(cfg.write(), {"SESSION_STORE": own.url + "?prefix=identity-branch:"}).start(wait=False)
        try:
            server.wait_ready(60)
            release = threading.Event()
            gpt.script(text("first ", "second", hold=release))
            pieces, finish = [], None
            with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                               timeout=60) as client:
                stream = client.chat.completions.create(model=AGENT, messages=[{"role": "user", "content": "hi"}],
                                                        stream=True)
                with pytest.raises(openai.APIError):
                    for chunk in stream:
                        if chunk.choices:
                            pieces.append(chunk.choices[0].delta.content or "")
                            finish = chunk.choices[0].finish_reason or finish
                        if "first " in pieces and own.proc is not None:
                            own.stop()  # Redis goes away while the turn runs
                            release.set()
            assert finish is None and "second" not in "".join(pieces)
        finally:
            release.set()
            out = server.stop()
            own.stop()
    assert "Traceback" not in out and "Exception in ASGI application" not in out, out[-4000:]
