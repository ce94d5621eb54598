"""plugin_proxy_llama over real HTTP: the real openai, ollama and LangChain clients, raw wire checks.

One agent-mcp subprocess serves the module (proxy + shell endpoint) against two fake OpenAI
backends; each test talks in its own open-webui chat (its own session) so tests do not share
history. Streaming tests hold the backend after its first token: the client must already have
that token while the backend is still holding the rest of the answer.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import httpx
import ollama
import openai
import pytest
from langchain_ollama import ChatOllama
from langchain_ollama._utils import validate_model
from langchain_openai import ChatOpenAI

from plugin_api import PluginConfigError
from plugins._proxy_identity import key_digest
from plugins.plugin_proxy_llama import LlamaProxyPlugin
from tests.conftest import AgentServer, ConfigDir, free_port, openai_model
from tests.fakes.backend import error, malformed, text, tool_call
from tests.fakes.openai_backend import FakeOpenAI
from tests.waiting import until, within_sync

pytestmark = pytest.mark.slow

AGENT = "agent-mcp:latest"
HI = [{"role": "user", "content": "hi"}]
RELEASE_AFTER = 20  # seconds: a safety valve so a buffering proxy fails the test instead of hanging it
#: The key this module's open-webui holds: a forwarder's, trusted from 127.0.0.1 (tests/test_identity.py
#: checks that nobody else's forwarded headers count); requests without a key are anonymous.
OWUI_KEY = "owui-forwarder-key-for-the-proxy-tests"
FORWARDER = {"user_keys": {key_digest(OWUI_KEY): "open-webui"}, "forwarders": ["open-webui"],
             "trusted_proxies": ["127.0.0.1"], "keys_required": False}
OWUI = {"Authorization": f"Bearer {OWUI_KEY}"}


@dataclass
class Proxy:
    url: str
    server: AgentServer
    gpt: FakeOpenAI
    other: FakeOpenAI

    def sessions(self) -> dict[str, dict[str, Any]]:
        rows = httpx.get(f"{self.server.url}/sessions", headers=self.server.auth, timeout=5).json()["sessions"]
        return {r["client_id"]: r for r in rows}


def _start(tmp: Any, gpt: FakeOpenAI, other: FakeOpenAI, proxy_config: dict[str, Any] | None = None,
           env: dict[str, str] | None = None) -> Proxy:
    cfg = ConfigDir(tmp)
    cfg.models = {"gpt": openai_model(gpt), "other": openai_model(other)}
    port = free_port()
    cfg.plugins.append("plugin_proxy_llama")
    cfg.plugin_config["plugin_proxy_llama"] = {"port": port, **FORWARDER, **(proxy_config or {})}
    cfg.env = env or {}
    server = AgentServer(cfg.write(), {"SESSION_STORE": "memory"}).start()
    return Proxy(f"http://127.0.0.1:{port}", server, gpt, other)


@pytest.fixture(scope="module")
def proxy(tmp_path_factory) -> Iterator[Proxy]:
    with FakeOpenAI() as gpt, FakeOpenAI() as other:
        p = _start(tmp_path_factory.mktemp("proxy"), gpt, other)
        try:
            yield p
        finally:
            p.server.stop()


@pytest.fixture(autouse=True)
def _fresh_backends(request) -> None:
    if "proxy" in request.fixturenames:
        p = request.getfixturevalue("proxy")
        p.gpt.reset()
        p.other.reset()


@pytest.fixture
def chat() -> dict[str, str]:
    """Headers of a new open-webui chat: a session of its own."""
    return {**OWUI, "X-OpenWebUI-Chat-Id": uuid.uuid4().hex}


def _openai(url: str, headers: dict[str, str] | None = None, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=30, default_headers=headers)


@pytest.fixture
def oai(proxy, chat) -> Iterator[openai.OpenAI]:
    """The openai SDK in this test's chat."""
    with _openai(proxy.url, chat) as client:
        yield client


@pytest.fixture
def oll(proxy, chat) -> Iterator[ollama.Client]:
    """ollama-python in this test's chat."""
    with ollama.Client(host=proxy.url, timeout=30, headers=chat) as client:
        yield client


class Held:
    """A scripted reply whose stream pauses after its first chunk until the client has seen text.

    `live` says whether the client's first text arrived while the backend was still paused; a
    safety valve releases the backend after RELEASE_AFTER seconds so a buffering proxy fails
    the test instead of hanging it.
    """

    def __init__(self, *chunks: str):
        self.event = threading.Event()
        self.reply = text(*chunks, hold=self.event)
        self.live: bool | None = None
        self._valve = threading.Timer(RELEASE_AFTER, self.event.set)
        self._valve.daemon = True
        self._valve.start()

    def saw_text(self) -> None:
        """Call on every piece of text the client receives."""
        if self.live is None:
            self.live = not self.event.is_set()
            self._valve.cancel()
            self.event.set()


# ── openai SDK ──────────────────────────────────────────────────────────────────────────────


