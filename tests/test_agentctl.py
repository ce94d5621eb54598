"""agentctl.py: every command as a subprocess on a temporary config dir, checked in the files it writes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from prompt_toolkit import PromptSession
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput

import agentctl
import agentctl_files
import agentctl_term
import config
from tests.conftest import ROOT, AgentServer, ConfigDir, free_port
from tests.fakes.backend import text
from tests.turns import run_turn

SHELLPY = "plugin_client_shellpy"
KEYS = ("OPENAI_API_KEY", "XAI_API_KEY", "GEMINI_API_KEY", "SLACK_BOT_TOKEN", "SLACK_APP_TOKEN", "AGENTCTL_TEST_KEY")

READY_PLUGIN = '''
from plugin_api import BasePlugin

class P(BasePlugin):
    PLUGIN_NAME = "{name}"
    PLUGIN_TYPE = "data_tool"
    def init(self, config):
        return True
    def shutdown(self):
        pass
    def get_tools(self):
        return {{"lc": []}}
'''


def ctl(cdir: Path, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    """`agentctl.py --config-dir cdir args…` as the operator runs it (stdin is a pipe, not a terminal)."""
    env = {k: v for k, v in os.environ.items() if k not in KEYS}
    return subprocess.run([sys.executable, str(ROOT / "agentctl.py"), "--config-dir", str(cdir), *args],
                          input=stdin, capture_output=True, text=True, cwd=ROOT, env=env, timeout=30)


def ok(cdir: Path, *args: str, stdin: str = "") -> str:
    result = ctl(cdir, *args, stdin=stdin)
    assert result.returncode == 0, result.stderr + result.stdout
    return result.stdout


def as_json(cdir: Path, *args: str) -> Any:
    return json.loads(ok(cdir, "--json", *args))


def read(cdir: Path, name: str) -> Any:
    return json.loads((cdir / name).read_text())


def snapshot(cdir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(cdir.iterdir()) if p.is_file()}


def write(cdir: Path, name: str, data: Any) -> None:
    (cdir / name).write_text(data if isinstance(data, str) else json.dumps(data, indent=2))


@pytest.fixture
def cdir(tmp_path: Path) -> Path:
    """A config dir with its own copies of the shipped files, so every write can be compared."""
    for name in (config.MODELS_FILE, config.ENABLED_FILE, config.GATE_DEFAULTS_FILE):
        (tmp_path / name).write_bytes((config.DEFAULTS_DIR / name).read_bytes())
    return tmp_path


@pytest.fixture
def plugin_dir(tmp_path: Path) -> Path:
    """Plugins in each state: ready, configured but off, enabled with problems, available."""
    cfg = ConfigDir(tmp_path)
    cfg.models = {"m": {"model_id": "x", "type": "OPENAI", "host": "http://127.0.0.1:9/v1", "env_key": None}}
    cfg.add_plugin("plugin_test_ready", READY_PLUGIN.format(name="plugin_test_ready"), tools=["t_ready"])
    cfg.add_plugin("plugin_test_off", READY_PLUGIN.format(name="plugin_test_off"), enabled=False)
    cfg.add_plugin("plugin_test_broken", READY_PLUGIN.format(name="plugin_test_broken"),
                   env_vars=["AGENTCTL_TEST_KEY"], dependencies=["surely-not-installed-pkg>=1"])
    cfg.plugin_config["plugin_test_broken"] = {"api_token": "hunter2-secret", "region": "eu"}
    cfg.write()
    return tmp_path


# ── plugins ──


def test_list_shows_every_status_with_reasons(plugin_dir):
    rows = {r["name"]: r for r in as_json(plugin_dir, "list")["plugins"]}
    assert rows[SHELLPY]["status"] == "ready" and rows[SHELLPY]["symbol"] == "✓"
    assert rows["plugin_test_ready"]["status"] == "ready"
    assert rows["plugin_test_off"]["symbol"] == "–"
    broken = rows["plugin_test_broken"]
    assert broken["symbol"] == "✗"
    assert any("AGENTCTL_TEST_KEY" in p for p in broken["problems"])
    assert any("surely-not-installed-pkg" in p for p in broken["problems"])
    assert rows["plugin_client_api"]["symbol"] == "○"
    table = ok(plugin_dir, "list")
    assert "✗ │ plugin_test_broken" in table and "environment variable AGENTCTL_TEST_KEY is not set" in table
    assert "– │ plugin_test_off" in table and "○ │ plugin_client_api" in table
    assert "pip install 'surely-not-installed-pkg>=1'" in table


def test_info_checks_each_requirement_and_says_what_to_do(plugin_dir):
    info = as_json(plugin_dir, "info", "plugin_test_broken")
    checks = {c["item"]: c for c in info["checks"]}
    assert checks["plugins/plugin_test_broken.py"]["ok"] is True
    assert checks["AGENTCTL_TEST_KEY"]["ok"] is False and "add it to .env" in checks["AGENTCTL_TEST_KEY"]["problem"]
    assert checks["surely-not-installed-pkg>=1"]["ok"] is False
    assert info["plugin_config"] == {"api_token": "***", "region": "eu"}
    assert any("pip install" in step for step in info["todo"])
    text_out = ok(plugin_dir, "info", "plugin_test_broken")
    assert "hunter2" not in text_out and "What to do:" in text_out

    (plugin_dir / ".env").write_text("AGENTCTL_TEST_KEY=abc\n")
    info = as_json(plugin_dir, "info", "plugin_test_broken")
    assert {c["item"]: c["ok"] for c in info["checks"]}["AGENTCTL_TEST_KEY"] is True
    assert as_json(plugin_dir, "info", "plugin_test_ready")["tools"] == ["t_ready"]
    assert "agentctl enable plugin_client_api" in " ".join(as_json(plugin_dir, "info", "plugin_client_api")["todo"])


def test_enable_and_disable_keep_the_plugin_and_its_settings(plugin_dir):
    ok(plugin_dir, "enable", "plugin_test_off")
    enabled = read(plugin_dir, config.ENABLED_FILE)
    assert enabled["plugin_config"]["plugin_test_off"] == {"enabled": True}
    assert enabled["enabled_plugins"].count("plugin_test_off") == 1

    out = ok(plugin_dir, "disable", "plugin_test_broken")
    assert "Restart agent-mcp.py" in out
    enabled = read(plugin_dir, config.ENABLED_FILE)
    assert "plugin_test_broken" in enabled["enabled_plugins"]
    assert enabled["plugin_config"]["plugin_test_broken"] == {"api_token": "hunter2-secret", "region": "eu",
                                                              "enabled": False}

    ok(plugin_dir, "enable", "plugin_search_ddgs")  # never listed before: appended and switched on
    enabled = read(plugin_dir, config.ENABLED_FILE)
    assert enabled["enabled_plugins"][-1] == "plugin_search_ddgs"
    assert enabled["plugin_config"]["plugin_search_ddgs"]["enabled"] is True
    result = ctl(plugin_dir, "enable", "plugin_test_broken")
    assert result.returncode == 0 and "will not start until you fix" in result.stderr
    assert {r["name"]: r["status"] for r in as_json(plugin_dir, "list")["plugins"]}["plugin_test_broken"] == "problems"


def test_disabling_the_last_client_interface_is_refused(cdir):
    ok(cdir, "disable", "plugin_client_api")
    before = snapshot(cdir)
    result = ctl(cdir, "disable", SHELLPY)
    assert result.returncode == 1 and "nothing to serve" in result.stderr
    assert snapshot(cdir) == before


def test_port_list_and_port_set(cdir):
    ports = {r["name"]: r for r in as_json(cdir, "port-list")["ports"]}
    assert ports[SHELLPY]["port"] == 8765 and ports[SHELLPY]["source"] == "plugin_config"
    assert ports["plugin_client_api"] == {**ports["plugin_client_api"], "port": 8767, "source": "manifest default"}
    assert "plugin_database_mysql" not in ports

    port = free_port()
    ok(cdir, "port-set", "plugin_client_api", str(port))
    assert read(cdir, config.ENABLED_FILE)["plugin_config"]["plugin_client_api"] == {"port": port}
    ports = {r["name"]: r for r in as_json(cdir, "port-list")["ports"]}
    assert ports["plugin_client_api"]["port"] == port and ports["plugin_client_api"]["in_use_now"] is False
    assert f"{port}" in ok(cdir, "port-list")


def test_port_bound_on_the_machine_is_warned_about(cdir):
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        result = ctl(cdir, "port-set", SHELLPY, str(port))
        ports = {r["name"]: r for r in as_json(cdir, "port-list")["ports"]}
    assert result.returncode == 0
    assert f"127.0.0.1:{port} is in use on this machine right now" in result.stderr
    assert read(cdir, config.ENABLED_FILE)["plugin_config"][SHELLPY]["port"] == port
    assert ports[SHELLPY]["in_use_now"] is True


# ── models ──


def test_models_and_model_info(cdir):
    (cdir / ".env").write_text("OPENAI_API_KEY=sk-test-value\n")
    listing = as_json(cdir, "models")
    rows = {r["name"]: r for r in listing["models"]}
    assert listing["default_model"] == "local" and rows["local"]["default"] is True
    assert rows["local"]["api_key"] == "not needed"
    assert rows["gpt52"]["api_key"] == "set"
    assert rows["grok4"]["api_key"] == "missing: set XAI_API_KEY in .env"
    table = ok(cdir, "models")
    assert "sk-test-value" not in table and "missing: set XAI_API_KEY in .env" in table
    info = as_json(cdir, "model-info", "gemini25")
    assert (info["type"], info["host"], info["max_retries"], info["default"]) == ("GEMINI", None, 2, False)
    assert "gemini-2.5-flash" in ok(cdir, "model-info", "gemini25")
    assert as_json(cdir, "model") == {"default_model": "local"}


def test_model_add_with_flags_and_every_setter(cdir):
    ok(cdir, "model-add", "mine", "--model-id", "my-model", "--type", "openai", "--host", "https://api.example.com/v1",
       "--env-key", "EXAMPLE_API_KEY", "--max-context", "100", "--description", "My custom model",
       "--tools", "ddgs_search,read_system_prompt", "--timeout", "90")
    entry = read(cdir, config.MODELS_FILE)["models"]["mine"]
    assert entry == {"model_id": "my-model", "type": "OPENAI", "host": "https://api.example.com/v1",
                     "env_key": "EXAMPLE_API_KEY", "max_context": 100, "enabled": True, "tool_call_available": False,
                     "llm_call_timeout": 90, "description": "My custom model",
                     "llm_tools": ["ddgs_search", "read_system_prompt"], "router": False}

    for args in (("model-context", "mine", "300"), ("model-desc", "mine", "A", "better", "model"),
                 ("model-host", "mine", "null"), ("model-llmcall", "mine", "true"), ("model-timeout", "mine", "2.5"),
                 ("model-tools", "mine", "all"), ("model-router", "mine", "on"), ("model-disable", "mine")):
        ok(cdir, *args)
    entry = read(cdir, config.MODELS_FILE)["models"]["mine"]
    assert entry == {**entry, "max_context": 300, "description": "A better model", "host": None,
                     "tool_call_available": True, "llm_call_timeout": 2.5, "llm_tools": "all", "router": True,
                     "enabled": False}
    refused = ctl(cdir, "model", "mine")
    assert refused.returncode == 1 and "mine is disabled; enable it first: agentctl model-enable mine" in refused.stderr
    ok(cdir, "model-enable", "mine")
    out = ok(cdir, "model", "mine")
    assert "default model: mine" in out and read(cdir, config.ENABLED_FILE)["default_model"] == "mine"
    ok(cdir, "model", "local")
    ok(cdir, "model-remove", "mine")
    assert "mine" not in read(cdir, config.MODELS_FILE)["models"]
    assert list(read(cdir, config.MODELS_FILE)["models"]) == ["local", "llamacpp", "gpt52", "grok4", "gemini25"]


def test_model_add_wizard_at_the_prompt_reasks_until_valid(cdir):
    answers = "\n".join([
        "model-add", "local", "wiz", "wiz-model-id", "2", "ftp://bad", "http://127.0.0.1:9/v1", "WIZ_KEY",
        "1", "40", "", "Wizard model", "", "models", "quit",
    ]) + "\n"
    result = ctl(cdir, stdin=answers)
    assert result.returncode == 0, result.stderr
    assert "model 'local' already exists" in result.stderr
    assert "invalid host 'ftp://bad'" in result.stderr and "invalid max_context '1'" in result.stderr
    entry = read(cdir, config.MODELS_FILE)["models"]["wiz"]
    assert entry == {"model_id": "wiz-model-id", "type": "GEMINI", "host": "http://127.0.0.1:9/v1",
                     "env_key": "WIZ_KEY", "max_context": 40, "enabled": True, "tool_call_available": False,
                     "llm_call_timeout": 60, "description": "Wizard model", "llm_tools": "all"}
    assert "WIZ_KEY is not set" in result.stderr
    assert "wiz-model-id" in result.stdout  # the `models` line after the wizard ran too


def test_wizard_cancelled_by_end_of_input_changes_nothing(cdir):
    before = snapshot(cdir)
    result = ctl(cdir, stdin="model-add\nhalf\n")
    assert result.returncode == 1 and "cancelled; nothing was changed" in result.stderr
    assert snapshot(cdir) == before


# ── rate limits and gates ──


def test_ratelimit_commands(cdir):
    limits = as_json(cdir, "ratelimit-list")["rate_limits"]
    assert limits["llm_call"] == {"calls": 3, "window_seconds": 20, "auto_disable": True}
    ok(cdir, "ratelimit-set", "search", "7", "12.5")
    ok(cdir, "ratelimit-autodisable", "search", "yes")
    result = ctl(cdir, "ratelimit-set", "weather", "4", "30")
    assert result.returncode == 0 and "not a type of the spec" in result.stderr
    limits = read(cdir, config.ENABLED_FILE)["rate_limits"]
    assert limits["search"] == {"calls": 7, "window_seconds": 12.5, "auto_disable": True}
    assert limits["weather"] == {"auto_disable": False, "calls": 4, "window_seconds": 30}
    assert "12.5" in ok(cdir, "ratelimit-list")


def test_gate_commands(cdir):
    ok(cdir, "gate-set", "db", "users", "write", "true")
    ok(cdir, "gate-set", "db", "*", "read", "true")
    ok(cdir, "gate-set", "db", "__meta__", "read", "true")
    ok(cdir, "gate-set", "ddgs_search", "read", "true")
    ok(cdir, "gate-set", "*", "write", "false")
    gates = read(cdir, config.GATE_DEFAULTS_FILE)
    assert gates["db"] == {"*": {"read": True, "write": False, "ddl": False},
                           "__meta__": {"read": True, "write": False, "ddl": False},
                           "users": {"read": False, "write": True, "ddl": False}}
    shipped = json.loads((config.DEFAULTS_DIR / config.GATE_DEFAULTS_FILE).read_text())
    assert gates["tools"] == {**shipped["tools"], "*": {"read": False, "write": False},
                              "ddgs_search": {"read": True, "write": False}}
    assert as_json(cdir, "gate-list") == {"db": gates["db"], "tools": gates["tools"]}
    assert "auto-allow" in ok(cdir, "gate-list")

    ok(cdir, "gate-reset", "db", "users")
    assert "users" not in read(cdir, config.GATE_DEFAULTS_FILE)["db"]
    ok(cdir, "gate-reset", "ddgs_search")
    ok(cdir, "gate-reset")
    assert read(cdir, config.GATE_DEFAULTS_FILE) == {**shipped, **agentctl_files.ALL_GATED}


def test_gate_set_without_own_gate_defaults_starts_from_the_shipped_file(tmp_path):
    ok(tmp_path, "gate-set", "db_query", "read", "true")
    gates = read(tmp_path, config.GATE_DEFAULTS_FILE)
    shipped = read(config.DEFAULTS_DIR, config.GATE_DEFAULTS_FILE)
    assert gates == {**shipped, "tools": {**shipped["tools"], "db_query": {"read": True, "write": False}}}


# ── invalid input, files on disk ──

INVALID = [
    (("enable", "plugin_nope"), "unknown plugin 'plugin_nope'"),
    (("info", "plugin_client_apo"), "did you mean plugin_client_api?"),
    (("port-set", "plugin_client_api", "70000"), "give a number from 1 to 65535"),
    (("port-set", "plugin_client_api", "http"), "invalid port 'http'"),
    (("port-set", "plugin_client_api", "8765"), "port 8765 is already configured for plugin_client_shellpy"),
    (("port-set", "plugin_database_mysql", "9000"), "only client interfaces listen on a port"),
    (("model-remove", "local"), "local is the default model; choose another first"),
    (("model-disable", "local"), "local is the default model"),
    (("model", "nope"), "unknown model 'nope'"),
    (("model-context", "local", "1"), "invalid max_context '1'"),
    (("model-context", "local", "lots"), "invalid max_context 'lots'"),
    (("model-host", "local", "ftp://x"), "must start with http:// or https://"),
    (("model-timeout", "local", "0"), "invalid llm_call_timeout '0'"),
    (("model-llmcall", "local", "maybe"), "invalid tool_call_available 'maybe'"),
    (("model-router", "local", "2"), "invalid router '2'"),
    (("model-tools", "nope", "all"), "unknown model 'nope'"),
    (("model-add", "local", "--model-id", "x", "--type", "OPENAI"), "model 'local' already exists"),
    (("model-add", "new", "--model-id", "x", "--type", "CLAUDE"), "invalid type 'CLAUDE'"),
    (("model-add", "new", "--model-id", "x"), "model-add needs --type"),
    (("model-add", "bad name", "--model-id", "x", "--type", "OPENAI"), "invalid model name 'bad name'"),
    (("model-add", "new", "--colour", "red"), "unrecognized arguments: --colour red"),
    (("ratelimit-set", "search", "-1", "10"), "invalid calls '-1'"),
    (("ratelimit-set", "Search!", "1", "10"), "invalid type 'Search!'"),
    (("ratelimit-autodisable", "nope", "true"), "unknown rate-limit type 'nope'"),
    (("gate-set", "db", "users", "delete", "true"), "invalid operation 'delete'"),
    (("gate-set", "db_query", "read", "sure"), "sure is not true/false"),
    (("gate-set", "db", "*", "write", "maybe"), "maybe is not true/false"),
    (
        ("gate-set", "dbquery", "read", "true"),
        "no plugin or core module declares a tool 'dbquery'; did you mean db_query",
    ),
    (("model-tools", "local", "db_query,web_serch"), "no plugin or core module declares a tool 'web_serch'"),
    (("gate-set", "db", "users"), "usage: agentctl gate-set"),
    (("model-context", "local"), "usage: agentctl model-context <name> <n>"),
    (("frobnicate",), "unknown command 'frobnicate'"),
]


@pytest.mark.parametrize(("args", "message"), INVALID, ids=[" ".join(a) for a, _ in INVALID])
def test_invalid_input_is_refused_and_changes_nothing(cdir, args, message):
    before = snapshot(cdir)
    result = ctl(cdir, *args)
    assert result.returncode == 1, result.stdout
    assert message in result.stderr
    assert snapshot(cdir) == before


def test_enabling_a_plugin_on_a_port_taken_by_another_is_refused(cdir):
    enabled = read(cdir, config.ENABLED_FILE)
    enabled["plugin_config"]["plugin_client_api"] = {"enabled": False, "port": 8765}
    write(cdir, config.ENABLED_FILE, enabled)
    before = snapshot(cdir)
    result = ctl(cdir, "enable", "plugin_client_api")
    assert result.returncode == 1 and "which plugin_client_shellpy also uses" in result.stderr
    assert snapshot(cdir) == before


@pytest.mark.parametrize(
    "command", [("list",), ("models",), ("model-context", "local", "60"), ("gate-set", "*", "read", "true")]
)
def test_malformed_json_on_disk_is_a_file_problem(cdir, command):
    (cdir / config.MODELS_FILE).write_text('{"models": {"local": ')
    before = snapshot(cdir)
    result = ctl(cdir, *command)
    assert result.returncode == 2
    assert f"{config.MODELS_FILE}: not valid JSON (line 1" in result.stderr
    assert snapshot(cdir) == before


def test_invalid_field_on_disk_and_missing_config_dir_are_file_problems(cdir, tmp_path):
    models = read(cdir, config.MODELS_FILE)
    models["models"]["local"]["max_context"] = "many"
    write(cdir, config.MODELS_FILE, models)
    before = snapshot(cdir)
    result = ctl(cdir, "model-desc", "local", "hi")
    assert result.returncode == 2 and "models.local.max_context" in result.stderr
    assert snapshot(cdir) == before
    result = ctl(tmp_path / "does-not-exist", "list")
    assert result.returncode == 2 and "config directory does not exist" in result.stderr


def test_unknown_fields_and_other_entries_are_kept(cdir):
    models = read(cdir, config.MODELS_FILE)
    models["metadata"] = {"note": "kept"}
    models["models"]["local"]["top_k"] = 20
    write(cdir, config.MODELS_FILE, models)
    enabled = read(cdir, config.ENABLED_FILE)
    enabled["plugin_config"][SHELLPY]["token_env"] = "MY_TOKEN"
    enabled["max_users"] = 5
    write(cdir, config.ENABLED_FILE, enabled)
    result = ctl(cdir, "model-context", "local", "77")
    assert result.returncode == 0 and "unknown field 'models.local.top_k' (kept)" in result.stderr
    ok(cdir, "port-set", SHELLPY, str(free_port()))
    models_after, enabled_after = read(cdir, config.MODELS_FILE), read(cdir, config.ENABLED_FILE)
    assert models_after["metadata"] == {"note": "kept"} and models_after["models"]["local"]["top_k"] == 20
    assert models_after["models"]["gpt52"] == models["models"]["gpt52"]
    assert enabled_after["max_users"] == 5 and enabled_after["plugin_config"][SHELLPY]["token_env"] == "MY_TOKEN"
    assert enabled_after["rate_limits"] == enabled["rate_limits"]


def test_writes_go_to_the_config_dir_and_never_to_the_shipped_files(tmp_path):
    shipped = {name: (config.DEFAULTS_DIR / name).read_bytes() for name in (config.MODELS_FILE, config.ENABLED_FILE)}
    ok(tmp_path, "model-context", "local", "70")
    ok(tmp_path, "disable", "plugin_client_api")
    assert {name: (config.DEFAULTS_DIR / name).read_bytes() for name in shipped} == shipped
    assert read(tmp_path, config.MODELS_FILE)["models"]["local"]["max_context"] == 70
    shipped_models = read(config.DEFAULTS_DIR, config.MODELS_FILE)["models"]
    assert read(tmp_path, config.MODELS_FILE)["models"].keys() == shipped_models.keys()
    assert read(tmp_path, config.ENABLED_FILE)["plugin_config"]["plugin_client_api"]["enabled"] is False
    assert not (tmp_path / config.MANIFEST_FILE).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [config.MODELS_FILE, config.ENABLED_FILE]


def test_a_config_that_cannot_start_can_still_be_repaired(cdir):
    models = read(cdir, config.MODELS_FILE)
    models["models"]["local"]["enabled"] = False  # the default model is off: the server refuses to start
    write(cdir, config.MODELS_FILE, models)
    ok(cdir, "port-set", "plugin_client_api", str(free_port()))  # an unrelated change does not make it worse
    ok(cdir, "model-enable", "local")
    assert config.load_config(cdir).default_model == "local"


def test_help_lists_every_command(cdir):
    out = ok(cdir, "help")
    for command in ("list", "info", "enable", "disable", "port-list", "port-set", "models", "model-info", "model-add",
                    "model-remove", "model-enable", "model-disable", "model [name]", "model-context", "model-desc",
                    "model-host", "model-llmcall", "model-timeout", "model-tools", "model-router", "ratelimit-list",
                    "ratelimit-set", "ratelimit-autodisable", "gate-list", "gate-set", "gate-reset"):
        assert f"\n{command}" in f"\n{out}", command
    assert "--env-key VAR" in ok(cdir, "help", "model-add")
    assert ok(cdir, "--help") == out


# ── the result runs ──


def test_config_written_by_agentctl_loads_in_the_server(tmp_path, fake_openai, servers):
    port = free_port()
    ok(tmp_path, "model-add", "fake", "--model-id", "fake-gpt", "--type", "OPENAI", "--host", fake_openai.base_url,
       "--timeout", "10", "--max-context", "20")
    ok(tmp_path, "model", "fake")
    ok(tmp_path, "port-set", SHELLPY, str(port))
    ok(tmp_path, "port-set", "plugin_client_api", str(free_port()))  # not the default 8767 a running server holds
    ok(tmp_path, "enable", "plugin_search_ddgs")
    ok(tmp_path, "disable", "plugin_search_ddgs")
    ok(tmp_path, "ratelimit-set", "search", "2", "5")
    ok(tmp_path, "gate-set", "db", "orders", "read", "true")
    loaded = config.load_config(tmp_path)
    assert loaded.gates.db["orders"].read is True and loaded.enabled.rate_limits["search"].calls == 2

    cfg = ConfigDir(tmp_path)
    cfg.port = port
    server = AgentServer(cfg)
    servers.append(server)
    server.start()
    health = server.health()
    assert health["default_model"] == "fake" and "local" in health["models"]
    assert health["plugins"]["plugin_search_ddgs"]["status"] == "disabled"
    fake_openai.script(text("hello ", "operator"))
    events = run_turn(server, "c1", "hi")
    assert "".join(e.data.get("text", "") for e in events if e.name == "tok") == "hello operator"
    assert fake_openai.requests[-1].json["model"] == "fake-gpt"



# ── in process: the prompt-toolkit prompt and the last line of defence ──


def test_prompt_reads_commands_through_prompt_toolkit(cdir, capsys):
    with create_pipe_input() as pipe:
        pipe.send_text("model-context local 64\rgate-set db t read true\rmodel-context local 1\rquit\r")
        session: PromptSession[str] = PromptSession(input=pipe, output=DummyOutput())
        ctl_ = agentctl.AgentCtl(cdir, agentctl_term.Terminal(session=session), in_prompt=True)
        assert ctl_.prompt() == 0  # on a terminal the operator has seen each error already
    assert read(cdir, config.MODELS_FILE)["models"]["local"]["max_context"] == 64
    assert read(cdir, config.GATE_DEFAULTS_FILE)["db"]["t"] == {"read": True, "write": False, "ddl": False}
    assert "invalid max_context '1'" in capsys.readouterr().err


def test_save_refuses_a_result_the_server_would_not_load(cdir):
    files = agentctl_files.ConfigFiles(cdir)
    raw = files.raw(config.MODELS_FILE)
    del raw["models"]["local"]  # the default model
    before = snapshot(cdir)
    with pytest.raises(agentctl_files.InputError, match=r"server would not start with this change: .*'default_model'"):
        files.save(config.MODELS_FILE, raw)
    raw = files.raw(config.GATE_DEFAULTS_FILE)
    raw["db"]["t"] = {"read": "sometimes"}
    with pytest.raises(agentctl_files.InputError, match=r"field 'db\.t\.read'"):
        files.save(config.GATE_DEFAULTS_FILE, raw)
    assert snapshot(cdir) == before  # no temporary file left behind either


def test_an_edit_made_meanwhile_is_never_overwritten(cdir):
    files = agentctl_files.ConfigFiles(cdir)  # e.g. while the operator answers the model-add wizard
    theirs = read(cdir, config.MODELS_FILE)
    theirs["models"]["local"]["description"] = "edited by hand meanwhile"
    write(cdir, config.MODELS_FILE, theirs)
    raw = files.raw(config.MODELS_FILE)
    raw["models"]["local"]["max_context"] = 99
    with pytest.raises(agentctl_files.FileProblem, match="changed by someone else meanwhile"):
        files.save(config.MODELS_FILE, raw)
    assert read(cdir, config.MODELS_FILE) == theirs


# ── what a new user trips on (issue 17) ──


def _documents(text: str) -> list[Any]:
    """Consecutive JSON documents in `text` (what `--json` prints, one per command)."""
    decoder, docs, at = json.JSONDecoder(), [], 0
    while at < len(text.rstrip()):
        doc, at = decoder.raw_decode(text, at)
        docs.append(doc)
        while at < len(text) and text[at].isspace():
            at += 1
    return docs


def test_piped_commands_print_one_json_document_each(cdir):
    result = ctl(cdir, "--json", stdin="models\nratelimit-list\ngate-set db t read true\n")
    assert result.returncode == 0, result.stderr
    models, limits, done = _documents(result.stdout)  # no banner, no prompt: only the documents
    assert "local" in json.dumps(models) and "search" in limits["rate_limits"]
    assert done == {"done": "db t: read auto-allowed", "note": agentctl_term.RESTART}


def test_an_undeclared_tool_name_needs_force_and_is_warned_about(cdir):
    result = ctl(cdir, "gate-set", "files_read_file", "read", "true", "--force")
    assert result.returncode == 0 and "no plugin or core module declares a tool 'files_read_file'" in result.stderr
    assert read(cdir, config.GATE_DEFAULTS_FILE)["tools"]["files_read_file"]["read"] is True
    assert ctl(cdir, "model-tools", "local", "db_query,llm_list").returncode == 0
    assert read(cdir, config.MODELS_FILE)["models"]["local"]["llm_tools"] == ["db_query", "llm_list"]


def test_rate_limit_zero_says_unlimited_and_mcp_is_a_known_type(cdir):
    assert "rate limit search: unlimited (0 means no limit)" in ctl(cdir, "ratelimit-set", "search", "0", "0").stdout
    result = ctl(cdir, "ratelimit-set", "mcp", "5", "60")
    assert result.returncode == 0 and "warning" not in result.stderr


def test_help_lines_have_no_trailing_padding(cdir):
    lines = ctl(cdir, "help").stdout.splitlines()
    assert len(lines) > 20 and all(line == line.rstrip() for line in lines)


def test_tab_completes_a_unique_prefix_in_place(cdir, capsys):
    with create_pipe_input() as pipe:
        # Typed at once, as a fast typist does: one Tab after a unique prefix completes it, before any menu.
        pipe.send_text("model-i\t local\rquit\r")
        session: PromptSession[str] = PromptSession(input=pipe, output=DummyOutput())
        assert agentctl.AgentCtl(cdir, agentctl_term.Terminal(session=session), in_prompt=True).prompt() == 0
    out = capsys.readouterr()
    assert "unknown command" not in out.err and "qwen2.5:7b-instruct" in out.out


def test_a_reader_that_stops_early_gets_no_traceback(cdir):
    """`agentctl --json list | head -2`: the pipe closes before agentctl has written everything."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "agentctl.py"), "--config-dir", str(cdir), "--json", "list"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "{"
    proc.stdout.close()
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "Traceback" not in err and "BrokenPipe" not in err


def test_repair_saves_a_broken_file_aside_and_restores_the_default(cdir):
    (cdir / config.MODELS_FILE).write_text('{"models": {"local": ')  # cut short: not JSON
    broken = ctl(cdir, "models")
    assert broken.returncode == 2 and "agentctl repair llm-models.json" in broken.stderr
    repaired = ctl(cdir, "repair")
    assert repaired.returncode == 0, repaired.stderr
    assert "✓ llm-models.json:" in repaired.stdout and "re-created from the shipped defaults" in repaired.stdout
    assert "✓ gate-defaults.json: " in repaired.stdout  # the others are left alone
    (aside,) = cdir.glob("llm-models.json.broken-*")
    assert aside.read_text() == '{"models": {"local": '
    assert read(cdir, config.MODELS_FILE) == json.loads((config.DEFAULTS_DIR / config.MODELS_FILE).read_text())
    assert ctl(cdir, "models").returncode == 0
    assert json.loads(ctl(cdir, "--json", "repair", config.MODELS_FILE).stdout)["repair"][0]["action"] == "ok"


def _documents(text: str) -> list[Any]:
    decoder, docs, rest = json.JSONDecoder(), [], text.strip()
    while rest:
        doc, end = decoder.raw_decode(rest)
        docs.append(doc)
        rest = rest[end:].strip()
    return docs


def test_piped_json_prints_one_document_per_command_failed_ones_too(cdir):
    result = ctl(cdir, "--json", stdin="model-i\nmodels\nmodel-timeout nosuch 5\n")
    docs = _documents(result.stdout)
    assert len(docs) == 3 and result.returncode == 1
    assert docs[0] == {"error": "unknown command 'model-i' (did you mean model-info?); 'help' lists the commands",
                       "exit_code": 1}
    assert "local" in json.dumps(docs[1]) and docs[2]["exit_code"] == 1 and "nosuch" in docs[2]["error"]


def test_repair_names_every_bad_field(cdir):
    data = read(cdir, config.MODELS_FILE)
    data["models"]["local"]["llm_call_timeout"] = "soon"
    data["models"]["gpt52"]["max_context"] = "many"
    write(cdir, config.MODELS_FILE, data)
    out = ok(cdir, "repair", config.MODELS_FILE)
    assert "models.local.llm_call_timeout" in out and "models.gpt52.max_context" in out


def test_repair_leaves_a_file_the_running_server_owns_alone(cdir):
    """While a server runs (it holds the audit log's lock), repair does not rewrite the files it owns and writes."""
    import fcntl

    import grants

    (cdir / config.MODELS_FILE).write_text('{"models": {"local": ')
    (cdir / "data").mkdir(exist_ok=True)
    with open(cdir / "data" / (grants.AUDIT_FILE + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as the running server does
        refused = ctl(cdir, "repair", config.MODELS_FILE)
    assert "✗ llm-models.json" in refused.stdout and "stop the server, then repair it" in refused.stdout, refused
    assert (cdir / config.MODELS_FILE).read_text() == '{"models": {"local": ' and not list(cdir.glob("*.broken-*"))
    assert "re-created from the shipped defaults" in ctl(cdir, "repair", config.MODELS_FILE).stdout  # stopped: repaired
