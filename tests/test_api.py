"""plugin_client_api over real HTTP, driven by api_client.AgentClient, raw httpx and shell.py's client.

One agent-mcp subprocess (API endpoint with API_KEY and an admin key, shell endpoint, a plugin
with a gated tool, API_GATE_TIMEOUT=1) runs against a fake OpenAI backend for the whole module;
each test uses client ids of its own.
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from httpx_sse import aconnect_sse

from api_client import (
    AgentAuthError,
    AgentCancelled,
    AgentClient,
    AgentError,
    AgentRequestError,
    AgentTimeout,
    SyncAgentClient,
    gate_decision,
)
from plugins import _http
from shell_client import ShellClient
from tests.conftest import AgentServer, ConfigDir, free_port, one_tool_plugin, openai_model
from tests.fakes.backend import error, malformed, text, tool_call
from tests.fakes.openai_backend import FakeOpenAI
from tests.waiting import until

pytestmark = pytest.mark.slow

KEY = "api-key-0123456789"
ADMIN = "admin-key-9876543210"
AUTH = {"Authorization": f"Bearer {KEY}"}
ADMIN_AUTH = {**AUTH, "X-Admin-Key": ADMIN}
JSON = {"Content-Type": "application/json"}

TOOLS_PLUGIN = one_tool_plugin("plugin_test_tools", "secret_lookup", "key", 'f"the secret of {key} is 42"',
                               {"type": "vault", "operation": "read"}, "Look up a secret.")


@dataclass
class Api:
    url: str
    shell_url: str
    server: AgentServer
    gpt: FakeOpenAI

    def client(self, **kwargs: Any) -> AgentClient:
        kwargs.setdefault("api_key", KEY)
        return AgentClient(self.url, f"api-{uuid.uuid4().hex[:8]}", **kwargs)

    def sessions(self, headers: dict[str, str] = ADMIN_AUTH) -> dict[str, dict[str, Any]]:
        rows = httpx.get(f"{self.url}/api/v1/sessions", headers=headers, timeout=5).json()["sessions"]
        return {r["client_id"]: r for r in rows}


@pytest.fixture(scope="module")
def api(tmp_path_factory) -> Iterator[Api]:
    with FakeOpenAI() as gpt:
        cfg = ConfigDir(tmp_path_factory.mktemp("api"))
        cfg.models = {"gpt": openai_model(gpt)}
        port = free_port()
        cfg.plugins.append("plugin_client_api")
        cfg.plugin_config["plugin_client_api"] = {"port": port}
        cfg.add_plugin("plugin_test_tools", TOOLS_PLUGIN)
        cfg.env = {"API_KEY": KEY, "API_ADMIN_KEY": ADMIN, "API_GATE_TIMEOUT": "1"}
        server = AgentServer(cfg.write(), {"SESSION_STORE": "memory"}).start()
        try:
            yield Api(f"http://127.0.0.1:{port}", server.url, server, gpt)
        finally:
            server.stop()


@pytest.fixture(autouse=True)
def _fresh_backend(request) -> None:
    if "api" in request.fixturenames:
        request.getfixturevalue("api").gpt.reset()


async def _post(api: Api, path: str, body: Any = None, headers: dict[str, str] = AUTH, **kw: Any) -> httpx.Response:
    async with httpx.AsyncClient(base_url=api.url, headers=headers, timeout=30) as http:
        if body is None or isinstance(body, bytes | str):  # raw bytes, labelled JSON as every client does
            return await http.post(path, content=body, headers=JSON, **kw)
        return await http.post(path, json=body, **kw)


def _tool_results(backend: FakeOpenAI) -> list[str]:
    return [m["content"] for m in backend.requests[-1].json["messages"] if m["role"] == "tool"]


# ── auth ────────────────────────────────────────────────────────────────────────────────────


ENDPOINTS = [  # method, path, body, status with the right key
    ("POST", "/api/v1/submit", {"text": "!help", "wait": True}, 200),
    ("GET", "/api/v1/stream/api-auth", None, 200),
    ("POST", "/api/v1/gate/nope", {"approve": True}, 404),
    ("GET", "/api/v1/sessions", None, 200),
    ("GET", "/api/v1/health", None, 200),
    ("DELETE", "/api/v1/session/api-nobody", None, 404),
    ("POST", "/api/v1/stop", {"client_id": "api-nobody"}, 200),
    ("GET", "/no/such/path", None, 404),
]


async def test_every_endpoint_needs_the_key(api) -> None:
    async with httpx.AsyncClient(base_url=api.url, timeout=10) as http:
        for method, path, body, expected in ENDPOINTS:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                            {"X-Admin-Key": ADMIN}):
                r = await http.request(method, path, json=body, headers=headers)
                assert r.status_code == 401, (method, path, headers, r.text)
                assert "Bearer" in r.json()["error"]
            if path.startswith("/api/v1/stream/"):
                async with http.stream(method, path, headers=AUTH) as r:
                    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
                continue
            r = await http.request(method, path, json=body, headers=AUTH)
            assert r.status_code == expected, (method, path, r.text)
    with pytest.raises(AgentAuthError, match="refused the credentials"):
        await api.client(api_key="wrong").send("hello")
    with pytest.raises(AgentAuthError):
        await AgentClient(api.url).health()
    assert (await api.client().health())["status"] == "ok"


# ── wait: true ──────────────────────────────────────────────────────────────────────────────


async def test_wait_complete_error_and_timeout_with_partial_text(api) -> None:
    cid = f"api-wait-{uuid.uuid4().hex[:6]}"
    api.gpt.script(text("Hello ", "there."))
    r = await _post(api, "/api/v1/submit", {"client_id": cid, "text": "hi", "wait": True})
    assert r.status_code == 200 and r.json() == {"client_id": cid, "status": "complete", "text": "Hello there."}

    api.gpt.script(error(500, "backend exploded"))
    body = (await _post(api, "/api/v1/submit", {"client_id": cid, "text": "again", "wait": True})).json()
    assert body["status"] == "error" and "HTTP 500" in body["error"] and "backend exploded" in body["error"]
    assert body["text"] == body["error"] and body["partial"] == ""  # the message in `text`, as the original
    assert "127.0.0.1" not in body["error"]  # API users are not told where the backends live

    release = threading.Event()
    api.gpt.script(text("partial ", "rest", hold=release))
    try:
        body = (await _post(api, "/api/v1/submit",
                            {"client_id": cid, "text": "slow", "wait": True, "timeout": 1})).json()
    finally:
        release.set()
    assert body == {"client_id": cid, "status": "timeout", "text": "partial "}
    # Only the completed turn is in the history: the failed and the timed-out one were rolled back.
    assert api.sessions()[cid]["history_length"] == 2


async def test_wait_cancelled_by_a_newer_message(api) -> None:
    cid = f"api-cancel-{uuid.uuid4().hex[:6]}"
    release = threading.Event()
    api.gpt.script(text("first ", "answer", hold=release), text("second answer"))
    try:
        async with httpx.AsyncClient(base_url=api.url, headers=AUTH, timeout=30) as http:
            waiting = asyncio.ensure_future(
                http.post("/api/v1/submit", json={"client_id": cid, "text": "one", "wait": True}))
            # Last-Event-ID 0: everything this new session has sent, however early the stream connects.
            async with http.stream("GET", f"/api/v1/stream/{cid}", headers={"Last-Event-ID": "0"}) as stream:
                async for line in stream.aiter_lines():  # the first turn is streaming
                    if line.startswith("event: tok"):
                        break
            newer = await http.post("/api/v1/submit", json={"client_id": cid, "text": "two", "wait": True})
            first = (await waiting).json()
    finally:
        release.set()
    assert newer.json() == {"client_id": cid, "status": "complete", "text": "second answer"}
    assert first == {"client_id": cid, "status": "cancelled", "text": "first "}


# ── AgentClient ─────────────────────────────────────────────────────────────────────────────


async def test_send_returns_the_whole_turn_not_the_first_round(api) -> None:
    client = api.client()
    api.gpt.script(tool_call("get_system_info", {}, text_before="Let me check. "), text("It is ", "noon."))
    assert await client.send("what time is it?") == "Let me check. It is noon."
    # Events of an earlier request that nobody streamed (its `done` included) do not end the next send().
    r = await _post(api, "/api/v1/submit", {"client_id": client.client_id, "text": "!model"})
    assert r.json()["status"] == "accepted" and r.json()["turn_id"] and isinstance(r.json()["after"], int)
    api.gpt.script(text("fresh ", "answer"))
    assert await client.send("next") == "fresh answer"
    pieces = []
    api.gpt.script(text("one ", "two ", "three"))
    async for piece in client.stream("count"):
        pieces.append(piece)
    assert "".join(pieces) == "one two three" and len(pieces) >= 2


async def test_a_reference_style_client_reads_the_plain_stream(api) -> None:
    """Submit without waiting, then read `/stream/{id}` up to the first `done`, as the reference client did."""
    cid = f"api-ref-{uuid.uuid4().hex[:6]}"
    api.gpt.script(tool_call("get_system_info", {}), text("All ", "fine."))
    async with httpx.AsyncClient(base_url=api.url, headers=AUTH, timeout=30) as http:
        r = await http.post("/api/v1/submit", json={"client_id": cid, "text": "status?", "wait": False})
        assert r.json()["status"] == "accepted"
        events = []
        async with aconnect_sse(http, "GET", f"/api/v1/stream/{cid}") as source:
            async for sse in source.aiter_sse():
                events.append(sse)
                if sse.event == "done":
                    break
    assert all(e.id.isdigit() for e in events) and [e.event for e in events].count("done") == 1
    assert "".join(json.loads(e.data)["text"] for e in events if e.event == "tok") == "All fine."
    assert any(e.event == "status" and "[get_system_info ◀]" in json.loads(e.data)["text"] for e in events)


class OriginalStyleClient:
    """A client written the way the original project's `api_client.py` is (its shapes, not its code):
    a new HTTP client per call, a hand-rolled SSE line parser that ends at the first `done`, a
    synchronous `send` that raises with the `text` of an error, `stop`, `sessions`."""

    def __init__(self, url: str, client_id: str):
        self.url, self.client_id, self.headers = url, client_id, dict(AUTH)

    async def stream(self, text_: str) -> list[str]:
        async with httpx.AsyncClient(headers=self.headers, timeout=10) as http:
            (await http.post(f"{self.url}/api/v1/submit", json={"client_id": self.client_id, "text": text_,
                                                                 "wait": False})).raise_for_status()
        tokens, event, data = [], "message", []
        async with httpx.AsyncClient(headers={**self.headers, "Accept": "text/event-stream"}, timeout=30) as http:
            async with http.stream("GET", f"{self.url}/api/v1/stream/{self.client_id}") as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("event:"):
                        event = line[6:].strip()
                    elif line.startswith("data:"):
                        data.append(line[5:].strip())
                    elif line == "":
                        raw, data = "\n".join(data), []
                        if event in ("", "message", "tok"):
                            tokens.append(json.loads(raw).get("text", ""))
                        elif event == "done":
                            return tokens
                        elif event == "error":
                            raise RuntimeError(f"Agent error: {json.loads(raw).get('message', raw)}")
                        event = "message"
        return tokens

    async def send(self, text_: str) -> str:
        async with httpx.AsyncClient(headers=self.headers, timeout=30) as http:
            body = (await http.post(f"{self.url}/api/v1/submit", json={"client_id": self.client_id, "text": text_,
                                                                       "wait": True, "timeout": 30})).json()
        if body["status"] == "error":
            raise RuntimeError(f"Agent error: {body['text']}")
        return body["text"]

    async def stop(self) -> dict[str, Any]:
        async with httpx.AsyncClient(headers=self.headers, timeout=10) as http:
            resp = await http.post(f"{self.url}/api/v1/stop", json={"client_id": self.client_id})
            resp.raise_for_status()
            return resp.json()

    async def sessions(self) -> list[dict[str, Any]]:
        async with httpx.AsyncClient(headers=self.headers, timeout=10) as http:
            return (await http.get(f"{self.url}/api/v1/sessions")).json()["sessions"]


async def test_a_client_written_like_the_originals_works_unmodified(api) -> None:
    client = OriginalStyleClient(api.url, f"api-orig-{uuid.uuid4().hex[:6]}")
    api.gpt.script(text("Four", "."))
    assert "".join(await client.stream("What is 2+2?")) == "Four."
    api.gpt.script(text("Still ", "four."))
    assert await client.send("And now?") == "Still four."
    api.gpt.script(error(500, "backend exploded"))
    with pytest.raises(RuntimeError, match=r"Agent error: .+HTTP 500.+backend exploded"):
        await client.send("again")
    # stop: nothing running, then a turn held by the backend is stopped and its stream ends with `done`.
    assert await client.stop() == {"status": "OK", "cancelled": False, "client_id": client.client_id}
    release = threading.Event()
    api.gpt.script(text("never ", "finished", hold=release))
    try:
        streaming = asyncio.ensure_future(client.stream("a long story"))
        await until(lambda: bool(api.gpt.requests) and api.gpt.requests[-1].last_user_text == "a long story",
                    "the turn's request at the model")
        assert (await client.stop())["cancelled"] is True
        assert "".join(await asyncio.wait_for(streaming, 10)) == "never "
    finally:
        release.set()
    rows = {r["client_id"]: r for r in await client.sessions()}
    assert rows[client.client_id]["history_length"] == 4 and isinstance(rows[client.client_id]["shorthand_id"], int)


async def test_client_ids_sessions_health_and_delete(api) -> None:
    api.gpt.script(text("ok"), text("ok"))
    client = AgentClient(api.url, "myapp-" + uuid.uuid4().hex[:6], api_key=KEY)
    original = client.client_id
    await client.send("hello")
    assert client.client_id == "api-" + original  # forced into the API namespace
    r = await _post(api, "/api/v1/submit", {"text": "!model", "wait": True})
    assert r.json()["client_id"].startswith("api-") and len(r.json()["client_id"]) == 12
    rows = {s["client_id"]: s for s in await client.sessions()}
    assert rows[client.client_id]["history_length"] == 2 and rows[client.client_id]["model"] == "gpt"
    health = await client.health()
    assert health["status"] == "ok" and health["models"] == ["gpt"] and health["sessions"] >= 2
    shorthand = rows[client.client_id]["shorthand_id"]
    assert await client.delete_session(shorthand) == {"status": "deleted", "client_id": client.client_id}
    assert client.client_id not in {s["client_id"] for s in await client.sessions()}
    # By the id the caller first used (without the prefix) too.
    named = AgentClient(api.url, "named-" + uuid.uuid4().hex[:6], api_key=KEY)
    await named.send("!help")
    assert (await named.delete_session(named.client_id.removeprefix("api-")))["client_id"] == named.client_id
    with pytest.raises(AgentRequestError, match="404"):
        await named.delete_session(named.client_id)


def test_sync_client_for_scripts(api) -> None:
    api.gpt.script(text("sync ", "answer"), text("a", "b", "c"))
    with SyncAgentClient(api.url, api_key=KEY) as client:
        assert client.send("hi") == "sync answer"
        assert list(client.stream("letters")) == ["a", "b", "c"]
        assert client.health()["status"] == "ok"
        assert client.client_id in {s["client_id"] for s in client.sessions()}


# ── gates ───────────────────────────────────────────────────────────────────────────────────


async def test_gate_window_policy_answers_at_once(api) -> None:
    lookup = tool_call("secret_lookup", {"key": "door"})
    # No answer: the tool is rejected when API_GATE_TIMEOUT (1 s here) runs out.
    api.gpt.script(lookup, text("no luck"))
    r = await _post(api, "/api/v1/submit", {"text": "open the door", "wait": True})
    assert r.json()["text"] == "no luck"
    assert "nobody approved" in _tool_results(api.gpt)[0] and "within 1 s" in _tool_results(api.gpt)[0]

    # An approving policy (by tool name) answers inside the window: the tool runs.
    client = api.client(auto_approve_gates={"secret_lookup": True})
    api.gpt.script(lookup, text("It is 42."))
    events = [ev async for ev in client.events("open the door")]
    gates = [ev.data for ev in events if ev.name == "gate"]
    assert gates and gates[0]["tool_name"] == "secret_lookup" and gates[0]["timeout_seconds"] == 1
    assert gates[0]["tool_args"] == {"key": "door", "operation_type": "read"}
    assert any("allowed once" in ev.text for ev in events if ev.name == "status")
    assert _tool_results(api.gpt) == ["the secret of door is 42"]
    assert "".join(ev.text for ev in events if ev.name == "tok") == "It is 42."

    # By operation type; and the default policy rejects at once instead of letting the window run out.
    api.gpt.script(lookup, text("read ok"))
    assert await api.client(auto_approve_gates={"write": False, "read": True}).send("x") == "read ok"
    assert _tool_results(api.gpt) == ["the secret of door is 42"]
    api.gpt.script(lookup, text("refused"))
    events = [ev async for ev in api.client().events("x")]
    assert any("rejected by the user" in ev.text for ev in events if ev.name == "status")
    assert "the user rejected" in _tool_results(api.gpt)[0]


def test_gate_policy_lookup() -> None:
    gate = {"tool_name": "db_query", "tool_args": {"sql": "x", "operation_type": "write"}}
    assert gate_decision(True, gate) and not gate_decision(None, gate) and not gate_decision(False, gate)
    assert gate_decision({"db_query": True, "write": False}, gate)
    assert not gate_decision({"db_query": False, "write": True}, gate)
    assert gate_decision({"write": 1}, gate) and not gate_decision({"read": True}, gate)
    assert not gate_decision({"db_query": True}, {"tool_args": "junk"})


async def test_an_api_caller_cannot_answer_a_shell_gate_nor_see_shell_sessions(api) -> None:
    shell_id = str(uuid.uuid4())
    api.gpt.script(tool_call("secret_lookup", {"key": "vault"}), text("shell done"))
    async with ShellClient(api.shell_url, shell_id, token=api.server.token) as shell:
        await shell.connect(max_wait=10)
        await shell.submit("open the vault")
        async for ev in shell.events():
            if ev.name == "gate":
                gate_id = ev.data["gate_id"]
                break
        for headers in (AUTH, ADMIN_AUTH):
            r = await _post(api, f"/api/v1/gate/{gate_id}", {"approve": True}, headers=headers)
            assert r.status_code == 404 and "unknown gate" in r.json()["error"]
        await shell.gate_response(gate_id, "reject")
        async for ev in shell.events():
            if ev.name == "done":
                break
    assert "the user rejected" in _tool_results(api.gpt)[0]
    shell_before = api.sessions(ADMIN_AUTH)[shell_id]
    assert shell_id not in api.sessions(AUTH) and shell_before["history_length"] == 4
    async with httpx.AsyncClient(base_url=api.url, headers=AUTH, timeout=10) as http:
        r = await http.delete(f"/api/v1/session/{shell_id}")
        assert r.status_code == 404
        r = await http.delete(f"/api/v1/session/{shell_before['shorthand_id']}")
        assert r.status_code == 404
        # Submitting with the shell's id reaches the API namespace's own session, never the shell's.
        r = await http.post("/api/v1/submit", json={"client_id": shell_id, "text": "!reset", "wait": True})
    assert r.json()["client_id"] == f"api-{shell_id}"
    assert api.sessions(ADMIN_AUTH)[shell_id] == shell_before


async def test_admin_key_allows_gate_commands(api) -> None:
    body = {"text": "!autogate secret_lookup true", "wait": True, "client_id": f"api-adm-{uuid.uuid4().hex[:6]}"}
    refused = (await _post(api, "/api/v1/submit", body)).json()["text"]
    assert refused.startswith("ERROR: !autogate is accepted only from the interactive shell")
    allowed = (await _post(api, "/api/v1/submit", body, headers=ADMIN_AUTH)).json()["text"]
    assert allowed == "autogate secret_lookup read+write: auto-allow (gate OFF) for this session."
    api.gpt.script(tool_call("secret_lookup", {"key": "k"}), text("ran"))
    r = await _post(api, "/api/v1/submit", {**body, "text": "look it up"})
    assert r.json()["text"] == "ran" and _tool_results(api.gpt) == ["the secret of k is 42"]
    # The wrong admin key is not an admin key.
    r = await _post(api, "/api/v1/submit", body, headers={**AUTH, "X-Admin-Key": "nope"})
    assert r.json()["text"].startswith("ERROR: !autogate")


# ── bad input ───────────────────────────────────────────────────────────────────────────────


BAD_SUBMITS: list[tuple[Any, int, str]] = [
    (b"not json", 400, "must be JSON"),
    (b"\xff\xfe garbage", 400, "must be JSON"),
    ([], 400, "valid dictionary"),
    ({}, 400, "text: Field required"),
    ({"text": 5}, 400, "text: Input should be a valid string"),
    ({"text": "   "}, 400, "text is empty"),
    ({"text": "hi", "wait": "yes"}, 400, "wait: Input should be a valid boolean"),
    ({"text": "hi", "wait": True, "timeout": "5"}, 400, "timeout: Input should be a valid number"),
    ({"text": "hi", "wait": True, "timeout": -1}, 400, "timeout: Input should be greater than 0"),
    (b'{"text": "hi", "wait": true, "timeout": NaN}', 400, "timeout"),
    ({"text": "hi", "client_id": "bad id!"}, 400, "client_id: String should match pattern"),
    ({"text": "hi", "client_id": "x" * 129}, 400, "client_id"),
    ({"text": "hi", "client_id": 7}, 400, "client_id: Input should be a valid string"),
    ({"text": "x" * (_http.MAX_TEXT + 1)}, 400, "text: String should have at most 200000 characters"),
    (b'{"text": "' + b"y" * (_http.MAX_BODY + 10) + b'"}', 413, "the limit is"),
]


async def test_bad_input_gets_a_clear_4xx_and_changes_nothing(api) -> None:
    cid = f"api-bad-{uuid.uuid4().hex[:6]}"
    api.gpt.script(text("fine"))
    assert (await _post(api, "/api/v1/submit", {"client_id": cid, "text": "hi", "wait": True})).json()["text"] == "fine"
    before_sessions, before_requests = api.sessions(), len(api.gpt.requests)
    body: Any
    for body, status, message in BAD_SUBMITS:
        r = await _post(api, "/api/v1/submit", body)
        assert r.status_code == status and message in r.json()["error"], (str(body)[:80], r.status_code, r.text[:300])
    async with httpx.AsyncClient(base_url=api.url, headers=AUTH, timeout=10) as http:
        checks = [
            (await http.get("/api/v1/stream/bad%20id"), 400, "invalid client_id"),
            (await http.get(f"/api/v1/stream/{cid}", params={"turn_id": "nope"}), 404, "unknown turn_id"),
            (await http.post("/api/v1/gate/nope", json={"approve": True}), 404, "unknown gate"),
            (await http.post("/api/v1/gate/nope", content=b"{", headers=JSON), 400, "must be JSON"),
            (
                await http.post("/api/v1/gate/nope", json={"approve": "yes"}),
                400,
                "approve: Input should be a valid boolean",
            ),
            (await http.post("/api/v1/gate/nope", json={}), 400, "approve: Field required"),
            (await http.delete("/api/v1/session/api-no-such-session"), 404, "not found"),
            (await http.delete("/api/v1/session/99999"), 404, "not found"),
            (await http.get("/api/v1/submit"), 405, "use POST"),
            (await http.put("/api/v1/sessions", json={}), 405, "use GET"),
            (await http.get("/api/v2/anything"), 404, "the API lives under /api/v1"),
        ]
    for r, status, message in checks:
        assert r.status_code == status and message in r.json()["error"], (r.request.url, r.status_code, r.text)
    with pytest.raises(AgentRequestError, match="400: text is empty"):
        await api.client().send("\n")
    assert api.sessions() == before_sessions and len(api.gpt.requests) == before_requests


async def test_an_agent_error_is_raised_with_the_partial_answer(api) -> None:
    api.gpt.script(error(429, "slow down"))
    with pytest.raises(AgentError, match=r"Agent error: .*HTTP 429: .*slow down") as caught:
        await api.client().send("hi")
    assert caught.value.partial == ""
    api.gpt.script(malformed())  # one chunk of text, then a broken stream
    with pytest.raises(AgentError, match="Agent error: model 'gpt'") as caught:
        await api.client().send("hi")
    assert caught.value.partial == "partial "


async def test_agent_client_timeout_keeps_the_partial_answer(api) -> None:
    release = threading.Event()
    api.gpt.script(text("slow ", "answer", hold=release))
    try:
        with pytest.raises(AgentTimeout) as caught:
            await api.client().send("take your time", timeout=1)
    finally:
        release.set()
    assert caught.value.partial == "slow "


async def test_a_timeout_above_the_limit_is_clamped_and_said(api) -> None:
    api.gpt.script(text("quick"))
    body = (await _post(api, "/api/v1/submit", {"text": "hi", "wait": True, "timeout": 3600})).json()
    assert body["status"] == "complete" and body["text"] == "quick"
    assert body["note"].startswith("timeout 3600 s is above this server's limit; waited at most 600 s")


async def test_agent_client_says_a_turn_was_interrupted_by_a_restart(tmp_path, monkeypatch) -> None:
    """kill -9 in the middle of a turn, restart: the client keeps what it had and says the turn was interrupted."""
    with FakeOpenAI() as gpt:
        cfg = ConfigDir(tmp_path)
        cfg.models = {"gpt": openai_model(gpt)}
        port = free_port()
        cfg.plugins.append("plugin_client_api")
        cfg.plugin_config["plugin_client_api"] = {"port": port}
        server = AgentServer(cfg.write()).start()
        release = threading.Event()
        gpt.script(text("half ", "of it", hold=release))
        # No key passed: the client reads the key file the server generated (AGENT_DATA_DIR names it).
        monkeypatch.setenv("AGENT_DATA_DIR", str(server.data_dir))
        client = AgentClient(f"http://127.0.0.1:{port}", default_timeout=60)
        pieces: list[str] = []
        try:
            async def follow() -> None:
                async for piece in client.stream("tell me"):
                    pieces.append(piece)

            task = asyncio.ensure_future(follow())
            await until(lambda: bool(pieces), "the first piece of the answer")
            assert server.proc is not None
            server.proc.kill()  # kill -9
            await asyncio.to_thread(server.stop)
            server.start()
            with pytest.raises(AgentCancelled, match="interrupted before it ended: the server restarted") as err:
                await asyncio.wait_for(task, 60)
            assert err.value.partial == "half " and pieces == ["half "]
        finally:
            release.set()
            server.stop()


async def _turn_answering_gates(api, cid: str, text_: str, answer: dict[str, Any],
                                headers: dict[str, str]) -> tuple[list[Any], list[int]]:
    """One turn read from the plain stream; every gate answered with `answer` (the HTTP statuses returned)."""
    events, statuses = [], []
    async with httpx.AsyncClient(base_url=api.url, headers=AUTH, timeout=30) as http:
        r = await http.post("/api/v1/submit", json={"client_id": cid, "text": text_, "wait": False})
        async with aconnect_sse(http, "GET", f"/api/v1/stream/{cid}", params={"turn_id": r.json()["turn_id"]}) as sse:
            async for ev in sse.aiter_sse():
                events.append(ev)
                if ev.event == "gate":
                    gate = json.loads(ev.data)
                    assert gate["grants"] == ["allow_for", "allow_session", "allow_pattern"]
                    reply = await _post(api, f"/api/v1/gate/{gate['gate_id']}", answer, headers=headers)
                    statuses.append(reply.status_code)
                    assert reply.status_code == 200 or "creates a grant, which only the shell" in reply.json()["error"]
    return events, statuses


async def test_only_the_admin_key_answers_a_gate_with_a_grant(api) -> None:
    cid = f"api-grant-{uuid.uuid4().hex[:6]}"
    five_minutes = {"approve": True, "scope": "minutes", "minutes": 5}
    api.gpt.script(tool_call("secret_lookup", {"key": "door"}), text("no"))
    _, statuses = await _turn_answering_gates(api, cid, "open the door", five_minutes, AUTH)
    assert statuses == [400] and "nobody approved" in _tool_results(api.gpt)[0]
    api.gpt.script(tool_call("secret_lookup", {"key": "door"}), text("done"))
    _, statuses = await _turn_answering_gates(api, cid, "open the door", five_minutes, ADMIN_AUTH)
    assert statuses == [200] and _tool_results(api.gpt)[-1] == "the secret of door is 42"
    # The grant (five minutes of secret_lookup) answers the next call of this session without a gate.
    api.gpt.script(tool_call("secret_lookup", {"key": "attic"}), text("again"))
    events, statuses = await _turn_answering_gates(api, cid, "and the attic?", five_minutes, ADMIN_AUTH)
    assert statuses == [] and _tool_results(api.gpt)[-1] == "the secret of attic is 42"
    assert any("allowed by grant" in json.loads(ev.data).get("text", "") for ev in events if ev.event == "status")
