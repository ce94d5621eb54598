"""plugin_mcp_client: tools of real MCP servers (the SDK test server over stdio and Streamable HTTP).

In-process tests drive the plugin inside a runtime; the end-to-end test drives a real agent-mcp
subprocess through shell.py's client code with the fake OpenAI backend making the tool calls.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import build
import routes
import state
import stores
from config import ConfigError, load_config
from registry import ToolError
from tests.conftest import ROOT, ConfigDir, free_port, openai_model
from tests.fakes.backend import text, tool_call
from tests.runtime import ask, execute, shell_payload
from tests.turns import answer, run_turn
from tests.waiting import succeeds, until_sync, within_sync

PLUGIN = "plugin_mcp_client"
TOKEN = "mcp-test-token-4242"


def server_pids(root: int | None = None) -> list[int]:
    """Host pids of the test MCP servers below process `root` (default: this one), sandboxed or not.

    A sandboxed server sees a pid of its own pid namespace, so `whoami`'s pid is not one to signal here.
    """
    parents: dict[int, int] = {}
    commands: dict[int, list[str]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as fh:
                parents[int(entry.name)] = int(fh.read().rpartition(")")[2].split()[1])
            with open(f"/proc/{entry.name}/cmdline", "rb") as fh:
                commands[int(entry.name)] = fh.read().decode(errors="replace").split("\0")
        except OSError:
            continue

    def below(pid: int) -> bool:
        for _ in range(64):
            pid = parents.get(pid, 0)
            if pid == (root or os.getpid()):
                return True
            if pid <= 1:
                return False
        return False

    return sorted(pid for pid, cmd in commands.items() if cmd[1:3] == ["-m", "tests.fakes.mcp_server"] and below(pid))


def stdio_server(**extra: Any) -> dict[str, Any]:
    """An mcp-servers.json entry that starts the SDK test server over stdio."""
    return {"command": sys.executable, "args": ["-m", "tests.fakes.mcp_server", "stdio"], "cwd": str(ROOT), **extra}


class HttpMcpServer:
    """The SDK test server over Streamable HTTP on 127.0.0.1 (a subprocess), requiring `Bearer TOKEN`."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> HttpMcpServer:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.fakes.mcp_server", "http", "--port", str(self.port),
             "--token-env", "MCP_TEST_TOKEN"],
            cwd=ROOT, env={**os.environ, "MCP_TEST_TOKEN": TOKEN}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        proc = self.proc
        up = within_sync(lambda: proc.poll() is not None or succeeds(  # (a server that exited ends the wait)
            lambda: socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close(), OSError), 20)
        if not up or proc.poll() is not None:
            self.stop()
            raise RuntimeError("the MCP test HTTP server did not start")
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None


@pytest.fixture
def http_mcp() -> Iterator[HttpMcpServer]:
    server = HttpMcpServer().start()
    yield server
    server.stop()


@pytest.fixture
def http_server(http_mcp: HttpMcpServer) -> str:
    """The URL of a running HttpMcpServer."""
    return http_mcp.url


def write_config(cfg: ConfigDir, servers: dict[str, Any]) -> ConfigDir:
    cfg.plugins.append(PLUGIN)
    cfg.plugin_config[PLUGIN] = {"enabled": True}
    cfg.gates = {"tools": {"*": {"read": True, "write": True}}}  # MCP tools are gated by default; not tested here
    (cfg.path / "mcp-servers.json").write_text(json.dumps({"servers": servers}, indent=2))
    return cfg.write()


@pytest.fixture
async def make_rt(tmp_path, fake_openai):
    """Build a runtime with plugin_mcp_client serving the given servers; everything is closed afterwards."""
    built: list[state.Runtime] = []

    async def _make(servers: dict[str, Any], env: dict[str, str] | None = None) -> state.Runtime:
        cfg = ConfigDir(tmp_path)
        cfg.models = {"fake": openai_model(fake_openai)}
        cfg.env = env or {}
        rt = await build.build_runtime(load_config(write_config(cfg, servers).path), store=stores.MemoryStore())
        built.append(rt)
        assert rt.plugins is not None
        await rt.plugins.load_all()
        return rt

    yield _make
    for rt in built:
        await build.close_runtime(rt)


