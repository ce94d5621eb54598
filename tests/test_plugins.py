"""Plugin loading through a real server: every failure is reported with its reason, the rest still works."""

from __future__ import annotations

import os
import stat
import textwrap

import httpx

from shell_client import find_token
from tests.conftest import free_port, openai_model
from tests.fakes.backend import text, tool_call
from tests.turns import answer, run_turn

GOOD = textwrap.dedent('''
    from langchain_core.tools import StructuredTool
    from pydantic import BaseModel, Field
    from plugin_api import BasePlugin


    class _Args(BaseModel):
        word: str = Field(description="a word")


    async def shout(word: str) -> str:
        return word.upper() + "!"


    class ShoutPlugin(BasePlugin):
        PLUGIN_NAME = "plugin_test_shout"
        PLUGIN_TYPE = "data_tool"

        def init(self, config):
            self.greeting = config.get("greeting", "pong")
            return True

        def shutdown(self):
            print("shout plugin shut down", flush=True)

        def get_tools(self):
            return {"lc": [StructuredTool.from_function(coroutine=shout, name="shout",
                                                         description="Shout a word.", args_schema=_Args)]}

        def get_commands(self):
            async def ping(args: str) -> str:
                return f"{self.greeting} {args}".strip()
            return {"ping": ping}

        def get_help(self):
            return "Shout plugin:\\n  !ping [text]   answer pong"
''')

FAILS_IN_INIT = textwrap.dedent('''
    from plugin_api import BasePlugin

    class Boom(BasePlugin):
        PLUGIN_NAME = "plugin_test_boom"
        PLUGIN_TYPE = "data_tool"
        def init(self, config):
            raise RuntimeError("database unreachable")
        def shutdown(self):
            pass
        def get_tools(self):
            return {"lc": []}
''')


def test_plugin_failures_are_reported_and_the_server_still_serves(config_dir, fake_openai, start_server):
    cfg = config_dir
    cfg.models = {"fake": openai_model(fake_openai)}
    cfg.add_plugin("plugin_test_shout", GOOD, priority=350)
    cfg.plugin_config["plugin_test_shout"] = {"greeting": "pong"}
    cfg.gates = {"tools": {"shout": {"read": True}}}  # a tool without a gate declaration is gated by default
    cfg.add_plugin("plugin_test_needs_env", GOOD.replace("plugin_test_shout", "plugin_test_needs_env"),
                   env_vars=["TEST_PLUGIN_SECRET_XYZ"])
    cfg.add_plugin("plugin_test_boom", FAILS_IN_INIT)
    cfg.add_plugin("plugin_test_off", GOOD.replace("plugin_test_shout", "plugin_test_off"), enabled=False)
    cfg.add_plugin("plugin_test_syntax", "def broken(:\n    pass\n")
    mismatch = GOOD.replace("plugin_test_shout", "plugin_test_mismatch").replace(
        'PLUGIN_TYPE = "data_tool"',
        'PLUGIN_TYPE = "data_tool"\n    DEPENDENCIES = ["httpx"]\n    ENV_VARS = ["SHOUT_KEY"]',
    )
    cfg.add_plugin("plugin_test_mismatch", mismatch, dependencies=["anyio>=4"])
    server = start_server(cfg)
    plugins = server.health()["plugins"]
    assert plugins["plugin_client_shellpy"]["status"] == "loaded"
    assert plugins["plugin_test_shout"] == {"status": "loaded", "reasons": []}
    assert plugins["plugin_test_needs_env"]["status"] == "invalid"
    assert "TEST_PLUGIN_SECRET_XYZ" in plugins["plugin_test_needs_env"]["reasons"][0]
    assert plugins["plugin_test_boom"]["status"] == "failed"
    assert "RuntimeError: database unreachable" in plugins["plugin_test_boom"]["reasons"][0]
    assert plugins["plugin_test_off"]["status"] == "disabled"
    assert plugins["plugin_test_syntax"]["status"] == "failed"
    assert 'Error importing plugin "plugin_test_syntax": SyntaxError' in plugins["plugin_test_syntax"]["reasons"][0]
    # The class's own metadata must agree with its manifest entry: both are named.
    assert plugins["plugin_test_mismatch"] == {"status": "invalid", "reasons": [
        "DEPENDENCIES ['httpx'] disagree with the manifest's dependencies ['anyio>=4'] (package names must match)",
        "ENV_VARS ['SHOUT_KEY'] disagree with the manifest's env_vars []"]}

    # The loaded plugin's command and tool work without any change to routes.py or agent-mcp.py.
    events = run_turn(server, "c1", "!ping hello")
    assert "".join(e.data.get("text", "") for e in events if e.name == "tok") == "pong hello"
    help_text = "".join(e.data.get("text", "") for e in run_turn(server, "c1", "!help") if e.name == "tok")
    assert "!ping [text]" in help_text and "shout" in help_text

    fake_openai.script(tool_call("shout", {"word": "hey"}), text("They ", "said HEY!"))
    events = run_turn(server, "c1", "make it loud")
    assert "".join(e.data["text"] for e in events if e.name == "tok") == "They said HEY!"
    tool_msgs = [m for m in fake_openai.requests[-1].json["messages"] if m["role"] == "tool"]
    assert tool_msgs[-1]["content"] == "HEY!"
    tools_offered = {t["function"]["name"] for t in fake_openai.requests[0].json["tools"]}
    assert "shout" in tools_offered and "ping" not in tools_offered

    out = server.stop()
    for name in ("plugin_test_needs_env", "plugin_test_boom", "plugin_test_off", "plugin_test_syntax"):
        assert name in out
    assert "shout plugin shut down" in out


