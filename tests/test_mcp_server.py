"""plugin_client_mcp: agent-mcp as an MCP server, driven by the official `mcp` SDK client over real HTTP.

One agent-mcp subprocess (shell endpoint + MCP server + a gated test tool, fake OpenAI backend) serves
the module. Shell turns go through shell.py's own client code; MCP clients use `mcp.Client` over
Streamable HTTP with bearer tokens from the token file, in both protocol eras.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import stat
import subprocess
import sys
import warnings
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import httpx2
import mcp_types as types
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPDeprecationWarning, MCPError
from starlette.applications import Starlette

from shell_client import ShellClient
from tests.conftest import ROOT, AgentServer, ConfigDir, free_port, openai_model
from tests.fakes.backend import text, tool_call
from tests.fakes.openai_backend import FakeOpenAI
from tests.plugin_host import plugin, plugin_runtime, report
from tests.test_gate_e2e import DB_PLUGIN
from tests.turns import collect_turn
from tests.waiting import until

PLUGIN = "plugin_client_mcp"
HUMAN = "human-token-for-tests-0001"
WORKER = "agent-token-worker-00001"
OTHER = "agent-token-other-000001"
TOKENS = {"tokens": {
    "alice": {"role": "human", "token": HUMAN},
    "worker": {"role": "agent", "session": "worker", "token": WORKER},
    "other": {"role": "agent", "session": "mcp-other", "token": OTHER},
}}
PENDING = "agentmcp://approvals/pending"
HISTORY = "agentmcp://approvals/history"
#: Guards only: a broken server fails the test instead of hanging it (no timing is asserted).
WAIT = 30


class McpServer:
    """The module's agent-mcp: shell endpoint `shell_url`, MCP endpoint `url`."""

    def __init__(self, server: AgentServer, port: int, backend: FakeOpenAI, config: Path):
        self.server, self.backend, self.config = server, backend, config
        self.shell_url = server.url
        self.port = port
        self.url = f"http://127.0.0.1:{port}/mcp"


@pytest.fixture(scope="module")
def mcp_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[McpServer]:
    path = tmp_path_factory.mktemp("mcp-server")
    with FakeOpenAI() as backend:
        cfg = ConfigDir(path)
        cfg.models = {"fake": openai_model(backend)}
        cfg.add_plugin("plugin_test_db", DB_PLUGIN)
        port = free_port()
        cfg.plugins.append(PLUGIN)
        cfg.plugin_config[PLUGIN] = {"port": port}
        (path / "mcp-tokens.json").write_text(json.dumps(TOKENS))
        (path / "mcp-tokens.json").chmod(0o600)  # it holds tokens: agent-mcp refuses it readable by others
        # Gated: db_query (every table). Open: get_system_info. "system" tools: 2 calls per session in 600 s.
        cfg.gates = {"db": {}, "tools": {"get_system_info": {"read": True, "write": False}}}
        enabled_extra = {"rate_limits": {"system": {"calls": 2, "window_seconds": 600}}}
        cfg.env = {"GATE_TIMEOUT": "60"}
        cfg.write()
        enabled = json.loads((path / "plugins-enabled.json").read_text())
        (path / "plugins-enabled.json").write_text(json.dumps({**enabled, **enabled_extra}))
        server = AgentServer(cfg).start()
        try:
            yield McpServer(server, port, backend, path)
        finally:
            out = server.stop()
            for token in (HUMAN, WORKER, OTHER):
                assert token not in out, "a token value reached the log"


@contextlib.asynccontextmanager
async def connect(url: str, token: str | None, *, mode: str = "legacy",
                  notes: asyncio.Queue[str] | None = None) -> AsyncIterator[Client]:
    """An SDK client with `Authorization: Bearer <token>`; resource-updated URIs go to `notes`."""

    async def on_message(message: Any) -> None:
        if notes is not None and isinstance(message, types.ResourceUpdatedNotification):
            notes.put_nowait(message.params.uri)

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30, read=120)) as http:
        async with Client(streamable_http_client(url, http_client=http), mode=mode, message_handler=on_message,
                          cache=None) as client:
            yield client


async def subscribe(client: Client, uri: str) -> None:
    with warnings.catch_warnings():  # resources/subscribe is the 2025-11-25 way, deprecated by the SDK
        warnings.simplefilter("ignore", MCPDeprecationWarning)
        await client.subscribe_resource(uri)


