"""Who a request is, proven: hostile tests of forwarded headers, per-user proxy keys, transcript
replay and the API's key, against real agent-mcp servers driven by the real openai and ollama
clients, api_client.AgentClient and raw httpx.

The keyed proxy knows three keys: alice's, bob's and open-webui's (a forwarder, trusted from
127.0.0.1). The strict proxy trusts its forwarder only from 10.0.0.0/8, so from here its headers
must not count; it lets keyless callers in as anonymous ones.
"""

from __future__ import annotations

import json
import os
import stat
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import ollama
import openai
import pytest

import api_client
from api_client import AgentAuthError, AgentClient
from plugins._proxy_identity import key_digest
from tests.conftest import AgentServer, ConfigDir, free_port, openai_model
from tests.fakes.openai_backend import FakeOpenAI
from tests.waiting import within_sync

pytestmark = pytest.mark.slow

AGENT = "agent-mcp:latest"
ALICE, BOB, OWUI = "alice-key-identity-0001", "bob-key-identity-0002", "owui-key-identity-0003"
KEYS = {key_digest(ALICE): "alice", key_digest(BOB): "bob", key_digest(OWUI): "open-webui"}


@dataclass
class Proxy:
    url: str
    server: AgentServer
    gpt: FakeOpenAI

    def sessions(self) -> dict[str, dict[str, Any]]:
        rows = httpx.get(f"{self.server.url}/sessions", headers=self.server.auth, timeout=5).json()["sessions"]
        return {r["client_id"]: r for r in rows}

    def chat(self, key: str, messages: list[dict[str, str]], headers: dict[str, str] | None = None,
             stream: bool = True) -> str:
        with openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=30,
                           default_headers=headers) as client:
            got = client.chat.completions.create(model=AGENT, messages=messages, stream=stream)
            return "".join(c.choices[0].delta.content or "" for c in got) if stream else got.choices[0].message.content

    def sent(self) -> list[str]:
        """The texts the agent sent its backend in the last model call, after the system prompt."""
        return [m["content"] for m in self.gpt.requests[-1].json["messages"][1:]]


def _proxy(tmp: Any, gpt: FakeOpenAI, settings: dict[str, Any]) -> Proxy:
    cfg = ConfigDir(tmp)
    cfg.models = {"gpt": openai_model(gpt)}
    port = free_port()
    cfg.plugins.append("plugin_proxy_llama")
    cfg.plugin_config["plugin_proxy_llama"] = {"port": port, **settings}
    server = AgentServer(cfg.write(), {"SESSION_STORE": "memory"}).start()
    return Proxy(f"http://127.0.0.1:{port}", server, gpt)


@pytest.fixture(scope="module")
def keyed(tmp_path_factory) -> Iterator[Proxy]:
    with FakeOpenAI() as gpt:
        p = _proxy(tmp_path_factory.mktemp("keyed"), gpt, {
            "user_keys": KEYS, "forwarders": ["open-webui"], "trusted_proxies": ["127.0.0.1"]})
        try:
            yield p
        finally:
            out = p.server.stop()
            for key in (ALICE, BOB, OWUI):
                assert key not in out
            assert "Traceback" not in out, out[-3000:]


@pytest.fixture(scope="module")
def strict(tmp_path_factory) -> Iterator[Proxy]:
    with FakeOpenAI() as gpt:
        p = _proxy(tmp_path_factory.mktemp("strict"), gpt, {
            "user_keys": KEYS, "forwarders": ["open-webui"], "trusted_proxies": ["10.0.0.0/8"],
            "keys_required": False})
        try:
            yield p
        finally:
            p.server.stop()


def _log_lines(p: Proxy, *words: str) -> list[str]:
    """The server's log lines holding every one of `words`, once the line of the last request is read
    (the server logs it before answering; the pipe is read by a thread)."""
    marker = uuid.uuid4().hex
    httpx.get(f"{p.server.url}/mark-{marker}", timeout=5)  # refused without a token: the guard logs one line
    within_sync(lambda: any(marker in ln for ln in p.server._lines), 10)
    return [ln for ln in "".join(p.server._lines).splitlines() if all(w in ln for w in words)]


# ── Keys ────────────────────────────────────────────────────────────────────────────────────


def test_a_proxy_with_user_keys_refuses_every_request_without_one(keyed):
    with pytest.raises(openai.AuthenticationError, match="user_keys"):
        keyed.chat("not-a-key", [{"role": "user", "content": "hi"}])
    with ollama.Client(host=keyed.url, timeout=10) as anon, pytest.raises(ollama.ResponseError) as denied:
        anon.chat(model=AGENT, messages=[{"role": "user", "content": "hi"}], stream=False)
    assert denied.value.status_code == 401
    for path in ("/", "/api/tags", "/v1/models", "/nope"):
        assert httpx.get(keyed.url + path, timeout=10).status_code == 401, path
    # A key's digest is no key.
    assert httpx.get(keyed.url + "/api/tags", headers={"Authorization": f"Bearer {key_digest(ALICE)}"},
                     timeout=10).status_code == 401
    with ollama.Client(host=keyed.url, timeout=10, headers={"Authorization": f"Bearer {BOB}"}) as bob:
        assert bob.chat(model=AGENT, messages=[{"role": "user", "content": "hi"}], stream=False).message.content \
            == "echo: hi"


