"""Gates routed to approvers, over real sockets (issue 29): the proxy with the real `openai` and `ollama`
clients, streamed; a shell window with `!approver on` (shell.py's own client and UI); the API's admin key;
a client that goes away while its gate waits; two instances on one Redis.

One server with `approvals` for the proxy's class: `db_query` goes to shell approvers and the API admin key
(and waits up to 120 s), `file_edit` to shell approvers only, for 2 s.
"""

from __future__ import annotations

import asyncio
import io
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
from rich.console import Console

import audit_log
import grants
from shell import Shell
from shell_client import RequestRejected, ShellClient
from shell_ui import ShellUI
from tests.conftest import ROOT, AgentServer, ConfigDir, free_port, one_tool_plugin, openai_model
from tests.fakes.backend import text, tool_call
from tests.fakes.openai_backend import FakeOpenAI
from tests.runtime import ALL_GATED
from tests.test_mcp_server import PENDING, call_json, connect, next_note, read_json, subscribe
from tests.test_shell import FakeTerminal
from tests.waiting import until

pytestmark = pytest.mark.slow

AGENT = "agent-mcp:latest"
API_KEY, ADMIN_KEY = "approvals-e2e-api-key-0123456789", "approvals-e2e-admin-key-0123456789"
ADMIN = {"X-Admin-Key": ADMIN_KEY}
APPROVALS = {"timeout_seconds": 120, "classes": {"proxy": {
    "shell": True, "api_admin": True, "tools": {"file_edit": {"shell": True, "timeout_seconds": 2}}}}}
DB_PLUGIN = one_tool_plugin("plugin_test_db", "db_query", "sql", r'"1 row changed"', {"type": "db"}, "Run SQL.")
FILE_PLUGIN = one_tool_plugin("plugin_test_files", "file_edit", "path", '"edited " + path',
                              {"type": "drive", "operation": "write"}, "Edit a file.")


@dataclass
class Servers:
    server: AgentServer
    gpt: FakeOpenAI
    proxy: str
    api: str

    def audit(self) -> list[dict[str, Any]]:
        return list(audit_log.read_audit(self.server.data_dir / grants.AUDIT_FILE))


def _config(path: Path, gpt: FakeOpenAI, **extra_plugins: int) -> ConfigDir:
    cfg = ConfigDir(path)
    cfg.models = {"gpt": openai_model(gpt)}
    cfg.gates = ALL_GATED
    cfg.add_plugin("plugin_test_db", DB_PLUGIN)
    cfg.add_plugin("plugin_test_files", FILE_PLUGIN)
    for plugin, port in extra_plugins.items():
        cfg.plugins.append(plugin)
        cfg.plugin_config[plugin] = {"port": port}
    cfg.enabled_extra = {"approvals": APPROVALS}
    return cfg


@pytest.fixture(scope="module")
def srv(tmp_path_factory) -> Iterator[Servers]:
    with FakeOpenAI() as gpt:
        ports = {"plugin_proxy_llama": free_port(), "plugin_client_api": free_port()}
        cfg = _config(tmp_path_factory.mktemp("approvals"), gpt, **ports)
        cfg.env = {"API_KEY": API_KEY, "API_ADMIN_KEY": ADMIN_KEY}
        server = AgentServer(cfg.write(), {"SESSION_STORE": "memory"}).start()
        try:
            yield Servers(server, gpt, f"http://127.0.0.1:{ports['plugin_proxy_llama']}",
                          f"http://127.0.0.1:{ports['plugin_client_api']}")
        finally:
            out = server.stop()
            assert "Traceback" not in out, out[-4000:]


@pytest.fixture(autouse=True)
def _fresh(request) -> None:
    if "srv" in request.fixturenames:
        request.getfixturevalue("srv").gpt.reset()


async def _approver(server: AgentServer, window: str) -> tuple[ShellClient, Any, ShellUI, io.StringIO]:
    """A shell window that ran `!approver on`: its client, its approver feed, its UI and screen."""
    shell = ShellClient(server.url, window, token=server.token)
    await shell.set_approver(True)
    out = io.StringIO()
    return shell, shell.approvals(), ShellUI(Console(file=out, width=200), shell), out