def plugin(rt: state.Runtime) -> Any:
    assert rt.plugins is not None
    (found,) = [p for p in rt.plugins.loaded if p.PLUGIN_NAME == PLUGIN]
    return found


async def until(rt: state.Runtime, predicate: Callable[[], bool], what: str) -> None:
    """Wait (up to 15 s) until a server change the plugin announces makes `predicate` true."""
    try:
        async with asyncio.timeout(15):
            while True:
                changed = plugin(rt).changed
                if predicate():
                    return
                await changed.wait()
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None


# ── configuration ──


def test_bad_config_names_the_file_and_each_field(tmp_path):
    from plugins._mcp_servers import load_servers

    path = tmp_path / "mcp-servers.json"
    path.write_text(json.dumps({"servers": {
        "both": {"command": "x", "url": "http://127.0.0.1/mcp"},
        "neither": {"args": []},
        "typo": {"comand": "x", "command": "y"},
        "envs": {"command": "x", "env": ["OK_NAME", "not valid"]},
        "web": {"url": "ftp://example.com"},
        "bad-name": {"command": "x"},
    }}))
    with pytest.raises(ConfigError) as err:
        load_servers(path)
    msg = str(err.value)
    assert str(path) in msg
    for field, why in [
        ("servers.both", "exactly one of 'command' (stdio) and 'url'"),
        ("servers.neither", "exactly one"),
        ("servers.typo.comand", "Extra inputs are not permitted"),
        ("servers.envs.env.not valid", "'not valid' is not an environment variable name"),
        ("servers.web.url", "must be an http:// or https:// URL"),
        ("servers.bad-name", "server name 'bad-name': use up to 32 letters"),
    ]:
        assert f"field '{field}" in msg and why in msg, (field, msg)
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_servers(path)


async def test_a_bad_config_fails_the_plugin_with_the_reason_and_the_server_runs_on(make_rt):
    rt = await make_rt({"files": {"comand": "npx"}})
    report = rt.plugins.reports[PLUGIN]
    assert report.status == "failed"
    assert "mcp-servers.json" in report.reasons[0] and "servers.files" in report.reasons[0]
    assert (await routes_command(rt, "!mcp")).startswith("Unknown command: !mcp")
    assert "get_system_info" in rt.tools.names()


def test_results_become_readable_text():
    import mcp_types as types

    from plugins._mcp_servers import format_result

    def result(*content: Any, structured: dict[str, Any] | None = None, error: bool = False) -> Any:
        return types.CallToolResult(content=list(content), structured_content=structured, is_error=error)

    text_ = types.TextContent(type="text", text="hello")
    assert format_result("s_t", result(text_)) == "hello"
    # Structured content once: skipped when a text block already carries it, added when not.
    assert (
        format_result("s_t", result(types.TextContent(type="text", text='{"a": 1}'), structured={"a": 1})) == '{"a": 1}'
    )
    assert format_result("s_t", result(types.TextContent(type="text", text="7"), structured={"result": 7})) == "7"
    assert format_result("s_t", result(text_, structured={"rows": [1, 2]})) == 'hello\n{"rows": [1, 2]}'
    assert format_result("s_t", result(structured={"ok": True})) == '{"ok": true}'
    assert format_result("s_t", result()) == "(no output)"
    with pytest.raises(ToolError, match=r"^s_t reported an error: hello$"):  # the pipeline adds "ERROR: "
        format_result("s_t", result(text_, error=True))
    media = format_result("s_t", result(
        types.ImageContent(type="image", data="QUJDRA==", mime_type="image/png"),
        types.ResourceLink(type="resource_link", name="report", uri="file:///r.txt", description="the report"),
        types.EmbeddedResource(type="resource", resource=types.TextResourceContents(uri="mem://a", text="inside")),
        types.EmbeddedResource(type="resource", resource=types.BlobResourceContents(uri="mem://b", blob="QUJD",
                                                                                     mime_type="application/zip")),
    ))
    assert media.splitlines() == ["[image image/png, 6 bytes]", "[resource link: report file:///r.txt] the report",
                                  "[resource mem://a]", "inside", "[resource mem://b application/zip, 3 bytes]"]