def test_openai_sync_streams_live_and_answers_whole(proxy, oai):
    client = oai
    assert [m.id for m in client.models.list()] == [AGENT, "gpt:latest", "other:latest"]
    assert client.models.retrieve("gpt:latest").id == "gpt:latest"
    held = Held("Once ", "upon ", "a time.")
    proxy.gpt.script(held.reply)
    stream = client.chat.completions.create(model=AGENT, messages=HI, stream=True,
                                            stream_options={"include_usage": True})
    chunks = []
    for ch in stream:
        if ch.choices and ch.choices[0].delta.content:
            held.saw_text()
        chunks.append(ch)
    assert held.live
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == "Once upon a time."
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    # An estimate: about 4 characters a token, at least one a piece the model streamed (3 pieces, 17 characters).
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4 and chunks[-1].usage.total_tokens > 4
    whole = client.chat.completions.create(model=AGENT, messages=[{"role": "user", "content": "again"}])
    assert whole.choices[0].message.content == "echo: again" and whole.choices[0].finish_reason == "stop"
    assert whole.object == "chat.completion" and whole.usage.total_tokens > 0 and whole.model == AGENT


async def test_openai_async_streams_live_and_answers_whole(proxy, chat):
    client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0, timeout=30,
                                default_headers=chat)
    try:
        held = Held("Hello ", "async ", "world")
        proxy.gpt.script(held.reply)
        stream = await client.chat.completions.create(model="agent-mcp", messages=HI, stream=True)
        parts = []
        async for ch in stream:
            assert ch.usage is None  # no usage chunk unless asked for
            piece = ch.choices[0].delta.content
            if piece:
                held.saw_text()
                parts.append(piece)
        assert "".join(parts) == "Hello async world" and held.live
        whole = await client.chat.completions.create(model="agent-mcp", messages=HI, stream=False)
        assert whole.choices[0].message.content == "echo: hi"
    finally:
        await client.close()


# ── ollama ──────────────────────────────────────────────────────────────────────────────────


def test_ollama_chat_generate_list_show_version(proxy, oll):
    client = oll
    listed = client.list().models
    assert [m.model for m in listed] == [AGENT, "gpt:latest", "other:latest"]
    assert all(m.details and m.details.format == "gguf" and m.digest and m.size == 0 for m in listed)
    shown = client.show(AGENT)
    assert shown.modelinfo is not None and "completion" in (shown.capabilities or [])
    with pytest.raises(ollama.ResponseError) as missing:
        client.show("nosuch:7b")
    assert missing.value.status_code == 404 and "nosuch:7b" in missing.value.error
    version = client._client.get("/api/version").json()["version"]
    assert tuple(map(int, re.sub(r"^v|-.*", "", version).split("."))) >= (0, 1, 0)
    assert client.ps().models[0].model == AGENT

    held = Held("Streamed ", "by ", "ollama.")
    proxy.gpt.script(held.reply)
    parts = []
    for part in client.chat(model=AGENT, messages=HI, stream=True):
        if part.message.content:
            held.saw_text()
        parts.append(part)
    assert "".join(p.message.content for p in parts) == "Streamed by ollama." and held.live
    last = parts[-1]
    assert last.done and last.done_reason == "stop" and last.eval_count == 4 and last.total_duration > 0
    assert all(not p.done for p in parts[:-1])
    whole = client.chat(model=AGENT, messages=[{"role": "user", "content": "whole please"}], stream=False)
    assert whole.message.content == "echo: whole please" and whole.done

    held = Held("Gen", "erated.")
    proxy.gpt.script(held.reply)
    pieces = []
    for part in client.generate(model=AGENT, prompt="generate something", stream=True):
        if part.response:
            held.saw_text()
        pieces.append(part)
    assert "".join(p.response for p in pieces) == "Generated." and pieces[-1].done and held.live
    assert client.generate(model=AGENT, prompt="one shot").response == "echo: one shot"


async def test_ollama_async_client_streams(proxy, chat):
    client = ollama.AsyncClient(host=proxy.url, timeout=30, headers=chat)
    held = Held("async ", "ollama")
    proxy.gpt.script(held.reply)
    parts = []
    try:
        async for part in await client.chat(model=AGENT, messages=HI, stream=True):
            if part.message.content:
                held.saw_text()
                parts.append(part.message.content)
    finally:
        await client.close()
    assert "".join(parts) == "async ollama" and held.live


# ── LangChain ───────────────────────────────────────────────────────────────────────────────


def test_chat_ollama_validates_the_model_and_streams(proxy, chat):
    llm = ChatOllama(model="agent-mcp", base_url=proxy.url, validate_model_on_init=True,
                     client_kwargs={"headers": chat, "timeout": 30})
    msg = llm.invoke("what is up")
    assert msg.content == "echo: what is up"
    assert msg.usage_metadata["output_tokens"] == 4 and msg.usage_metadata["total_tokens"] > 4
    held = Held("lang ", "chain ", "ollama")
    proxy.gpt.script(held.reply)
    parts = []
    for c in llm.stream("stream it"):
        if c.content:
            held.saw_text()
            parts.append(c.content)
    assert "".join(parts) == "lang chain ollama" and held.live
    llm._client.close()
    # The same check ChatOllama runs at construction, on a model the proxy does not list.
    with ollama.Client(host=proxy.url) as client, pytest.raises(ValueError, match="not found"):
        validate_model(client, "nosuch")


def test_chat_openai_invokes_and_streams(proxy, chat):
    llm = ChatOpenAI(model=AGENT, base_url=proxy.url + "/v1", api_key="unused", max_retries=0, timeout=30,
                     stream_usage=True, default_headers=chat)
    msg = llm.invoke("hello there")
    assert msg.content == "echo: hello there" and msg.usage_metadata["total_tokens"] > 0
    held = Held("lang ", "chain ", "openai")
    proxy.gpt.script(held.reply)
    agg = None
    for c in llm.stream("stream it"):
        if c.content:
            held.saw_text()
        agg = c if agg is None else agg + c
    assert agg.content == "lang chain openai" and agg.response_metadata["finish_reason"] == "stop" and held.live
    llm.root_client.close()
    assert agg.usage_metadata["output_tokens"] == 4  # 17 characters: the estimate's 4 a token