async def _next(feed: Any) -> Any:
    async with asyncio.timeout(60):
        return await anext(feed)


def _waits(parts: list[str]) -> bool:
    return "⏳ waiting for approval" in "".join(parts)


async def test_an_openai_stream_says_whom_it_waits_for_and_goes_on_when_a_shell_window_approves(srv) -> None:
    srv.gpt.script(tool_call("db_query", {"sql": "UPDATE users SET name = 'ada' WHERE id = 7"}),
                   text("Renamed ", "user 7."))
    shell, feed, ui, screen = await _approver(srv.server, "window-one")
    parts: list[str] = []
    async with openai.AsyncOpenAI(base_url=srv.proxy + "/v1", api_key="unused", max_retries=0) as client:
        stream = await client.chat.completions.create(
            model=AGENT, messages=[{"role": "user", "content": "rename user 7 to ada"}], stream=True)

        async def read() -> None:
            async for chunk in stream:
                if chunk.choices:
                    parts.append(chunk.choices[0].delta.content or "")

        reader = asyncio.create_task(read())
        asked = await _next(feed)
        assert asked.name == "approval" and asked.data["tool"] == "db_query" and asked.data["op"] == "write"
        assert asked.data["session"].startswith("llama-") and asked.data["client_label"] == "the chat proxy"
        await until(lambda: _waits(parts), "the wait line in the open stream")
        assert not reader.done()  # the answer waits for the approver
        await ui.handle_event(asked)
        assert "approval asked for session llama-" in screen.getvalue() and "the chat proxy" in screen.getvalue()
        await ui.handle_key("a")
        async with asyncio.timeout(60):
            await reader
    await feed.aclose()
    await shell.aclose()
    answer = "".join(parts)
    wait = answer.index("⏳ waiting for approval of db_query (UPDATE users SET name = ?s WHERE id = ?n) by the API "
                        "admin key, shell approvers")
    assert wait < answer.index("allowed once by shell:") < answer.index("Renamed user 7.")
    tool_results = [m["content"] for m in srv.gpt.requests[-1].json["messages"] if m["role"] == "tool"]
    assert tool_results == ["1 row changed"]
    await until(lambda: any(r["event"] == "decision" and r["tool"] == "db_query" for r in srv.audit()),
                "the decision in the audit log")
    record = next(r for r in reversed(srv.audit()) if r["event"] == "decision" and r["tool"] == "db_query")
    assert record["actor"] == f"shell:{shell.window_id}" and record["outcome"] == "allowed once"
    detail = json.loads(record["detail"])
    assert (detail["by"], detail["channel"], detail["client"]) == (f"shell:{shell.window_id}", "shell", "proxy")
    assert detail["asked"] == ["api:admin", "shell:*"]


async def test_an_ollama_stream_waits_for_the_api_admin_key_and_the_other_approvers_learn_who_answered(
        srv) -> None:
    srv.gpt.script(tool_call("db_query", {"sql": "DELETE FROM users WHERE id = 9"}), text("Deleted."))
    shell, feed, ui, screen = await _approver(srv.server, "window-two")
    parts: list[str] = []
    chat = ollama.AsyncClient(host=srv.proxy)
    stream = await chat.chat(model=AGENT, messages=[{"role": "user", "content": "delete user 9"}], stream=True)

    async def read() -> None:
        async for part in stream:
            parts.append(part.message.content or "")

    reader = asyncio.create_task(read())
    asked = await _next(feed)
    gate_id = asked.data["gate_id"]
    await ui.handle_event(asked)
    await until(lambda: _waits(parts), "the wait line in the open stream")
    async with httpx.AsyncClient(base_url=srv.api, headers={"Authorization": f"Bearer {API_KEY}"}) as api:
        listed = (await api.get("/api/v1/approvals", headers=ADMIN)).json()["approvals"]
        assert [(g["gate_id"], g["tool"], g["tables"]) for g in listed] == [(gate_id, "db_query", ["users"])]
        assert (await api.get("/api/v1/approvals")).status_code == 404  # the admin key answers, not any key
        refused = await api.post(f"/api/v1/gate/{gate_id}", json={"approve": True})
        assert refused.status_code == 409 and refused.json()["outcome"] == "not_approver"
        assert "not an approver of this gate" in refused.json()["error"]
        still = (await api.get("/api/v1/approvals", headers=ADMIN)).json()["approvals"]
        assert not reader.done() and [g["gate_id"] for g in still] == [gate_id]
        assert (await api.post(f"/api/v1/gate/{gate_id}", json={"approve": True}, headers=ADMIN)).status_code == 200
        late = await api.post(f"/api/v1/gate/{gate_id}", json={"approve": False}, headers=ADMIN)
        assert late.status_code == 409 and "already answered: allow by api:admin (api)" in late.json()["error"]
    closed = await _next(feed)
    assert closed.name == "approval_closed" and (closed.data["by"], closed.data["decision"]) == ("api:admin", "allow")
    await ui.handle_event(closed)
    assert "was answered by api:admin (api): allow" in screen.getvalue() and not ui.pending_gates
    with pytest.raises(RequestRejected, match="already answered: allow by api:admin"):
        await shell.gate_response(gate_id, "reject", as_approver=True)  # too late: told who was first
    async with asyncio.timeout(60):
        await reader
    await chat.close()
    await feed.aclose()
    await shell.aclose()
    answer = "".join(parts)
    assert answer.index("⏳ waiting for approval of db_query (DELETE FROM users WHERE id = ?n)") < \
        answer.index("Deleted.")


