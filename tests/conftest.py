"""Shared fixtures: free ports, temporary config dirs, agent-mcp servers as real subprocesses."""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import httpx
import pytest

import guard
from tests import needs
from tests.fakes.gemini_backend import FakeGemini
from tests.fakes.openai_backend import FakeOpenAI
from tests.waiting import within_sync

ROOT = Path(__file__).resolve().parent.parent


#: The longest test files (seconds each, in one run of the suite), handed out first: xdist gives each worker
#: whole files, in collection order, so a long file collected last makes the others wait for it at the end.
_LONGEST_FIRST = ("test_scale_processes.py", "test_agentctl.py", "test_db_enforcement.py", "test_mcp_client.py",
                  "test_newcomer_findings.py", "test_scale.py", "test_newcomer.py", "test_agentctl_remote.py",
                  "test_plugins.py", "test_e2e.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the others keep their order


_PORT_BLOCK = 1000
_next_port = itertools.count()


def free_port() -> int:
    """A port nothing listens on, for a server a test starts after this returns.

    The kernel's "any free port" (bind to 0) is a race under xdist: the port is free again the moment
    this returns, and another worker's bind to 0 or any outgoing connection may get it before our
    server binds it. Each worker therefore takes its ports from a block of its own below the
    ephemeral range (32768 and up on Linux), in turn, skipping any that is taken."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker[2:].isdigit():  # one process (a single pytest, a benchmark): the kernel's choice is safe
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    first = 20000 + int(worker[2:]) % 12 * _PORT_BLOCK
    for _ in range(_PORT_BLOCK):
        port = first + next(_next_port) % _PORT_BLOCK
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {first}-{first + _PORT_BLOCK - 1}")


def openai_model(backend: FakeOpenAI, **extra: Any) -> dict[str, Any]:
    return {"model_id": "fake-gpt", "type": "OPENAI", "host": backend.base_url, "env_key": None,
            "max_retries": 0, "llm_call_timeout": 10, **extra}


def gemini_model(backend: FakeGemini, **extra: Any) -> dict[str, Any]:
    return {"model_id": "gemini-fake", "type": "GEMINI", "host": backend.base_url, "env_key": "FAKE_GEMINI_KEY",
            "max_retries": 0, "llm_call_timeout": 10, **extra}


ONE_TOOL_PLUGIN = textwrap.dedent('''
    from langchain_core.tools import StructuredTool
    from pydantic import BaseModel, Field
    from plugin_api import BasePlugin


    class _Args(BaseModel):
        {arg}: str = Field(description="{arg}")


    async def {tool}({arg}: str) -> str:
        print("{tool} ran:", {arg}, flush=True)
        return {result}


    class OneToolPlugin(BasePlugin):
        PLUGIN_NAME = "{plugin}"
        PLUGIN_TYPE = "data_tool"

        def init(self, config):
            return True

        def shutdown(self):
            pass

        def get_tools(self):
            return {{"lc": [StructuredTool.from_function(coroutine={tool}, name="{tool}",
                                                          description="{description}", args_schema=_Args)]}}

        def get_gate_tools(self):
            return {{"{tool}": {gate}}}
''')


def one_tool_plugin(plugin: str, tool: str, arg: str, result: str, gate: dict[str, str], description: str) -> str:
    """Source of a data_tool plugin with one async tool taking one string `arg`; `result` is a Python
    expression over `arg`. The tool prints "<tool> ran: <arg>" so a test can see it ran."""
    return ONE_TOOL_PLUGIN.format(plugin=plugin, tool=tool, arg=arg, result=result, gate=repr(gate),
                                  description=description)


class ConfigDir:
    """A temporary --config-dir: writes the JSON files a test needs; the rest fall back to the shipped ones."""

    def __init__(self, path: Path):
        self.path = path
        self.port = free_port()
        self.models: dict[str, Any] = {}
        self.default_model = ""
        self.plugins: list[str] = ["plugin_client_shellpy"]
        self.plugin_config: dict[str, Any] = {}
        self.manifest_extra: dict[str, Any] = {}
        self.env: dict[str, str] = {}
        #: gate-defaults.json to write (None: the shipped one, where undeclared tools are gated).
        self.gates: dict[str, Any] | None = None
        #: agents.json to write: the agents agent_call may reach (None: no file).
        self.agents: dict[str, Any] | None = None
        #: More top-level sections of plugins-enabled.json (e.g. "approvals").
        self.enabled_extra: dict[str, Any] = {}

    def add_plugin(self, name: str, source: str, *, type_: str = "data_tool", enabled: bool = True,
                   priority: int = 300, **manifest: Any) -> None:
        """Drop a plugin file into <dir>/plugins and declare it; nothing in the code base changes."""
        (self.path / "plugins").mkdir(exist_ok=True)
        (self.path / "plugins" / f"{name}.py").write_text(source)
        self.manifest_extra[name] = {"type": type_, "file": f"{name}.py", "priority": priority, **manifest}
        self.plugins.append(name)
        if not enabled:
            self.plugin_config[name] = {"enabled": False}

    def write(self) -> ConfigDir:
        shell_cfg = {"port": self.port, **self.plugin_config.get("plugin_client_shellpy", {})}
        enabled = {
            "default_model": self.default_model or next(iter(self.models)),
            "enabled_plugins": self.plugins,
            "plugin_config": {**self.plugin_config, "plugin_client_shellpy": shell_cfg},
            **self.enabled_extra,
        }
        (self.path / "plugins-enabled.json").write_text(json.dumps(enabled, indent=2))
        (self.path / "llm-models.json").write_text(json.dumps({"models": self.models}, indent=2))
        if self.manifest_extra:
            shipped = json.loads((ROOT / "plugin-manifest.json").read_text())
            shipped["plugins"].update(self.manifest_extra)
            (self.path / "plugin-manifest.json").write_text(json.dumps(shipped, indent=2))
        (self.path / ".env").write_text("".join(f"{k}={v}\n" for k, v in self.env.items()))
        if self.gates is not None:
            (self.path / "gate-defaults.json").write_text(json.dumps(self.gates, indent=2))
        if self.agents is not None:
            (self.path / "agents.json").write_text(json.dumps({"agents": self.agents}, indent=2))
        return self


class AgentServer:
    """agent-mcp.py as a subprocess on free ports; `url` is its shell.py endpoint."""

    def __init__(self, cfg: ConfigDir, env: dict[str, str] | None = None, checkout: Path | None = None,
                 code: Path | None = None):
        self.cfg = cfg
        self.url = f"http://127.0.0.1:{cfg.port}"
        self.env = env or {}
        #: Run that checkout's agent-mcp.py as `make run` does, without --config-dir (cfg.path is the checkout).
        self.checkout = checkout
        #: Run another tree's agent-mcp.py with this config (benchmarks compare a baseline in the same run).
        self.code = code
        self.proc: subprocess.Popen[str] | None = None
        self.output = ""

    def start(self, wait: bool = True) -> AgentServer:
        env = {k: v for k, v in os.environ.items() if not k.endswith("_PROXY") and not k.endswith("_proxy")}
        env.update({"PYTHONUNBUFFERED": "1", **self.env})
        where = self.checkout or self.code or ROOT
        args = [] if self.checkout else ["--config-dir", str(self.cfg.path)]
        self.proc = subprocess.Popen(
            [sys.executable, str(where / "agent-mcp.py"), *args],
            cwd=where, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        # Read the output as it comes: a server that logs more than a pipe holds must never block.
        self._lines: list[str] = []
        self._reader = threading.Thread(target=self._lines.extend, args=(self.proc.stdout,), daemon=True)
        self._reader.start()
        if wait:
            self.wait_ready()
        return self

    @property
    def data_dir(self) -> Path:
        return Path({**self.cfg.env, **self.env}.get("AGENT_DATA_DIR") or self.cfg.path / "data")

    @property
    def token(self) -> str:
        """The shell endpoint's bearer token: AGENT_SHELL_TOKEN when the test set one, else the generated file's."""
        return ({**self.cfg.env, **self.env}.get("AGENT_SHELL_TOKEN")
                or guard.read_token_file(self.data_dir / guard.SHELL_TOKEN_FILE))

    @property
    def api_key(self) -> str:
        """The API endpoint's key: API_KEY when the test set one, else the key file the server generated."""
        return ({**self.cfg.env, **self.env}.get("API_KEY")
                or guard.read_token_file(self.data_dir / guard.API_KEY_FILE, "API_KEY"))

    @property
    def api_auth(self) -> dict[str, str]:
        """Headers that authenticate a request to the API endpoint."""
        return {"Authorization": f"Bearer {self.api_key}"}

    @property
    def auth(self) -> dict[str, str]:
        """Headers that authenticate a request to the shell endpoint."""
        return {"Authorization": f"Bearer {self.token}"}

    def wait_ready(self, timeout: float = 20) -> None:
        def answered() -> bool:
            if self.proc and self.proc.poll() is not None:
                raise RuntimeError(f"agent-mcp exited with {self.proc.returncode}:\n{self.stop()}")
            try:
                return httpx.get(f"{self.url}/health", headers=self.auth, timeout=1).status_code < 500
            except (httpx.TransportError, guard.TokenFileError):  # not listening yet / token file not written yet
                return False

        if within_sync(answered, timeout):
            return
        raise TimeoutError(f"agent-mcp did not answer on {self.url}:\n{self.stop()}")

    def health(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/health", headers=self.auth, timeout=5).json()

    def stop(self) -> str:
        """SIGTERM, wait, and return everything the server printed."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self._reader.join(10)
            assert self.proc.stdout is not None
            self.proc.stdout.close()
            self.output += "".join(self._lines)
            self.proc = None
        return self.output


@pytest.fixture
def fake_openai() -> Iterator[FakeOpenAI]:
    with FakeOpenAI() as backend:
        yield backend


@pytest.fixture
def fake_gemini() -> Iterator[FakeGemini]:
    with FakeGemini() as backend:
        yield backend


#: The Redis the tests of several instances use: TEST_REDIS_URL, else the machine's Redis, database 15.
#: Not database 0: that is where redis-py, redis-cli and every `redis://host:6379/0` example (a developer's own
#: agent-mcp instances included) keep their keys, so the tests' keys never sit among them. Every test also
#: uses a key prefix of its own (after any `?prefix=` of TEST_REDIS_URL) and removes its keys afterwards.
TEST_REDIS = os.environ.get("TEST_REDIS_URL") or "redis://127.0.0.1:6379/15"


def redis_test_url(prefix: str) -> str:
    """TEST_REDIS with `prefix` appended to its own `?prefix=` (if any)."""
    parts = urlsplit(TEST_REDIS)
    query = dict(parse_qsl(parts.query))
    query["prefix"] = query.get("prefix", "") + prefix
    return urlunsplit(parts._replace(query=urlencode(query, safe=":")))


@pytest.fixture
def redis_store() -> Iterator[str]:
    """A SESSION_STORE URL on the tests' Redis (TEST_REDIS_URL) with a key prefix of this test's own, whose
    keys are removed afterwards. Without a Redis there, the test is skipped (or fails: tests/needs.py)."""
    import redis  # only the tests of several instances need it

    url = redis_test_url(f"test-{uuid.uuid4().hex[:10]}:")
    client = redis.Redis.from_url(TEST_REDIS.split("?")[0], socket_connect_timeout=2)
    try:
        client.ping()
    except (redis.exceptions.ConnectionError, redis.exceptions.AuthenticationError) as exc:
        client.close()
        needs.absent("redis", f"no Redis answers at {TEST_REDIS.split('?')[0]} ({exc}): install and start "
                              "redis-server, or point TEST_REDIS_URL at one")
    prefix = dict(parse_qsl(urlsplit(url).query))["prefix"]
    yield url
    keys = list(client.scan_iter(match=prefix + "*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture
def config_dir(tmp_path: Path) -> ConfigDir:
    return ConfigDir(tmp_path)


@pytest.fixture
def servers() -> Iterator[list[AgentServer]]:
    """Collects servers a test starts and stops them all afterwards."""
    started: list[AgentServer] = []
    yield started
    for s in started:
        s.stop()


@pytest.fixture
def start_server(servers: list[AgentServer]):
    def _start(cfg: ConfigDir, env: dict[str, str] | None = None, wait: bool = True) -> AgentServer:
        server = AgentServer(cfg.write(), env)
        servers.append(server)
        return server.start(wait)

    return _start