async def read_json(client: Client, uri: str) -> Any:
    result = await client.read_resource(uri)
    return json.loads(result.contents[0].text)


def call_json(result: types.CallToolResult) -> Any:
    assert not result.is_error, result.content
    return result.structured_content if result.structured_content is not None else json.loads(result.content[0].text)


async def next_note(notes: asyncio.Queue[str], uri: str) -> str:
    while (got := await asyncio.wait_for(notes.get(), WAIT)) != uri:
        pass
    return got


async def shell_turn(server: AgentServer, client_id: str, message: str) -> list[Any]:
    async with ShellClient(server.url, client_id, token=server.token) as client:
        return await collect_turn(client, message)


# ── The approval round trip ─────────────────────────────────────────────────────────────────


async def test_human_approves_a_shell_gate_over_mcp(mcp_server: McpServer) -> None:
    backend = mcp_server.backend
    backend.script(tool_call("db_query", {"sql": "SELECT name FROM users"}), text("The user is ", "ada."))
    notes: asyncio.Queue[str] = asyncio.Queue()
    async with connect(mcp_server.url, HUMAN, notes=notes) as legacy, \
            connect(mcp_server.url, HUMAN, mode="auto") as modern:
        assert legacy.server_capabilities.resources and legacy.server_capabilities.resources.subscribe
        await subscribe(legacy, PENDING)
        await subscribe(legacy, HISTORY)
        async with modern.listen(resource_subscriptions=[PENDING]) as listener:
            shell = asyncio.create_task(shell_turn(mcp_server.server, "shell-mcp", "who are the users?"))
            # One notify reaches both eras: the 2025 notification and the 2026 listen stream.
            await next_note(notes, PENDING)
            event = await asyncio.wait_for(anext(aiter(listener)), WAIT)
            assert getattr(event, "uri", None) == PENDING
            (pending,) = await read_json(legacy, PENDING)
            assert pending["session"] == "shell-mcp" and pending["tool_name"] == "db_query"
            assert pending["request"]["tables"] == ["users"]
            assert await read_json(legacy, "agentmcp://sessions/shell-mcp/approvals/pending") == [pending]
            answer = call_json(await legacy.call_tool("answer_approval", {"gate_id": pending["gate_id"],
                                                                           "decision": "allow_once"}))
            assert answer["decided_by"] == "human:alice"
            events = await asyncio.wait_for(shell, WAIT)
            await next_note(notes, HISTORY)  # the decision is stored, then announced
    assert "".join(e.text for e in events if e.name == "tok") == "The user is ada."
    assert any("allowed once" in e.text for e in events if e.name == "status")
    async with connect(mcp_server.url, HUMAN) as client:
        assert await read_json(client, PENDING) == []
        record = next(r for r in await read_json(client, HISTORY) if r["gate_id"] == pending["gate_id"])
        assert record["decision"] == "allow" and record["decided_by"] == "human:alice"
        assert record["decided_at"] >= record["opened_at"] and record["session"] == "shell-mcp"
        session_history = await read_json(client, "agentmcp://sessions/shell-mcp/approvals/history")
        assert [r["gate_id"] for r in session_history] == [pending["gate_id"]]
        turns = await read_json(client, "agentmcp://sessions/shell-mcp/history")
        assert turns[-1] == {"role": "assistant", "content": "The user is ada."}


async def _first_pending(client: Any) -> list[dict[str, Any]]:
    # The shell's turn reaches its gate within a few polls.
    return await until(lambda: read_json(client, PENDING), "a pending approval", 10, step=0.05)