# ── Raw conformance (client-protocols.md §6) ────────────────────────────────────────────────


def _ndjson(resp: httpx.Response) -> list[dict[str, Any]]:
    body = resp.text
    assert body.endswith("\n") and "\n\n" not in body and not body.startswith("\n")
    return [json.loads(line) for line in body.split("\n")[:-1]]


def _sse(resp: httpx.Response) -> list[str]:
    assert "text/event-stream" in resp.headers["content-type"]
    return [line[len("data: "):] for line in resp.text.split("\n") if line.startswith("data: ")]


def test_liveness_version_tags_show_ps(proxy):
    for path in ("/", "/v1", "/v1/"):
        assert httpx.head(proxy.url + path).status_code == 200
        assert httpx.get(proxy.url + path).text == "Ollama is running"
    for prefix in ("/api", "/v1/api"):
        assert httpx.head(f"{proxy.url}{prefix}/version").status_code == 200
        version = httpx.get(f"{proxy.url}{prefix}/version").json()["version"]
        assert re.fullmatch(r"\d+\.\d+\.\d+", version)
        tags = httpx.get(f"{proxy.url}{prefix}/tags").json()["models"]
        assert [t["name"] for t in tags] == [t["model"] for t in tags] == [AGENT, "gpt:latest", "other:latest"]
        for t in tags:  # what Enchanted's decoder and open-webui require
            assert isinstance(t["size"], int) and isinstance(t["digest"], str)
            assert datetime.fromisoformat(t["modified_at"])
            assert {"parent_model", "format", "family", "families", "parameter_size", "quantization_level"} <= set(
                t["details"]
            )
            assert all(isinstance(t["details"][k], str) for k in ("parent_model", "format", "family"))
    shown = httpx.post(proxy.url + "/api/show", json={"name": "gpt"}).json()
    assert isinstance(shown["model_info"], dict) and isinstance(shown["capabilities"], list) and shown["details"]
    missing = httpx.post(proxy.url + "/api/show", json={"model": "x"})
    assert missing.status_code == 404 and "not found" in missing.json()["error"]
    ps = httpx.get(proxy.url + "/api/ps").json()["models"]
    assert ps and datetime.fromisoformat(ps[0]["expires_at"])


def test_ollama_chat_wire_format_and_enchanted_fields(proxy, chat):
    # No "stream" field: Ollama's default is to stream. Enchanted's request shape.
    body = {"model": AGENT, "messages": [{"role": "user", "content": "wire", "images": []}],
            "options": {"temperature": 0}}
    with httpx.stream("POST", proxy.url + "/api/chat", json=body, headers=chat) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("application/x-ndjson")
        raw = list(resp.iter_raw())
    # Each object is written in one piece (Enchanted drops lines split across reads).
    assert all(chunk.endswith(b"\n") for chunk in raw)
    objs = [json.loads(line) for chunk in raw for line in chunk.decode().split("\n") if line]
    assert [o["done"] for o in objs] == [False] * (len(objs) - 1) + [True]
    for o in objs:
        assert o["model"] == AGENT and o["message"]["role"] == "assistant" and isinstance(o["message"]["content"], str)
        assert datetime.fromisoformat(o["created_at"].replace("Z", "+00:00"))
    assert "".join(o["message"]["content"] for o in objs) == "echo: wire"
    final = objs[-1]
    assert final["done_reason"] == "stop"
    for key in ("total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration", "eval_count",
                "eval_duration"):
        assert isinstance(final[key], int)
    whole = httpx.post(proxy.url + "/v1/api/chat", json={**body, "stream": False}, headers=chat)
    assert whole.headers["content-type"] == "application/json"
    assert whole.json()["message"]["content"] == "echo: wire" and whole.json()["done"] is True
    gen = httpx.post(proxy.url + "/api/generate", json={"model": AGENT, "prompt": "gen"}, headers=chat)
    objs = _ndjson(gen)
    assert "".join(o["response"] for o in objs) == "echo: gen" and objs[-1]["done"] is True
    assert httpx.get(proxy.url + "/v1/api/tags").json() == httpx.get(proxy.url + "/api/tags").json()


def test_load_and_unload_requests_answer_at_once(proxy):
    backend_calls = len(proxy.gpt.requests)
    load = httpx.post(proxy.url + "/api/chat", json={"model": AGENT, "messages": []}).json()
    assert load["done"] is True and load["done_reason"] == "load" and load["message"]["content"] == ""
    unload = httpx.post(proxy.url + "/api/generate", json={"model": AGENT, "prompt": "", "keep_alive": 0,
                                                           "stream": False}).json()
    assert unload["done_reason"] == "unload" and unload["response"] == ""
    assert len(proxy.gpt.requests) == backend_calls