def test_bad_identity_settings_are_refused_with_the_field_named(tmp_path):
    from plugin_api import PluginConfigError
    from plugins.plugin_proxy_llama import LlamaProxyPlugin

    for settings, words in (({"user_keys": {ALICE: "alice"}}, "sha256:"),
                            ({"user_keys": KEYS, "forwarders": ["carol"], "trusted_proxies": ["127.0.0.1"]}, "carol"),
                            ({"user_keys": KEYS, "forwarders": ["open-webui"]}, "trusted_proxies"),
                            ({"trusted_proxies": ["localhost"]}, "not an address")):
        with pytest.raises(PluginConfigError, match=words):
            LlamaProxyPlugin().init(settings)


# ── Forwarded headers ───────────────────────────────────────────────────────────────────────


def test_forwarded_headers_with_a_non_forwarder_key_are_ignored(keyed):
    chat, user = uuid.uuid4().hex, "victim-" + uuid.uuid4().hex[:6]
    victim = {"X-OpenWebUI-Chat-Id": chat, "X-OpenWebUI-User-Id": user}
    assert keyed.chat(OWUI, [{"role": "user", "content": "my pin is 4711"}], victim) == "echo: my pin is 4711"
    victim_id = f"llama-open-webui-user-{user}-chat-{chat}"
    assert keyed.sessions()[victim_id]["history_length"] == 2
    # Alice sends the victim's headers (and a made-up address): she lands in a session of her own.
    for n in range(2):
        keyed.chat(ALICE, [{"role": "user", "content": f"what is my pin? {n}"}],
                   {**victim, "X-Forwarded-For": "10.1.2.3"})
        assert "my pin is 4711" not in keyed.sent() and "echo: my pin is 4711" not in keyed.sent()
    assert keyed.sessions()[victim_id]["history_length"] == 2
    assert not [s for s in keyed.sessions() if "10.1.2.3" in s or (user in s and s != victim_id)]
    # `!reset` through the victim's headers resets nothing of the victim's.
    keyed.chat(ALICE, [{"role": "user", "content": "!reset"}], victim)
    assert keyed.sessions()[victim_id]["history_length"] == 2
    lines = _log_lines(keyed, "ignored forwarded headers", "no forwarder key")
    assert len(lines) == 1, lines  # once per source, not per request
    assert "from 127.0.0.1" in lines[0] and "x-openwebui-chat-id" in lines[0]


def test_forwarded_headers_from_an_address_not_trusted_are_ignored(strict):
    chat = uuid.uuid4().hex
    for n in range(3):
        strict.chat(OWUI, [{"role": "user", "content": f"in chat {n}"}],
                    {"X-OpenWebUI-Chat-Id": chat, "X-OpenWebUI-User-Id": "u1", "X-Forwarded-For": "10.0.0.9"})
    sessions = strict.sessions()
    assert not [s for s in sessions if chat in s or "u1" in s or "10.0.0.9" in s], sessions
    lines = _log_lines(strict, "ignored forwarded headers", "an address not in trusted_proxies")
    assert len(lines) == 1 and "x-openwebui-chat-id" in lines[0], lines


def test_x_forwarded_for_from_an_anonymous_caller_is_not_its_address(strict):
    """uvicorn's own proxy-headers handling is off: the address is the TCP peer's."""
    with openai.OpenAI(base_url=strict.url + "/v1", api_key="anything", max_retries=0, timeout=30) as client:
        client.chat.completions.create(model=AGENT, messages=[{"role": "user", "content": "where am I"}],
                                       extra_headers={"X-Forwarded-For": "192.0.2.77", "X-Real-IP": "192.0.2.77"})
    assert not [s for s in strict.sessions() if "192.0.2.77" in s]


# ── Replay ──────────────────────────────────────────────────────────────────────────────────