async def test_a_human_grants_a_statement_shape_over_mcp(mcp_server: McpServer) -> None:
    backend = mcp_server.backend
    grants_uri = "agentmcp://sessions/shell-shape/grants"
    backend.script(tool_call("db_query", {"sql": "SELECT name FROM users WHERE id = 1"}), text("ada"))
    notes: asyncio.Queue[str] = asyncio.Queue()
    async with connect(mcp_server.url, HUMAN, notes=notes) as human:
        await subscribe(human, grants_uri)
        shell = asyncio.create_task(shell_turn(mcp_server.server, "shell-shape", "user 1?"))
        pending = await _first_pending(human)
        assert pending[0]["request"]["grants"] == ["allow_for", "allow_session", "allow_pattern"]
        assert pending[0]["request"]["shape"] == "SELECT name FROM users WHERE id = ?n"
        call_json(await human.call_tool("answer_approval", {"gate_id": pending[0]["gate_id"],
                                                             "decision": "allow_pattern"}))
        await asyncio.wait_for(shell, WAIT)
        await next_note(notes, grants_uri)  # subscribers hear of the new grant
        (grant,) = await read_json(human, grants_uri)
        assert (grant["scope"], grant["granted_by"], grant["uses"]) == ("allow_pattern", "mcp token 'alice'", 0)
        # The same shape with another value runs without asking; another shape asks again.
        backend.script(tool_call("db_query", {"sql": "SELECT name FROM users WHERE id = 2"}), text("bob"))
        events = await shell_turn(mcp_server.server, "shell-shape", "user 2?")
        assert "gate" not in [e.name for e in events]
        assert (await read_json(human, grants_uri))[0]["uses"] == 1


# ── Authentication, Origin, Host ────────────────────────────────────────────────────────────


INITIALIZE = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
    "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}}}
MCP_HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


def test_tokens_origin_and_host_are_checked(mcp_server: McpServer) -> None:
    def post(**headers: str) -> httpx.Response:
        return httpx.post(mcp_server.url, json=INITIALIZE, headers={**MCP_HEADERS, **headers}, timeout=10)

    missing = post()
    assert missing.status_code == 401 and missing.headers["www-authenticate"].startswith("Bearer")
    assert post(Authorization="Bearer not-a-token-of-ours").status_code == 401
    assert post(Authorization=f"Basic {HUMAN}").status_code == 401
    assert post(Authorization=f"Bearer {HUMAN}", Origin="https://evil.example").status_code == 403
    assert post(Authorization=f"Bearer {HUMAN}", Host="evil.example").status_code == 421
    ok = post(Authorization=f"Bearer {HUMAN}", Origin=f"http://127.0.0.1:{mcp_server.port}")
    assert ok.status_code == 200


async def test_sdk_client_with_a_wrong_token_is_refused(mcp_server: McpServer) -> None:
    statuses: list[int] = []

    async def record(response: httpx2.Response) -> None:
        statuses.append(response.status_code)

    headers = {"Authorization": "Bearer wrong-token-000000000"}
    async with httpx2.AsyncClient(headers=headers, event_hooks={"response": [record]}) as http:
        with pytest.raises(Exception) as caught:  # the SDK reports it inside an exception group
            async with Client(streamable_http_client(mcp_server.url, http_client=http), mode="legacy"):
                pass
    assert statuses == [401] and "MCPError" in repr(caught.value)


# ── Roles ───────────────────────────────────────────────────────────────────────────────────