# ── tools, schemas, gates, results ──


async def test_stdio_tools_become_registry_tools_with_the_servers_schema_and_gates(make_rt, fake_openai):
    rt = await make_rt({"local": stdio_server(trusted=True), "other": stdio_server()})
    names = rt.tools.names()
    assert {"local_add", "local_shout", "local_fail", "local_whoami", "local_grow", "local_dotted_name_tool",
            "other_add"} <= set(names)
    # Gates: `read` only where a trusted server marks the tool read-only.
    assert rt.tools.entry("local_add").gate == {"type": "mcp", "operation": "read"}
    assert rt.tools.entry("local_shout").gate == {"type": "mcp", "operation": "write"}
    assert rt.tools.entry("other_add").gate == {"type": "mcp", "operation": "write"}
    # The model sees the server's input schema, as the server wrote it.
    schemas = {s["function"]["name"]: s["function"] for s in rt.tools.openai_schemas()}
    add = schemas["local_add"]
    assert add["parameters"]["properties"] == {"a": {"type": "integer"}, "b": {"type": "integer"}}
    assert add["parameters"]["required"] == ["a", "b"] and add["description"].startswith("Add two integers.")
    assert schemas["local_shout"]["parameters"]["properties"]["times"] == {"default": 1, "type": "integer"}

    fake_openai.script(
        tool_call("local_add", {"a": 2, "b": 3}),
        tool_call("local_shout", {"text": "hi", "times": 2}),
        tool_call("local_fail", {"reason": "no disk"}),
        tool_call("local_add", {"a": "two"}),
        tool_call("local_dotted_name_tool", {"x": "y"}),
        tool_call("local_whoami", {"names": []}),
        text("all done"),
    )
    sub = rt.hub.subscribe("c1", rt.hub.last_id("c1"))
    await routes.submit(rt, ask(rt, "c1", "use the tools", {"interactive": True}))
    async for ev in sub:
        if ev.name == "done":
            break
    results = [m["content"] for m in fake_openai.requests[-1].json["messages"] if m["role"] == "tool"]
    assert results[0] == "5"
    assert results[1] == "HI HI"
    assert results[2] == "ERROR: local_fail reported an error: Error executing tool fail: failed on purpose: no disk"
    assert results[3].startswith("ERROR: invalid arguments for local_add:")
    assert "'two' is not of type 'integer'" in results[3] and "'b' is a required property" in results[3]
    assert results[4] == "dotted:y"
    assert json.loads(results[5])["env"] == {} and isinstance(json.loads(results[5])["pid"], int)
    assert rt.sessions.get("c1").history[-1] == {"role": "assistant", "content": "all done"}


async def test_only_named_environment_variables_reach_a_stdio_server(make_rt, monkeypatch):
    monkeypatch.setenv("MCP_TEST_PROCESS_SECRET", "from-the-process")
    rt = await make_rt(
        {"named": stdio_server(env=["MCP_TEST_VISIBLE"]), "mapped": stdio_server(env={"RENAMED": "MCP_TEST_SOURCE"})},
        env={"MCP_TEST_VISIBLE": "v1", "MCP_TEST_SOURCE": "s1", "MCP_TEST_DOTENV_SECRET": "hidden"},
    )
    names = ["MCP_TEST_VISIBLE", "RENAMED", "MCP_TEST_SOURCE", "MCP_TEST_DOTENV_SECRET", "MCP_TEST_PROCESS_SECRET"]
    seen = json.loads(await execute(rt, "c1", "named_whoami", {"names": names}))["env"]
    assert seen == dict.fromkeys(names) | {"MCP_TEST_VISIBLE": "v1"}
    seen = json.loads(await execute(rt, "c1", "mapped_whoami", {"names": names}))["env"]
    assert seen == dict.fromkeys(names) | {"RENAMED": "s1"}