def test_busy_port_names_plugin_and_port(config_dir, fake_openai, start_server):
    config_dir.models = {"fake": openai_model(fake_openai)}
    with __import__("socket").socket() as blocker:
        blocker.bind(("127.0.0.1", config_dir.port))
        blocker.listen()
        server = start_server(config_dir, wait=False)
        assert server.proc.wait(timeout=20) == 1
        out = server.stop()
    assert f"plugin_client_shellpy cannot listen on 127.0.0.1:{config_dir.port}" in out
    assert "plugins-enabled.json" in out


def test_non_loopback_listener_needs_a_token(config_dir, fake_openai, start_server):
    config_dir.models = {"fake": openai_model(fake_openai)}
    config_dir.plugins.append("plugin_proxy_llama")  # its token is optional (the shell's never is)
    config_dir.plugin_config["plugin_proxy_llama"] = {"host": "0.0.0.0", "port": free_port()}
    server = start_server(config_dir, wait=False)
    assert server.proc.wait(timeout=20) == 1
    assert "plugin plugin_proxy_llama would listen on 0.0.0.0" in server.stop()


def test_token_protects_every_endpoint(config_dir, fake_openai, start_server):
    config_dir.models = {"fake": openai_model(fake_openai)}
    config_dir.env = {"AGENT_SHELL_TOKEN": "s3cret-token-value"}
    server = start_server(config_dir, wait=False)
    server.wait_ready()
    for method, path in [("GET", "/health"), ("GET", "/sessions"), ("POST", "/submit"), ("GET", "/stream?client_id=x"),
                         ("POST", "/gate_response"), ("DELETE", "/session/101")]:
        assert httpx.request(method, server.url + path, timeout=5).status_code == 401, path
        bad = httpx.request(method, server.url + path, headers={"Authorization": "Bearer wrong"}, timeout=5)
        assert bad.status_code == 401, path
    ok = httpx.get(server.url + "/health", headers={"Authorization": "Bearer s3cret-token-value"}, timeout=5)
    assert ok.status_code == 200
    assert not (config_dir.path / "data" / "shell-token").exists()  # the configured token wins; no file
    assert "s3cret-token-value" not in server.stop()


def test_without_a_configured_token_the_first_start_writes_one_and_shell_py_finds_it(config_dir, fake_openai,
                                                                                     start_server):
    config_dir.models = {"fake": openai_model(fake_openai)}
    server = start_server(config_dir)
    path = config_dir.path / "data" / "shell-token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    token = path.read_text().strip()
    assert httpx.get(server.url + "/health", timeout=5).status_code == 401
    assert find_token(None, {"AGENT_DATA_DIR": str(path.parent)})[0] == token
    assert answer(run_turn(server, "c1", "hi")) == "echo: hi"
    out = server.stop()
    assert f"wrote a new shell endpoint token to {path}" in out and token not in out
    server.start()  # a restart reuses the file
    assert path.read_text().strip() == token
    assert httpx.get(server.url + "/health", headers={"Authorization": f"Bearer {token}"}, timeout=5).status_code == 200
    assert server.stop().count("wrote a new shell endpoint token") == 1
    os.chmod(path, 0o644)
    server.start(wait=False)
    assert server.proc is not None and server.proc.wait(timeout=20) == 1
    out = server.stop()
    assert f"{path} is readable by other users" in out and f"chmod 600 {path}" in out and token not in out


def test_the_data_dir_is_created_private_and_a_readable_one_is_reported(config_dir, fake_openai, start_server):
    config_dir.models = {"fake": openai_model(fake_openai)}
    data = config_dir.path / "data"
    assert not data.exists()
    server = start_server(config_dir)
    assert stat.S_IMODE(data.stat().st_mode) == 0o700  # it holds every conversation
    assert "can be read by other users" not in server.stop()
    os.chmod(data, 0o755)
    server.start()
    assert f"data directory {data} can be read by other users" in server.stop()
    assert stat.S_IMODE(data.stat().st_mode) == 0o755  # reported, not changed behind the operator's back


def test_malformed_config_stops_startup_naming_file_and_field(config_dir, fake_openai, start_server):
    config_dir.models = {"fake": {**openai_model(fake_openai), "max_context": "many"}}
    server = start_server(config_dir, wait=False)
    assert server.proc.wait(timeout=20) == 2
    out = server.stop()
    assert "llm-models.json" in out and "models.fake.max_context" in out