async def test_a_client_that_goes_away_while_waiting_leaves_the_gate_to_expire_and_it_is_audited(srv) -> None:
    srv.gpt.script(tool_call("file_edit", {"path": "/srv/notes.txt"}), text("Nobody approved it."))
    shell, feed, _, _ = await _approver(srv.server, "window-three")
    parts: list[str] = []
    async with openai.AsyncOpenAI(base_url=srv.proxy + "/v1", api_key="unused", max_retries=0) as client:
        stream = await client.chat.completions.create(
            model=AGENT, messages=[{"role": "user", "content": "edit my notes"}], stream=True)
        async for chunk in stream:
            parts.append(chunk.choices[0].delta.content or "" if chunk.choices else "")
            if _waits(parts):
                break
        await stream.close()  # the user closed the chat tab
    asked = await _next(feed)
    assert asked.data["tool"] == "file_edit" and asked.data["approvers"] == ["shell:*"]
    closed = await _next(feed)  # still open after the client left: it expires, it is not cut short
    assert closed.data["decision"] == "timeout" and closed.data["by"] == "" and closed.data["waited"] > 1
    await feed.aclose()
    await shell.aclose()

    def expired() -> list[dict[str, Any]]:
        return [r for r in srv.audit() if r["event"] == "decision" and r["tool"] == "file_edit"]

    await until(lambda: bool(expired()), "the expired gate in the audit log")
    (record,) = expired()
    assert record["outcome"] == "no answer: rejected" and record["actor"] == "timeout"
    assert audit_log.describe_detail(record["detail"]).startswith("routed (proxy) to shell:*; nobody answered after 2.")
    # The turn went on without its client: the model was told, and the tool never ran.
    await until(lambda: len(srv.gpt.requests) >= 2, "the model hearing of the rejection")
    tool_results = [m["content"] for m in srv.gpt.requests[-1].json["messages"] if m["role"] == "tool"]
    assert tool_results[0].startswith("TOOL CALL REJECTED: nobody approved your file_edit request")
    shown = await asyncio.to_thread(subprocess.run, [sys.executable, str(ROOT / "agentctl.py"), "--config-dir",
                                                     str(srv.server.cfg.path), "audit"],
                                    capture_output=True, text=True, timeout=60, env={"COLUMNS": "400"})
    assert "routed (proxy) to shell:*; nobody answered" in shown.stdout, shown.stdout + shown.stderr
    assert "file_edit ran" not in srv.server.output + "".join(srv.server._lines)