async def test_streamable_http_server_with_a_token_from_the_environment(make_rt, http_server):
    rt = await make_rt(
        {"remote": {"url": http_server, "token_env": "MCP_REMOTE_TOKEN", "trusted": True},
         "notoken": {"url": http_server},
         "wrongtoken": {"url": http_server, "headers_env": {"Authorization": "MCP_WRONG_AUTH"}}},
        env={"MCP_REMOTE_TOKEN": TOKEN, "MCP_WRONG_AUTH": "Bearer nope"},
    )
    assert await execute(rt, "c1", "remote_shout", {"text": "over http"}) == "OVER HTTP"
    assert rt.tools.entry("remote_add").gate["operation"] == "read"
    servers = plugin(rt).servers
    for name in ("notoken", "wrongtoken"):
        assert servers[name].status == "failed" and "HTTP 401" in servers[name].error
        assert not any(n.startswith(f"{name}_") for n in rt.tools.names())
    assert TOKEN not in (await routes_command(rt, "!mcp")) and "nope" not in (await routes_command(rt, "!mcp"))


async def routes_command(rt: state.Runtime, line: str) -> str:
    asked = ask(rt, "c1", line, shell_payload(rt, "c1", None))  # as the shell
    events = [ev async for ev in routes.run_turn(rt, asked)]
    return "".join(e.data.get("text", "") for e in events if e.name == "tok")


# ── list changes, reconnection, failures, shutdown ──


@pytest.mark.parametrize("protocol", ["auto", "legacy"])
async def test_tool_list_changes_replace_the_servers_tools(make_rt, http_server, protocol):
    rt = await make_rt({
        "local": stdio_server(protocol=protocol),
        "remote": {"url": http_server, "token_env": "MCP_REMOTE_TOKEN", "protocol": protocol},
    }, env={"MCP_REMOTE_TOKEN": TOKEN})
    conns = plugin(rt).servers
    assert conns["local"].protocol == ("2026-07-28" if protocol == "auto" else "2025-11-25")
    for server in ("local", "remote"):
        assert rt.tools.get(f"{server}_extra") is None
        assert await execute(rt, "c1", f"{server}_grow", {}) == "grown"
        await until(rt, lambda s=server: rt.tools.get(f"{s}_extra") is not None, f"{server}_extra to be registered")
        assert await execute(rt, "c1", f"{server}_extra", {}) == "extra!"
        assert rt.tools.entry(f"{server}_extra").gate == {"type": "mcp", "operation": "write"}
    assert "local_extra" in await routes_command(rt, "!mcp")


async def test_a_killed_stdio_server_is_restarted_on_the_next_call(make_rt):
    rt = await make_rt({"local": stdio_server()})
    conn = plugin(rt).servers["local"]
    (first,) = server_pids()
    os.kill(first, signal.SIGKILL)
    await until(rt, lambda: conn.status == "disconnected", "the plugin to notice the dead server")
    status = await routes_command(rt, "!mcp")
    assert "local [disconnected]" in status and "restarted on the next call" in status
    assert json.loads(await execute(rt, "c1", "local_whoami", {"names": []}))["pid"]
    (second,) = server_pids()
    assert second != first and conn.status == "connected" and conn.starts == 2
    assert await execute(rt, "c1", "local_add", {"a": 1, "b": 1}) == "2"