async def test_agent_token_reaches_only_its_own_session(mcp_server: McpServer) -> None:
    backend = mcp_server.backend
    async with connect(mcp_server.url, OTHER) as other, connect(mcp_server.url, WORKER, mode="auto") as worker, \
            connect(mcp_server.url, HUMAN, notes=(notes := asyncio.Queue())) as human:
        await subscribe(human, PENDING)
        # `other` calls a gated tool: a pending approval of session mcp-other.
        call = asyncio.create_task(other.call_tool("db_query", {"sql": "SELECT * FROM payroll"}))
        await next_note(notes, PENDING)
        (pending,) = [p for p in await read_json(human, PENDING) if p["session"] == "mcp-other"]

        # The worker sees its own session only, and cannot read, watch or answer the other's.
        listed = {r.uri for r in (await worker.list_resources()).resources}
        assert listed and all(u == "agentmcp://sessions" or u.startswith("agentmcp://sessions/mcp-worker/")
                              for u in listed)
        for uri in ("agentmcp://sessions/mcp-other/approvals/pending", "agentmcp://sessions/mcp-other/history",
                    "agentmcp://sessions/shell-mcp/state", PENDING, HISTORY, "agentmcp://policy"):
            with pytest.raises(MCPError, match=r"forbidden: .*token 'worker'"):  # every refusal names the token
                await worker.read_resource(uri)
        with pytest.raises(MCPError, match="forbidden"):
            async with worker.listen(resource_subscriptions=["agentmcp://sessions/mcp-other/approvals/pending"]):
                pass
        with pytest.raises(MCPError, match="forbidden: answer_approval needs a human token; token 'worker' has role "
                                           "agent"):
            await worker.call_tool("answer_approval", {"gate_id": pending["gate_id"], "decision": "allow_once"})
        with pytest.raises(MCPError, match="unknown tool 'nope'; tools/list shows the tools of token 'worker'"):
            await worker.call_tool("nope", {})
        with pytest.raises(MCPError, match="forbidden"):
            await worker.call_tool("send_message", {"session": "other", "text": "hi"})
        tools = {t.name for t in (await worker.list_tools()).tools}
        assert {"send_message", "db_query", "get_system_info"} <= tools and "answer_approval" not in tools
        assert {s["session"] for s in await read_json(worker, "agentmcp://sessions")} <= {"mcp-worker"}
        async with connect(mcp_server.url, WORKER) as legacy_worker:
            with pytest.raises(MCPError, match="forbidden"):
                await subscribe(legacy_worker, "agentmcp://sessions/mcp-other/approvals/pending")
        # The gate is still pending; the human rejects it and `other` gets -32950 with its data.
        assert [p["gate_id"] for p in await read_json(human, "agentmcp://sessions/mcp-other/approvals/pending")] \
            == [pending["gate_id"]]
        call_json(await human.call_tool("answer_approval", {"gate_id": pending["gate_id"], "decision": "reject"}))
        with pytest.raises(MCPError) as refused:
            await asyncio.wait_for(call, WAIT)
        error = refused.value.error
        assert error.code == -32950 and error.message == "policy_denied"
        assert error.data["decision"] == "reject" and error.data["tool"] == "db_query"
        assert error.data["type"] == "policy_denied" and "rejected" in error.data["reason"]
        assert (error.data["token"], error.data["session"]) == ("other", "mcp-other")
        assert OTHER not in json.dumps(error.data)  # its name, never its secret
        # The worker's own tools: an open one runs, and send_message talks to its own session.
        info = await worker.call_tool("get_system_info", {})
        assert not info.is_error and info.content[0].text
        backend.script(text("hello worker"))
        answer = call_json(await worker.call_tool("send_message", {"text": "hi"}))
        assert answer == {"session": "mcp-worker", "status": "complete", "text": "hello worker"}


async def test_rate_limited_agent_call_is_policy_denied(mcp_server: McpServer) -> None:
    async with connect(mcp_server.url, OTHER) as other:
        for _ in range(2):  # the limit of "system" tools is 2 calls per session in 600 s
            assert not (await other.call_tool("get_system_info", {})).is_error
        with pytest.raises(MCPError) as refused:
            await other.call_tool("get_system_info", {})
    assert refused.value.error.code == -32950 and refused.value.error.data["decision"] == "rate_limited"


# ── Human management tools ──────────────────────────────────────────────────────────────────


async def test_human_sessions_messages_and_gate_policy(mcp_server: McpServer) -> None:
    mcp_server.backend.script(text("Hi ", "there."))
    notes: asyncio.Queue[str] = asyncio.Queue()
    async with connect(mcp_server.url, HUMAN, notes=notes) as human:
        await subscribe(human, "agentmcp://sessions")
        await subscribe(human, "agentmcp://policy")
        created = call_json(await human.call_tool("create_session", {"name": "notes"}))
        assert created["session"] == "mcp-notes" and created["client"] == "mcp"
        await next_note(notes, "agentmcp://sessions")
        answer = call_json(await human.call_tool("send_message", {"session": "notes", "text": "hello"}))
        assert answer == {"session": "mcp-notes", "status": "complete", "text": "Hi there."}
        state_doc = await read_json(human, "agentmcp://sessions/mcp-notes/state")
        assert state_doc["history_length"] == 2 and state_doc["busy"] is False

        changed = call_json(await human.call_tool("set_gate_default", {
            "section": "tools", "key": "llm_list", "operation": "read", "allowed": True}))
        assert changed["read"] is True and "saved in" in changed["note"]
        await next_note(notes, "agentmcp://policy")
        policy = await read_json(human, "agentmcp://policy")
        assert policy["tools"]["llm_list"] == {"read": True, "write": False}
        saved = json.loads((mcp_server.config / "gate-defaults.json").read_text())
        assert saved["tools"]["llm_list"] == {"read": True, "write": False}
        # ddl is a database permission of its own, named to be set, never part of "both"
        changed = call_json(await human.call_tool("set_gate_default", {
            "section": "db", "key": "logs", "operation": "ddl", "allowed": True}))
        assert (changed["read"], changed["write"], changed["ddl"]) == (False, False, True)
        refused = await human.call_tool("set_gate_default", {
            "section": "tools", "key": "llm_list", "operation": "ddl", "allowed": True})
        assert refused.is_error and "ddl is a permission of database tables only" in refused.content[0].text

        deleted = call_json(await human.call_tool("delete_session", {"session": "mcp-notes"}))
        assert deleted == {"status": "deleted", "session": "mcp-notes"}
        await next_note(notes, "agentmcp://sessions")
        assert "mcp-notes" not in [s["session"] for s in await read_json(human, "agentmcp://sessions")]
        bad = await human.call_tool("answer_approval", {"gate_id": "no-such-gate", "decision": "reject"})
        assert bad.is_error and "no pending gate" in bad.content[0].text