async def test_a_window_that_did_not_opt_in_is_refused_and_changes_nothing(srv) -> None:
    srv.gpt.script(tool_call("db_query", {"sql": "UPDATE users SET name = 'x'"}), text("Done."))
    shell, feed, _, _ = await _approver(srv.server, "window-four")
    bystander = ShellClient(srv.server.url, "window-five", token=srv.server.token)
    client = ollama.AsyncClient(host=srv.proxy)
    chat = asyncio.create_task(client.chat(model=AGENT, messages=[{"role": "user", "content": "rename everyone"}],
                                           stream=False))
    gate_id = (await _next(feed)).data["gate_id"]
    with pytest.raises(RequestRejected, match="not an approver of this gate"):
        await bystander.gate_response(gate_id, "allow", as_approver=True)
    with pytest.raises(RequestRejected, match="not an approver of this gate"):
        await bystander.gate_response(gate_id, "allow")  # the shell's own answer path: not for routed gates
    assert not chat.done()
    await shell.gate_response(gate_id, "reject", as_approver=True)
    async with asyncio.timeout(60):
        whole = await chat  # a request that is not streamed just waits
    await client.close()
    assert whole.message.content.endswith("Done.")
    tool_results = [m["content"] for m in srv.gpt.requests[-1].json["messages"] if m["role"] == "tool"]
    assert tool_results[0].startswith("TOOL CALL REJECTED: the user rejected your db_query request")

    def refused() -> list[str]:
        return [r["actor"] for r in srv.audit() if r["event"] == "approval_refused" and r["op"] == "write"
                and r["tables"] == ["users"] and r["actor"].startswith("shell")]

    await until(lambda: len(refused()) == 2, "both refused answers in the audit log")
    assert refused() == [f"shell:{bystander.window_id}", "shell"]
    await feed.aclose()
    await shell.aclose()
    await bystander.aclose()


async def test_a_gate_raised_through_one_instance_is_answered_through_the_other(tmp_path, redis_store) -> None:
    token = "approvals-e2e-shell-token-0123456789"
    with FakeOpenAI() as gpt:
        servers = []
        for name, extra in (("a", {"plugin_proxy_llama": free_port()}), ("b", {})):
            (tmp_path / name).mkdir()
            cfg = _config(tmp_path / name, gpt, **extra)
            env = {"SESSION_STORE": redis_store, "AGENT_SHELL_TOKEN": token,
                   "AGENT_AUDIT_KEY_FILE": str(tmp_path / "audit-key")}
            servers.append(AgentServer(cfg.write(), env).start(wait=False))
        a, b = servers
        try:
            for s in servers:
                s.wait_ready(60)
            gpt.script(tool_call("db_query", {"sql": "UPDATE users SET role = 'admin' WHERE id = 3"}), text("Done."))
            on_b, feed, ui, _ = await _approver(b, "window-on-b")
            on_a = ShellClient(a.url, "window-on-a", token=token)
            await on_a.set_approver(True)
            parts: list[str] = []
            proxy = f"http://127.0.0.1:{a.cfg.plugin_config['plugin_proxy_llama']['port']}"
            async with openai.AsyncOpenAI(base_url=proxy + "/v1", api_key="unused", max_retries=0) as client:
                stream = await client.chat.completions.create(
                    model=AGENT, messages=[{"role": "user", "content": "make user 3 an admin"}], stream=True)

                async def read() -> None:
                    async for chunk in stream:
                        if chunk.choices:
                            parts.append(chunk.choices[0].delta.content or "")

                reader = asyncio.create_task(read())
                asked = await _next(feed)  # raised on A, on B's feed
                await ui.handle_event(asked)
                await ui.handle_key("a")
                async with asyncio.timeout(60):
                    await reader
            with pytest.raises(RequestRejected, match=f"already answered: allow by shell:{on_b.window_id}"):
                await on_a.gate_response(asked.data["gate_id"], "reject", as_approver=True)
            closed = await _next(feed)
            assert (closed.data["gate_id"], closed.data["by"]) == (asked.data["gate_id"], f"shell:{on_b.window_id}")
            for c in (feed, on_a, on_b):
                await c.aclose()
            answer = "".join(parts)
            assert answer.index("⏳ waiting for approval of db_query") < answer.index("Done.")
            assert f"allowed once by shell:{on_b.window_id}" in answer
        finally:
            outputs = [s.stop() for s in servers]
    assert "db_query ran: UPDATE users SET role = 'admin' WHERE id = 3" in outputs[0]