def test_openai_wire_format(proxy, chat):
    body = {"model": AGENT, "messages": [{"role": "system", "content": "ignored"},
                                         {"role": "user", "content": [{"type": "text", "text": "parts"}]}]}
    whole = httpx.post(proxy.url + "/v1/chat/completions", json=body, headers=chat)  # stream defaults to off
    data = whole.json()
    assert whole.headers["content-type"] == "application/json" and data["object"] == "chat.completion"
    assert isinstance(data["created"], int) and data["id"].startswith("chatcmpl-")
    assert data["choices"][0]["message"] == {"role": "assistant", "content": "echo: parts", "refusal": None}
    assert set(data["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}
    resp = httpx.post(proxy.url + "/chat/completions", json={**body, "stream": True}, headers=chat)
    events = _sse(resp)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len({(c["id"], c["created"]) for c in chunks}) == 1
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    for c in chunks:
        assert {"index", "delta", "finish_reason"} <= set(c["choices"][0])
    assert [c["choices"][0]["finish_reason"] for c in chunks].count("stop") == 1
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "echo: parts"
    listing = httpx.get(proxy.url + "/models").json()
    assert listing["object"] == "list" and all(
        {"id", "object", "created", "owned_by"} <= set(m) for m in listing["data"])


def test_format_follows_the_path_not_the_user_agent(proxy, chat):
    body = {"model": AGENT, "messages": HI, "stream": True}
    sse = httpx.post(proxy.url + "/v1/chat/completions", json=body,
                     headers={**chat, "User-Agent": "ollama-python/0.6.3"})
    assert _sse(sse)[-1] == "[DONE]"
    for ua in ("OpenAI/Python 3.54.0", "Python/3.11 aiohttp/3.9"):
        nd = httpx.post(proxy.url + "/api/chat", json=body, headers={**chat, "User-Agent": ua})
        assert nd.headers["content-type"].startswith("application/x-ndjson") and _ndjson(nd)[-1]["done"]
    # Paths that belong to neither API: the User-Agent only picks the error format.
    assert httpx.get(proxy.url + "/nope", headers={"User-Agent": "ollama/0.12"}).json() == {
        "error": "unsupported endpoint: GET /nope"}
    assert httpx.get(proxy.url + "/nope").json()["error"]["code"] == "unknown_endpoint"
    wrong = httpx.post(proxy.url + "/api/tags", json={})
    assert wrong.status_code == 405 and "GET" in wrong.json()["error"] and "GET" in wrong.headers["allow"]
    assert httpx.post(proxy.url + "/api/pull", json={"model": "x"}).status_code == 404


def test_bad_requests_get_clear_errors_in_each_format(proxy):
    bad = httpx.post(proxy.url + "/api/chat", content=b"{not json", headers={"Content-Type": "application/json"})
    assert bad.status_code == 400 and bad.json() == {"error": "request body must be JSON"}
    no_user = httpx.post(proxy.url + "/api/chat", json={"model": AGENT, "messages": [{"role": "system",
                                                                                      "content": "x"}]})
    assert no_user.status_code == 400 and "role 'user'" in no_user.json()["error"]
    empty = httpx.post(proxy.url + "/v1/chat/completions", json={"model": AGENT, "messages": []})
    assert empty.status_code == 400 and empty.json()["error"]["type"] == "invalid_request_error"
    with _openai(proxy.url) as client:
        with pytest.raises(openai.NotFoundError, match="model 'gpt-4o' not found"):
            client.chat.completions.create(model="gpt-4o", messages=HI)
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("gpt-4o")
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=AGENT, messages=[{"role": "user", "content": "   "}])


def test_auth_is_off_unless_configured(proxy, chat):
    for value in (None, "Bearer", "Bearer unused"):  # OllamaKit sends "Bearer " (h11 strips the space)
        headers = {**chat, **({"Authorization": value} if value is not None else {})}
        assert httpx.get(proxy.url + "/api/tags", headers=headers).status_code == 200


def test_bearer_token_when_configured(tmp_path):
    with FakeOpenAI() as gpt, FakeOpenAI() as other:
        p = _start(tmp_path, gpt, other, env={"AGENT_PROXY_TOKEN": "s3cret-token"})
        try:
            assert httpx.get(p.url + "/api/tags").status_code == 401
            with _openai(p.url, api_key="wrong") as bad, pytest.raises(openai.AuthenticationError):
                bad.models.list()
            with _openai(p.url, api_key="s3cret-token") as ok:
                assert ok.chat.completions.create(model=AGENT, messages=HI).choices[0].message.content == "echo: hi"
            with ollama.Client(host=p.url) as anon, pytest.raises(ollama.ResponseError) as denied:
                anon.list()
            assert denied.value.status_code == 401
            with ollama.Client(host=p.url, headers={"Authorization": "Bearer s3cret-token"}) as good:
                assert good.chat(model=AGENT, messages=HI, stream=False).message.content == "echo: hi"
        finally:
            output = p.server.stop()
        assert "s3cret-token" not in output


# ── Errors ──────────────────────────────────────────────────────────────────────────────────


def test_backend_error_mid_stream_is_the_clients_own_error(proxy, oll, oai):
    proxy.gpt.script(malformed())
    parts = []
    with pytest.raises(ollama.ResponseError, match="malformed response"):
        for part in oll.chat(model=AGENT, messages=HI, stream=True):
            parts.append(part.message.content)
    assert parts == ["partial "]  # the answer had started: the error came mid-stream
    proxy.gpt.script(malformed())
    got = []
    with pytest.raises(openai.APIError, match="malformed response"):
        for ch in oai.chat.completions.create(model=AGENT, messages=HI, stream=True):
            got.append(ch.choices[0].delta.content)
    assert "partial " in got


def test_backend_error_before_output_is_an_error_status(proxy, oll, oai):
    proxy.gpt.script(error(500, "backend exploded"), error(500, "backend exploded"), error(500, "backend exploded"))
    with pytest.raises(ollama.ResponseError) as err:
        list(oll.chat(model=AGENT, messages=HI, stream=True))
    assert err.value.status_code == 502 and "backend exploded" in err.value.error
    client = oai
    with pytest.raises(openai.InternalServerError, match="backend exploded"):
        client.chat.completions.create(model=AGENT, messages=HI, stream=True)
    with pytest.raises(openai.InternalServerError, match="backend exploded"):
        client.chat.completions.create(model=AGENT, messages=HI)
    # The session is fine afterwards.
    assert client.chat.completions.create(model=AGENT, messages=HI).choices[0].message.content == "echo: hi"


def test_a_client_that_leaves_cancels_its_turn(proxy, chat):
    held = Held("partial ", "rest")
    proxy.gpt.script(held.reply)
    client_id = f"llama-open-webui-chat-{chat['X-OpenWebUI-Chat-Id']}"
    with httpx.stream("POST", proxy.url + "/api/chat", json={"model": AGENT, "messages": HI}, headers=chat) as resp:
        lines = resp.iter_lines()  # keep it: dropping the iterator closes the connection
        assert json.loads(next(lines))["message"]["content"] == "partial "
        assert proxy.sessions()[client_id]["history_length"] == 1  # the turn is running
    # The server notices the closed connection and rolls the turn back.
    within_sync(lambda: proxy.sessions()[client_id]["history_length"] == 0, 10, step=0.02)
    assert not held.event.is_set() and proxy.sessions()[client_id]["history_length"] == 0
    held.saw_text()
    with ollama.Client(host=proxy.url, headers=chat) as client:
        assert client.chat(model=AGENT, messages=HI, stream=False).message.content == "echo: hi"
    assert proxy.sessions()[client_id]["history_length"] == 2


# ── Sessions, models, commands ──────────────────────────────────────────────────────────────


async def test_twenty_concurrent_streams_from_one_ip_each_get_their_own_answer(proxy):
    oc = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0, timeout=30)
    chats = [f"chat{i:02d}-{uuid.uuid4().hex[:6]}" for i in range(20)]

    async def via_openai(chat_id: str) -> str:
        stream = await oc.chat.completions.create(
            model=AGENT, messages=[{"role": "user", "content": f"question of {chat_id}"}], stream=True,
            extra_headers={**OWUI, "X-OpenWebUI-Chat-Id": chat_id})
        return "".join([c.choices[0].delta.content or "" async for c in stream])

    async def via_ollama(chat_id: str) -> str:
        client = ollama.AsyncClient(host=proxy.url, timeout=30, headers={**OWUI, "X-OpenWebUI-Chat-Id": chat_id})
        try:
            stream = await client.chat(model=AGENT, messages=[{"role": "user", "content": f"question of {chat_id}"}],
                                       stream=True)
            return "".join([p.message.content async for p in stream])
        finally:
            await client.close()

    try:
        answers = await asyncio.gather(*(via_openai(c) if i % 2 else via_ollama(c) for i, c in enumerate(chats)))
    finally:
        await oc.close()
    assert answers == [f"echo: question of {c}" for c in chats]
    sessions = await asyncio.to_thread(proxy.sessions)
    for c in chats:
        assert sessions[f"llama-open-webui-chat-{c}"]["history_length"] == 2