def test_a_replayed_transcript_never_continues_another_users_session(keyed):
    before = set(keyed.sessions())
    alice = [{"role": "user", "content": "alice's secret is " + uuid.uuid4().hex[:8]}]
    alice.append({"role": "assistant", "content": keyed.chat(ALICE, alice)})
    (alice_id,) = set(keyed.sessions()) - before
    # Bob replays Alice's transcript exactly (with her forwarded identity claimed too).
    replay = [*alice, {"role": "user", "content": "and what did I say?"}]
    keyed.chat(BOB, replay, {"X-OpenWebUI-User-Id": "alice", "X-Forwarded-For": "127.0.0.1"})
    assert keyed.sessions()[alice_id]["history_length"] == 2  # untouched
    (bob_id,) = set(keyed.sessions()) - before - {alice_id}
    assert keyed.sessions()[bob_id]["history_length"] == 4  # a new session, seeded with what Bob sent
    # An anonymous replay is refused outright here; Alice herself continues her own session.
    with pytest.raises(openai.AuthenticationError):
        keyed.chat("unused", replay)
    keyed.chat(ALICE, replay)
    assert keyed.sessions()[alice_id]["history_length"] == 4


def test_an_anonymous_replay_of_a_keyed_users_transcript_starts_afresh(strict):
    before = set(strict.sessions())
    alice = [{"role": "user", "content": "alice only " + uuid.uuid4().hex[:8]}]
    alice.append({"role": "assistant", "content": strict.chat(ALICE, alice)})
    (alice_id,) = set(strict.sessions()) - before
    strict.chat("unused", [*alice, {"role": "user", "content": "go on"}],
                {"X-OpenWebUI-User-Id": "alice", "X-Forwarded-For": "127.0.0.1"})
    assert strict.sessions()[alice_id]["history_length"] == 2
    strict.chat(ALICE, [*alice, {"role": "user", "content": "go on"}])
    assert strict.sessions()[alice_id]["history_length"] == 4


# ── The API's key ───────────────────────────────────────────────────────────────────────────


def _api_server(tmp: Any, gpt: FakeOpenAI) -> tuple[AgentServer, str]:
    cfg = ConfigDir(tmp)
    cfg.models = {"gpt": openai_model(gpt)}
    port = free_port()
    cfg.plugins.append("plugin_client_api")
    cfg.plugin_config["plugin_client_api"] = {"port": port}
    return AgentServer(cfg.write(), {"SESSION_STORE": "memory"}), f"http://127.0.0.1:{port}"


async def test_the_api_without_its_key_is_refused_and_the_key_file_is_private(tmp_path, monkeypatch):
    with FakeOpenAI() as gpt:
        server, url = _api_server(tmp_path, gpt)
        server.start()
        try:
            path = server.data_dir / "api-key"
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
            async with httpx.AsyncClient(timeout=10) as http:
                for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer"}):
                    for method, route in (("POST", "/api/v1/submit"), ("GET", "/api/v1/sessions"),
                                          ("POST", "/api/v1/gate/g1"), ("GET", "/api/v1/health")):
                        got = await http.request(method, url + route, content=json.dumps({"text": "hi", "approve": 1}),
                                                 headers={**headers, "Content-Type": "application/json"})
                        assert got.status_code == 401, (method, route, got.text)
                        assert "<data dir>/api-key" in got.json()["error"]
            assert gpt.requests == []  # nothing reached the model
            # AgentClient reads the key file by itself (AGENT_DATA_DIR says where the server keeps it).
            monkeypatch.setenv("AGENT_DATA_DIR", str(server.data_dir))
            assert await AgentClient(url).send("hi") == "echo: hi"
            monkeypatch.setenv("AGENT_DATA_DIR", str(tmp_path / "elsewhere"))
            with pytest.raises(AgentAuthError, match="does not exist"):
                await AgentClient(url).send("hi")
            monkeypatch.delenv("AGENT_DATA_DIR")  # the server started below inherits the environment
        finally:
            server.stop()
        # A key file others may read is refused at start, with the path and the fix: the API stays closed.
        os.chmod(path, 0o640)
        server.start()
        try:
            async with httpx.AsyncClient(timeout=5) as http:
                with pytest.raises(httpx.ConnectError):
                        await http.get(url + "/api/v1/health")
        finally:
            out = server.stop()
        assert f"chmod 600 {path}" in out and "Traceback" not in out, out


async def test_a_call_to_another_agent_never_carries_this_servers_key(tmp_path, monkeypatch):
    """`api_key=""` (what agent_call passes without a token of the target's) sends no key at all."""
    (tmp_path / "api-key").write_text("this-servers-own-key\n")
    os.chmod(tmp_path / "api-key", 0o600)
    monkeypatch.setenv("AGENT_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("API_KEY", raising=False)
    seen: list[str | None] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization"))
        return httpx.Response(200, json={"status": "ok", "sessions": 0, "models": []})

    for key in ("", None):
        await AgentClient("http://other.example", api_key=key, transport=httpx.MockTransport(answer)).health()
    assert seen == [None, "Bearer this-servers-own-key"]
    assert api_client.default_key_file({"AGENT_DATA_DIR": str(tmp_path)}) == tmp_path / "api-key"