# ── The SDK's app, built at the first request ──────────────────────────────────────────────


async def test_the_sdk_app_is_built_at_the_first_request_and_serves_what_was_listed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import plugins._mcp_app

    async with plugin_runtime(tmp_path, {PLUGIN: {"port": free_port()}}, {}) as rt:
        mcp_plugin: Any = plugin(rt, PLUGIN)
        listed = {r.path: r.methods for r in mcp_plugin.get_routes()[0].routes}
        assert mcp_plugin.server is None  # idle: nothing of the SDK built
        app = Starlette(routes=mcp_plugin.get_routes())
        metadata = "/.well-known/oauth-protected-resource/mcp"
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as http:
            def broken(*args: Any) -> None:
                raise RuntimeError("no SDK today")
            with monkeypatch.context() as patch:
                patch.setattr(plugins._mcp_app, "McpApp", broken)
                failed = await http.get(metadata)
            assert failed.status_code == 503 and "the next request tries again" in failed.text
            first = await asyncio.gather(*(http.get(metadata) for _ in range(3)))
            anonymous = await http.post("/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "ping"})
        assert [r.status_code for r in first] == [200] * 3 and anonymous.status_code == 401
        assert {r.path: r.methods for r in mcp_plugin.server.app.routes} == listed
        assert [t.get_name() for t in mcp_plugin._tasks].count("mcp-session-manager") == 1  # built once


# ── The token file ──────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize(("tokens", "field"), [
    ({"tokens": {"w": {"role": "agent", "token": "x" * 20}}}, "tokens.w"),
    ({"tokens": {"w": {"role": "robot", "token": "x" * 20}}}, "tokens.w.role"),
    ({"tokens": {"w": {"role": "human", "token": "short"}}}, "tokens.w.token"),
    ({"tokens": {"a": {"role": "human", "token": "x" * 20}, "b": {"role": "human", "token": "x" * 20}}}, "tokens.b"),
    ({"tokens": {}}, "tokens"),
    ({"users": {}}, "users"),
])
async def test_bad_token_file_names_file_and_field(tmp_path: Path, tokens: dict[str, Any], field: str) -> None:
    (tmp_path / "mcp-tokens.json").write_text(json.dumps(tokens))
    (tmp_path / "mcp-tokens.json").chmod(0o600)  # it holds tokens: agent-mcp refuses it readable by others
    async with plugin_runtime(tmp_path, {PLUGIN: {"port": free_port()}}, {}) as rt:
        line = report(rt, PLUGIN).line()
    assert report(rt, PLUGIN).status == "failed"
    assert str(tmp_path / "mcp-tokens.json") in line and f"field '{field}" in line
    assert "x" * 20 not in line


async def test_missing_token_file_is_created_private_with_one_human_token(tmp_path: Path, caplog) -> None:
    async with plugin_runtime(tmp_path, {PLUGIN: {"port": free_port()}}, {}) as rt:
        assert report(rt, PLUGIN).status == "loaded", report(rt, PLUGIN).line()
    path = tmp_path / "mcp-tokens.json"
    created = json.loads(path.read_text())["tokens"]
    assert list(created) == ["owner"] and created["owner"]["role"] == "human"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert created["owner"]["token"] not in caplog.text and str(path) in caplog.text


def test_help_names_the_token_file() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "agent-mcp.py"), "--help"], capture_output=True, text=True,
                         check=True).stdout
    assert "mcp-tokens.json" in out and "plugin_client_mcp" in out