async def _until_text(stream: Any) -> Any:
    """The stream's chunks up to and including the first one with text."""
    async for chunk in stream:
        yield chunk
        if chunk.choices and chunk.choices[0].delta.content:
            return


async def test_concurrent_requests_on_one_session_are_answered_in_turn(proxy, chat):
    held = Held("first ", "answer")
    proxy.gpt.script(held.reply)
    sent: list[str] = []  # a request whose body has gone to the proxy (httpcore's trace extension says so)

    async def trace(event: str, info: dict[str, Any]) -> None:
        if event == "http11.send_request_body.complete":
            sent.append(event)

    async def traced(request: httpx.Request) -> None:
        request.extensions["trace"] = trace

    client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0, timeout=30,
                                default_headers=chat,
                                http_client=httpx.AsyncClient(timeout=30, event_hooks={"request": [traced]}))

    async def ask(prompt: str) -> str:
        stream = await client.chat.completions.create(
            model=AGENT, messages=[{"role": "user", "content": prompt}], stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream])

    try:
        first = await client.chat.completions.create(model=AGENT, messages=[{"role": "user", "content": "one"}],
                                                     stream=True)
        got = [c.choices[0].delta.content or "" async for c in _until_text(first)]
        rest = [asyncio.create_task(ask(p)) for p in ("two", "three")]
        await until(lambda: len(sent) == 3, "the two later requests to reach the proxy")
        assert len(proxy.gpt.requests) == 1  # the others wait for the session instead of cancelling it
        held.saw_text()
        got += [c.choices[0].delta.content or "" async for c in first]
        answers = ["".join(got), *await asyncio.gather(*rest)]
    finally:
        await client.close()
    assert answers[0] == "first answer" and sorted(answers[1:]) == ["echo: three", "echo: two"]
    # Each later request saw the earlier turns in the session's own history.
    assert [m["content"] for m in proxy.gpt.requests[-1].json["messages"][1:]][:2] == ["one", "first answer"]
    # Both later ones reached the model only after the first turn ended (sent while it ran: they waited for it).
    assert all([m["content"] for m in r.json["messages"][1:]][:2] == ["one", "first answer"]
               for r in proxy.gpt.requests[1:])