async def test_a_restarted_http_server_gets_a_new_session_on_the_next_call(make_rt, http_mcp):
    rt = await make_rt({"remote": {"url": http_mcp.url, "token_env": "MCP_REMOTE_TOKEN", "protocol": "legacy"}},
                       env={"MCP_REMOTE_TOKEN": TOKEN})
    first = json.loads(await execute(rt, "c1", "remote_whoami", {"names": []}))["pid"]
    http_mcp.stop()
    down = await execute(rt, "c1", "remote_add", {"a": 1, "b": 2})
    assert down.startswith("ERROR: MCP server 'remote' cannot be reached, so remote_add did not run")
    http_mcp.start()
    second = json.loads(await execute(rt, "c1", "remote_whoami", {"names": []}))["pid"]
    conn = plugin(rt).servers["remote"]
    assert second != first and conn.status == "connected" and conn.starts == 2
    # Restarted between two calls: the old session id gets HTTP 404, the call goes to a new session.
    http_mcp.stop()
    http_mcp.start()
    third = json.loads(await execute(rt, "c1", "remote_whoami", {"names": []}))["pid"]
    assert third != second and conn.status == "connected" and conn.starts == 3


async def test_servers_that_cannot_start_are_reported_and_skipped(make_rt):
    crash = "import sys; sys.stderr.write('boom: config file missing\\n'); sys.exit(3)"
    rt = await make_rt({
        "good": stdio_server(),
        "nocommand": {"command": "definitely-not-an-mcp-server-xyz"},
        "crashes": {"command": sys.executable, "args": ["-c", crash]},
        "hangs": {"command": sys.executable, "args": ["-c", "import time; time.sleep(60)"], "connect_timeout": 1},
        "needsenv": stdio_server(env=["MCP_TEST_UNSET_VARIABLE"]),
        "off": stdio_server(enabled=False),
    })
    report = rt.plugins.reports[PLUGIN]
    assert report.status == "loaded"
    why = "\n".join(report.reasons)
    assert "'nocommand' failed: command not found: definitely-not-an-mcp-server-xyz" in why
    assert "'crashes' failed:" in why and "boom: config file missing" in why
    assert "'hangs' failed: no answer within 1 s (connect_timeout)" in why
    assert "'needsenv' failed: environment variable MCP_TEST_UNSET_VARIABLE" in why and ".env" in why
    assert "off" not in plugin(rt).servers
    assert [n for n in rt.tools.names() if rt.tools.entry(n).owner == PLUGIN and not n.startswith("good_")] == []
    assert await execute(rt, "c1", "good_add", {"a": 20, "b": 22}) == "42"
    status = await routes_command(rt, "!mcp")
    assert "good [connected]" in status and "nocommand [failed]" in status and "why: command not found" in status
    retry = await routes_command(rt, "!mcp reconnect crashes")
    assert retry.startswith("MCP server 'crashes' failed:") and "boom" in retry


async def test_shutdown_closes_every_session_and_child_process(tmp_path, fake_openai):
    cfg = ConfigDir(tmp_path)
    cfg.models = {"fake": openai_model(fake_openai)}
    rt = await build.build_runtime(load_config(write_config(cfg, {"a": stdio_server(), "b": stdio_server()}).path),
                                    store=stores.MemoryStore())
    await rt.plugins.load_all()
    for s in "ab":
        assert json.loads(await execute(rt, "c1", f"{s}_whoami", {"names": []}))["pid"]
    pids = server_pids()
    assert len(pids) == 2
    conns = list(plugin(rt).servers.values())
    await build.close_runtime(rt)
    assert [c.status for c in conns] == ["stopped", "stopped"]
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# ── through a real agent-mcp process ──