async def test_the_shell_window_opts_in_sees_the_panel_answers_with_a_key_and_opts_out(srv) -> None:
    srv.gpt.script(tool_call("db_query", {"sql": "UPDATE users SET name = 'y' WHERE id = 2"}), text("Renamed."))
    terminal = FakeTerminal()
    async with ShellClient(srv.server.url, "window-six", token=srv.server.token) as client:
        shell = Shell(client, terminal)
        running = asyncio.create_task(shell.run())
        terminal.feed("!approver on")
        await until(lambda: "approver on: this window now answers" in terminal.out.getvalue(), "!approver on")
        async with ollama.AsyncClient(host=srv.proxy) as chat:
            asked = asyncio.create_task(chat.chat(model=AGENT, messages=[{"role": "user", "content": "rename 2"}]))
            await until(lambda: "approval asked for session llama-" in terminal.out.getvalue(), "the panel")
            assert "UPDATE users SET name = 'y' WHERE id = 2" in terminal.out.getvalue()
            terminal.keys.put_nowait("a")
            async with asyncio.timeout(60):
                answer = await asyncio.shield(asked)
        terminal.feed("!approver off", "!approver", "!exit")
        async with asyncio.timeout(30):
            assert await running == 0
    screen = terminal.out.getvalue()
    assert "✓ allowed once — db_query proceeds" in screen and answer.message.content.endswith("Renamed.")
    assert "approver off: this window no longer answers" in screen and "approver: off" in screen
    assert "db_query ran: UPDATE users SET name = 'y' WHERE id = 2" in "".join(srv.server._lines)


async def test_only_the_human_mcp_tokens_a_gate_names_may_answer_it(tmp_path) -> None:
    lead, intern = "approvals-e2e-mcp-lead-token-0001", "approvals-e2e-mcp-intern-token-01"
    with FakeOpenAI() as gpt:
        ports = {"plugin_proxy_llama": free_port(), "plugin_client_mcp": free_port()}
        cfg = _config(tmp_path, gpt, **ports)
        cfg.enabled_extra = {"approvals": {"classes": {"proxy": {"mcp_tokens": ["lead"]}}}}
        (tmp_path / "mcp-tokens.json").write_text(json.dumps({"tokens": {
            "lead": {"role": "human", "token": lead}, "intern": {"role": "human", "token": intern}}}))
        (tmp_path / "mcp-tokens.json").chmod(0o600)
        server = AgentServer(cfg.write(), {"SESSION_STORE": "memory"}).start()
        try:
            gpt.script(tool_call("db_query", {"sql": "DELETE FROM orders WHERE id = 5"}), text("Deleted."))
            mcp_url = f"http://127.0.0.1:{ports['plugin_client_mcp']}/mcp"
            notes: asyncio.Queue[str] = asyncio.Queue()
            async with connect(mcp_url, intern, notes=notes) as as_intern, connect(mcp_url, lead) as as_lead:
                await subscribe(as_intern, PENDING)
                async with ollama.AsyncClient(host=f"http://127.0.0.1:{ports['plugin_proxy_llama']}") as chat:
                    asked = asyncio.create_task(chat.chat(model=AGENT, messages=[{"role": "user", "content": "go"}]))
                    await next_note(notes, PENDING)
                    (pending,) = await read_json(as_intern, PENDING)
                    assert pending["session"].startswith("llama-") and pending["request"]["approvers"] == ["mcp:lead"]
                    refused = await as_intern.call_tool("answer_approval", {"gate_id": pending["gate_id"],
                                                                             "decision": "allow_once"})
                    assert refused.is_error and "token 'intern' is not one of them" in refused.content[0].text
                    assert not asked.done()
                    answer = call_json(await as_lead.call_tool("answer_approval", {"gate_id": pending["gate_id"],
                                                                                    "decision": "allow_once"}))
                    assert answer["status"] == "answered"
                    async with asyncio.timeout(60):
                        whole = await asked
            assert whole.message.content.endswith("Deleted.") and "allowed once by mcp:lead" in whole.message.content
        finally:
            out = server.stop()
    assert "db_query ran: DELETE FROM orders WHERE id = 5" in out and lead not in out and intern not in out