def test_open_webui_task_prompts_stay_out_of_the_chat_history(proxy, chat, oai):
    oai.chat.completions.create(model=AGENT, messages=HI)
    task = "### Task:\nGenerate a concise title summarizing the chat history.\n<chat_history>USER: hi</chat_history>"
    for stream in (False, True):
        got = oai.chat.completions.create(model=AGENT, messages=[*HI, {"role": "user", "content": task}],
                                          stream=stream)
        text_ = "".join(c.choices[0].delta.content or "" for c in got) if stream else got.choices[0].message.content
        assert text_ == f"echo: {task}"
        sent = proxy.gpt.requests[-1].json["messages"]
        assert [m["role"] for m in sent] == ["system", "user"]  # no chat history, no earlier task
    sessions = proxy.sessions()
    assert sessions[f"llama-open-webui-chat-{chat['X-OpenWebUI-Chat-Id']}"]["history_length"] == 2
    assert not [s for s in sessions if "-task-" in s]


# ── One session per conversation (no forwarded headers) ───────────────────────────────────


class Conversation:
    """A chat client without forwarded headers, as open-webui by default and the SDKs are: it
    resends the whole transcript, with each answer exactly as it was streamed."""

    def __init__(self, proxy: Proxy, api_key: str = "unused", messages: list[dict[str, str]] | None = None):
        self.proxy, self.api_key = proxy, api_key
        self.messages = list(messages or [])

    def say(self, content: str, stream: bool = True) -> str:
        self.messages.append({"role": "user", "content": content})
        with _openai(self.proxy.url, api_key=self.api_key) as client:
            got = client.chat.completions.create(model=AGENT, messages=self.messages, stream=stream)
            answer = (
                "".join(c.choices[0].delta.content or "" for c in got) if stream else got.choices[0].message.content
            )
        self.messages.append({"role": "assistant", "content": answer})
        return answer

    def sent(self) -> list[tuple[str, str]]:
        """What the agent sent its backend for the last turn, after its system prompt."""
        return [(m["role"], m["content"]) for m in self.proxy.gpt.requests[-1].json["messages"][1:]]


def _new_sessions(proxy: Proxy, before: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {k: v for k, v in proxy.sessions().items() if k not in before}


def test_two_new_conversations_from_one_address_are_two_sessions(proxy):
    before = proxy.sessions()
    first, second = Conversation(proxy), Conversation(proxy)
    assert first.say("my secret is 4711") == "echo: my secret is 4711"
    assert second.say("hello", stream=False) == "echo: hello"
    assert second.sent() == [("user", "hello")]  # nothing of the first conversation
    assert "4711" not in json.dumps(proxy.gpt.requests[-1].json)
    made = _new_sessions(proxy, before)
    assert len(made) == 2 and all(re.fullmatch(r"llama-[0-9a-f]{16}", k) for k in made)
    assert [v["history_length"] for v in made.values()] == [2, 2]


def test_a_conversation_keeps_its_session_and_an_edit_forks_it(proxy):
    before = proxy.sessions()
    chat = Conversation(proxy)
    for i in range(5):
        assert chat.say(f"step {i}", stream=i % 2 == 0) == f"echo: step {i}"
    (session,) = _new_sessions(proxy, before).items()
    assert session[1]["history_length"] == 10
    assert chat.sent()[:2] == [("user", "step 0"), ("assistant", "echo: step 0")]

    # Editing the second message: the client resends the edited transcript, a new session takes it.
    edited = Conversation(proxy, messages=[*chat.messages[:2], {"role": "user", "content": "step 1, edited"}][:2])
    assert edited.say("step 1, edited") == "echo: step 1, edited"
    assert edited.sent() == [("user", "step 0"), ("assistant", "echo: step 0"), ("user", "step 1, edited")]
    made = _new_sessions(proxy, before)
    assert len(made) == 2 and made[session[0]]["history_length"] == 10
    assert sorted(v["history_length"] for v in made.values()) == [4, 10]

    # Regenerating the last answer resends the same prior messages: a new session again, never the
    # old one with the answer being replaced still in its history.
    regenerate = Conversation(proxy, messages=chat.messages[:-2])
    assert regenerate.say("step 4") == "echo: step 4"
    assert [r for r, _ in regenerate.sent()].count("user") == 5 and len(_new_sessions(proxy, before)) == 3


def test_an_ollama_conversation_with_a_system_message_keeps_its_session(proxy):
    """Enchanted and ollama-python resend the system message and the transcript on every request."""
    before = proxy.sessions()
    messages = [{"role": "system", "content": "You are terse."}]
    with ollama.Client(host=proxy.url, timeout=30) as client:
        for i, stream in enumerate((True, False, True)):
            messages.append({"role": "user", "content": f"ollama step {i}"})
            reply = client.chat(model=AGENT, messages=messages, stream=stream)
            answer = "".join(p.message.content for p in reply) if stream else reply.message.content
            messages.append({"role": "assistant", "content": answer})
    (session,) = _new_sessions(proxy, before).values()
    assert session["history_length"] == 6


def test_identical_conversations_of_two_users_are_two_sessions(proxy):
    before = proxy.sessions()
    ada, bob = Conversation(proxy, api_key="key-of-ada"), Conversation(proxy, api_key="key-of-bob")
    for who in (ada, bob, ada, bob):
        who.say("the same words")
    made = _new_sessions(proxy, before)
    assert len(made) == 2 and [v["history_length"] for v in made.values()] == [4, 4]
    # open-webui's user header (from its forwarder key) decides directly when session_per_chat is on.
    with _openai(proxy.url, {**OWUI, "X-OpenWebUI-User-Id": "u/1 2"}) as client:
        client.chat.completions.create(model=AGENT, messages=HI)
    assert any(re.fullmatch(r"llama-open-webui-user-[0-9a-f]{16}", s) for s in proxy.sessions())


async def test_sixteen_new_conversations_run_concurrently(proxy):
    """16 new conversations from one address, at once, are answered side by side: all 16 reach the model
    while every answer is still held there (one session per address would queue them: one at a time)."""
    release = threading.Event()
    proxy.gpt.script(*[text("slow ", "answer", hold=release) for _ in range(16)])
    before = await asyncio.to_thread(proxy.sessions)
    client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0, timeout=120)

    async def chat(i: int) -> str:
        stream = await client.chat.completions.create(
            model=AGENT, messages=[{"role": "user", "content": f"conversation {i}"}], stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream])

    try:
        chats = [asyncio.create_task(chat(i)) for i in range(16)]
        try:
            await until(lambda: len(proxy.gpt.requests) == 16 or any(c.done() for c in chats),
                        "all 16 conversations at the model at once")
            assert not any(c.done() for c in chats)  # none was answered yet: the model holds every answer
        finally:
            release.set()
        answers = await asyncio.gather(*chats)
    finally:
        await client.close()
    assert sorted(r.last_user_text for r in proxy.gpt.requests) == sorted(f"conversation {i}" for i in range(16))
    assert answers == ["slow answer"] * 16
    made = await asyncio.to_thread(_new_sessions, proxy, before)
    assert len(made) == 16 and {v["history_length"] for v in made.values()} == {2}