def test_fake_llm_calls_stdio_and_http_tools_through_agent_mcp(config_dir, fake_openai, start_server, http_server):
    config_dir.models = {"gpt": openai_model(fake_openai)}
    config_dir.env = {"MCP_REMOTE_TOKEN": TOKEN}
    write_config(config_dir, {
        "local": stdio_server(trusted=True),
        "remote": {"url": http_server, "token_env": "MCP_REMOTE_TOKEN"},
        "broken": {"command": "definitely-not-an-mcp-server-xyz"},
    })
    server = start_server(config_dir)

    # A server that cannot start: agent-mcp runs, and /health and !mcp say why.
    health = server.health()["plugins"][PLUGIN]
    assert health["status"] == "loaded"
    assert any("'broken' failed: command not found" in r for r in health["reasons"])
    status = answer(run_turn(server, "c1", "!mcp"))
    assert "local [connected]" in status and "remote [connected]" in status and "broken [failed]" in status
    assert "local_add" in status and "remote_shout" in status

    fake_openai.script(
        tool_call("local_add", {"a": 40, "b": 2}),
        tool_call("remote_shout", {"text": "hello"}),
        tool_call("local_whoami", {"names": []}),
        text("The answer ", "is 42."),
    )
    assert answer(run_turn(server, "c1", "add and shout")) == "The answer is 42."
    offered = {t["function"]["name"]: t["function"] for t in fake_openai.requests[0].json["tools"]}
    assert offered["local_add"]["parameters"]["required"] == ["a", "b"]
    assert "remote_shout" in offered and not any(n.startswith("broken_") for n in offered)
    results = [m["content"] for m in fake_openai.requests[-1].json["messages"] if m["role"] == "tool"]
    assert results[:2] == ["42", "HELLO"]
    assert json.loads(results[2])["pid"]
    assert server.proc is not None
    (pid,) = server_pids(server.proc.pid)

    # Kill the stdio server: the next call starts it again.
    os.kill(pid, signal.SIGKILL)
    until_sync(lambda: "local [disconnected]" in answer(run_turn(server, "c1", "!mcp")),
               "agent-mcp to notice the killed MCP server", 15)
    fake_openai.script(tool_call("local_whoami", {"names": []}), text("again"))
    assert answer(run_turn(server, "c1", "who are you now")) == "again"
    (new_pid,) = server_pids(server.proc.pid)
    assert new_pid != pid
    assert "local [connected]" in answer(run_turn(server, "c1", "!mcp"))

    out = server.stop()
    assert "MCP server broken" in out and "command not found" in out
    with pytest.raises(ProcessLookupError):
        os.kill(new_pid, 0)



def test_registry_replaces_a_plugins_tools_all_or_nothing():
    from langchain_core.tools import StructuredTool
    from pydantic import BaseModel

    from registry import ToolRegistrationError, ToolRegistry

    class NoArgs(BaseModel):
        pass

    def make(name: str) -> StructuredTool:
        async def run() -> str:
            return name

        return StructuredTool.from_function(coroutine=run, name=name, description=name, args_schema=NoArgs)

    reg = ToolRegistry()
    reg.register(make("core_tool"))
    reg.register_plugin_tools("p", {"lc": [make("p_a"), make("p_b")]})
    reg.register_gate_tools("p", {"p_a": {"type": "mcp", "operation": "read"}})
    assert reg.replace_plugin_tools("p", {"lc": [make("p_b"), make("p_c")]}, {"p_c": {"type": "mcp"}}) == ["p_b", "p_c"]
    assert reg.names() == ["core_tool", "p_b", "p_c"] and reg.entry("p_c").gate == {"type": "mcp"}
    with pytest.raises(ToolRegistrationError, match="core_tool"):
        reg.replace_plugin_tools("p", {"lc": [make("p_d"), make("core_tool")]}, {})
    assert sorted(reg.names()) == ["core_tool", "p_b", "p_c"] and reg.entry("p_c").gate == {"type": "mcp"}
    with pytest.raises(ToolRegistrationError, match="p_zzz"):
        reg.replace_plugin_tools("p", {"lc": [make("p_e")]}, {"p_zzz": {"type": "mcp"}})
    assert sorted(reg.names()) == ["core_tool", "p_b", "p_c"] and reg.entry("core_tool").owner == "core"