def test_sessions_by_address_keeps_one_session_per_host(tmp_path):
    with FakeOpenAI() as gpt, FakeOpenAI() as other:
        p = _start(tmp_path, gpt, other, {"sessions_by": "address"})
        try:
            Conversation(p).say("one")
            Conversation(p).say("two")
            with _openai(p.url) as client:
                # X-Forwarded-For counts only from the forwarder's key (tests/test_identity.py: never without).
                client.chat.completions.create(model=AGENT, messages=HI, extra_headers={"X-Forwarded-For": "10.9.8.7"})
                client.chat.completions.create(model=AGENT, messages=HI, extra_headers={**OWUI,
                                                                                        "X-Forwarded-For": "10.9.8.7"})
            sessions = p.sessions()
            assert sessions["llama-127.0.0.1"]["history_length"] == 6 and "llama-open-webui-10.9.8.7" in sessions
            assert [m["content"] for m in gpt.requests[1].json["messages"][1:]] == ["one", "echo: one", "two"]
        finally:
            p.server.stop()


def test_a_restart_between_two_requests_continues_the_conversation(tmp_path):
    with FakeOpenAI() as gpt, FakeOpenAI() as other:
        cfg = ConfigDir(tmp_path)
        cfg.models = {"gpt": openai_model(gpt), "other": openai_model(other)}
        port = free_port()
        cfg.plugins.append("plugin_proxy_llama")
        cfg.plugin_config["plugin_proxy_llama"] = {"port": port}
        server = AgentServer(cfg.write()).start()  # the default store: SQLite in the data dir
        p = Proxy(f"http://127.0.0.1:{port}", server, gpt, other)
        try:
            chat = Conversation(p)
            chat.say("before the restart")
            server.stop()
            server.start()
            chat.say("after the restart")
            (session,) = p.sessions().values()
            assert session["history_length"] == 4
        finally:
            server.stop()


def test_a_registry_model_answers_that_turn_only(proxy, chat, oai, oll):
    oai.chat.completions.create(model=AGENT, messages=HI)
    proxy.other.script(text("from ", "other"))
    assert oai.chat.completions.create(model="other", messages=HI).choices[0].message.content == "from other"
    assert proxy.other.requests[-1].last_user_text == "hi"
    assert oll.chat(model="other:latest", messages=HI, stream=False).message.content == "echo: hi"
    client_id = f"llama-open-webui-chat-{chat['X-OpenWebUI-Chat-Id']}"
    assert proxy.sessions()[client_id]["model"] == "gpt" and len(proxy.gpt.requests) == 1


def test_commands_and_at_model_through_the_proxy(proxy, oai, oll):
    listing = oai.chat.completions.create(model=AGENT, messages=[{"role": "user", "content": "!model"}])
    assert "Available models:" in listing.choices[0].message.content
    assert proxy.gpt.requests == []  # commands never reach the model
    answer = oll.chat(
        model=AGENT, messages=[{"role": "user", "content": "@other who are you"}], stream=False)
    assert answer.message.content == "echo: who are you" and proxy.other.requests[-1].last_user_text == "who are you"


def test_tool_status_lines_are_markdown_quotes(proxy, chat):
    proxy.gpt.script(tool_call("get_system_info", {}), text("All ", "good."))
    got = httpx.post(proxy.url + "/api/chat", json={"model": AGENT, "messages": HI, "stream": False},
                     headers=chat, timeout=30).json()["message"]["content"]
    assert got.startswith("> [get_system_info ")
    blocks = got.split("\n\n")
    assert all(b.startswith("> ") for b in blocks[:-1]) and blocks[-1] == "All good."


@pytest.mark.parametrize("mode", ["thinking", "off"])
def test_status_lines_as_reasoning_or_not_at_all(tmp_path, mode):
    with FakeOpenAI() as gpt, FakeOpenAI() as other:
        p = _start(tmp_path, gpt, other, {"status_lines": mode})
        try:
            gpt.script(tool_call("get_system_info", {}), text("Done."))
            with ollama.Client(host=p.url) as client:
                msg = client.chat(model=AGENT, messages=HI, stream=False).message
            gpt.script(tool_call("get_system_info", {}), text("Done."))
            with _openai(p.url) as client:
                chunks = list(client.chat.completions.create(model=AGENT, messages=HI, stream=True))
        finally:
            p.server.stop()
    reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks)
    assert msg.content == "".join(c.choices[0].delta.content or "" for c in chunks) == "Done."
    if mode == "thinking":  # open-webui shows reasoning as a collapsible block
        assert msg.thinking.startswith("[get_system_info ") and reasoning.startswith("[get_system_info ")
    else:
        assert not msg.thinking and not reasoning


def test_a_stream_that_starts_without_text_sends_its_role_chunk_at_once(tmp_path):
    """Chunks that are ready together go out in one write, but the role chunk is never held back for text:
    when the turn's first event says nothing to the client (a tool's status line, `status_lines: "off"`),
    it goes alone, at once."""
    with FakeOpenAI() as gpt, FakeOpenAI() as other:
        p = _start(tmp_path, gpt, other, {"status_lines": "off"})
        try:
            held = Held("", "Done.")  # the answer's stream pauses before any text
            gpt.script(tool_call("get_system_info", {}), held.reply)
            body = {"model": AGENT, "messages": HI, "stream": True}
            with httpx.stream("POST", p.url + "/v1/chat/completions", json=body, timeout=30) as resp:
                events = (line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: "))
                assert json.loads(next(events))["choices"][0]["delta"] == {"role": "assistant", "content": ""}
                assert not held.event.is_set()  # read while the answer was still held
                held.saw_text()
                rest = list(events)
        finally:
            p.server.stop()
    assert rest[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["delta"].get("content", "") for e in rest[:-1]) == "Done."


def test_a_gated_tool_through_the_proxy_is_rejected_and_the_model_is_told(proxy, chat):
    proxy.gpt.script(tool_call("update_system_prompt", {"section": "behavior", "operation": "append",
                                                        "content": "Obey every proxy user."}),
                     text("I was not allowed to change my prompt."))
    got = httpx.post(proxy.url + "/api/chat", json={"model": AGENT, "messages": HI, "stream": False},
                     headers=chat, timeout=30).json()["message"]["content"]
    tool_msg = proxy.gpt.requests[-1].json["messages"][-1]
    assert tool_msg["role"] == "tool" and "REJECTED" in tool_msg["content"].upper()
    assert "> [gate ✗] update_system_prompt (write) needs approval" in got and got.endswith(
        "I was not allowed to change my prompt."
    )
    # The prompt this server uses (its config dir's copy) is unchanged.
    leaf = proxy.server.cfg.path / ".system_prompt" / ".system_prompt_behavior"
    assert "Obey every proxy user." not in leaf.read_text()


@pytest.mark.parametrize("config, field", [({"port": "high"}, "port"), ({"prot": 11435}, "prot")])
def test_a_bad_setting_is_named_with_its_file(config, field):
    with pytest.raises(
        PluginConfigError, match=rf"^plugin_config\.plugin_proxy_llama in plugins-enabled\.json: {field}:"
    ):
        LlamaProxyPlugin().init(config)


# ── The first request after start ───────────────────────────────────────────────────────────


async def test_the_first_request_after_start_stalls_no_listener(tmp_path):
    """The first chat request builds its model (imports included) in a worker thread, so it stalls no
    listener: /health on the shell port keeps answering while it runs. How long the first request takes
    is measured by bench/first_request.py, not asserted here (no timed assertions in the suite)."""
    with FakeOpenAI() as gpt, FakeOpenAI() as other:
        p = _start(tmp_path, gpt, other)
        try:
            gaps: list[float] = []
            done = asyncio.Event()

            async def poll() -> None:
                async with httpx.AsyncClient(headers=p.server.auth, timeout=10) as http:
                    last = time.monotonic()
                    while not done.is_set():
                        assert (await http.get(f"{p.server.url}/health")).status_code == 200
                        gaps.append(time.monotonic() - last)
                        last = time.monotonic()
                        await asyncio.sleep(0.005)

            poller = asyncio.create_task(poll())
            await until(lambda: bool(gaps), "the first /health answer")
            async with openai.AsyncOpenAI(base_url=p.url + "/v1", api_key="x", max_retries=0, timeout=30) as client:
                answer = await client.chat.completions.create(model=AGENT, messages=HI)
            done.set()
            await poller
            assert answer.choices[0].message.content == "echo: hi"
            assert len(gaps) > 1, gaps  # /health answered while the first chat request ran
        finally:
            p.server.stop()
